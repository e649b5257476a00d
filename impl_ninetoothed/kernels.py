"""Scaled-dot-product attention, forward and backward, as NineToothed kernels.

The same algorithms as ``impl_triton/kernels.py``, with the same names
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
own band, arranged like the log-sum-exp; soft-capping, ALiBi (each row's slope and
position shift, (B, H, Lq) views arranged like the sinks) and attention sinks as in the Triton kernel. Short
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
generated module by ``impl_ninetoothed.attention._make``: NineToothed compiles
the application's source in a module of its own.
"""

from __future__ import annotations

import functools
import inspect

import ninetoothed.language as ntl
import triton
from ninetoothed import Tensor

from common.configs import padded_head_dim
from common.jit_helpers import (
    _alibi_bias,
    _cap_factors,
    _dropout_keep,
    _in_band,
    _keep_widened,
    _key_stages,
    _narrow_query,
    _p_operand,
    _pv_rows,
    _scores,
    _sign_unknown,
    _tanh,
    _widen,
)
from common.plan import DESCALE_ROWS, LN2, LOG2E, ROW_BANDS, UNBOUNDED, UNIFORM_24, MaskKind, Softcap, Widen
from impl_ninetoothed.tiles import (
    _group_row_blocks,
    _group_rows,
    _key_blocks_row,
    _key_row,
    _last_first,
    _mask_row,
    _per_kv_head,
    _per_program,
    _per_split,
    _row_slices,
    _rows,
    _split_blocks,
)

NO_MASK, BOOL_MASK, ADDITIVE_MASK = int(MaskKind.NONE), int(MaskKind.BOOL), int(MaskKind.ADDITIVE)
TANH_APPROX = int(Softcap.APPROX)
WIDEN_F16_ROWS = int(Widen.FLOAT16_ROWS)
_SCORES_CALLS = (_tanh, _alibi_bias)  # (jit helpers of this module: NineToothed copies them with _scores)
ONE_STAGE = 2  # SPLIT's value for a split walked in one masked loop (impl_ninetoothed.attention.one_stage_split)
KERNEL_CONSTANTS = dict(LOG2E=LOG2E, LN2=LN2, NO_MASK=NO_MASK, BOOL_MASK=BOOL_MASK, ADDITIVE_MASK=ADDITIVE_MASK,
                        UNIFORM_24=UNIFORM_24, TANH_APPROX=TANH_APPROX, WIDEN_F16=int(Widen.FLOAT16),
                        WIDEN_F16_ROWS=WIDEN_F16_ROWS, WIDEN_PV_ORDER=int(Widen.PV_ORDER),
                        ROW_BANDS=ROW_BANDS, DESCALE_ROWS=DESCALE_ROWS, ONE_STAGE=ONE_STAGE)


# -- forward ---------------------------------------------------------------------------------

