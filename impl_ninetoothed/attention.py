"""Scaled-dot-product attention, forward and backward, as NineToothed kernels.

The same algorithms as ``impl_triton/attention.py``, with the same names
(``acc``, ``m_i``, ``l_i``, ``qk``, ``p``, ``dq``, ``dk``, ``dv``, ``delta``),
the same units (loop bounds count blocks) and the same named constants,
written as NineToothed arrangements + applications and compiled to Triton by
``ninetoothed.make``:

- an *arrangement* says which tiles each program sees; NineToothed writes the
  pointer arithmetic, strides and bounds masks of every load and store;
- an *application* is the program, written for those tiles.

Forward (``arrangement`` + ``application``): one program per (batch, head,
block of BLOCK_M query rows), which sees its query and output tiles and the
whole key/value sequence of its (grouped-query) head as a row of (BLOCK_N, D)
tiles (likewise the mask); FlashAttention-2's online softmax in base 2, key
blocks in three stages (the band's left edge masked, the blocks every row sees
whole unmasked, the right edge and the ragged tail masked; causal, bottom-right
and windowed calls are all bands), blocks outside the band never visited;
packed variable-length sequences (``BANDED == ROW_BANDS``) give every row its
own band, arranged like the log-sum-exp; soft-capping and attention sinks as in
the Triton kernel. Short
queries split the keys as the Triton kernel does: the arrangement tiles each
K/V row once more into splits of ``blocks_per_split`` blocks, one program per
split, and ``combine_arrangement`` + ``combine_application`` merge the
partial outputs by their log-sum-exps.

Backward: ``dq_arrangement`` + ``dq_application`` (one program per block of
query rows, the forward's schedule; it also stores ``delta``), then
``dkdv_arrangement`` + ``dkdv_application`` (one program per block of keys of
one K/V head; the arrangement hands it the query rows of every query head of
its group, so grouped-query gradients are summed in registers).

The named constants (``LOG2E``, ``LN2``, the mask kinds) are defined in each
generated module by :func:`_make`: NineToothed compiles the application's
source in a module of its own.
"""

from __future__ import annotations

import functools
import inspect
import threading

import ninetoothed
import ninetoothed.language as ntl
import torch
import triton
import triton.language as tl
from ninetoothed import Tensor

from common.codecache import number_tensors_from_zero, use_private_cache
from common.configs import padded_head_dim
from common.interpret import apply_interpreter_fixes, interpreter_requested
from common.jit_helpers import JIT_HELPERS, _cap_factors, _dropout_keep, _in_band, _key_stages, _tanh
from common.launch import (
    BoundKernel,
    define_constants,
    inputs_aligned,
    int_classes,
    launcher_arguments,
    route_generated_launch,
    routed_kernel,
)
from common.plan import LN2, LOG2E, ROW_BANDS, UNBOUNDED, UNIFORM_24, MaskKind, Softcap, one_stage_split
from common.validation import OFFSET_LIMIT

NO_MASK, BOOL_MASK, ADDITIVE_MASK = int(MaskKind.NONE), int(MaskKind.BOOL), int(MaskKind.ADDITIVE)
TANH_APPROX = int(Softcap.APPROX)
ONE_STAGE = 2  # SPLIT's value for a split walked in one masked loop (common.plan.one_stage_split)
KERNEL_CONSTANTS = dict(LOG2E=LOG2E, LN2=LN2, NO_MASK=NO_MASK, BOOL_MASK=BOOL_MASK, ADDITIVE_MASK=ADDITIVE_MASK,
                        UNIFORM_24=UNIFORM_24, TANH_APPROX=TANH_APPROX,
                        ROW_BANDS=ROW_BANDS, ONE_STAGE=ONE_STAGE)


# -- arranging tiles (plain Python on symbolic tensors, run once per make) ---------------

def _rows(x, block_m, block_d):
    """(B, H, L, D) -> programs (B, H, L / BLOCK_M), each a (BLOCK_M, D) tile."""
    arranged = x.tile((1, 1, block_m, block_d)).squeeze(3)
    arranged.dtype = arranged.dtype.squeeze((0, 1))
    return arranged


def _row_slices(x, block_m):
    """(B, H, L) -> programs (B, H, L / BLOCK_M), each a (BLOCK_M,) slice."""
    arranged = x.tile((1, 1, block_m))
    arranged.dtype = arranged.dtype.squeeze((0, 1))
    return arranged


def _key_row(x, heads, m_blocks, block_n, block_d, blocks_per_split=None):
    """(B, H_kv, Lk, D) -> per program of (B, heads, m_blocks[, S]), the row of
    (BLOCK_N, D) tiles of the K/V head its query head reads (split: its split's
    part of that row, ``blocks_per_split`` tiles: an int, or a symbol of
    :func:`_split_blocks`). Query head h reads K/V head h // GROUP, so the H_kv
    heads are repeated GROUP times by broadcasting (expand), never by copying."""
    group = heads // x.shape[1]
    arranged = x.tile((1, 1, block_n, block_d))
    if blocks_per_split is None:
        arranged = arranged.tile((1, 1, -1, -1)).squeeze((2, 3))  # (B, H_kv)
        arranged = arranged.unsqueeze(2).unsqueeze(3)
        arranged = arranged.expand((-1, -1, group, m_blocks)).flatten(1, 3)
    else:
        arranged = arranged.tile((1, 1, blocks_per_split, -1)).squeeze(3)  # (B, H_kv, S)
        arranged = arranged.unsqueeze(2).unsqueeze(3)
        arranged = arranged.expand((-1, -1, group, m_blocks, -1)).flatten(1, 3)
    arranged.dtype = arranged.dtype.squeeze((0, 1, 3))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
    return arranged


def _key_blocks_row(x, heads, m_blocks, block_d, num_splits=None):
    """(B, H_kv, Lk // BLOCK_N, BLOCK_N, D), the keys' whole blocks as a dimension of their own
    (a view, see ``blocked_keys``) -> per program of (B, heads, m_blocks), the row of
    (BLOCK_N, D) tiles of its K/V head, as :func:`_key_row`; with ``num_splits`` (a split
    launch, which reads none of them) the same row for each split."""
    group = heads // x.shape[1]
    arranged = x.tile((1, 1, 1, x.shape[3], block_d)).tile((1, 1, -1, -1, -1)).squeeze((2, 3, 4))  # (B, H_kv)
    arranged = arranged.unsqueeze(2).unsqueeze(3)
    arranged = arranged.expand((-1, -1, group, m_blocks)).flatten(1, 3)
    if num_splits is not None:
        arranged = arranged.unsqueeze(2).expand((-1, -1, num_splits))
    arranged.dtype = arranged.dtype.squeeze((0, 1, 3, 4))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1, 2))
    return arranged


def _group_row_blocks(x, group, n_blocks, block_d=None):
    """(B, H, Lq // BLOCK_M, BLOCK_M[, D]), the rows' whole blocks as a dimension of their own
    (a view) -> per program of (B, H_kv, n_blocks), the (GROUP, Lq // BLOCK_M) tiles of
    (BLOCK_M[, D]) of the query heads that read K/V head h_kv, as :func:`_group_rows`."""
    if block_d is None:
        arranged = x.tile((1, 1, 1, x.shape[3])).tile((1, group, -1, -1)).squeeze((2, 3))
        arranged.dtype = arranged.dtype.squeeze((0, 3))
        arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1, 2))
    else:
        arranged = x.tile((1, 1, 1, x.shape[3], block_d)).tile((1, group, -1, -1, -1)).squeeze((2, 3, 4))
        arranged.dtype = arranged.dtype.squeeze((0, 3, 4))
        arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1, 2))
    return arranged.unsqueeze(2).expand((-1, -1, n_blocks))


def _mask_row(attn_mask, block_m, block_n, blocks_per_split=None):
    """(B, H, Lq, Lk), broadcast views welcome -> per program a row of
    (BLOCK_M, BLOCK_N) tiles (split: BLOCKS_PER_SPLIT of them)."""
    arranged = attn_mask.tile((1, 1, block_m, block_n))
    arranged = arranged.tile((1, 1, 1, blocks_per_split if blocks_per_split is not None else -1))
    if blocks_per_split is None:
        arranged = arranged.squeeze(3)
    arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
    return arranged


def _last_first(arranged):
    """Programs (B, H, M[, ...]) -> the same with the row blocks last to first (a causal row
    block's work grows with its index: the longest start first, as in the Triton kernel)."""
    return arranged[:, :, ::-1]


def _split_blocks(key, num_splits, block_n):
    """The key blocks of each split, as the plan makes them (``common.plan.plan_splits``):
    ceil(ceil(Lk / BLOCK_N) / S), in symbols of the keys' length and the partials' split count,
    so that one compiled kernel serves every split size (a tile size of the arrangement; a
    Python int here would be a kernel per value, compiled as a decode loop's cache grows)."""
    k_blocks = (key.shape[2] + (block_n - 1)) // block_n
    return (k_blocks + (num_splits - 1)) // num_splits


def _per_split(arranged, num_splits):
    """The same tile for each of the S programs of a row block: (B, H, M) -> (B, H, M, S)."""
    return arranged.unsqueeze(3).expand((-1, -1, -1, num_splits))


def _per_program(dropout_seed, arranged):
    """The dropout seed, a (1,) tensor, as the same (1,) tile for every program of ``arranged``'s grid."""
    tiled = dropout_seed.tile((1,))
    for _ in range(len(arranged.shape) - 1):
        tiled = tiled.unsqueeze(0)
    return tiled.expand(tuple(arranged.shape))


def _group_rows(x, group, n_blocks, block_m, block_d=None):
    """(B, H, L[, D]) -> per program of (B, H_kv, n_blocks), the (GROUP, L / BLOCK_M)
    tiles of (BLOCK_M[, D]) of the query heads that read K/V head h_kv."""
    if block_d is None:
        arranged = x.tile((1, 1, block_m)).tile((1, group, -1)).squeeze(2)
        arranged.dtype = arranged.dtype.squeeze(0)
    else:
        arranged = x.tile((1, 1, block_m, block_d)).tile((1, group, -1, -1)).squeeze((2, 3))
        arranged.dtype = arranged.dtype.squeeze((0, 3))
    arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
    return arranged.unsqueeze(2).expand((-1, -1, n_blocks))


# -- forward ---------------------------------------------------------------------------------

