"""Launch configurations (block sizes, warps, stages) for the kernels.

Each backend keeps a small committed table, ``configs.json`` beside its kernel,
from (padded head dim, dtype, causal, query-length bucket) to a
:class:`Config`. ``python -m common tune`` fills it on a GPU; a user's first
call only looks it up, so nothing is autotuned on a user's time. Entries
missing from the table fall back to defaults per head dim.

Under Triton's interpreter the numbers that matter are different (each
operation costs the same whatever its size, so fewer, larger blocks are
faster) and warps and stages mean nothing: :meth:`ConfigTable.lookup` answers
with :meth:`ConfigTable.interpreter_config` there.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import torch

LENGTH_BUCKETS = (16, 64, 256, 1024, 4096, 16384)


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def as_list(self) -> list[int]:
        return [self.block_m, self.block_n, self.num_warps, self.num_stages]


# Used where the table has no entry: what the tutorial-style kernels pick on
# Hopper, by padded head dim.
DEFAULTS = {
    16: Config(128, 64, 4, 3),
    32: Config(128, 64, 4, 3),
    64: Config(128, 64, 4, 3),
    128: Config(128, 64, 8, 3),
    256: Config(64, 32, 4, 2),
}


def default_config(block_d: int, q_len: int) -> Config:
    """The configuration where the table has no entry.

    Short queries (decoding, a few speculative tokens) get the smallest row
    tile that holds them: their programs stream keys and values, and rows
    past Lq would only burn tensor-core time.
    """
    if q_len <= 64:
        block_m = min(64, max(16, next_power_of_2(q_len)))
        if block_d <= 64:
            return Config(block_m, 128, 4, 3)
        if block_d <= 128:
            return Config(block_m, 64, 4, 3)
        return Config(block_m, 32, 4, 2)
    return DEFAULTS[block_d]


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The tile width a head dim is padded to (tl.dot needs at least 16)."""
    return max(16, next_power_of_2(head_dim))


def length_bucket(length: int) -> int:
    for bucket in LENGTH_BUCKETS:
        if length <= bucket:
            return bucket
    return LENGTH_BUCKETS[-1]


def key(block_d: int, dtype: torch.dtype, is_causal: bool, bucket: int) -> str:
    return f"d{block_d}-{str(dtype).removeprefix('torch.')}-{'causal' if is_causal else 'full'}-L{bucket}"


class ConfigTable:
    def __init__(self, path: pathlib.Path, entries: dict[str, Config], meta: dict):
        self.path = path
        self.entries = entries
        self.meta = meta

    @classmethod
    def load(cls, module_name: str) -> "ConfigTable":
        """The table in ``configs.json`` beside the module (empty if there is none)."""
        path = pathlib.Path(sys.modules[module_name].__file__).with_name("configs.json")
        if not path.exists():
            return cls(path, {}, {})
        data = json.loads(path.read_text())
        entries = {k: Config(*v) for k, v in data.get("entries", {}).items()}
        return cls(path, entries, data.get("meta", {}))

    def save(self, meta: dict) -> None:
        data = {
            "meta": meta,
            "entries": {k: v.as_list() for k, v in sorted(self.entries.items())},
        }
        self.path.write_text(json.dumps(data, indent=1) + "\n")

    @staticmethod
    def interpreter_config(block_d: int, q_len: int, k_len: int) -> Config:
        block_m = min(128, max(16, next_power_of_2(q_len)))
        block_n = min(128 if block_d <= 64 else 64, max(16, next_power_of_2(k_len)))
        return Config(block_m, block_n, 1, 1)

    @functools.lru_cache(maxsize=1024)
    def lookup(self, block_d: int, dtype: torch.dtype, is_causal: bool, q_len: int, k_len: int,
               interpreted: bool) -> Config:
        if interpreted:
            return self.interpreter_config(block_d, q_len, k_len)
        config = self.entries.get(key(block_d, dtype, is_causal, length_bucket(q_len)))
        return config if config is not None else default_config(block_d, q_len)