def arrangement(
    query, key, value, key_blocks, value_blocks, attn_mask, scale, dropout_seed, dropout_p, dropout_scale,
    band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, sinks, slopes, alibi_shift, q_descale, k_descale,
    v_descale, output, lse,
    BANDED, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, SINKS, RESUME, BLOCKED, ALIBI,
    DESCALE, WIDEN_K, WIDEN_V,
    block_m, block_n, block_d, block_dv, split=False, descale_rows=False,
):
    """One program per (batch, head, block of BLOCK_M query rows), and per split
    of the keys when ``split``; a head's row blocks last to first (:func:`_last_first`).
    ``descale_rows``: the FP8 descales are (B, H, Lq), a (BLOCK_M,) slice each program (packed
    sequences, DESCALE_ROWS), not (B, H_kv).

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
    slopes_arranged = _last_first(_row_slices(slopes, block_m))  # (B, H, Lq), each row's slope
    shifts_arranged = _last_first(_row_slices(alibi_shift, block_m))  # (B, H, Lq), each row's shift
    row_bands_arranged = [_last_first(_row_slices(x, block_m)) for x in (row_bands_lo, row_bands_hi)]
    # FP8: each program's K/V head's descales, (1,) tiles of the (B, H_kv) tensors, or its rows'
    if descale_rows:
        descales_arranged = [_last_first(_row_slices(x, block_m)) for x in (q_descale, k_descale, v_descale)]
    else:
        descales_arranged = [_per_kv_head(x, query.shape[1], m_blocks, num_splits)
                             for x in (q_descale, k_descale, v_descale)]
    if blocks_per_split is None:
        output_arranged = _last_first(_rows(output, block_m, block_dv))
        lse_arranged = _last_first(_row_slices(lse, block_m))
    else:
        query_arranged = _per_split(query_arranged, num_splits)
        sinks_arranged = _per_split(sinks_arranged, num_splits)
        slopes_arranged = _per_split(slopes_arranged, num_splits)
        shifts_arranged = _per_split(shifts_arranged, num_splits)
        row_bands_arranged = [_per_split(x, num_splits) for x in row_bands_arranged]
        if descale_rows:
            descales_arranged = [_per_split(x, num_splits) for x in descales_arranged]
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
        band_hi, softcap, *row_bands_arranged, sinks_arranged, slopes_arranged, shifts_arranged, *descales_arranged,
        output_arranged, lse_arranged, BANDED, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT,
        SOFTCAP, SINKS, RESUME, BLOCKED, ALIBI, DESCALE, WIDEN_K, WIDEN_V,
    )


def _attn_fwd_inner(
    acc, l_i, m_i, q, key, value, attn_mask, offs_m, lo, hi, first, band_lo, band_hi, qk_scale, cap_in, cap_out,
    alibi, shift, seed, head, dropout_p, BANDED, MASK_KIND, MASKED, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
    DROPOUT, SOFTCAP, ALIBI, DESCALE, SCALE_FIRST, WIDEN_K, WIDEN_V,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i); inlined by NineToothed.

    Blocks count from the first key; the program's tiles start at block
    ``first`` (0 unless the keys are split). MASKED: the blocks may hold keys
    past Lk or, when BANDED, outside a row's band (row i sees keys i + band_lo
    .. i + band_hi); mask them. Unmasked blocks
    skip every comparison. DROPOUT: the row sums take every probability, the
    output only the kept ones. DESCALE (FP8 inputs): qk_scale holds the descales (per row for
    DESCALE_ROWS: an (M, 1) column); SCALE_FIRST: their sign is unknown (:func:`_sign_unknown`):
    scores are scaled before their maximum is taken, in a loop that is not pipelined (the rare
    case); WIDEN_K, WIDEN_V widen FP8 tiles for a 16-bit product.
    """
    for j in triton.language.range(lo, hi, num_stages=1 if SCALE_FIRST else None):
        k = key[j - first]
        k = _widen(k, WIDEN_K)
        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP or ALIBI or SCALE_FIRST:
            # soft-capped (or scaled) and ALiBi's bias added, in base 2
            qk, cap = _scores(qk, offs_m, key[j - first].offsets(-2), qk_scale, cap_in, cap_out, alibi, shift,
                              SOFTCAP, ALIBI)
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
            row_scale = qk_scale
            if DESCALE == DESCALE_ROWS:
                row_scale = ntl.max(qk_scale, 1)  # (each row's scale: the column as a vector)
            if NEGATIVE_SCALE:
                m_ij = ntl.maximum(m_i, ntl.min(qk, 1) * row_scale)
            else:
                m_ij = ntl.maximum(m_i, ntl.max(qk, 1) * row_scale)
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
        v = _widen(v, WIDEN_V)
        if WIDEN_V == WIDEN_F16_ROWS:  # (widened before the product's transpose)
            v = _keep_widened(v, value[j - first].offsets(-1) < value.source.shape[-1])
        acc = ntl.dot(_p_operand(p, v.dtype, WIDEN_V), v, acc, input_precision=DOT_PRECISION)  # (FP8: e4m3)
        m_i = m_ij
    return acc, l_i, m_i