def arrangement(
    query, key, value, key_blocks, value_blocks, attn_mask, scale, dropout_seed, dropout_p, dropout_scale,
    band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, sinks, output, lse,
    BANDED, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, SINKS, RESUME, BLOCKED,
    block_m, block_n, block_d, block_dv, split=False,
):
    """One program per (batch, head, block of BLOCK_M query rows), and per split
    of the keys when ``split``; a head's row blocks last to first (:func:`_last_first`).

    Unsplit, output is (B, H, Lq, Dv) and lse (B, H, Lq); split, output is the
    float32 partial-output buffer (B, H, Lq, S, Dv) and lse (B, H, Lq, S), and
    each program sees its split's key blocks instead of all of them: as many as
    :func:`_split_blocks` derives from the keys' length and the split count.
    """
    query_arranged = _last_first(_rows(query, block_m, block_d))
    m_blocks = query_arranged.shape[2]
    blocks_per_split = None
    if split:
        blocks_per_split = _split_blocks(key, output.shape[3], block_n)
    key_arranged = _key_row(key, query.shape[1], m_blocks, block_n, block_d, blocks_per_split)
    value_arranged = _key_row(value, query.shape[1], m_blocks, block_n, block_dv, blocks_per_split)
    num_splits = output.shape[3] if split else None
    key_blocks_arranged = _key_blocks_row(key_blocks, query.shape[1], m_blocks, block_d, num_splits)
    value_blocks_arranged = _key_blocks_row(value_blocks, query.shape[1], m_blocks, block_dv, num_splits)
    attn_mask_arranged = _last_first(_mask_row(attn_mask, block_m, block_n, blocks_per_split))
    sinks_arranged = _last_first(_row_slices(sinks, block_m))  # (B, H, Lq): stride 0 but over H
    row_bands_arranged = [_last_first(_row_slices(x, block_m)) for x in (row_bands_lo, row_bands_hi)]
    if blocks_per_split is None:
        output_arranged = _last_first(_rows(output, block_m, block_dv))
        lse_arranged = _last_first(_row_slices(lse, block_m))
    else:
        query_arranged = _per_split(query_arranged, num_splits)
        sinks_arranged = _per_split(sinks_arranged, num_splits)
        row_bands_arranged = [_per_split(x, num_splits) for x in row_bands_arranged]
        # (B, H, Lq, S, Dv) -> programs (B, H, Lq / BLOCK_M, S), each (BLOCK_M, Dv)
        output_arranged = output.tile((1, 1, block_m, 1, block_dv)).squeeze(4)
        output_arranged.dtype = output_arranged.dtype.squeeze((0, 1, 3))
        output_arranged = _last_first(output_arranged)
        # (B, H, Lq, S) -> a (BLOCK_M,) slice per program
        lse_arranged = lse.tile((1, 1, block_m, 1))
        lse_arranged.dtype = lse_arranged.dtype.squeeze((0, 1, 3))
        lse_arranged = _last_first(lse_arranged)
    return (
        query_arranged, key_arranged, value_arranged, key_blocks_arranged, value_blocks_arranged,
        attn_mask_arranged, scale, _per_program(dropout_seed, query_arranged), dropout_p, dropout_scale, band_lo,
        band_hi, softcap, *row_bands_arranged, sinks_arranged, output_arranged, lse_arranged, BANDED, MASK_KIND,
        WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, SINKS, RESUME, BLOCKED,
    )


def _attn_fwd_inner(
    acc, l_i, m_i, q, key, value, attn_mask, offs_m, lo, hi, first, band_lo, band_hi, qk_scale, cap_in, cap_out,
    seed, head, dropout_p, BANDED, MASK_KIND, MASKED, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i); inlined by NineToothed.

    Blocks count from the first key; the program's tiles start at block
    ``first`` (0 unless the keys are split). MASKED: the blocks may hold keys
    past Lk or, when BANDED, outside a row's band (row i sees keys i + band_lo
    .. i + band_hi); mask them. Unmasked blocks
    skip every comparison. DROPOUT: the row sums take every probability, the
    output only the kept ones.
    """
    for j in range(lo, hi):
        k = key[j - first]
        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP:
            if SOFTCAP:  # softcap * tanh(s / softcap), in base 2
                qk = _tanh(qk * cap_in, SOFTCAP == TANH_APPROX) * cap_out
            else:
                qk = qk * qk_scale
            if MASKED:
                offs_n = key[j - first].offsets(-2)
                valid = offs_n[None, :] < key.source.shape[-2]
                if BANDED:
                    valid = valid & _in_band(offs_m, offs_n, band_lo, band_hi)
                qk = ntl.where(valid, qk, float("-inf"))
            if MASK_KIND != NO_MASK:
                mask = attn_mask[j - first]
                if MASK_KIND == BOOL_MASK:
                    qk = ntl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(ntl.float32) * LOG2E
            m_ij = ntl.maximum(m_i, ntl.max(qk, 1))
            if MASK_KIND != NO_MASK or SPLIT or BANDED:
                # A row with no visible key yet has m_ij = -inf (a mask, a band
                # that hides every key of the block from it, or a split that
                # starts past a causal row's last key); subtract 0
                # instead so that its p and alpha are 0, not NaN.
                m_sub = ntl.where(m_ij == float("-inf"), 0.0, m_ij)
            else:
                m_sub = m_ij
            qk = qk - m_sub[:, None]
        else:
            # No mask: scale and subtract the maximum in one FMA per score. The
            # row maximum of qk * qk_scale is max(qk) * qk_scale, or min(qk) *
            # qk_scale for a negative scale.
            if NEGATIVE_SCALE:
                m_ij = ntl.maximum(m_i, ntl.min(qk, 1) * qk_scale)
            else:
                m_ij = ntl.maximum(m_i, ntl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            qk = qk * qk_scale - m_sub[:, None]
        p = ntl.exp2(qk)
        alpha = ntl.exp2(m_i - m_sub)
        l_i = l_i * alpha + ntl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            offs_n = key[j - first].offsets(-2)
            keep = _dropout_keep(seed, head, offs_m, offs_n, dropout_p)
            p = ntl.where(keep, p, 0.0)
        v = value[j - first]
        acc = ntl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


def application(
    query, key, value, key_blocks, value_blocks, attn_mask, scale, dropout_seed, dropout_p, dropout_scale,
    band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, sinks, output, lse,
    BANDED, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, SINKS, RESUME, BLOCKED,
):
    q = query
    offs_m = query.offsets(-2)
    head = query.offsets(0) * query.source.shape[1] + query.offsets(1)  # in (B·H): the dropout mask's
    qk_scale = scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))
    cap_in, cap_out = _cap_factors(scale, softcap, SOFTCAP)
    seed = 0
    if DROPOUT:
        seed = ntl.sum(dropout_seed, 0)  # the (1,) tile, loaded once
    acc = ntl.zeros(output.shape, dtype=ntl.float32)
    l_i = ntl.zeros((query.shape[0],), dtype=ntl.float32)
    m_i = ntl.full((query.shape[0],), float("-inf"), dtype=ntl.float32)
    BLOCK_N = key.dtype.shape[0]
    lo = ntl.min(key[0].offsets(-2), 0) // BLOCK_N  # the split's first key block
    if SINKS:  # a logit with no value: it starts the online softmax, once per row
        m_i = ntl.where(lo == 0, sinks * LOG2E, m_i)
        l_i = ntl.where(lo == 0, 1.0, l_i)
    if RESUME:
        # Fold these keys into a running (float32) output and log-sum-exp, in place: the
        # state acc = output, m_i = lse (base 2), l_i = 1; a row at -inf starts afresh.
        seen = lse != float("-inf")
        m_i = ntl.where(seen, lse * LOG2E, m_i)
        l_i = ntl.where(seen, 1.0, l_i)
        acc = ntl.where(seen[:, None], output, acc)

    # In key blocks of this program's [lo, hi) (the split's, when split): the
    # band's left edge [first, full_lo) (masked; BANDED only), the blocks every
    # row sees whole [full_lo, full_hi) (unmasked), then the band's right edge
    # (the causal diagonal) and the ragged end of the keys [full_hi, end) (masked).
    Lk = key.source.shape[-2]
    row_lo = band_lo
    row_hi = band_hi
    if BANDED == ROW_BANDS:  # each row's own band (packed sequences)
        row_lo = row_bands_lo
        row_hi = row_bands_hi
    first, full_lo, full_hi, end = _key_stages(offs_m, lo, lo + key.shape[0], Lk, row_lo, row_hi, BLOCK_N, BANDED)
    if SPLIT == ONE_STAGE:
        # All of [first, end) in the last, masked loop: with a split size in symbols, two loops
        # had ptxas serialise a warpgroup tile's MMAs (common.plan.ONE_STAGE_SPLIT_ROWS); one costs
        # a compare and a select per score, in a launch bound by memory.
        full_lo = first
        full_hi = first
    if BANDED:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key, value, attn_mask, offs_m, first, full_lo, lo, row_lo, row_hi, qk_scale,
            cap_in, cap_out, seed, head, dropout_p, BANDED, MASK_KIND, True, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
            DROPOUT, SOFTCAP,
        )
    if BLOCKED:
        # The whole blocks from their own view, whose block size is a constant: their loads carry
        # no per-key bounds check (an unsplit launch without dropout; the blocks count from 0).
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key_blocks, value_blocks, attn_mask, offs_m, full_lo, full_hi, lo, row_lo, row_hi,
            qk_scale, cap_in, cap_out, seed, head, dropout_p, BANDED, MASK_KIND, False, NEGATIVE_SCALE,
            DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP,
        )
    else:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key, value, attn_mask, offs_m, full_lo, full_hi, lo, row_lo, row_hi, qk_scale,
            cap_in, cap_out, seed, head, dropout_p, BANDED, MASK_KIND, False, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
            DROPOUT, SOFTCAP,
        )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, key, value, attn_mask, offs_m, full_hi, end, lo, row_lo, row_hi, qk_scale,
        cap_in, cap_out, seed, head, dropout_p, BANDED, MASK_KIND, True, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
        DROPOUT, SOFTCAP,
    )

    if WITH_LSE:
        # Log-sum-exp of the scaled scores, from base 2 back to natural log;
        # -inf for a row whose every key is masked out (m_i = -inf, l_i = 0).
        lse = (m_i + ntl.log2(l_i)) * LN2  # noqa: F841 (a store)
    if MASK_KIND != NO_MASK or SPLIT or BANDED or RESUME:
        # A row whose every key is masked out (a mask, a band that leaves it no
        # key, or a split none of whose keys it sees; resumed, no key so far)
        # has acc = 0 and l_i = 0: SDPA returns 0.
        l_i = ntl.where(l_i == 0.0, 1.0, l_i)
    if DROPOUT:
        output = acc / l_i[:, None] * dropout_scale  # noqa: F841 (a store)
    else:
        output = acc / l_i[:, None]  # noqa: F841 (a store)


def combine_arrangement(o_part, lse_part, output, lse, WITH_LSE, block_r, block_s, block_dv):
    """One program per BLOCK_R rows of the flattened (B·H·Lq) rows, walking their splits
    BLOCK_S at a time (as the Triton merge, :func:`impl_triton.attention._merge_kernel`): the
    split count is a size, not a tile size, so no split count compiles a merge of its own."""
    # (R, S, Dv) -> programs (R / BLOCK_R,), each a row of S / BLOCK_S (BLOCK_R, BLOCK_S, Dv) tiles
    o_part_arranged = o_part.tile((block_r, block_s, block_dv)).tile((1, -1, -1)).squeeze((1, 2))
    o_part_arranged.dtype = o_part_arranged.dtype.squeeze((0, 2))
    # (R, S) -> a row of (BLOCK_R, BLOCK_S) tiles
    lse_part_arranged = lse_part.tile((block_r, block_s)).tile((1, -1)).squeeze(1)
    lse_part_arranged.dtype = lse_part_arranged.dtype.squeeze(0)
    # (R, Dv) -> (BLOCK_R, Dv) tiles; (R,) -> (BLOCK_R,) slices
    output_arranged = output.tile((block_r, block_dv)).squeeze(1)
    lse_arranged = lse.tile((block_r,))
    return o_part_arranged, lse_part_arranged, output_arranged, lse_arranged, WITH_LSE


def combine_application(o_part, lse_part, output, lse, WITH_LSE):
    """Merge the splits, folded as an online softmax: o = sum_s w_s o_s / sum_s w_s,
    w_s = exp(lse_s - max_s lse_s).

    A split whose rows saw no key has lse_s = -inf and weighs 0.
    """
    m = ntl.full((output.shape[0],), float("-inf"), dtype=ntl.float32)
    l = ntl.zeros((output.shape[0],), dtype=ntl.float32)  # noqa: E741
    o = ntl.zeros(output.shape, dtype=ntl.float32)
    for s in range(lse_part.shape[0]):
        lse_s = lse_part[s]
        m_new = ntl.maximum(m, ntl.max(lse_s, 1))
        m_sub = ntl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a key yet: weights 0, not NaN
        alpha = ntl.exp(m - m_sub)
        w = ntl.exp(lse_s - m_sub[:, None])
        l = l * alpha + ntl.sum(w, 1)  # noqa: E741
        o = o * alpha[:, None] + ntl.sum(w[:, :, None] * o_part[s], 1)
        m = m_new
    output = o / ntl.where(l == 0.0, 1.0, l)[:, None]  # noqa: F841
    if WITH_LSE:
        lse = ntl.where(m == float("-inf"), 0.0, m) + ntl.log(l)  # noqa: F841 (a store; log(0) = -inf: no key at all)


# -- backward ----------------------------------------------------------------------------------

def dq_arrangement(
    query, key, value, key_blocks, value_blocks, attn_mask, out, grad_out, lse, grad_lse, scale, dropout_seed,
    dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, delta_out, grad_query,
    BANDED, MASK_KIND, WITH_DLSE, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED,
    block_m, block_n, block_d, block_dv,
):
    """One program per (batch, head, block of BLOCK_M query rows), as the forward (row blocks
    last to first)."""
    query_arranged = _last_first(_rows(query, block_m, block_d))
    m_blocks = query_arranged.shape[2]

    def rows(x, block_d=None):  # a per-row-block tensor, last to first as the query
        return _last_first(_rows(x, block_m, block_d) if block_d is not None else _row_slices(x, block_m))

    return (
        query_arranged,
        _key_row(key, query.shape[1], m_blocks, block_n, block_d),
        _key_row(value, query.shape[1], m_blocks, block_n, block_dv),
        _key_blocks_row(key_blocks, query.shape[1], m_blocks, block_d),
        _key_blocks_row(value_blocks, query.shape[1], m_blocks, block_dv),
        _last_first(_mask_row(attn_mask, block_m, block_n)),
        rows(out, block_dv), rows(grad_out, block_dv), rows(lse), rows(grad_lse), scale,
        _per_program(dropout_seed, query_arranged), dropout_p, dropout_scale, band_lo, band_hi, softcap,
        rows(row_bands_lo), rows(row_bands_hi), rows(delta_out), rows(grad_query, block_d),
        BANDED, MASK_KIND, WITH_DLSE, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED,
    )


def _attn_bwd_dq_inner(
    dq, q, do, m2, delta, key, value, attn_mask, offs_m, lo, hi, band_lo, band_hi, qk_scale, cap_in, cap_out,
    seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, MASKED, DOT_PRECISION, DROPOUT, SOFTCAP,
):
    """Add key blocks [lo, hi) to dq (unscaled). MASKED as in _attn_fwd_inner.
    DROPOUT: dp reaches only the kept probabilities, scaled as in the forward.
    SOFTCAP: ds passes through the cap's derivative, 1 - tanh^2."""
    for j in range(lo, hi):
        k = key[j]
        v = value[j]
        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP:
            if SOFTCAP:
                cap = _tanh(qk * cap_in, SOFTCAP == TANH_APPROX)
                qk = cap * cap_out
            else:
                qk = qk * qk_scale
            if MASKED:
                offs_n = key[j].offsets(-2)
                valid = offs_n[None, :] < key.source.shape[-2]
                if BANDED:
                    valid = valid & _in_band(offs_m, offs_n, band_lo, band_hi)
                qk = ntl.where(valid, qk, float("-inf"))
            if MASK_KIND != NO_MASK:
                mask = attn_mask[j]
                if MASK_KIND == BOOL_MASK:
                    qk = ntl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(ntl.float32) * LOG2E
            p = ntl.exp2(qk - m2[:, None])
        else:
            p = ntl.exp2(qk * qk_scale - m2[:, None])
        dp = ntl.dot(do, ntl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            offs_n = key[j].offsets(-2)
            keep = _dropout_keep(seed, head, offs_m, offs_n, dropout_p)
            dp = ntl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - cap * cap)
        dq = ntl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


