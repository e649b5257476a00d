"""Short queries against long keys: grouped-query packing and split-KV.

Both Triton backends give each program one block of query rows of one head and
stream that head's keys through it. With few query rows (decoding: Lq = 1 or
a few speculative tokens) that schedule starves the GPU twice over:

- every query head of a grouped-query group re-reads the same K/V head, and
  each program holds only Lq useful rows;
- there are only B·H programs, each walking all of Lk on one SM.

:func:`pack_gqa` cures the first without touching a kernel: the GROUP query
heads that share a K/V head become GROUP·Lq rows of one head (a view), so each
K/V tile is read once for all of them. :func:`plan_splits` cures the second:
the keys are cut into ``num_splits`` ranges of ``blocks_per_split`` key blocks,
one program per range ("flash-decoding"); each writes its partial output and
log-sum-exp, and a second kernel merges them:
``o = sum_s exp(lse_s - lse) o_s`` with ``lse = log(sum_s exp(lse_s))``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from common.configs import next_power_of_2

# A launch with fewer programs than SMs is split, into enough splits for about
# this many programs per SM: a decode program streams memory, and more than
# one of them per SM hides its latency (2 won the decode sweep on the H200).
PROGRAMS_PER_SM = 2
# Under the interpreter there are no SMs; pretend there are a few, so that the
# CPU suite meets split launches on small decode-like shapes.
INTERPRETER_SMS = 2
# Pack grouped-query heads only for short queries: for long ones a program is
# already full of rows of one head, and packing would change nothing but the
# tile boundaries.
PACK_MAX_LQ = 64
# Split only where each program would otherwise walk this many keys or more:
# below it the merge kernel's launch costs more than the split saves.
MIN_SPLIT_KEYS = 2048

# Rows per program of the merge kernel (both backends).
COMBINE_ROWS = 16

_forced_splits: contextvars.ContextVar[int | None] = contextvars.ContextVar("forced_splits", default=None)


@contextlib.contextmanager
def force_splits(num_splits: int):
    """Inside the block, split the keys of every call into ``num_splits`` ranges
    (at most one per key block) whatever the heuristic says; 1 turns splitting off.
    For tests and benchmarks."""
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    token = _forced_splits.set(num_splits)
    try:
        yield
    finally:
        _forced_splits.reset(token)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(programs: int, Lk: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """``(num_splits, blocks_per_split)`` for a launch of ``programs`` programs per split.

    Splits only when the unsplit launch leaves the GPU short of programs.
    ``blocks_per_split`` is a power of two (NineToothed makes it a tile size,
    so each value is a compiled kernel) and every split holds at least one key
    block; ``num_splits == 1`` means one program walks all the keys.
    """
    # Every key block counts (the dispatcher already dropped, for causal calls,
    # the keys past Lq - 1 that no row sees); NineToothed's arrangement makes
    # exactly ceil(k_blocks / blocks_per_split) splits of the same blocks.
    k_blocks = -(-Lk // block_n)
    wanted = _forced_splits.get()
    if wanted is None:
        target = PROGRAMS_PER_SM * _sm_count(device)
        if programs >= target // 2 or k_blocks * block_n < MIN_SPLIT_KEYS:
            return 1, k_blocks
        wanted = min(-(-target // programs), k_blocks // 2)
    if wanted <= 1:
        return 1, k_blocks
    blocks_per_split = next_power_of_2(-(-k_blocks // min(wanted, k_blocks)))
    return -(-k_blocks // blocks_per_split), blocks_per_split


def pack_gqa(query, key, attn_mask, is_causal):
    """``(query, attn_mask)`` with each group's query heads packed into rows, or None.

    query (B, H, Lq, D) with H = GROUP·H_kv becomes (B, H_kv, GROUP·Lq, D):
    row g·Lq + i of K/V head j is row i of query head j·GROUP + g. A view,
    so it exists only where the strides allow (always for Lq = 1 or a
    contiguous query); the mask likewise. An output (B, H_kv, GROUP·Lq, Dv)
    computed from it is, contiguous, the output (B, H, Lq, Dv). Causal calls
    are not packed (a packed row's position is no longer its row index).
    """
    B, H, Lq, D = query.shape
    H_kv = key.shape[1]
    if H_kv == H or is_causal or Lq > PACK_MAX_LQ:
        return None
    group = H // H_kv
    try:
        packed_query = query.view(B, H_kv, group * Lq, D)
        packed_mask = None if attn_mask is None else attn_mask.view(B, H_kv, group * Lq, attn_mask.shape[3])
    except RuntimeError:  # strides that no view can merge
        return None
    return packed_query, packed_mask


def combine_rows(rows: int, interpreted: bool) -> int:
    """Rows per merge program for ``rows`` merged rows: COMBINE_ROWS, or fewer
    under the interpreter, where padding rows cost as much as real ones."""
    return min(COMBINE_ROWS, next_power_of_2(rows)) if interpreted else COMBINE_ROWS