def application(
    query, key, value, key_blocks, value_blocks, attn_mask, scale, dropout_seed, dropout_p, dropout_scale,
    band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, sinks, slopes, alibi_shift, q_descale, k_descale,
    v_descale, output, lse,
    BANDED, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, SINKS, RESUME, BLOCKED, ALIBI,
    DESCALE, WIDEN_K, WIDEN_V,
):
    q = query
    offs_m = query.offsets(-2)
    head = query.offsets(0) * query.source.shape[1] + query.offsets(1)  # in (B·H): the dropout mask's
    score_scale = scale
    out_scale = 1.0
    if DESCALE == DESCALE_ROWS:  # each row's descales (a column: a row's keys are its sequence's)
        score_scale = scale * ntl.expand_dims(q_descale * k_descale, 1)
        out_scale = ntl.expand_dims(v_descale, 1)
    elif DESCALE:  # real values are the stored ones times their descales ((1,) tiles, loaded once)
        score_scale = scale * ntl.sum(q_descale, 0) * ntl.sum(k_descale, 0)
        out_scale = ntl.sum(v_descale, 0)
    if DESCALE:
        q, score_scale = _narrow_query(q, score_scale, WIDEN_K)  # (a bfloat16 query on float16-widened keys)
    qk_scale = score_scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))
    cap_in, cap_out = _cap_factors(score_scale, softcap, SOFTCAP)
    alibi = 0.0
    shift = 0
    if ALIBI:  # each row's slope (a column, in base-2 units) and position shift (row r at r + shift)
        alibi = ntl.expand_dims(slopes, 1) * LOG2E  # (NineToothed reads x[:, None] as a tile index)
        shift = alibi_shift
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
        # had ptxas serialise a warpgroup tile's MMAs (impl_ninetoothed.attention.one_stage_split); one costs
        # a compare and a select per score, in a launch bound by memory.
        full_lo = first
        full_hi = first
    if BANDED:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key, value, attn_mask, offs_m, first, full_lo, lo, row_lo, row_hi, qk_scale,
            cap_in, cap_out, alibi, shift, seed, head, dropout_p, BANDED, MASK_KIND, True, NEGATIVE_SCALE,
            DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, False, WIDEN_K, WIDEN_V,
        )
    fast_hi = full_hi
    if DESCALE:
        # A descale's sign is the GPU's: where not every row's scale is positive, the whole blocks
        # take their maxima from the scaled scores, in a loop of their own after these (the rare
        # case); otherwise that loop is empty. (Bounds, not a branch: loops under a branch had
        # ptxas serialise the MMAs.)
        fast_hi = ntl.where(_sign_unknown(score_scale, DESCALE == DESCALE_ROWS), full_lo, full_hi)
    if BLOCKED:
        # The whole blocks from their own view, whose block size is a constant: their loads carry
        # no per-key bounds check (an unsplit launch without dropout or ALiBi; the blocks count from 0).
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key_blocks, value_blocks, attn_mask, offs_m, full_lo, fast_hi, lo, row_lo, row_hi,
            qk_scale, cap_in, cap_out, alibi, shift, seed, head, dropout_p, BANDED, MASK_KIND, False,
            NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, False, DESCALE, False, WIDEN_K, WIDEN_V,
        )
    else:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key, value, attn_mask, offs_m, full_lo, fast_hi, lo, row_lo, row_hi, qk_scale,
            cap_in, cap_out, alibi, shift, seed, head, dropout_p, BANDED, MASK_KIND, False, NEGATIVE_SCALE,
            DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, False, WIDEN_K, WIDEN_V,
        )
    if DESCALE:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, key, value, attn_mask, offs_m, fast_hi, full_hi, lo, row_lo, row_hi, qk_scale,
            cap_in, cap_out, alibi, shift, seed, head, dropout_p, BANDED, MASK_KIND, False, NEGATIVE_SCALE,
            DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, True, WIDEN_K, WIDEN_V,
        )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, key, value, attn_mask, offs_m, full_hi, end, lo, row_lo, row_hi, qk_scale,
        cap_in, cap_out, alibi, shift, seed, head, dropout_p, BANDED, MASK_KIND, True, NEGATIVE_SCALE,
        DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, False, WIDEN_K, WIDEN_V,
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
    o = acc / l_i[:, None]
    if DROPOUT:
        o = o * dropout_scale
    if DESCALE:
        o = o * out_scale
    output = o  # noqa: F841 (a store)