def dq_application(
    query, key, value, key_blocks, value_blocks, attn_mask, out, grad_out, lse, grad_lse, scale, dropout_seed,
    dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, delta_out, grad_query,
    BANDED, MASK_KIND, WITH_DLSE, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED,
):
    q = query
    do = grad_out
    o = out
    offs_m = query.offsets(-2)
    head = query.offsets(0) * query.source.shape[1] + query.offsets(1)  # in (B·H): the dropout mask's
    seed = 0
    if DROPOUT:
        seed = ntl.sum(dropout_seed, 0)  # the (1,) tile, loaded once
    delta = ntl.sum(do.to(ntl.float32) * o.to(ntl.float32), 1)
    if WITH_DLSE:
        delta = delta - grad_lse
    delta_out = delta  # noqa: F841 (a store, for the dK/dV pass)
    # p = exp2(s * log2(e) - m2); a row with no visible key (lse = -inf) gets
    # m2 = +inf, so its p is 0 (SDPA's math backend: zero gradient).
    m2 = ntl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    qk_scale = scale * LOG2E
    cap_in, cap_out = _cap_factors(scale, softcap, SOFTCAP)
    dq = ntl.zeros(grad_query.shape, dtype=ntl.float32)

    # In key blocks, as in the forward: the band's left edge [first, full_lo)
    # (masked), the blocks every row sees whole, then the band's right edge and
    # the ragged end of the keys (masked).
    BLOCK_N = key.dtype.shape[0]
    Lk = key.source.shape[-2]
    row_lo = band_lo
    row_hi = band_hi
    if BANDED == ROW_BANDS:
        row_lo = row_bands_lo
        row_hi = row_bands_hi
    first, full_lo, full_hi, end = _key_stages(offs_m, 0, ntl.cdiv(Lk, BLOCK_N), Lk, row_lo, row_hi, BLOCK_N, BANDED)
    if BANDED:
        dq = _attn_bwd_dq_inner(
            dq, q, do, m2, delta, key, value, attn_mask, offs_m, first, full_lo, row_lo, row_hi, qk_scale,
            cap_in, cap_out, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT,
            SOFTCAP,
        )
    if BLOCKED:  # the whole blocks from their own view, as in the forward (no dropout)
        dq = _attn_bwd_dq_inner(
            dq, q, do, m2, delta, key_blocks, value_blocks, attn_mask, offs_m, full_lo, full_hi, row_lo, row_hi,
            qk_scale, cap_in, cap_out, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, False,
            DOT_PRECISION, DROPOUT, SOFTCAP,
        )
    else:
        dq = _attn_bwd_dq_inner(
            dq, q, do, m2, delta, key, value, attn_mask, offs_m, full_lo, full_hi, row_lo, row_hi, qk_scale,
            cap_in, cap_out, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, False, DOT_PRECISION,
            DROPOUT, SOFTCAP,
        )
    dq = _attn_bwd_dq_inner(
        dq, q, do, m2, delta, key, value, attn_mask, offs_m, full_hi, end, row_lo, row_hi, qk_scale,
        cap_in, cap_out, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT,
        SOFTCAP,
    )
    grad_query = dq * scale  # noqa: F841 (a store)


def dkdv_arrangement(
    query, key, value, attn_mask, grad_out, lse, delta, query_blocks, grad_out_blocks, lse_blocks, delta_blocks,
    scale, dropout_seed, dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi,
    key_bands_lo, key_bands_hi, grad_key, grad_value,
    BANDED, MASK_KIND, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, GROUP_OF_ONE,
    block_m, block_n, block_d, block_dv,
):
    """One program per (batch, K/V head, block of BLOCK_N keys); it sees the
    (GROUP, Lq / BLOCK_M) query-row tiles of its group's query heads and the
    matching (BLOCK_N, BLOCK_M) tiles of the mask, transposed."""
    key_arranged = _rows(key, block_n, block_d)
    n_blocks = key_arranged.shape[2]
    group = query.shape[1] // key.shape[1]
    # (B, H, Lq, Lk) seen as (B, H, Lk, Lq) -> (GROUP, Lq / BLOCK_M) tiles of (BLOCK_N, BLOCK_M)
    attn_mask_arranged = attn_mask.permute((0, 1, 3, 2)).tile((1, 1, block_n, block_m))
    attn_mask_arranged = attn_mask_arranged.tile((1, group, 1, -1)).squeeze(3)
    attn_mask_arranged.dtype = attn_mask_arranged.dtype.squeeze((0, 2))
    attn_mask_arranged.dtype.dtype = attn_mask_arranged.dtype.dtype.squeeze((0, 1))
    return (
        _group_rows(query, group, n_blocks, block_m, block_d),
        key_arranged, _rows(value, block_n, block_dv), attn_mask_arranged,
        _group_rows(grad_out, group, n_blocks, block_m, block_dv),
        _group_rows(lse, group, n_blocks, block_m), _group_rows(delta, group, n_blocks, block_m),
        _group_row_blocks(query_blocks, group, n_blocks, block_d),
        _group_row_blocks(grad_out_blocks, group, n_blocks, block_dv),
        _group_row_blocks(lse_blocks, group, n_blocks), _group_row_blocks(delta_blocks, group, n_blocks),
        scale, _per_program(dropout_seed, key_arranged), dropout_p, dropout_scale, band_lo, band_hi, softcap,
        _group_rows(row_bands_lo, group, n_blocks, block_m), _group_rows(row_bands_hi, group, n_blocks, block_m),
        _row_slices(key_bands_lo, block_n), _row_slices(key_bands_hi, block_n),
        _rows(grad_key, block_n, block_d), _rows(grad_value, block_n, block_dv),
        BANDED, MASK_KIND, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, GROUP_OF_ONE,
    )


