"""Launch configurations (block sizes, warps, stages) for the kernels.

Each kernel backend keeps a small committed table, ``configs.json`` in its
package, from (pass, padded head dim, dtype, causal, query-length bucket) to a
configuration: :class:`Config` for the forward pass, :class:`BackwardConfig`
for the backward. ``twin-attention tune`` writes it on a GPU; a user's call
only looks it up, so nothing is autotuned on a user's time. Keys missing from
the table get the defaults below.

Look-ups are keyed on *buckets* of the lengths, never on the lengths
themselves, so a decoding loop (one more key per step) hits the same entry,
and the same compiled kernel, at every step.

The Triton backend's table also says, in its ``gluon`` section, which kernel runs a plain
forward on sm_90 (``GLUON_VARIANTS``: the ``tl`` kernel or a variant of the Gluon kernel), keyed
alike on the shorter of the query and key lengths (:meth:`ConfigTable.lookup_gluon`).

Under Triton's interpreter the numbers that matter are different (each
operation costs the same whatever its size, so fewer, larger blocks are
faster) and warps and stages mean nothing: the look-ups answer with
:func:`interpreter_config` / :func:`interpreter_backward_config` there.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.resources
import json
import pathlib

import torch

# Query-length buckets of the committed tables (a length uses the first bucket >= it).
LENGTH_BUCKETS = (16, 64, 256, 1024, 4096, 16384)
# What the gluon section may name: the tl kernel, or the Gluon kernel's variant (one partition, a
# producer warp, two consumer warp groups in ping-pong, those in persistent programs;
# impl_triton.gluon_attention).
GLUON_VARIANTS = ("tl", "one", "producer", "pingpong", "persistent")
# Lengths are rounded up to a power of two, capped here, before any look-up.
_MAX_LENGTH_KEY = 1 << 15


@dataclasses.dataclass(frozen=True)
class Config:
    """Forward pass: BLOCK_M query rows x BLOCK_N keys per inner step; ``maxnreg``, where set,
    caps each thread's registers (Triton's launch option of that name: the compiler then fits
    the kernel into that many, so that more programs share an SM): the plan sets it for
    decode at a large batch (:func:`common.plan.shallow_stages`), and a table entry may carry
    it where the tuner timed a capped candidate fastest (``common.tools.tune.CANDIDATES``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Backward pass: the dK/dV pass holds BLOCK_N1 keys and walks BLOCK_M1
    query rows per step; the dQ pass holds BLOCK_M2 rows and walks BLOCK_N2
    keys per step."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int


# Where the table has no entry: what FlashAttention-2-style Triton kernels pick
# on Hopper, by padded head dim.
DEFAULTS = {
    16: Config(128, 64, 4, 3),
    32: Config(128, 64, 4, 3),
    64: Config(128, 64, 4, 3),
    128: Config(128, 64, 8, 3),
    256: Config(64, 32, 4, 2),
}
# (D = 128: the tuned best at long lengths, benchmarks/NOTES.md "Backward".)
BACKWARD_DEFAULTS = {
    16: BackwardConfig(32, 128, 128, 32, 4, 3),
    32: BackwardConfig(32, 128, 128, 32, 4, 3),
    64: BackwardConfig(32, 128, 128, 32, 4, 3),
    128: BackwardConfig(64, 128, 128, 64, 8, 3),
    256: BackwardConfig(16, 64, 64, 16, 8, 2),
}
# float32 inputs multiply on the FMA units (full-precision products: no tensor cores), where a
# product's operands are spread over the threads, each holding its rows of one and its columns of
# the other: the 16-bit tiles above spill kilobytes a thread on sm_90 and take ptxas minutes. These
# keep every product in registers (8 warps: more threads to share them), at any query length (a
# short query's rows cut to the next power of two; benchmarks/NOTES.md has the compiles).
FLOAT32_DEFAULTS = {d: Config(32, 64, 8, 2) if d <= 64 else Config(16, 32, 8, 2) for d in (16, 32, 64, 128, 256)}
# An FP8 (e4m3) query, keys and values: tiles of half the bytes, at the tensor cores' FP8 rate;
# at D 128, 128 keys a step ran fastest on the H200; at D 64 that tile spills and the 16-bit one
# stays (benchmarks/NOTES.md, issue 44).
FP8_DEFAULTS = {**DEFAULTS, 128: Config(128, 128, 8, 3)}
# (float32's backward: as FLOAT32_DEFAULTS, every pass's products in registers)
FLOAT32_BACKWARD_DEFAULTS = {
    **{d: BackwardConfig(16, 32, 32, 16, 8, 2) for d in (16, 32, 64, 128)},
    256: BackwardConfig(16, 16, 16, 16, 8, 2),
}


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """The tile width a head dim is padded to: the next power of two, at least 16 (tl.dot's least),
    and 32 for head dims under 16, the width they were verified at on sm_90 (a masked 16-wide value
    tile beside a 32-wide key tile went wrong there: see ``plan.tile_widths``); the zeros cost little
    at such head dims."""
    return 32 if head_dim < 16 else max(16, next_power_of_2(head_dim))


def length_key(length: int) -> int:
    """What a look-up sees of a length: the next power of two, capped."""
    return next_power_of_2(min(length, _MAX_LENGTH_KEY))


def length_bucket(length: int) -> int:
    for bucket in LENGTH_BUCKETS:
        if length <= bucket:
            return bucket
    return LENGTH_BUCKETS[-1]


def key(block_d: int, dtype: torch.dtype, is_causal: bool, bucket: int, backward: bool = False) -> str:
    """The table key, e.g. ``d64-float16-causal-L1024`` (``bwd-`` in front for the backward)."""
    name = f"d{block_d}-{str(dtype).removeprefix('torch.')}-{'causal' if is_causal else 'full'}-L{bucket}"
    return "bwd-" + name if backward else name


def default_config(block_d: int, q_len: int, dtype: torch.dtype = torch.float16,
                   kv_dtype: torch.dtype | None = None) -> Config:
    """The forward configuration where the table has no entry (``dtype`` the query's,
    ``kv_dtype`` the keys' and values' where it differs).

    Short queries (decoding, a few speculative tokens) get the smallest row
    tile that holds them: their programs stream keys and values, and rows
    past Lq would only burn tensor-core time; FP8 keys and values take half
    the bytes a key, so such a program takes twice the keys a step. float32
    inputs take FLOAT32_DEFAULTS' tiles at any length (their products run on
    the FMA units), a short query's rows cut as above; FP8 tiles take twice
    the keys at D 128.
    """
    if dtype == torch.float32:
        config = FLOAT32_DEFAULTS[block_d]
        if q_len <= 64:
            return dataclasses.replace(config, block_m=min(config.block_m, max(16, next_power_of_2(q_len))))
        return config
    if q_len <= 64:
        block_m = min(64, max(16, next_power_of_2(q_len)))
        keys = 2 if (kv_dtype or dtype) == torch.float8_e4m3fn else 1
        if block_d <= 64:
            return Config(block_m, 128 * keys, 4, 3)
        if block_d <= 128:
            return Config(block_m, 64 * keys, 4, 3)
        return Config(block_m, 32 * keys, 4, 2)
    return FP8_DEFAULTS[block_d] if dtype == torch.float8_e4m3fn else DEFAULTS[block_d]


def interpreter_config(block_d: int, q_len: int, k_len: int) -> Config:
    block_m = min(128, max(16, next_power_of_2(q_len)))
    block_n = min(128 if block_d <= 64 else 64, max(16, next_power_of_2(k_len)))
    return Config(block_m, block_n, 1, 1)


def interpreter_backward_config(block_d: int, q_len: int, k_len: int) -> BackwardConfig:
    block_m = min(64, max(16, next_power_of_2(q_len)))
    block_n = min(64, max(16, next_power_of_2(k_len)))
    return BackwardConfig(block_m, block_n, block_m, block_n, 1, 1)


class ConfigTable:
    """One backend's committed table (read-only at run time)."""

    def __init__(self, entries: dict, meta: dict, gluon: dict | None = None):
        self.entries = entries
        self.meta = meta
        self.gluon = gluon or {}
        bad = {k: v for k, v in self.gluon.items() if v not in GLUON_VARIANTS}
        if bad:
            raise ValueError(f"a config table's gluon section names {GLUON_VARIANTS}, got {bad}")

    @classmethod
    def load(cls, package: str) -> ConfigTable:
        """The table in ``configs.json`` of ``package`` (empty if there is none); imports no kernel."""
        resource = importlib.resources.files(package) / "configs.json"
        if not resource.is_file():
            return cls({}, {})
        data = json.loads(resource.read_text())
        entries = {k: (BackwardConfig(*v) if k.startswith("bwd-") else Config(*v))
                   for k, v in data.get("entries", {}).items()}
        return cls(entries, data.get("meta", {}), data.get("gluon", {}))

    @staticmethod
    def path(package: str) -> pathlib.Path:
        """Where ``tune`` writes the table of ``package``."""
        return pathlib.Path(str(importlib.resources.files(package) / "configs.json"))

    @staticmethod
    def write(path: pathlib.Path, entries: dict, meta: dict, gluon: dict | None = None) -> None:
        data = {"meta": meta, "entries": {k: [x for x in dataclasses.astuple(v) if x is not None]
                                          for k, v in sorted(entries.items())}}
        if gluon:
            data["gluon"] = dict(sorted(gluon.items()))
        path.write_text(json.dumps(data, indent=1) + "\n")

    def lookup(self, block_d: int, dtype: torch.dtype, is_causal: bool, q_len: int, k_len: int,
               interpreted: bool, kv_dtype: torch.dtype | None = None) -> Config:
        """The forward configuration for a call (an override, inside :func:`override`); ``dtype``
        the query's, ``kv_dtype`` the keys' and values' where it differs (an FP8 cache)."""
        forced = _override.get()
        if forced is not None:
            return forced
        return self._lookup(block_d, dtype, is_causal, length_key(q_len), length_key(k_len), interpreted,
                            kv_dtype)

    def lookup_backward(self, block_d: int, dtype: torch.dtype, is_causal: bool, q_len: int, k_len: int,
                        interpreted: bool) -> BackwardConfig:
        """The backward configuration for a call (an override, inside :func:`override`)."""
        forced = _override_backward.get()
        if forced is not None:
            return forced
        return self._lookup_backward(block_d, dtype, is_causal, length_key(q_len), length_key(k_len), interpreted)

    def lookup_gluon(self, head_dim: int, dtype: torch.dtype, is_causal: bool, length: int) -> str:
        """The kernel that runs a plain forward on sm_90 (one of ``GLUON_VARIANTS``), by the bucket of
        ``length``, the shorter of its query and key lengths; "tl" where the table has no entry."""
        return self._lookup_gluon(head_dim, dtype, is_causal, length_key(length))

    @functools.lru_cache(maxsize=512)  # noqa: B019 - one table per backend, alive for the process
    def _lookup_gluon(self, head_dim, dtype, is_causal, length) -> str:
        return self.gluon.get(key(head_dim, dtype, is_causal, length_bucket(length)), "tl")

    @functools.lru_cache(maxsize=512)  # noqa: B019 - one table per backend, alive for the process
    def _lookup(self, block_d, dtype, is_causal, q_key, k_key, interpreted, kv_dtype) -> Config:
        if interpreted:
            return interpreter_config(block_d, q_key, k_key)
        config = self.entries.get(key(block_d, dtype, is_causal, length_bucket(q_key)))
        return config if config is not None else default_config(block_d, q_key, dtype, kv_dtype)

    @functools.lru_cache(maxsize=512)  # noqa: B019 - one table per backend, alive for the process
    def _lookup_backward(self, block_d, dtype, is_causal, q_key, k_key, interpreted) -> BackwardConfig:
        if interpreted:
            return interpreter_backward_config(block_d, q_key, k_key)
        config = self.entries.get(key(block_d, dtype, is_causal, length_bucket(q_key), backward=True))
        if config is not None:
            return config
        return (FLOAT32_BACKWARD_DEFAULTS if dtype == torch.float32 else BACKWARD_DEFAULTS)[block_d]


_override: contextvars.ContextVar[Config | None] = contextvars.ContextVar("config_override", default=None)
_override_backward: contextvars.ContextVar[BackwardConfig | None] = contextvars.ContextVar(
    "backward_config_override", default=None)


def forced() -> Config | None:
    """The forward configuration :func:`override` forces in this thread, or None."""
    return _override.get()


@contextlib.contextmanager
def override(config: Config | BackwardConfig):
    """Inside the block, every call of this thread uses ``config`` for its pass
    instead of the table (``tune`` times candidates this way)."""
    var = _override_backward if isinstance(config, BackwardConfig) else _override
    token = var.set(config)
    try:
        yield
    finally:
        var.reset(token)