def combine_arrangement(o_part, lse_part, output, lse, WITH_LSE, block_r, block_s, block_dv):
    """One program per BLOCK_R rows of the flattened (B·H·Lq) rows, walking their splits
    BLOCK_S at a time (as the Triton merge, :func:`impl_triton.kernels._merge_kernel`): the
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


def copy_arrangement(source, target, PV_ORDER, block_l, block_d):
    """One program per BLOCK_L rows of a (batch, head): the same (BLOCK_L, BLOCK_D) tile of both
    tensors, each read through its own strides (as :func:`impl_triton.kernels._copy_values`)."""

    def tiles(x):
        arranged = x.tile((1, 1, block_l, block_d)).squeeze(3)  # (B, H, L / BLOCK_L)
        arranged.dtype = arranged.dtype.squeeze((0, 1))
        return arranged

    return tiles(source), tiles(target), PV_ORDER


def copy_application(source, target, PV_ORDER):
    """The tile as it is, into the other layout (FP8 values column-major for the e4m3 P·V
    product): the load coalesced along the source's unit stride, the store along the target's.
    PV_ORDER (L and BLOCK_L multiples of 32): its rows in the P·V order (``common.plan.pv_position``)."""
    if PV_ORDER:
        target = _pv_rows(source)  # noqa: F841 (a store)
    else:
        target = source  # noqa: F841 (a store)


# -- backward ----------------------------------------------------------------------------------

def dq_arrangement(
    query, key, value, key_blocks, value_blocks, attn_mask, out, grad_out, lse, grad_lse, scale, dropout_seed,
    dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, slopes, alibi_shift, delta_out,
    grad_query, BANDED, MASK_KIND, WITH_DLSE, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, ALIBI,
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
        rows(row_bands_lo), rows(row_bands_hi), rows(slopes), rows(alibi_shift), rows(delta_out),
        rows(grad_query, block_d),
        BANDED, MASK_KIND, WITH_DLSE, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, ALIBI,
    )


def _attn_bwd_dq_inner(
    dq, q, do, m2, delta, key, value, attn_mask, offs_m, lo, hi, band_lo, band_hi, qk_scale, cap_in, cap_out,
    alibi, shift, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, MASKED, DOT_PRECISION, DROPOUT,
    SOFTCAP, ALIBI,
):
    """Add key blocks [lo, hi) to dq (unscaled). MASKED as in _attn_fwd_inner.
    DROPOUT: dp reaches only the kept probabilities, scaled as in the forward.
    SOFTCAP: ds passes through the cap's derivative, 1 - tanh^2."""
    for j in range(lo, hi):
        k = key[j]
        v = value[j]
        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP or ALIBI:
            qk, cap = _scores(qk, offs_m, key[j].offsets(-2), qk_scale, cap_in, cap_out, alibi, shift, SOFTCAP,
                              ALIBI)
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
    dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi, slopes, alibi_shift, delta_out,
    grad_query, BANDED, MASK_KIND, WITH_DLSE, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, ALIBI,
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
    alibi = 0.0
    shift = 0
    if ALIBI:  # (as the forward's)
        alibi = ntl.expand_dims(slopes, 1) * LOG2E
        shift = alibi_shift
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
            cap_in, cap_out, alibi, shift, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, True,
            DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
        )
    if BLOCKED:  # the whole blocks from their own view, as in the forward (no dropout or ALiBi)
        dq = _attn_bwd_dq_inner(
            dq, q, do, m2, delta, key_blocks, value_blocks, attn_mask, offs_m, full_lo, full_hi, row_lo, row_hi,
            qk_scale, cap_in, cap_out, alibi, shift, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND,
            False, DOT_PRECISION, DROPOUT, SOFTCAP, False,
        )
    else:
        dq = _attn_bwd_dq_inner(
            dq, q, do, m2, delta, key, value, attn_mask, offs_m, full_lo, full_hi, row_lo, row_hi, qk_scale,
            cap_in, cap_out, alibi, shift, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, False,
            DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
        )
    dq = _attn_bwd_dq_inner(
        dq, q, do, m2, delta, key, value, attn_mask, offs_m, full_hi, end, row_lo, row_hi, qk_scale,
        cap_in, cap_out, alibi, shift, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, True,
        DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
    )
    grad_query = dq * scale  # noqa: F841 (a store)


def dkdv_arrangement(
    query, key, value, attn_mask, grad_out, lse, delta, query_blocks, grad_out_blocks, lse_blocks, delta_blocks,
    scale, dropout_seed, dropout_p, dropout_scale, band_lo, band_hi, softcap, row_bands_lo, row_bands_hi,
    key_bands_lo, key_bands_hi, slopes, alibi_shift, grad_key, grad_value,
    BANDED, MASK_KIND, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, GROUP_OF_ONE, ALIBI,
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
        _group_rows(slopes, group, n_blocks, block_m), _group_rows(alibi_shift, group, n_blocks, block_m),
        _rows(grad_key, block_n, block_d), _rows(grad_value, block_n, block_dv),
        BANDED, MASK_KIND, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, GROUP_OF_ONE, ALIBI,
    )