def _attn_bwd_dkdv_inner(
    dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn, lo, hi, band_lo,
    band_hi, qk_scale,
    cap_in, cap_out, seed, head, dropout_p, dropout_scale,
    BANDED, MASK_KIND, MASKED, DOT_PRECISION, DROPOUT, SOFTCAP,
):
    """Add query blocks [lo, hi) of query head ``g`` of the group to (dk, dv)
    (dk unscaled), on transposed scores (keys x rows). MASKED: the blocks may
    hold rows whose band misses some of these keys. (Rows past Lq need no mask here:
    NineToothed loads them as 0 and their lse as +inf, so their p is 0.)
    DROPOUT: the forward's mask, regenerated transposed (``head``: of query head ``g``)."""
    for i in range(lo, hi):
        q = query[g, i]
        lse_i = lse[g, i]  # (each subscript of a tile is a load of its own)
        m2 = ntl.where(lse_i == float("-inf"), float("inf"), lse_i * LOG2E)
        qkT = ntl.dot(k, ntl.trans(q), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP:
            if SOFTCAP:
                capT = _tanh(qkT * cap_in, SOFTCAP == TANH_APPROX)
                qkT = capT * cap_out
            else:
                qkT = qkT * qk_scale
            if MASKED and BANDED:
                offs_qm = query[g, i].offsets(-2)
                row_lo = band_lo
                row_hi = band_hi
                if BANDED == ROW_BANDS:
                    row_lo = row_bands_lo[g, i]
                    row_hi = row_bands_hi[g, i]
                qkT = ntl.where(ntl.trans(_in_band(offs_qm, offs_kn, row_lo, row_hi)), qkT, float("-inf"))
            if MASK_KIND != NO_MASK:
                mask = attn_mask[g, i]
                if MASK_KIND == BOOL_MASK:
                    qkT = ntl.where(mask, qkT, float("-inf"))
                else:
                    qkT = qkT + mask.to(ntl.float32) * LOG2E
            pT = ntl.exp2(qkT - m2[None, :])
        else:
            pT = ntl.exp2(qkT * qk_scale - m2[None, :])
        do = grad_out[g, i]
        dpT = ntl.dot(v, ntl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            offs_qm = query[g, i].offsets(-2)
            keepT = ntl.trans(_dropout_keep(seed, head, offs_qm, offs_kn, dropout_p))
            dv = ntl.dot(ntl.where(keepT, pT * dropout_scale, 0.0).to(do.dtype), do, dv,
                         input_precision=DOT_PRECISION)
            dpT = ntl.where(keepT, dpT * dropout_scale, 0.0)
        else:
            dv = ntl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[g, i][None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - capT * capT)
        dk = ntl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


def dkdv_application(
    query, key, value, attn_mask, grad_out, lse, delta, query_blocks, grad_out_blocks, lse_blocks, delta_blocks,
    scale, dropout_seed, dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi,
    key_bands_lo, key_bands_hi, grad_key, grad_value,
    BANDED, MASK_KIND, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, GROUP_OF_ONE,
):
    k = key
    v = value
    offs_kn = key.offsets(-2)
    qk_scale = scale * LOG2E
    cap_in, cap_out = _cap_factors(scale, softcap, SOFTCAP)
    seed = 0
    if DROPOUT:
        seed = ntl.sum(dropout_seed, 0)  # the (1,) tile, loaded once
    dk = ntl.zeros(grad_key.shape, dtype=ntl.float32)
    dv = ntl.zeros(grad_value.shape, dtype=ntl.float32)

    # In query blocks: the rows on the band's right edge (the causal diagonal)
    # [lo, full_lo) (masked), the rows that see every key here [full_lo, full_hi)
    # (unmasked), the rows on the band's left edge and the ragged end of the rows
    # [full_hi, hi) (masked). Row i sees key j iff j - band_hi <= i <= j - band_lo
    # (ROW_BANDS: iff j + key_lo_j <= i <= j + key_hi_j): _key_stages with rows
    # and keys swapped.
    BLOCK_M = query.dtype.shape[0]
    Lq = query.source.shape[-2]
    key_lo = -band_hi
    key_hi = -band_lo
    if BANDED == ROW_BANDS:
        key_lo = key_bands_lo
        key_hi = key_bands_hi
    lo, full_lo, full_hi, hi = _key_stages(offs_kn, 0, query.shape[1], Lq, key_lo, key_hi, BLOCK_M, BANDED)
    groups = query.shape[0]  # the query heads that read this K/V head
    if GROUP_OF_ONE:
        # A trip count of 1 the compiler knows, as the Triton kernel's GROUP (specialised on
        # == 1): the loop folds, and so do the values it kept live across its three inner loops
        # (sm_90, D 128 causal: 448 -> 32 bytes of stack). A size here is never a constant.
        groups = 1
    for g in range(groups):
        # query head g of this K/V head, in (B·H): the dropout mask's (NineToothed's inliner
        # mis-names a helper called inside an expression, so this is spelled out)
        head = key.offsets(0) * query.source.shape[1] + key.offsets(1) * query.shape[0] + g
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn, lo, full_lo,
            band_lo, band_hi, qk_scale, cap_in, cap_out, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND,
            True, DOT_PRECISION, DROPOUT, SOFTCAP,
        )
        if BLOCKED:  # the whole row blocks from their own views (no dropout): see blocked_keys
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, query_blocks, grad_out_blocks, lse_blocks, delta_blocks, attn_mask, row_bands_lo,
                row_bands_hi, g, offs_kn, full_lo, full_hi, band_lo, band_hi, qk_scale, cap_in, cap_out, seed, head,
                dropout_p, dropout_scale, BANDED, MASK_KIND, False, DOT_PRECISION, DROPOUT, SOFTCAP,
            )
        else:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn,
                full_lo, full_hi, band_lo, band_hi, qk_scale, cap_in, cap_out, seed, head, dropout_p, dropout_scale,
                BANDED, MASK_KIND, False, DOT_PRECISION, DROPOUT, SOFTCAP,
            )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn, full_hi, hi,
            band_lo, band_hi, qk_scale, cap_in, cap_out, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND,
            True, DOT_PRECISION, DROPOUT, SOFTCAP,
        )
    grad_key = dk * scale  # noqa: F841 (a store)
    grad_value = dv  # noqa: F841 (a store)


# -- premake: (arrangement, application, tensors) per kernel --------------------------------

def _flags(*names):
    return tuple(Tensor(0, constexpr=True, name=name) for name in names)


# Sizes. A tensor's sizes are symbols (kernel arguments) of its own unless given, and
# NineToothed unravels the program id into each arranged tensor's coordinates from that
# tensor's own sizes: an integer division by a kernel argument apiece (about 20 instructions
# on sm_90: MUFU.RCP and its fix-ups), which LLVM merges only where the arguments are the same.
# So tensors whose sizes are equal in every launch take the same symbols (the output, the
# log-sum-exps, the gradients, the bands and sinks take the query's (B, H, Lq); the values the
# keys'; ...): on sm_90 that left 6-7 divisions before the first key step where there were
# 14-26, and prologues 25-49% shorter (benchmarks/NOTES.md, "nt-shared-sizes"). Every plan
# passes tensors of those sizes (stand-ins included); a size given here is never checked.

def _like(sizes, *trailing, other=None):
    """A tensor whose leading sizes are ``sizes`` (another tensor's symbols), then ``trailing``
    (an int: a constant; None: a symbol of its own)."""
    return Tensor(shape=(*sizes, *trailing), other=other)


def _rows_like(query, *trailing, other=None):
    """A tensor of the query's (B, H, Lq), then ``trailing`` sizes (see :func:`_like`)."""
    return _like(query.shape[:3], *trailing, other=other)


def _attention_inputs(head_dim, head_dim_v):
    """query, key, value and attn_mask, as every attention kernel takes them: the values of the
    keys' (B, H_kv, Lk), the mask (B, H, Lq, Lk) of the query's and the keys'.

    Out-of-range elements must read as 0 (padded head dims enter the dot
    products; past-the-end keys and values meet p = 0, and 0 * garbage may be
    NaN); NineToothed leaves them undefined unless told.
    """
    query = Tensor(shape=(None, None, None, head_dim), other=0)
    key = Tensor(shape=(None, None, None, head_dim), other=0)
    value = _like(key.shape[:3], head_dim_v, other=0)
    attn_mask = _rows_like(query, key.shape[2], other=0)
    return query, key, value, attn_mask


def _key_blocks_inputs(key, head_dim, head_dim_v, block_n):
    """The keys' and values' whole blocks, (B, H_kv, Lk // BLOCK_N, BLOCK_N, D | Dv) (see
    ``blocked_keys``): the block size a constant of the kernel, so that loads of them check no
    key against the keys' length; (B, H_kv) the keys', the block count one symbol of both."""
    key_blocks = _like(key.shape[:2], None, block_n, head_dim, other=0)
    return key_blocks, _like(key_blocks.shape[:3], block_n, head_dim_v, other=0)


def _dropout_inputs():
    """seed (a (1,) int64 tensor, read on the device: no host sync), dropout_p and
    dropout_scale (runtime floats)."""
    return Tensor(shape=(1,)), Tensor(0), Tensor(0)


def _band_inputs(query, key=None):
    """band_lo, band_hi (runtime ints): row i sees keys i + band_lo .. i + band_hi when BANDED;
    softcap (runtime float), read when SOFTCAP; then, read when BANDED == ROW_BANDS, each
    row's own band_lo and band_hi ((B, H, Lq) int32 views, stride 0 but over Lq: the query's
    sizes) and, given ``key``, each key's rows (key j: rows j + lo .. j + hi; (B, H_kv, Lk)
    views: the keys' sizes). Rows and keys past the end see nothing."""
    def per_row(sizes):
        return _like(sizes, other=UNBOUNDED), _like(sizes, other=-UNBOUNDED)

    per_key = per_row(key.shape[:3]) if key is not None else ()
    return Tensor(0), Tensor(0), Tensor(0), *per_row(query.shape[:3]), *per_key


# What a split forward's launch changes with the split count, which its kernel is not to be
# specialised on (common.launch.route_generated_launch): the number of splits of the partials,
# (B, H, Lq, S, Dv) and (B, H, Lq, S) (one symbol), and the partial log-sum-exps' strides
# (multiples of S; the partial outputs' are multiples of Dv, as in the Triton kernel).
_OUTPUT, _LSE = (list(inspect.signature(application).parameters).index(name) for name in ("output", "lse"))
_SPLIT_COUNT_ARGS = (("size", _OUTPUT, 3), *(("stride", _LSE, dim) for dim in range(3)))
# and the combine's (o_part (R, S, Dv), lse_part (R, S))
_O_PART, _LSE_PART = (list(inspect.signature(combine_application).parameters).index(name)
                      for name in ("o_part", "lse_part"))
_COMBINE_SPLIT_COUNT_ARGS = (("size", _O_PART, 1), ("stride", _LSE_PART, 0))


def premake(head_dim, head_dim_v, block_m, block_n, split=False):
    """The forward; with ``split``, its split-KV variant (see ``arrangement``)."""
    arrangement_ = functools.partial(
        arrangement, block_m=block_m, block_n=block_n, block_d=padded_head_dim(head_dim),
        block_dv=padded_head_dim(head_dim_v), split=split,
    )
    query, key, value, attn_mask = _attention_inputs(head_dim, head_dim_v)
    # output (split: float32 partial outputs, (B, H, Lq, S, Dv)) and lse ((B, H, Lq[, S])); read
    # too when RESUME (a running float32 output and its lse; rows past the end read as no key seen)
    output = _rows_like(query, *((None,) if split else ()), head_dim_v, other=0)
    lse = _like(output.shape[:-1], other=float("-inf"))
    tensors = (
        query, key, value, *_key_blocks_inputs(key, head_dim, head_dim_v, block_n), attn_mask,
        Tensor(0),  # scale (runtime float)
        *_dropout_inputs(),
        *_band_inputs(query),
        _rows_like(query, other=0),  # sinks, (B, H, Lq) float32: a broadcast view of the (H,) logits
        output, lse,
        *_flags("BANDED", "MASK_KIND", "WITH_LSE", "NEGATIVE_SCALE", "DOT_PRECISION", "SPLIT", "DROPOUT", "SOFTCAP",
                 "SINKS", "RESUME", "BLOCKED"),
    )
    return arrangement_, application, tensors


def premake_combine(head_dim_v, block_r, block_s):
    """The split merge."""
    arrangement_ = functools.partial(
        combine_arrangement, block_r=block_r, block_s=block_s, block_dv=padded_head_dim(head_dim_v)
    )
    o_part = Tensor(shape=(None, None, head_dim_v), other=0)  # (R, S, Dv)
    rows = o_part.shape[:1]
    tensors = (
        o_part,
        _like(o_part.shape[:2], other=float("-inf")),  # lse_part (R, S): a missing split weighs 0
        _like(rows, head_dim_v),  # output (R, Dv)
        _like(rows),  # lse (R,)
        *_flags("WITH_LSE"),
    )
    return arrangement_, combine_application, tensors


def premake_dq(head_dim, head_dim_v, block_m, block_n):
    """The backward's dQ pass."""
    arrangement_ = functools.partial(
        dq_arrangement, block_m=block_m, block_n=block_n, block_d=padded_head_dim(head_dim),
        block_dv=padded_head_dim(head_dim_v),
    )
    query, key, value, attn_mask = _attention_inputs(head_dim, head_dim_v)
    tensors = (
        query, key, value, *_key_blocks_inputs(key, head_dim, head_dim_v, block_n), attn_mask,
        _rows_like(query, head_dim_v, other=0),  # out
        _rows_like(query, head_dim_v, other=0),  # grad_out
        _rows_like(query, other=float("inf")),  # lse: rows past Lq get p = 0
        _rows_like(query, other=0),  # grad_lse
        Tensor(0),  # scale
        *_dropout_inputs(),
        *_band_inputs(query),
        _rows_like(query),  # delta_out
        _rows_like(query, head_dim),  # grad_query
        *_flags("BANDED", "MASK_KIND", "WITH_DLSE", "DOT_PRECISION", "DROPOUT", "SOFTCAP", "BLOCKED"),
    )
    return arrangement_, dq_application, tensors


def premake_dkdv(head_dim, head_dim_v, block_m, block_n):
    """The backward's dK/dV pass."""
    arrangement_ = functools.partial(
        dkdv_arrangement, block_m=block_m, block_n=block_n, block_d=padded_head_dim(head_dim),
        block_dv=padded_head_dim(head_dim_v),
    )
    query, key, value, attn_mask = _attention_inputs(head_dim, head_dim_v)
    # the whole row blocks of query, grad_out, lse and delta, (B, H, Lq // BLOCK_M, BLOCK_M[, D | Dv]):
    # the query's (B, H), the block count one symbol of all four
    query_blocks = _like(query.shape[:2], None, block_m, head_dim, other=0)
    row_blocks = query_blocks.shape[:3]
    tensors = (
        query, key, value, attn_mask,
        _rows_like(query, head_dim_v, other=0),  # grad_out
        _rows_like(query, other=float("inf")),  # lse: rows past Lq get p = 0
        _rows_like(query, other=0),  # delta
        query_blocks, _like(row_blocks, block_m, head_dim_v, other=0), _like(row_blocks, block_m, other=0),
        _like(row_blocks, block_m, other=0),
        Tensor(0),  # scale
        *_dropout_inputs(),
        *_band_inputs(query, key),
        _like(key.shape[:3], head_dim),  # grad_key
        _like(key.shape[:3], head_dim_v),  # grad_value
        *_flags("BANDED", "MASK_KIND", "DOT_PRECISION", "DROPOUT", "SOFTCAP", "BLOCKED", "GROUP_OF_ONE"),
    )
    return arrangement_, dkdv_application, tensors


# -- a paged KV cache ----------------------------------------------------------------------

def _pages(cache, batch, heads, m_blocks, page, block_d, num_splits=None):
    """(num_pages, PAGE, H_kv, D) -> per program of (batch, heads, m_blocks[, S]), every page
    of the K/V head its query head reads, as a (num_pages,) array of (PAGE, D) tiles: the
    program picks pages by index (a gather: which page is data, read from the block table).
    The batch, the group's heads and the row blocks are broadcast (expand)."""
    group = heads // cache.shape[2]
    arranged = cache.tile((1, page, 1, block_d)).squeeze((1, 3))  # (num_pages, H_kv)
    arranged.dtype = arranged.dtype.squeeze((0, 2))
    arranged = arranged.permute((1, 0)).tile((1, -1)).squeeze(1)  # (H_kv,), each a row of num_pages tiles
    arranged.dtype = arranged.dtype.squeeze(0)
    arranged = arranged.unsqueeze(0).unsqueeze(2).unsqueeze(3)  # (1, H_kv, 1, 1)
    if num_splits is None:
        arranged = arranged.expand((batch, -1, group, m_blocks))
    else:
        arranged = arranged.unsqueeze(4).expand((batch, -1, group, m_blocks, num_splits))
    return arranged.flatten(1, 2)


def paged_arrangement(
    query, key_cache, value_cache, block_table, cache_seqlens, scale, lq_seq, num_pages, output, lse,
    IS_CAUSAL, WITH_LSE, DOT_PRECISION, SPLIT, PAGES_PER_STEP,
    block_m, page, block_d, block_dv, blocks_per_split=None,
):
    """One program per (batch, head, block of BLOCK_M query rows), and per split of the
    pages when ``blocks_per_split`` is given: the block table's row for the batch entry
    (its split's part), (1,) tiles each; the sequence's length; all pages of the caches."""
    query_arranged = _rows(query, block_m, block_d)
    batch, heads, m_blocks = query_arranged.shape
    split = blocks_per_split is not None
    num_splits = output.shape[3] if split else None
    # (B, max_pages) -> per program its (part of the) row of (1,) tiles
    table = block_table.tile((1, 1))
    table.dtype = table.dtype.squeeze(0)
    table = table.tile((1, blocks_per_split if split else -1))
    table.dtype = table.dtype.squeeze(0)
    table = table.unsqueeze(1).unsqueeze(2).expand((-1, heads, m_blocks, -1))  # (B, H, M, S)
    seqlens = cache_seqlens.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, heads, m_blocks))
    if split:
        query_arranged = _per_split(query_arranged, num_splits)
        seqlens = _per_split(seqlens, num_splits)
        output_arranged = output.tile((1, 1, block_m, 1, block_dv)).squeeze(4)
        output_arranged.dtype = output_arranged.dtype.squeeze((0, 1, 3))
        lse_arranged = lse.tile((1, 1, block_m, 1))
        lse_arranged.dtype = lse_arranged.dtype.squeeze((0, 1, 3))
    else:
        table = table.squeeze(3)
        output_arranged = _rows(output, block_m, block_dv)
        lse_arranged = _row_slices(lse, block_m)
    return (
        query_arranged, _pages(key_cache, batch, heads, m_blocks, page, block_d, num_splits),
        _pages(value_cache, batch, heads, m_blocks, page, block_dv, num_splits), table, seqlens, scale, lq_seq,
        num_pages, output_arranged, lse_arranged, IS_CAUSAL, WITH_LSE, DOT_PRECISION, SPLIT, PAGES_PER_STEP,
    )