def _attn_bwd_dkdv_inner(
    dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn, lo, hi, band_lo,
    band_hi, qk_scale, cap_in, cap_out, slopes, alibi_shift, seed, head, dropout_p, dropout_scale,
    BANDED, MASK_KIND, MASKED, DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
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
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP or ALIBI:
            # (keys x rows: ALiBi's |j - pos_i| = |pos_i - j|, the rows' slopes a (1, M) row)
            alibi = 0.0
            shift = 0
            if ALIBI:
                alibi = ntl.expand_dims(slopes[g, i], 0) * LOG2E
                shift = alibi_shift[g, i]
            qkT, capT = _scores(qkT, offs_kn, query[g, i].offsets(-2) + shift, qk_scale, cap_in, cap_out, alibi, 0,
                                SOFTCAP, ALIBI)
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
    key_bands_lo, key_bands_hi, slopes, alibi_shift, grad_key, grad_value,
    BANDED, MASK_KIND, DOT_PRECISION, DROPOUT, SOFTCAP, BLOCKED, GROUP_OF_ONE, ALIBI,
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
        # (which otherwise spill). A size here is never a constant.
        groups = 1
    for g in range(groups):
        # query head g of this K/V head, in (B·H): the dropout mask's (NineToothed's inliner
        # mis-names a helper called inside an expression, so this is spelled out)
        head = key.offsets(0) * query.source.shape[1] + key.offsets(1) * query.shape[0] + g
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn, lo, full_lo,
            band_lo, band_hi, qk_scale, cap_in, cap_out, slopes, alibi_shift, seed, head, dropout_p, dropout_scale,
            BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
        )
        if BLOCKED:  # the whole row blocks from their own views (no dropout or ALiBi): see blocked_keys
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, query_blocks, grad_out_blocks, lse_blocks, delta_blocks, attn_mask, row_bands_lo,
                row_bands_hi, g, offs_kn, full_lo, full_hi, band_lo, band_hi, qk_scale, cap_in, cap_out, slopes,
                alibi_shift, seed, head, dropout_p, dropout_scale, BANDED, MASK_KIND, False, DOT_PRECISION, DROPOUT,
                SOFTCAP, False,
            )
        else:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn,
                full_lo, full_hi, band_lo, band_hi, qk_scale, cap_in, cap_out, slopes, alibi_shift, seed, head,
                dropout_p, dropout_scale, BANDED, MASK_KIND, False, DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
            )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, query, grad_out, lse, delta, attn_mask, row_bands_lo, row_bands_hi, g, offs_kn, full_hi, hi,
            band_lo, band_hi, qk_scale, cap_in, cap_out, slopes, alibi_shift, seed, head, dropout_p, dropout_scale,
            BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT, SOFTCAP, ALIBI,
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
# keys'; ...): each program then divides by each size once (benchmarks/NOTES.md, "nt-shared-sizes"). Every plan
# passes tensors of those sizes (stand-ins included); a size given here is never checked.

def _like(sizes, *trailing, other=None):
    """A tensor whose leading sizes are ``sizes`` (another tensor's symbols), then ``trailing``
    (an int: a constant; None: a symbol of its own)."""
    return Tensor(shape=(*sizes, *trailing), other=other)


def _rows_like(query, *trailing, other=None):
    """A tensor of the query's (B, H, Lq), then ``trailing`` sizes (see :func:`_like`)."""
    return _like(query.shape[:3], *trailing, other=other)


def _attention_inputs(head_dim, head_dim_v, grouped=True):
    """query, key, value and attn_mask, as every attention kernel takes them: the values of the
    keys' (B, H_kv, Lk), the mask (B, H, Lq, Lk) of the query's and the keys'. ``grouped`` False:
    one K/V head a query head (every call whose heads are packed, as the kernels see it), the keys
    of the query's (B, H): fewer sizes, and the keys' coordinates unravelled from the program id by
    the query's divisions.

    Out-of-range elements must read as 0 (padded head dims enter the dot
    products; past-the-end keys and values meet p = 0, and 0 * garbage may be
    NaN); NineToothed leaves them undefined unless told. (0.0, a float: Triton converts no
    integer to an 8-bit float, and FP8 inputs take these loads too.)
    """
    query = Tensor(shape=(None, None, None, head_dim), other=0.0)
    key = Tensor(shape=(None, None, None, head_dim) if grouped else (*query.shape[:2], None, head_dim), other=0.0)
    value = _like(key.shape[:3], head_dim_v, other=0.0)
    attn_mask = _rows_like(query, key.shape[2], other=0)
    return query, key, value, attn_mask


def _key_blocks_inputs(key, head_dim, head_dim_v, block_n):
    """The keys' and values' whole blocks, (B, H_kv, Lk // BLOCK_N, BLOCK_N, D | Dv) (see
    ``blocked_keys``): the block size a constant of the kernel, so that loads of them check no
    key against the keys' length; (B, H_kv) the keys', the block count one symbol of both."""
    key_blocks = _like(key.shape[:2], None, block_n, head_dim, other=0.0)
    return key_blocks, _like(key_blocks.shape[:3], block_n, head_dim_v, other=0.0)


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