def paged_application(
    query, key_cache, value_cache, block_table, cache_seqlens, scale, lq_seq, num_pages, output, lse,
    IS_CAUSAL, WITH_LSE, DOT_PRECISION, SPLIT, PAGES_PER_STEP,
):
    """BLOCK_M query rows against their sequence's pages (its split's), PAGES_PER_STEP pages
    an iteration, each its own dot and softmax update (``_paged_fwd`` of the Triton kernel
    makes one tile of them), as ``_paged_fwd``: packed row r is query row r % lq_seq of its
    head, at position Lk - lq_seq + r % lq_seq (bottom-right); a page entry outside the
    cache is clamped into it, a length past the table to the table."""
    q = query
    offs_m = query.offsets(-2)
    PAGE = key_cache.dtype.shape[0]
    # the (1,) tile of this sequence's length; a bad one reads no entry past the table (as _paged_fwd)
    Lk = ntl.minimum(ntl.sum(cache_seqlens, 0), block_table.source.shape[-1] * PAGE)
    last_key = Lk - lq_seq + offs_m % lq_seq  # the key at each row's position
    qk_scale = scale * LOG2E
    acc = ntl.zeros(output.shape, dtype=ntl.float32)
    l_i = ntl.zeros((query.shape[0],), dtype=ntl.float32)
    m_i = ntl.full((query.shape[0],), float("-inf"), dtype=ntl.float32)
    lo = ntl.min(block_table[0].offsets(-1), 0)  # the split's first page
    hi = ntl.minimum(lo + block_table.shape[0], ntl.cdiv(Lk, PAGE))
    for j in range(lo, hi, PAGES_PER_STEP):
        # PAGES_PER_STEP pages an iteration, unrolled: their table entries and tiles are
        # independent loads, in flight together (one page of 16 keys an iteration left
        # the loop bound by each load's latency)
        for g in triton.language.static_range(PAGES_PER_STEP):
            entry = ntl.minimum(j + g, hi - 1) - lo  # past the last page: a masked repeat of it
            page = ntl.minimum(ntl.maximum(ntl.sum(block_table[entry], 0), 0), num_pages - 1)
            offs_kn = (j + g) * PAGE + ntl.arange(0, key_cache.dtype.shape[0])  # (inline: arange needs the constant)
            key_ok = offs_kn < Lk
            k = key_cache[page]
            qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            valid = key_ok[None, :]
            if IS_CAUSAL:
                valid = valid & (offs_kn[None, :] <= last_key[:, None])
            qk = ntl.where(valid, qk, float("-inf"))
            m_ij = ntl.maximum(m_i, ntl.max(qk, 1))
            m_sub = ntl.where(m_ij == float("-inf"), 0.0, m_ij)  # a row with no key yet: p = 0, not NaN
            p = ntl.exp2(qk - m_sub[:, None])
            alpha = ntl.exp2(m_i - m_sub)
            l_i = l_i * alpha + ntl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = ntl.where(key_ok[:, None], value_cache[page], 0.0)  # slots past the length: any bits
            acc = ntl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            m_i = m_ij

    if WITH_LSE:
        lse = (m_i + ntl.log2(l_i)) * LN2  # noqa: F841 (a store)
    l_i = ntl.where(l_i == 0.0, 1.0, l_i)  # no key (an empty sequence, or a split past its end): 0
    output = acc / l_i[:, None]  # noqa: F841 (a store)


def append_arrangement(key, value, key_cache, value_cache, block_table, cache_seqlens, num_pages, block_d,
                       block_dv):
    """One program per (batch, K/V head, new token): its key and value rows, every slot of
    its head in the caches as a (num_pages, PAGE) array of (D,) tiles (the program stores
    into one by index: where a token goes is data), its sequence's block table row and
    length. (NineToothed indexes a tile array with scalars only, so a program cannot
    scatter a block of tokens to their different slots as the Triton kernel's does.)"""
    batch, heads, new_tokens = key.shape[0], key.shape[1], key.shape[2]

    def rows(x, block):
        arranged = x.tile((1, 1, 1, block)).squeeze(3)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
        return arranged

    def slots(cache, block):
        arranged = cache.tile((1, 1, 1, block)).squeeze(3).permute((2, 0, 1))  # (H_kv, num_pages, PAGE)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 2))
        arranged = arranged.tile((1, -1, -1)).squeeze((1, 2))
        arranged.dtype = arranged.dtype.squeeze(0)
        return arranged.unsqueeze(0).unsqueeze(2).expand((batch, -1, new_tokens))

    table = block_table.tile((1, 1))
    table.dtype = table.dtype.squeeze(0)
    table = table.tile((1, -1)).squeeze(1)
    table.dtype = table.dtype.squeeze(0)
    table = table.unsqueeze(1).unsqueeze(2).expand((-1, heads, new_tokens))
    seqlens = cache_seqlens.tile((1,)).unsqueeze(1).unsqueeze(2).expand((-1, heads, new_tokens))
    return (rows(key, block_d), rows(value, block_dv), slots(key_cache, block_d), slots(value_cache, block_dv), table,
            seqlens, num_pages)


def append_application(key, value, key_cache, value_cache, block_table, cache_seqlens, num_pages):
    """Token i of sequence z to position cache_seqlens[z] + i of its pages, as ``_append_kv``
    of the Triton kernel: not written when that position is past the table or its page
    entry lies outside the cache."""
    PAGE = key_cache.shape[1]
    max_pages = block_table.shape[0]
    pos = ntl.sum(cache_seqlens, 0) + key.offsets(2)  # this program's token: its offset along L_new
    fits = (pos >= 0) & (pos < max_pages * PAGE)
    entry = ntl.minimum(ntl.maximum(pos // PAGE, 0), max_pages - 1)
    page = ntl.sum(block_table[entry], 0)
    if fits & (page >= 0) & (page < num_pages):
        key_cache[page, pos % PAGE] = key
        value_cache[page, pos % PAGE] = value


def premake_paged(head_dim, head_dim_v, block_m, page, blocks_per_split=None):
    """Paged attention; with ``blocks_per_split``, its split variant (see ``paged_arrangement``)."""
    arrangement_ = functools.partial(
        paged_arrangement, block_m=block_m, page=page, block_d=padded_head_dim(head_dim),
        block_dv=padded_head_dim(head_dim_v), blocks_per_split=blocks_per_split,
    )
    split = blocks_per_split is not None
    query = Tensor(shape=(None, None, None, head_dim), other=0)
    key_cache = Tensor(shape=(None, None, None, head_dim), other=0)  # (num_pages, PAGE, H_kv, D)
    output = _rows_like(query, *((None,) if split else ()), head_dim_v)
    tensors = (
        query, key_cache,
        _like(key_cache.shape[:3], head_dim_v, other=0),  # value_cache
        _like(query.shape[:1], None, other=0),  # block_table (B, max_pages) int32
        _like(query.shape[:1]),  # cache_seqlens (B,) int32
        Tensor(0), Tensor(0), Tensor(0),  # scale, lq_seq, num_pages
        output,
        _like(output.shape[:-1]),  # lse (split partials only)
        *_flags("IS_CAUSAL", "WITH_LSE", "DOT_PRECISION", "SPLIT", "PAGES_PER_STEP"),
    )
    return arrangement_, paged_application, tensors


def premake_append(head_dim, head_dim_v):
    """append_kv: the new tokens' keys and values into their slots."""
    arrangement_ = functools.partial(append_arrangement, block_d=padded_head_dim(head_dim),
                                     block_dv=padded_head_dim(head_dim_v))
    key = Tensor(shape=(None, None, None, head_dim))  # (B, H_kv, L_new, D)
    key_cache = Tensor(shape=(None, None, None, head_dim))  # (num_pages, PAGE, H_kv, D)
    tensors = (
        key,
        _like(key.shape[:3], head_dim_v),  # value
        key_cache,
        _like(key_cache.shape[:3], head_dim_v),  # value_cache
        _like(key.shape[:1], None, other=-1),  # block_table (B, max_pages) int32
        _like(key.shape[:1]),  # cache_seqlens (B,) int32
        Tensor(0),  # num_pages
    )
    return arrangement_, append_application, tensors


# -- making kernels: once per process, thread-safe ---------------------------------------------

_made: dict = {}
_make_lock = threading.Lock()


def _wide(*tensors) -> bool:
    """Whether a launch of these tensors (None: absent) takes 64-bit batch and head strides
    (``common.launch._rejitted``): where one of them lies in a storage of 2^31 elements or more
    (what its indexing can reach is within its storage: a bound at 0.15 µs a tensor, where
    ``common.validation.span`` takes 1.5, on a path a decode step takes). Every other launch
    keeps 32-bit strides: made wide, every kernel ran slower (benchmarks/NOTES.md, "nt-offsets64
    on the H200 and merged"); each batch and head stays under 2^31 elements either way
    (``common.validation.slice_span``)."""
    return any(t is not None and t.untyped_storage().nbytes() >= OFFSET_LIMIT * t.element_size() for t in tensors)


def _make(premake_fn, *args, num_warps: int, num_stages: int, maxnreg: int | None = None, wide: bool = False):
    """``ninetoothed.make(*premake_fn(*args))``, made once per process; ``maxnreg``, where not
    None, caps each thread's registers (a launch option ``make`` does not take: our launch path
    passes it, so each cap has a handle of its own); ``wide``: the kernel takes its batch and
    head strides as 64-bit integers (:func:`_wide`), a handle of its own too.

    ``make`` generates, writes and imports Triton code on every call (0.1-0.5 s)
    and sets the application's annotations while it works, so it runs under a
    lock and its handles are kept. The code goes to a private directory,
    written atomically (``common.codecache``). Each handle's generated module gets the
    kernels' named constants, and its launch goes through a ``CachedLauncher``.
    """
    key = (premake_fn, args, num_warps, num_stages, maxnreg, wide)
    handle = _made.get(key)
    if handle is not None:
        return handle
    with _make_lock:
        handle = _made.get(key)
        if handle is None:
            apply_interpreter_fixes()
            use_private_cache()
            name = "_".join(["nt_attention", premake_fn.__name__.removeprefix("premake")[1:] or "fwd",
                             *(str(a) for a in args if a is not None)])
            number_tensors_from_zero()  # the same source in every process, whatever was made before
            arrangement_, application_, tensors = premake_fn(*args)
            handle = ninetoothed.make(arrangement_, application_, tensors, kernel_name=name, num_warps=num_warps,
                                      num_stages=num_stages)
            define_constants(handle, KERNEL_CONSTANTS)
            # NineToothed copies the module's @triton.jit helpers into the generated
            # code as written (their bodies say ``tl``), but not under the
            # interpreter (they are not JITFunctions there).
            handle._launch.__globals__.setdefault("tl", tl)
            for helper in JIT_HELPERS:
                handle._launch.__globals__.setdefault(helper.__name__, helper)
            split_counts = (_SPLIT_COUNT_ARGS if premake_fn is premake and args[4]
                            else _COMBINE_SPLIT_COUNT_ARGS if premake_fn is premake_combine else ())
            loose = _loose_arguments(handle, application_, split_counts)
            handle = _made[key] = route_generated_launch(handle, loose, maxnreg, wide_strides=wide)
    return handle


def _loose_arguments(handle, application_, split_counts=()) -> set:
    """The arguments of ``handle``'s kernel that it is not specialised on (roles as
    ``common.launch.launcher_arguments`` describes them): ``split_counts``, in the forward every
    tensor's length (its dimension 2: each is (B, H, L, ...)) but the keys' and the values', and
    in the dQ pass the batch (the query's and the keys' dimension 0).

    NineToothed passes each tensor's sizes, so the queries' length reaches the forward eight times
    (query, bands, sinks, output, lse, the mask's rows) and the key blocks' count twice (the
    views of whole blocks), and Triton compiles a kernel for each class of each (a size of 1, a
    multiple of 16, another): 10,000 calls of lengths 1-299 asked for 174 forwards, 88 with these
    loosened. They bound masks and loops whose code does not depend on their class (sm_90: the
    same instructions a step). The keys' length stays, as Lk in the Triton kernel: a multiple of
    16 lets the masked steps compare keys 16 at a time and load the mask's tiles vectorised
    along it. The batch and head counts stay too: a batch of 1 is a constant the compiler
    folds (loosened, the D 128 causal forward at B 1, 16k, spilled 8 more bytes, loaded from the
    stack 5 times a step instead of once, and ran 4% slower on the H200). The backward passes stay
    specialised on their lengths: without it their masked steps grew by 8% (dQ) and 29% (dK/dV,
    whose loop runs over the queries). The dQ pass is not specialised on its batch: with its tensors'
    sizes shared (:func:`_like`), a batch of 1 folded into its code had ptxas serialise its warpgroup
    products (C7515, D 64 and 128, causal L 16k: 9% slower on the H200); loose, no benchmark shape
    serialises (sm_90, ``tools/cpu_sass.py``)."""
    if application_ is dq_application:
        names = list(inspect.signature(application_).parameters)
        return {("size", names.index(name), 0) for name in ("query", "key")}
    if application_ is not application:
        return set(split_counts)
    described = launcher_arguments(handle._launch) or ()
    names = list(inspect.signature(application_).parameters)
    keys_and_values = {names.index("key"), names.index("value")}
    lengths = {role for role in described if role[0] == "size" and role[2] == 2 and role[1] not in keys_and_values}
    return lengths | set(split_counts)


INTERPRETED = interpreter_requested()


# -- launching a plan ------------------------------------------------------------------------

_scalars: dict = {}  # (device, dtype) -> one element, allocated once
_stand_ins: dict = {}  # (device, dtype, shape) -> that element broadcast to shape (a view)


def _absent(like, *shape):
    """A stand-in for a tensor a kernel never touches (a flag turns its use off): one
    element per (device, dtype), broadcast. The views are kept per shape (making one
    is a torch call, and a plain forward needs four of them); only the element holds
    memory, so starting the views over frees and allocates nothing."""
    key = (like.device, like.dtype, shape)
    stand_in = _stand_ins.get(key)
    if stand_in is None:
        scalar = _scalars.get(key[:2])
        if scalar is None:
            scalar = _scalars[key[:2]] = like.new_empty(())
        if len(_stand_ins) >= 256:
            _stand_ins.clear()
        stand_in = _stand_ins[key] = scalar.expand(*shape)
    return stand_in


def _dropout_args(plan):
    """(seed, dropout_p, dropout_scale) as the kernels take them; a stand-in seed without dropout."""
    seed = plan.seed if plan.seed is not None else _absent(plan.query, 1)
    return seed.view(1), plan.dropout_p, plan.dropout_scale


def _band_args(plan, keys=False) -> tuple:
    """(band_lo, band_hi, softcap, row_lo, row_hi[, key_lo, key_hi]): what BANDED and
    SOFTCAP kernels read (see _band_inputs); unread (0, 0), 0.0 and stand-ins otherwise."""
    B, H, Lq, _ = plan.query.shape
    H_kv, Lk = plan.key.shape[1], plan.key.shape[2]
    if plan.row_bands is None:
        per_row = (_absent(plan.query, B, H, Lq),) * 2
        per_key = (_absent(plan.query, B, H_kv, Lk),) * 2
    else:
        bands = plan.row_bands
        per_row = tuple(bands[i, :Lq].expand(B, H, Lq) for i in (0, 1))
        per_key = tuple(bands[i, Lq:].expand(B, H_kv, Lk) for i in (0, 1))
    return (*(plan.band if plan.band is not None else (0, 0)), plan.softcap, *per_row, *(per_key if keys else ()))


def blocked_keys(plan) -> bool:
    """Whether the forward's unmasked stage reads the keys and values through views of their
    whole blocks (:func:`_row_blocks`): every load of NineToothed's is masked against the
    bounds of its source, and a source whose block size is a constant makes the per-key
    check of those loads a constant too (on sm_90, D 64, 128 x 64 tiles: 577 -> 538
    instructions a step of that loop, against the Triton kernel's 509). Unsplit launches
    without dropout (whose unmasked stage reads the keys' positions from the keys' tiles)."""
    return not plan.split and not plan.dropout


def _row_blocks(x, block: int, blocked: bool):
    """(B, H, L[, D]) -> its whole blocks of ``block`` rows, a view (B, H, L // block, block[, D])
    that starts where ``x`` does; a stand-in where the kernel reads none (not ``blocked``)."""
    B, H, L = x.shape[:3]
    if not blocked:
        return _absent(x, B, H, 1, block, *x.shape[3:])
    stride = x.stride()
    # (as_strided: one torch call, where slicing then unflattening is two)
    return x.as_strided((B, H, L // block, block, *x.shape[3:]), (*stride[:2], stride[2] * block, *stride[2:]),
                        x.storage_offset())


def _attention_launch(plan) -> tuple:
    """(kernel, inputs, flags) of the forward's attention launch: ``kernel(*inputs, **flags)``."""
    q, out = plan.query, plan.out
    B, H, Lq, D = q.shape
    Lk, Dv = plan.key.shape[2], plan.value.shape[3]
    config = plan.config
    attn_mask = plan.attn_mask if plan.attn_mask is not None else _absent(out, B, H, Lq, Lk)
    if plan.split:
        o, lse = plan.o_part, plan.lse_part
    else:
        o, lse = out, (plan.lse if plan.lse is not None else _absent(out, B, H, Lq))
    kernel = _make(premake, D, Dv, config.block_m, config.block_n, plan.split,
                   num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
                   wide=_wide(q, plan.key, plan.value, plan.attn_mask, o, lse))
    blocked = blocked_keys(plan)
    inputs = (q, plan.key, plan.value, _row_blocks(plan.key, config.block_n, blocked),
              _row_blocks(plan.value, config.block_n, blocked), attn_mask, plan.scale, *_dropout_args(plan),
              *_band_args(plan), plan.sinks if plan.sinks is not None else _absent(out, B, H, Lq), o, lse)
    return kernel, inputs, dict(
        BANDED=plan.banded, MASK_KIND=int(plan.mask_kind), WITH_LSE=plan.kernel_lse,
        NEGATIVE_SCALE=plan.scale < 0, DOT_PRECISION=plan.dot_precision, SPLIT=_split_kind(plan), DROPOUT=plan.dropout,
        SOFTCAP=int(plan.softcap_kind), SINKS=plan.sinks is not None, RESUME=plan.resume, BLOCKED=blocked,
    )


def _split_kind(plan) -> int:
    """The kernel's SPLIT: 0 unsplit, 1 split, ONE_STAGE split at the derived size in tiles of
    common.plan.ONE_STAGE_SPLIT_ROWS rows and more."""
    if not plan.split:
        return 0
    return ONE_STAGE if one_stage_split(plan.config.block_m) else 1


def _merge_kernel(plan):
    merge = plan.merge
    return _make(premake_combine, plan.value.shape[3], merge.block_r, merge.block_s, num_warps=4, num_stages=1,
                 wide=_wide(plan.o_part, plan.out))


def _merge_inputs(o_part, lse_part, out, lse, rows: int, num_splits: int) -> tuple:
    """The merge's inputs: the partials (rows, splits, Dv) and (rows, splits), the output (rows,
    Dv) and its log-sum-exp (rows,), or a stand-in where none is asked for."""
    Dv = out.shape[-1]
    return (o_part.view(rows, num_splits, Dv), lse_part.view(rows, num_splits), out.view(rows, Dv),
            lse.view(rows) if lse is not None else _absent(out, rows))


def forward(plan):
    """Launch the forward (and, for split keys, the merge) for a ``common.plan.ForwardPlan``.

    Returns ``(plan.out, plan.lse)``, filled in.
    """
    kernel, inputs, flags = _attention_launch(plan)
    kernel(*inputs, **flags)
    if plan.split:
        _merge_kernel(plan)(*_merge_inputs(plan.o_part, plan.lse_part, plan.out, plan.lse, plan.merge.rows,
                                           plan.num_splits), WITH_LSE=plan.with_lse)
    return plan.out, plan.lse


def _is_stand_in(t) -> bool:
    """``t`` is one of :func:`_absent`'s stand-ins (a view of its one element)."""
    scalar = _scalars.get((t.device, t.dtype))
    return scalar is not None and t.data_ptr() == scalar.data_ptr()


def bind_forward(plan, keys: bool = False):
    """The launches of ``plan`` (just launched by :func:`forward`, on this thread) bound to its
    layout, for later calls laid out alike (a ``common.plan.ForwardTemplate``'s): a
    :class:`BoundForward` made from the arguments NineToothed's generated launchers passed to
    the kernels (recorded by ``common.launch``'s routing) and what the launchers' source says
    each one is (``common.launch.launcher_arguments``), so later calls skip the launchers and
    their reads of every size and stride. ``keys``: later calls may differ in the keys' length
    and strides (a growing cache; same config, split count and blocks per split): the keys' and
    values' sizes and strides are filled in per call. None where a launch holds a tensor that
    is neither the plan's own nor a stand-in, or the launchers do not read as expected."""
    kernel, inputs, _ = _attention_launch(plan)
    roles = {0: 0, 1: 1, 2: 2}  # query, key, value by position: one tensor may be passed as two of them
    for i, t in enumerate(inputs[3:], 3):
        for role, own in enumerate((plan.out, plan.lse, plan.o_part, plan.lse_part), 3):
            if own is not None and t is own:
                roles[i] = role
    key_inputs = {1: None, 2: None} if keys else {}
    if blocked_keys(plan):
        roles.update({3: 1, 4: 2})  # the whole blocks' views start where the keys and values do
        if keys:
            key_inputs.update({3: plan.config.block_n, 4: plan.config.block_n})
    attention = _bind(kernel, inputs, roles, key_inputs)
    if attention is None:
        return None
    merge = None
    if plan.split:
        views = _merge_inputs(plan.o_part, plan.lse_part, plan.out, plan.lse, plan.merge.rows, plan.num_splits)
        merge = _bind(_merge_kernel(plan), views, {i: i for i in range(4 if plan.lse is not None else 3)})
        if merge is None:
            return None
    return BoundForward(attention, merge)


def _bind(kernel, inputs, roles: dict, key_inputs=None):
    """The last launch of ``kernel`` on this thread, made with ``inputs``, bound (a
    :class:`BoundGeneratedLaunch`): the inputs with a role (index into the tensors a later call passes)
    put in their slots; the length and strides of ``key_inputs`` (index -> None for keys or values
    themselves, or BLOCK_N for the views of their whole blocks, :func:`_row_blocks`) read per call
    from the tensors of their roles. None where the recorded launch is not one of ``inputs`` or
    holds another call's tensor."""
    key_inputs = key_inputs or {}
    routed = routed_kernel(kernel)
    record = routed.last() if routed is not None else None
    described = launcher_arguments(kernel._launch) if record is not None else None
    if described is None or len(described) != len(record[1]):
        return None
    grid, args, num_warps, num_stages = record
    slots, holes = [], []
    for position, (what, *where) in enumerate(described):
        if what == "fixed":
            continue
        index = where[0]
        given = inputs[index]
        if what != "input":
            # A growing cache's keys keep their batch, heads and head dim (the template's layout
            # says so): their length and strides are what a later call fills in.
            if index in key_inputs:
                hole = _key_hole(what == "size", where[1], key_inputs[index])
                if hole is not None:
                    holes.append((position, roles[index], what == "size", *hole))
            continue
        if not isinstance(given, torch.Tensor):
            continue  # a scalar of the layout
        arg = args[position]
        if not (isinstance(arg, torch.Tensor) and arg.data_ptr() == given.data_ptr() and arg.shape == given.shape):
            return None  # another call's launch
        if index in roles:
            slots.append((position, roles[index]))
        elif not _is_stand_in(given):
            return None  # a tensor of this call alone (those calls are not templated)
    return BoundGeneratedLaunch(routed.launcher, args, slots, holes, grid, num_warps, num_stages, routed.maxnreg)


_KEY_LENGTH_DIM = 2  # of the keys and values, (B, H_kv, Lk, D)


def _key_hole(size: bool, dim: int, block_n: int | None):
    """What a growing cache's call fills in for a size (``size``) or stride of dimension ``dim``
    of its keys or values (``block_n`` None) or of the view of their whole blocks (``block_n``,
    (B, H_kv, Lk // BLOCK_N, BLOCK_N, D)): ``(dim, factor)`` of the keys' own, the size divided
    by the factor or the stride multiplied by it; None for what the layout fixes."""
    if block_n is None:
        return (dim, 1) if not size or dim == _KEY_LENGTH_DIM else None
    if size:
        return (_KEY_LENGTH_DIM, block_n) if dim == _KEY_LENGTH_DIM else None
    # the view's strides: (s0, s1, s2 * BLOCK_N, s2, s3) of the keys' (s0, s1, s2, s3)
    return ((0, 1), (1, 1), (2, block_n), (2, 1), (3, 1))[dim]


class BoundGeneratedLaunch(BoundKernel):
    """One NineToothed kernel's launch with the arguments its generated launcher computed for
    one layout (``common.launch.BoundKernel``): a later call puts its tensors in their ``slots``
    ((position, index into the call's tensors)) and, for ``holes`` ((position, index, size or
    stride, dim)), those tensors' sizes and strides."""

    def __init__(self, launcher, args, slots, holes, grid, num_warps, num_stages, maxnreg=None):
        super().__init__(launcher, grid, num_warps, num_stages, maxnreg)
        self.args, self.slots = list(args), tuple(slots)
        for position, _ in self.slots:
            self.args[position] = None  # (the binding call's tensors: not kept)
        # the same with the kept tensors' addresses, for a compiled kernel called directly (they
        # are kept alive by self.args: the stride-0 dummies NineToothed's arrangement needs)
        self.pointer_args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.args]
        # the holes by tensor, each tensor once: (its index, its holes as (position, size or stride, dim,
        # factor)): a size divided by the factor, a stride multiplied by it (see _key_hole)
        self.hole_tensors = tuple((index, tuple((p, size, dim, f) for p, i, size, dim, f in holes if i == index))
                                  for index in dict.fromkeys(i for _, i, _, _, _ in holes))
        self.hole_positions = tuple(p for _, tensor_holes in self.hole_tensors for p, _, _, _ in tensor_holes)

    def __call__(self, tensors) -> None:
        aligned = inputs_aligned(tensors)
        values = []
        for index, holes in self.hole_tensors:  # (one shape and one stride read per tensor)
            shape, stride = tensors[index].shape, tensors[index].stride()
            values += [shape[dim] // factor if size else stride[dim] * factor for _, size, dim, factor in holes]
        key = (aligned, int_classes(values)) if values else aligned
        kernel = self.kernels.get(key)
        if kernel is not None:  # addresses (common.launch.BoundKernel.run_compiled); the kept tensors' are kept
            args = self.pointer_args.copy()
            for position, index in self.slots:
                args[position] = tensors[index].data_ptr()
        else:
            args = self.args.copy()
            for position, index in self.slots:
                args[position] = tensors[index]
        for position, value in zip(self.hole_positions, values):
            args[position] = value
        if kernel is not None:
            self.run_compiled(kernel, args)
        else:
            self.launch_new(args, key)


class BoundForward:
    """The forward's launches bound to a layout: the attention kernel's and, for split keys,
    the merge's; called with the tensors ``common.plan.launch_bound`` passes (query, key,
    value, out, lse, o_part, lse_part)."""

    def __init__(self, attention: BoundGeneratedLaunch, merge: BoundGeneratedLaunch | None):
        self.attention, self.merge = attention, merge

    def __call__(self, tensors) -> None:
        self.attention(tensors)
        if self.merge is not None:
            # The merge's views of the partials and outputs start where they do, and a bound
            # launch reads only a tensor's address: the tensors themselves (lse None: unused).
            self.merge((tensors[5], tensors[6], tensors[3], tensors[4]))

    def launch_keys(self, tensors, blocks_per_split: int) -> None:
        """Launch for keys of another length and strides (bound with ``keys``; the kernel
        derives the blocks per split from the keys' length and the split count, or has them as
        its tile size: then bound per value, ``common.plan.launch_growing``)."""
        self(tensors)

    def launch_plan(self, plan) -> None:
        """Launch a plan of the bound layout whose keys may differ in length and strides."""
        self((plan.query, plan.key, plan.value, plan.out, plan.lse, plan.o_part, plan.lse_part))


def backward(plan):
    """Launch the backward for a ``common.plan.BackwardPlan``: the dQ pass (which
    also stores delta), then the dK/dV pass. Returns ``(dq, dk, dv)``, filled in."""
    q, k, v = plan.query, plan.key, plan.value
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    config = plan.config
    attn_mask = plan.attn_mask if plan.attn_mask is not None else _absent(q, B, H, Lq, Lk)
    grad_lse = plan.grad_lse if plan.grad_lse is not None else _absent(plan.lse, B, H, Lq)
    flags = dict(BANDED=plan.banded, MASK_KIND=int(plan.mask_kind), DOT_PRECISION=plan.dot_precision,
                 DROPOUT=plan.dropout, SOFTCAP=int(plan.softcap_kind))
    dropout = _dropout_args(plan)
    blocked = not plan.dropout  # (both passes' unmasked stages, as the forward's: blocked_keys)
    wide = _wide(q, k, v, plan.attn_mask, plan.out, plan.grad_out, plan.lse, plan.grad_lse, plan.grad_query,
                 plan.grad_key, plan.grad_value)
    _make(premake_dq, D, Dv, config.block_m2, config.block_n2,
          num_warps=config.num_warps, num_stages=config.num_stages, wide=wide)(
        q, k, v, _row_blocks(k, config.block_n2, blocked), _row_blocks(v, config.block_n2, blocked), attn_mask,
        plan.out, plan.grad_out, plan.lse, grad_lse, plan.scale, *dropout, *_band_args(plan), plan.delta,
        plan.grad_query, WITH_DLSE=plan.grad_lse is not None, BLOCKED=blocked, **flags,
    )
    rows = (q, plan.grad_out, plan.lse, plan.delta)
    _make(premake_dkdv, D, Dv, config.block_m1, config.block_n1,
          num_warps=config.num_warps, num_stages=config.num_stages, wide=wide)(
        q, k, v, attn_mask, plan.grad_out, plan.lse, plan.delta,
        *(_row_blocks(x, config.block_m1, blocked) for x in rows), plan.scale, *dropout,
        *_band_args(plan, keys=True), plan.grad_key, plan.grad_value, BLOCKED=blocked, GROUP_OF_ONE=H == k.shape[1],
        **flags,
    )
    return plan.grad_query, plan.grad_key, plan.grad_value


def paged_forward(plan):
    """Launch paged attention (and, for split keys, the merge) for a ``common.paged.PagedPlan``.
    Returns ``plan.out``, filled in."""
    q, out = plan.query, plan.out
    B, H, Lq, D = q.shape
    kc, vc = plan.key_cache, plan.value_cache
    Dv = vc.shape[3]
    config = plan.config
    o, lse = (plan.o_part, plan.lse_part) if plan.split else (out, _absent(out, B, H, Lq))
    page = kc.shape[1]
    pages_per_step = config.block_n // page
    # (the table's tile per split: its steps' pages)
    _make(premake_paged, D, Dv, config.block_m, page, plan.blocks_per_split * pages_per_step if plan.split else None,
          num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.maxnreg,
          wide=_wide(q, kc, vc, plan.block_table, o))(
        q, kc, vc, plan.block_table, plan.cache_seqlens, plan.scale, plan.lq_seq, kc.shape[0], o, lse,
        IS_CAUSAL=plan.is_causal, WITH_LSE=plan.split, DOT_PRECISION=plan.dot_precision, SPLIT=plan.split,
        PAGES_PER_STEP=pages_per_step,
    )
    if plan.split:
        merge = plan.merge
        R = merge.rows
        _make(premake_combine, Dv, merge.block_r, merge.block_s, num_warps=4, num_stages=1,
              wide=_wide(plan.o_part, out))(
            plan.o_part.view(R, plan.num_splits, Dv), plan.lse_part.view(R, plan.num_splits), out.view(R, Dv),
            _absent(out, R), WITH_LSE=False,
        )
    return out


def append_kv(key_cache, value_cache, block_table, cache_seqlens, key, value, *, block_m: int, block_d: int,
              block_dv: int):
    """Write key and value (B, H_kv, L_new, D | Dv) into the paged caches, in one launch
    (one program per token: see append_arrangement; block sizes as the Triton kernel's API)."""
    D, Dv = key.shape[3], value.shape[3]
    _make(premake_append, D, Dv, num_warps=4, num_stages=1, wide=_wide(key, value, key_cache, value_cache))(
        key, value, key_cache, value_cache, block_table, cache_seqlens, key_cache.shape[0])