def _alibi_inputs(query):
    """slopes, ALiBi's float32 slope of each row, and alibi_shift, each row's int32 position shift
    (row r at position r + shift), both (B, H, Lq) like the log-sum-exp (views of the (B, H) slopes
    and the (Lq,) shifts), read when ALIBI."""
    return _rows_like(query, other=0), _rows_like(query, other=0)


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


def premake(head_dim, head_dim_v, block_m, block_n, split=False, block_d=None, descale_rows=None, grouped=None,
            block_dv=None):
    """The forward; with ``split``, its split-KV variant (see ``arrangement``). ``block_d``,
    ``block_dv``: the head dims' tiles where the plan widens them past ``padded_head_dim`` (an e4m3
    Q·K product: 32; ``common.plan.tile_widths``).
    ``descale_rows``: FP8 descales per query head and row (DESCALE_ROWS), not per K/V head.
    ``grouped``: query heads read K/V heads in groups (heads not packed); otherwise the keys take
    the query's (B, H) sizes (``_attention_inputs``)."""
    arrangement_ = functools.partial(
        arrangement, block_m=block_m, block_n=block_n,
        block_d=block_d if block_d is not None else padded_head_dim(head_dim),
        block_dv=block_dv if block_dv is not None else padded_head_dim(head_dim_v), split=split,
        descale_rows=bool(descale_rows),
    )
    query, key, value, attn_mask = _attention_inputs(head_dim, head_dim_v, grouped=bool(grouped))
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
        *_alibi_inputs(query),
        # FP8 descales of query, key and value: (B, H_kv), or (B, H, Lq) per row
        *((_rows_like(query, other=1.0) if descale_rows else _like(key.shape[:2])) for _ in range(3)),
        output, lse,
        *_flags("BANDED", "MASK_KIND", "WITH_LSE", "NEGATIVE_SCALE", "DOT_PRECISION", "SPLIT", "DROPOUT", "SOFTCAP",
                 "SINKS", "RESUME", "BLOCKED", "ALIBI", "DESCALE", "WIDEN_K", "WIDEN_V"),
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


def premake_copy(head_dim, block_l):
    """The values' copy into another layout: (B, H, L, D) into the same sizes."""
    arrangement_ = functools.partial(copy_arrangement, block_l=block_l, block_d=padded_head_dim(head_dim))
    source = Tensor(shape=(None, None, None, head_dim))
    return arrangement_, copy_application, (source, _like(source.shape[:3], head_dim), *_flags("PV_ORDER"))


def premake_dq(head_dim, head_dim_v, block_m, block_n, block_d=None, block_dv=None):
    """The backward's dQ pass. ``block_d``, ``block_dv``: as ``premake``'s."""
    arrangement_ = functools.partial(
        dq_arrangement, block_m=block_m, block_n=block_n,
        block_d=block_d if block_d is not None else padded_head_dim(head_dim),
        block_dv=block_dv if block_dv is not None else padded_head_dim(head_dim_v),
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
        *_alibi_inputs(query),
        _rows_like(query),  # delta_out
        _rows_like(query, head_dim),  # grad_query
        *_flags("BANDED", "MASK_KIND", "WITH_DLSE", "DOT_PRECISION", "DROPOUT", "SOFTCAP", "BLOCKED", "ALIBI"),
    )
    return arrangement_, dq_application, tensors


def premake_dkdv(head_dim, head_dim_v, block_m, block_n, block_d=None, block_dv=None):
    """The backward's dK/dV pass. ``block_d``, ``block_dv``: as ``premake``'s."""
    arrangement_ = functools.partial(
        dkdv_arrangement, block_m=block_m, block_n=block_n,
        block_d=block_d if block_d is not None else padded_head_dim(head_dim),
        block_dv=block_dv if block_dv is not None else padded_head_dim(head_dim_v),
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
        *_alibi_inputs(query),
        _like(key.shape[:3], head_dim),  # grad_key
        _like(key.shape[:3], head_dim_v),  # grad_value
        *_flags("BANDED", "MASK_KIND", "DOT_PRECISION", "DROPOUT", "SOFTCAP", "BLOCKED", "GROUP_OF_ONE", "ALIBI"),
    )
    return arrangement_, dkdv_application, tensors
