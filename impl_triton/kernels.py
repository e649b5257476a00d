"""Scaled-dot-product attention, forward and backward, as hand-written Triton kernels.

Algorithm: FlashAttention-2.

Forward (``_attn_fwd``). Each program owns one block of BLOCK_M query rows of
one (batch, head), keeps it on chip, and streams the keys and values in
blocks of BLOCK_N through an online softmax with float32 accumulators
(``acc``, the running row sum ``l_i`` and the running row maximum ``m_i``).
The Lq x Lk score matrix never exists outside registers.

- The softmax runs in base 2 with log2(e) folded into the scale; in blocks
  without masks, scaling a score and subtracting its row maximum is one FMA,
  then one ``exp2``.
- Key blocks are visited in two stages: first the blocks that need no mask at
  all (every key exists and, when causal, lies on or below the diagonal for
  every row of the block), then the few blocks that do (the diagonal band and
  the ragged tail of the keys). Causal programs never visit key blocks that lie
  wholly above the diagonal. Loop bounds (``lo``, ``full_end``, ``hi``) count
  key blocks, as in the NineToothed kernel.
- Causal masking, bottom-right alignment and sliding windows are one band
  (``BANDED``): row i sees keys i + band_lo .. i + band_hi (``common.plan.band``;
  top-left causal, SDPA's ``ones(Lq, Lk).tril(0)``, is band_hi = 0). Key blocks
  come in three stages: the band's left edge (masked), the blocks every row of
  the program sees whole (unmasked), the right edge and the ragged end of the
  keys (masked); blocks outside the band are never visited. Packed
  variable-length sequences (``common.varlen``) are BANDED == ROW_BANDS: each
  row its own band (ROW_LO, ROW_HI), each key its rows (KEY_LO, KEY_HI, for the
  dK/dV pass), the stages taken over the block's rows.
- SOFTCAP: scores become softcap * tanh(s / softcap) (``tanh.approx.f32`` for
  16-bit inputs on NVIDIA GPUs, else tanh from exp2: ``common.plan.Planner.softcap_kind``); the
  backward multiplies ds by 1 - tanh^2. ALIBI: -slope_i * |pos_i - j| added to
  the (capped) scores before any mask, each row's slope and position i + shift_i read
  from SLOPES ((B, H, Lq) strided) and SHIFTS ((Lq,) int32), so packed grouped heads and
  packed sequences take it too; it only lowers scores, so band skipping stays valid. SINKS: a per-head logit starts each
  row's online softmax (m_i = sink, l_i = 1), so it joins the denominator with
  no value; the log-sum-exp includes it, and the backward needs nothing more.
- Grouped-query attention reads key/value head ``h // GROUP``: no copies.
- An optional ``attn_mask`` (boolean: True takes part; or additive) is read
  through its strides, so a broadcast mask costs no memory. A row whose every
  key is masked out gives 0, as SDPA's math backend does.
- The log-sum-exp of each row's scaled, masked scores (natural log) can be
  written out: the backward pass and split merges need it.
- Short queries (decoding): the keys can be split across programs (the
  grid's second axis, BLOCKS_PER_SPLIT key blocks each); each program writes a float32 partial
  output and its log-sum-exp, and the last program of each row block to finish
  merges them (``_merge_splits``; a ticket taken with an atomic on per-stream
  counters, ``common.launch.ticket_counters``), so a decode step is one launch.
  When and how much to split is ``common.plan``'s decision, shared with NineToothed.

Backward, deterministic (no atomics), from the forward's log-sum-exp:
``p = exp(s - lse)``, ``dv = p^T do``, ``dp = do v^T``, ``ds = p (dp - delta)``
with ``delta = rowsum(do * o)``, ``dq = scale ds k``, ``dk = scale ds^T q``.

- ``_attn_bwd_dq``: one program per block of BLOCK_M2 query rows, the same
  schedule as the forward (the band's three stages of key blocks). It
  also computes ``delta`` for its rows and stores it for the next pass.
- ``_attn_bwd_dkdv``: one program per block of BLOCK_N1 keys of one K/V head;
  it walks the query rows of every query head of its group (grouped-query
  gradients summed in registers, never materialised) in three stages: the
  rows on the band's right edge (masked), the rows that see every key of the
  block (unmasked), the band's left edge and the ragged tail of the rows
  (masked). Rows outside the band are never visited.
- A gradient reaching the log-sum-exp too (``return_lse=True``) enters as
  ``delta - dlse``: ``d lse / d s = p``.

Every tensor is read through its strides: transposed views need no copy.
Offsets are 64-bit wherever an index meets a stride (``offs_m.to(tl.int64)``,
``start_n.to(tl.int64)``): a long sequence in a (B, L, H, D) layout passes
2^31 elements within one head. The (batch·head, block) pair is one grid axis
(CUDA caps the other two at 65535).
"""

from __future__ import annotations

import triton
import triton.language as tl

from common import plan as _plan
from common.jit_helpers import (
    WIDEN_F16_ROWS,
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
    _widen,
)

LOG2E = tl.constexpr(_plan.LOG2E)
LN2 = tl.constexpr(_plan.LN2)
NO_MASK = tl.constexpr(int(_plan.MaskKind.NONE))
BOOL_MASK = tl.constexpr(int(_plan.MaskKind.BOOL))
ADDITIVE_MASK = tl.constexpr(int(_plan.MaskKind.ADDITIVE))
ROW_BANDS = tl.constexpr(_plan.ROW_BANDS)
DESCALE_ROWS = tl.constexpr(_plan.DESCALE_ROWS)
UNBOUNDED = tl.constexpr(_plan.UNBOUNDED)


# -- forward ----------------------------------------------------------------------------

@triton.jit
def _load_tile(ptrs, row_ok, col_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows and/or columns only where it is asked
    (unmasked loads are the fast path of the inner loops)."""
    if MASK_ROWS:
        tile = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif MASK_COLS:
        tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _row_band(lo_ptr, hi_ptr, rows, rows_ok, band_lo, band_hi, BANDED: tl.constexpr):
    """(band_lo, band_hi) for these rows: the scalars as given or, when BANDED ==
    ROW_BANDS, each row's own offsets (int32 vectors at lo_ptr and hi_ptr, indexed
    by row); rows past the end see nothing."""
    if BANDED == ROW_BANDS:
        band_lo = tl.load(lo_ptr + rows, mask=rows_ok, other=UNBOUNDED)
        band_hi = tl.load(hi_ptr + rows, mask=rows_ok, other=-UNBOUNDED)
    return band_lo, band_hi


@triton.jit
def _alibi_rows(slope_ptr, shift_ptr, stride_am, stride_as, rows, rows_ok, ALIBI: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """(slopes, shifts (M,)): ALiBi's slope, in base-2 units, and position shift of each of
    ``rows`` (row r at position r + shift) from a head's row-strided slopes and the rows' shifts;
    the slopes an (M, 1) column, or TRANSPOSED a (1, M) row (scores keys x rows); (0.0, 0)
    without ALIBI. (Packed grouped heads and packed sequences give each row its own.)"""
    slopes = 0.0
    shifts = 0
    if ALIBI:
        slopes = tl.load(slope_ptr + rows.to(tl.int64) * stride_am, mask=rows_ok, other=0.0) * LOG2E
        if TRANSPOSED:
            slopes = slopes[None, :]
        else:
            slopes = slopes[:, None]
        shifts = tl.load(shift_ptr + rows.to(tl.int64) * stride_as, mask=rows_ok, other=0)
    return slopes, shifts


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, mask_ptrs,
    stride_kn, stride_vn, stride_mn,
    offs_m, offs_n, offs_d, offs_dv, lo, hi, Lq, Lk, band_lo, band_hi, qk_scale, cap_in, cap_out,
    alibi, alibi_shift, seed, off_hz, dropout_p,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DESCALE: tl.constexpr, SCALE_FIRST: tl.constexpr,
    WIDEN_K: tl.constexpr, WIDEN_V: tl.constexpr,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i).

    MASKED: the blocks may hold keys past Lk or, when BANDED, outside a row's
    band (row i sees keys i + band_lo .. i + band_hi); mask them. Unmasked blocks skip every comparison. DROPOUT: the
    row sums take every probability, the output only the kept ones. DESCALE (FP8 inputs):
    qk_scale holds the descales (per row for DESCALE_ROWS: an (M, 1) column); SCALE_FIRST:
    their sign is unknown (:func:`_sign_unknown`): scores are scaled before their maximum is
    taken, in a loop that is not pipelined (the rare case); WIDEN_K, WIDEN_V widen FP8 tiles for a 16-bit product.
    """
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for j in tl.range(lo, hi, num_stages=1 if SCALE_FIRST else None):
        start_n = tl.multiple_of(j * BLOCK_N, BLOCK_N)
        offs_kn = start_n + offs_n
        key_ok = offs_kn < Lk
        k = _load_tile(k_ptrs + start_n.to(tl.int64) * stride_kn, key_ok, d_ok, MASKED, BLOCK_D != HEAD_DIM)
        k = _widen(k, WIDEN_K)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP or ALIBI or SCALE_FIRST:
            # soft-capped (or scaled) and ALiBi's bias added, in base 2
            qk, cap = _scores(qk, offs_m, offs_kn, qk_scale, cap_in, cap_out, alibi, alibi_shift, SOFTCAP, ALIBI)
            if MASKED:
                valid = key_ok[None, :]
                if BANDED:
                    valid = valid & _in_band(offs_m, offs_kn, band_lo, band_hi)
                qk = tl.where(valid, qk, float("-inf"))
            if MASK_KIND != NO_MASK:
                mask_ok = (offs_m[:, None] < Lq) & key_ok[None, :]
                mask = tl.load(mask_ptrs + start_n.to(tl.int64) * stride_mn, mask=mask_ok, other=0)
                if MASK_KIND == BOOL_MASK:
                    qk = tl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(tl.float32) * LOG2E
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            if MASK_KIND != NO_MASK or SPLIT or BANDED:
                # A row with no visible key yet has m_ij = -inf (a mask, a band
                # that hides every key of the block from it, or a split that
                # starts past a causal row's last key); subtract 0
                # instead so that its p and alpha are 0, not NaN.
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            else:
                m_sub = m_ij
            qk = qk - m_sub[:, None]
        else:
            # No mask: scale and subtract the maximum in one FMA per score. The
            # row maximum of qk * qk_scale is max(qk) * qk_scale, or min(qk) *
            # qk_scale for a negative scale.
            row_scale = qk_scale
            if DESCALE == DESCALE_ROWS:
                row_scale = tl.max(qk_scale, 1)  # (each row's scale: the column as a vector)
            if NEGATIVE_SCALE:
                m_ij = tl.maximum(m_i, tl.min(qk, 1) * row_scale)
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * row_scale)
            m_sub = m_ij
            qk = qk * qk_scale - m_sub[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = _dropout_keep(seed, off_hz, offs_m, offs_kn, dropout_p)
            p = tl.where(keep, p, 0.0)
        v = _load_tile(v_ptrs + start_n.to(tl.int64) * stride_vn, key_ok, dv_ok, MASKED, BLOCK_DV != HEAD_DIM_V)
        v = _widen(v, WIDEN_V)
        if WIDEN_V == WIDEN_F16_ROWS:  # (widened before the product's transpose)
            v = _keep_widened(v, dv_ok)
        acc = tl.dot(_p_operand(p, v.dtype, WIDEN_V), v, acc, input_precision=DOT_PRECISION)  # (FP8: e4m3)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _descale(ptr, offs_m, m_ok, stride_m, DESCALE: tl.constexpr):
    """A descale at ``ptr``: one (a scalar), or per row (DESCALE_ROWS: a (BLOCK_M, 1) column, each
    row's, which scales the row's scores and output as the scalar does)."""
    if DESCALE == DESCALE_ROWS:
        descale = tl.expand_dims(tl.load(ptr + offs_m.to(tl.int64) * stride_m, mask=m_ok, other=1.0), 1)
    else:
        descale = tl.load(ptr)
    return descale


# What a growing cache changes as it grows is not specialised on (Triton compiles a kernel per
# class of an integer argument: 1, a multiple of 16, other), so that a decode loop compiles
# nothing once warm: the merge switch, the split count and blocks per split, and the partial
# log-sum-exps' strides (rows x NUM_SPLITS). (The partial outputs' strides are multiples of Dv:
# one class while Dv is a multiple of 16.) Nor the queries' length and the row-block count: they
# bound masks and a grid whose code does not depend on their class (sm_90: the same instructions
# a step), and calls of changing lengths would compile a kernel for each combination of classes.
# Lk stays: a multiple of 16 lets the masked steps compare keys 16 at a time and load the
# attention mask's tiles vectorised along it. (The backward kernels stay specialised: without
# it, Lq, the dK/dV loop's length, made their masked steps longer.)
@triton.jit(do_not_specialize=["kernel_merge", "NUM_SPLITS", "BLOCKS_PER_SPLIT", "stride_lz", "stride_lh",
                               "stride_lm", "Lq", "M_BLOCKS"])
def _attn_fwd(
    Q, K, V, O, LSE, MASK, SEED, SINK, SLOPES, SHIFTS, ROW_LO, ROW_HI, OUT, LSE_OUT, COUNTS, Q_DESCALE, K_DESCALE,
    V_DESCALE,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_os, stride_od,
    stride_mz, stride_mh, stride_mm, stride_mn,
    stride_sz, stride_sh, stride_sm, stride_az, stride_ah, stride_am, stride_as,
    stride_lz, stride_lh, stride_lm, stride_ls,
    stride_qdz, stride_qdh, stride_qdm, stride_kdz, stride_kdh, stride_kdm, stride_vdz, stride_vdh, stride_vdm,
    H, GROUP, Lq, Lk, scale, M_BLOCKS, NUM_SPLITS, BLOCKS_PER_SPLIT, dropout_p, dropout_scale, band_lo, band_hi,
    softcap, kernel_merge,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, WITH_LSE: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, SINKS: tl.constexpr, RESUME: tl.constexpr,
    MERGE_LSE: tl.constexpr, ALIBI: tl.constexpr, DESCALE: tl.constexpr, WIDEN_K: tl.constexpr,
    WIDEN_V: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head), against the key
    blocks of one split (all of them unless SPLIT).

    SPLIT: O is the float32 partial-output buffer (B, H, Lq, NUM_SPLITS, Dv)
    and LSE (B, H, Lq, NUM_SPLITS) its log-sum-exps, which the last of a row block's
    programs to finish merges into OUT (B, H, Lq, Dv) and, MERGE_LSE, LSE_OUT (B, H,
    Lq), both contiguous; COUNTS (int32, one per program along grid axis 0, zero
    between launches) counts the finished splits.
    DROPOUT: SEED holds the mask's seed (int64); kept probabilities are scaled
    by dropout_scale = 1 / (1 - dropout_p). The log-sum-exp is dropout's input's.
    SINKS: SINK (B, H, Lq; strides) holds each row's sink logit, which joins the
    softmax of the split that starts at the first key (m_i = sink, l_i = 1).
    RESUME: O (float32) and LSE hold a running output and log-sum-exp (a ring's,
    over other keys), which these keys are folded into, in place: the running
    output is the state acc = O, m_i = LSE (base 2), l_i = 1; a row at -inf has
    seen no key yet and starts afresh.
    DESCALE: FP8 inputs; Q_DESCALE, K_DESCALE, V_DESCALE (B, H_kv; strides) hold each K/V
    head's descales: the scores' scale takes the first two, the output the third. DESCALE ==
    DESCALE_ROWS: they are (B, H, Lq), each query head's and row's (packed sequences: a row's
    keys are its own sequence's, so its sequence's descales scale all of its scores).
    """
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_DV >= HEAD_DIM_V)
    # One grid axis for (batch·head, row block): CUDA caps axes 1 and 2 at 65535. Row
    # blocks go last to first: the GPU starts programs in grid order, and a causal row
    # block's work grows with its index, so the longest start first and the last wave
    # holds short ones (the tail where SMs sit idle).
    start_m = M_BLOCKS - 1 - tl.program_id(0) % M_BLOCKS
    off_hz = tl.program_id(0) // M_BLOCKS
    split = tl.program_id(1)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_h_kv = off_h // GROUP  # grouped-query attention: GROUP query heads share one K/V head

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq

    mask_ptrs = (MASK + off_z * stride_mz + off_h * stride_mh + offs_m.to(tl.int64)[:, None] * stride_mm
                 + offs_n.to(tl.int64)[None, :] * stride_mn)
    q_ptrs = (Q + off_z * stride_qz + off_h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    k_ptrs = (K + off_z * stride_kz + off_h_kv * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kn
              + offs_d[None, :] * stride_kd)
    v_ptrs = (V + off_z * stride_vz + off_h_kv * stride_vh + offs_n.to(tl.int64)[:, None] * stride_vn
              + offs_dv[None, :] * stride_vd)
    score_scale = scale
    out_scale = 1.0
    if DESCALE:  # real values are the stored ones times their descales (loaded once)
        head = off_h if DESCALE == DESCALE_ROWS else off_h_kv
        q_descale = _descale(Q_DESCALE + off_z * stride_qdz + head * stride_qdh, offs_m, m_ok, stride_qdm, DESCALE)
        k_descale = _descale(K_DESCALE + off_z * stride_kdz + head * stride_kdh, offs_m, m_ok, stride_kdm, DESCALE)
        score_scale = scale * q_descale * k_descale
        out_scale = _descale(V_DESCALE + off_z * stride_vdz + head * stride_vdh, offs_m, m_ok, stride_vdm, DESCALE)
        q, score_scale = _narrow_query(q, score_scale, WIDEN_K)  # (a bfloat16 query on float16-widened keys)
    qk_scale = score_scale * LOG2E  # softmax in base 2: exp(x) = exp2(x * log2(e))
    cap_in, cap_out = _cap_factors(score_scale, softcap, SOFTCAP)
    alibi, alibi_shift = _alibi_rows(SLOPES + off_z * stride_az + off_h * stride_ah, SHIFTS, stride_am, stride_as,
                                     offs_m, m_ok, ALIBI, False)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo = split * BLOCKS_PER_SPLIT
    if SINKS:  # a logit with no value: it starts the online softmax, once per row
        sink = tl.load(SINK + off_z * stride_sz + off_h * stride_sh + offs_m.to(tl.int64) * stride_sm, mask=m_ok,
                       other=0.0)
        m_i = tl.where(lo == 0, sink * LOG2E, m_i)
        l_i = tl.where(lo == 0, 1.0, l_i)
    lse_ptrs = LSE + off_z * stride_lz + off_h * stride_lh + offs_m.to(tl.int64) * stride_lm + split * stride_ls
    o_ptrs = (O + off_z * stride_oz + off_h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om + split * stride_os
              + offs_dv[None, :] * stride_od)
    if RESUME:
        lse_run = tl.load(lse_ptrs, mask=m_ok, other=float("-inf"))
        seen = lse_run != float("-inf")
        m_i = tl.where(seen, lse_run * LOG2E, m_i)
        l_i = tl.where(seen, 1.0, l_i)
        o_run = tl.load(o_ptrs, mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        acc = tl.where(seen[:, None], o_run, acc)

    # In key blocks of this split's [lo, lo + BLOCKS_PER_SPLIT): the band's left edge
    # [first, full_lo) (masked; BANDED only), the blocks every row sees whole
    # [full_lo, full_hi) (unmasked), then the band's right edge (the causal diagonal)
    # and the ragged end of the keys [full_hi, end) (masked).
    row_lo, row_hi = _row_band(ROW_LO, ROW_HI, offs_m, m_ok, band_lo, band_hi, BANDED)
    first, full_lo, full_hi, end = _key_stages(offs_m, lo, lo + BLOCKS_PER_SPLIT, Lk, row_lo, row_hi, BLOCK_N,
                                               BANDED)
    if BANDED:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
            offs_m, offs_n, offs_d, offs_dv, first, full_lo, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
            alibi, alibi_shift, seed, off_hz, dropout_p, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED,
            MASK_KIND, True, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, False, WIDEN_K,
            WIDEN_V,
        )
    fast_hi = full_hi
    if DESCALE:
        # A descale's sign is the GPU's: where not every row's scale is positive, the whole blocks
        # take their maxima from the scaled scores, in a loop of their own after these (not
        # pipelined: the rare case); otherwise that loop is empty. (Bounds, not a branch: loops
        # under a branch had ptxas serialise the MMAs.)
        fast_hi = tl.where(_sign_unknown(score_scale, DESCALE == DESCALE_ROWS), full_lo, full_hi)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
        offs_m, offs_n, offs_d, offs_dv, full_lo, fast_hi, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
        alibi, alibi_shift, seed, off_hz, dropout_p, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED,
        MASK_KIND, False, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, False, WIDEN_K,
        WIDEN_V,
    )
    if DESCALE:
        acc, l_i, m_i = _attn_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
            offs_m, offs_n, offs_d, offs_dv, fast_hi, full_hi, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
            alibi, alibi_shift, seed, off_hz, dropout_p, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED,
            MASK_KIND, False, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, True, WIDEN_K,
            WIDEN_V,
        )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
        offs_m, offs_n, offs_d, offs_dv, full_hi, end, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
        alibi, alibi_shift, seed, off_hz, dropout_p, HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED,
        MASK_KIND, True, NEGATIVE_SCALE, DOT_PRECISION, SPLIT, DROPOUT, SOFTCAP, ALIBI, DESCALE, False, WIDEN_K,
        WIDEN_V,
    )

    if WITH_LSE:
        # Log-sum-exp of the scaled scores, from base 2 back to natural log;
        # -inf for a row whose every key is masked out (m_i = -inf, l_i = 0).
        lse = (m_i + tl.math.log2(l_i)) * LN2
        tl.store(lse_ptrs, lse, mask=m_ok)
    if MASK_KIND != NO_MASK or SPLIT or BANDED or RESUME:
        # A row whose every key is masked out (a mask, a band that leaves it no
        # key, or a split none of whose keys it sees; resumed, no key so far)
        # has acc = 0 and l_i = 0: SDPA returns 0.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    if DROPOUT:
        o = o * dropout_scale
    if DESCALE:
        o = o * out_scale
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    if SPLIT:
        if kernel_merge != 0:  # (otherwise _merge_kernel's launch merges them; a runtime switch: one kernel)
            _last_split_merges(COUNTS, O, LSE, OUT, LSE_OUT, off_hz.to(tl.int64) * Lq + offs_m, m_ok, NUM_SPLITS,
                               HEAD_DIM_V, BLOCK_M, BLOCK_DV, MERGE_LSE)


@triton.jit
def _last_split_merges(
    COUNTS, O_PART, LSE_PART, O, LSE, offs_r, r_ok, NUM_SPLITS,
    HEAD_DIM_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, WITH_LSE: tl.constexpr,
):
    """Called by every split program of a row block (grid axis 0) after storing its partials:
    the last of the NUM_SPLITS to get here merges them all (:func:`_merge_splits`), with no
    second launch. Every program's partials are stored before its ticket: the barrier orders
    its threads' stores before the ticket, the acq_rel atomic publishes them to (and the last
    one acquires them from) the other programs; the merge reads past L1. The last one sets
    the counter back to 0 for the next launch."""
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTS + tl.program_id(0), 1, sem="acq_rel")
    if ticket == NUM_SPLITS - 1:
        _merge_splits(O_PART, LSE_PART, O, LSE, offs_r, r_ok, NUM_SPLITS, HEAD_DIM_V, BLOCK_R, BLOCK_DV, WITH_LSE)
        tl.atomic_xchg(COUNTS + tl.program_id(0), 0)


@triton.jit
def _store_merged(O, LSE, o, l, m, offs_r, r_ok, offs_dv, dv_ok, HEAD_DIM_V: tl.constexpr, WITH_LSE: tl.constexpr):
    """The end of both merges (:func:`_merge_splits`, :func:`_merge_kernel`): rows offs_r of O
    (R, Dv) = o / l and, WITH_LSE, of LSE (R,) = m + log(l); l = 0 (no key at all) gives 0 and
    -inf, not NaN."""
    o = o / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(O + offs_r[:, None] * HEAD_DIM_V + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=r_ok[:, None] & dv_ok[None, :])
    if WITH_LSE:  # log(0) = -inf: no key at all
        tl.store(LSE + offs_r, tl.where(m == float("-inf"), 0.0, m) + tl.log(l), mask=r_ok)


@triton.jit
def _merge_splits(
    O_PART, LSE_PART, O, LSE, offs_r, r_ok, NUM_SPLITS,
    HEAD_DIM_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, WITH_LSE: tl.constexpr,
):
    """Merge the splits of rows offs_r (BLOCK_R of them, int64; r_ok: real): O_PART
    (R, NUM_SPLITS, Dv) float32 and LSE_PART (R, NUM_SPLITS) into O (R, Dv) and,
    WITH_LSE, LSE (R,); all contiguous.

    o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max_s lse_s), one split at a
    time as an online softmax over the splits (registers for one (BLOCK_R, Dv) tile,
    and no tile size that depends on the number of splits: a decode loop whose splits
    grow compiles nothing new); a split whose rows saw no key has lse_s = -inf and
    weighs 0. Loads bypass L1 (.cg): other SMs' programs of the same launch wrote the
    partials.
    """
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < HEAD_DIM_V
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)  # noqa: E741
    o = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse_s = tl.load(LSE_PART + offs_r * NUM_SPLITS + s, mask=r_ok, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(O_PART + (offs_r * NUM_SPLITS + s)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                      mask=r_ok[:, None] & dv_ok[None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse_s)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a key yet: weights 0, not NaN
        alpha = tl.exp(m - m_sub)
        w = tl.exp(lse_s - m_sub)
        l = l * alpha + w  # noqa: E741
        o = o * alpha[:, None] + w[:, None] * o_s
        m = m_new
    _store_merged(O, LSE, o, l, m, offs_r, r_ok, offs_dv, dv_ok, HEAD_DIM_V, WITH_LSE)


@triton.jit(do_not_specialize=["NUM_SPLITS"])  # (a growing cache changes it: no recompile)
def _merge_kernel(
    O_PART, LSE_PART, O, LSE, R, NUM_SPLITS,
    HEAD_DIM_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """The split merge as a launch of its own, where one program's fold would take long
    (``impl_triton.attention.kernel_merges``): O_PART (R, NUM_SPLITS, Dv) float32 and LSE_PART
    (R, NUM_SPLITS) into O (R, Dv) and, WITH_LSE, LSE (R,); all contiguous. One program per
    BLOCK_R rows, BLOCK_S splits a step (the plan's fixed step, as NineToothed's combine: no
    split count compiles a kernel of its own), folded as an online softmax: o = sum_s w_s o_s
    / sum_s w_s, w_s = exp(lse_s - max_s lse_s); a split whose rows saw no key has lse_s =
    -inf and weighs 0."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)
    r_ok = offs_r < R
    dv_ok = offs_dv < HEAD_DIM_V
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)  # noqa: E741
    o = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        rs = offs_r[:, None] * NUM_SPLITS + offs_s[None, :]
        rs_ok = r_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
        lse_part = tl.load(LSE_PART + rs, mask=rs_ok, other=float("-inf"))
        o_part = tl.load(O_PART + rs[:, :, None] * HEAD_DIM_V + offs_dv[None, None, :],
                         mask=rs_ok[:, :, None] & dv_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m, tl.max(lse_part, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split with a key yet: weights 0, not NaN
        alpha = tl.exp(m - m_sub)
        w = tl.exp(lse_part - m_sub[:, None])
        l = l * alpha + tl.sum(w, 1)  # noqa: E741
        o = o * alpha[:, None] + tl.sum(w[:, :, None] * o_part, 1)
        m = m_new
    _store_merged(O, LSE, o, l, m, offs_r, r_ok, offs_dv, dv_ok, HEAD_DIM_V, WITH_LSE)


@triton.jit
def _copy_values(
    SRC, DST,
    stride_sb, stride_sh, stride_sl, stride_sd,
    stride_db, stride_dh, stride_dl, stride_dd,
    H, L, D,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, PV_ORDER: tl.constexpr,
):
    """DST[b, h, l, d] = SRC[b, h, l, d] over (B, H, L, D), a (BLOCK_L, BLOCK_D) tile a program
    (BLOCK_D >= D): FP8 values copied column-major (DST's l stride 1) for the e4m3 P·V product;
    PV_ORDER (L and BLOCK_L multiples of 32): DST's row pv_position(l) (``common.plan``).
    The load is coalesced along SRC's unit stride, the store along DST's; the compiler moves the
    tile between the two layouts through shared memory, where a strided copy of bytes would
    write one byte a row. The (batch·head, block) pair is the grid's one axis."""
    l_blocks = tl.cdiv(L, BLOCK_L)
    pid = tl.program_id(0)
    off_hz = pid // l_blocks
    off_z = off_hz // H
    off_h = off_hz % H
    offs_l = (pid % l_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_l[:, None] < L) & (offs_d[None, :] < D)
    src = SRC + off_z.to(tl.int64) * stride_sb + off_h.to(tl.int64) * stride_sh
    dst = DST + off_z.to(tl.int64) * stride_db + off_h.to(tl.int64) * stride_dh
    tile = tl.load(src + offs_l.to(tl.int64)[:, None] * stride_sl + offs_d[None, :] * stride_sd, mask=ok)
    if PV_ORDER:  # (whole groups of 32 in the tile: L is a multiple of 32, the tile's rows too)
        tile = _pv_rows(tile)
    tl.store(dst + offs_l.to(tl.int64)[:, None] * stride_dl + offs_d[None, :] * stride_dd, tile, mask=ok)


# -- backward ---------------------------------------------------------------------------

@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, m2, delta,
    k_ptrs, v_ptrs, mask_ptrs,
    stride_kn, stride_vn, stride_mn,
    offs_m, offs_n, offs_d, offs_dv, lo, hi, Lq, Lk, band_lo, band_hi, qk_scale, cap_in, cap_out,
    alibi, alibi_shift, seed, off_hz, dropout_p, dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """Add key blocks [lo, hi) to dq (unscaled). MASKED as in _attn_fwd_inner.
    DROPOUT: dp reaches only the kept probabilities, scaled as in the forward.
    SOFTCAP: ds passes through the cap's derivative, 1 - tanh^2."""
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for j in range(lo, hi):
        start_n = tl.multiple_of(j * BLOCK_N, BLOCK_N)
        offs_kn = start_n + offs_n
        key_ok = offs_kn < Lk
        k = _load_tile(k_ptrs + start_n.to(tl.int64) * stride_kn, key_ok, d_ok, MASKED, BLOCK_D != HEAD_DIM)
        v = _load_tile(v_ptrs + start_n.to(tl.int64) * stride_vn, key_ok, dv_ok, MASKED, BLOCK_DV != HEAD_DIM_V)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP or ALIBI:
            qk, cap = _scores(qk, offs_m, offs_kn, qk_scale, cap_in, cap_out, alibi, alibi_shift, SOFTCAP, ALIBI)
            if MASKED:
                valid = key_ok[None, :]
                if BANDED:
                    valid = valid & _in_band(offs_m, offs_kn, band_lo, band_hi)
                qk = tl.where(valid, qk, float("-inf"))
            if MASK_KIND != NO_MASK:
                mask_ok = (offs_m[:, None] < Lq) & key_ok[None, :]
                mask = tl.load(mask_ptrs + start_n.to(tl.int64) * stride_mn, mask=mask_ok, other=0)
                if MASK_KIND == BOOL_MASK:
                    qk = tl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(tl.float32) * LOG2E
            p = tl.math.exp2(qk - m2[:, None])
        else:
            p = tl.math.exp2(qk * qk_scale - m2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        if DROPOUT:
            keep = _dropout_keep(seed, off_hz, offs_m, offs_kn, dropout_p)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - cap * cap)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, O, DO, LSE, DLSE, DELTA, DQ, MASK, SEED, SLOPES, SHIFTS, ROW_LO, ROW_HI,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_lz, stride_lh, stride_lm,
    stride_dlz, stride_dlh, stride_dlm,
    stride_mz, stride_mh, stride_mm, stride_mn, stride_az, stride_ah, stride_am, stride_as,
    H, GROUP, Lq, Lk, scale, M_BLOCKS, dropout_p, dropout_scale, band_lo, band_hi, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, WITH_DLSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """One program: dq of BLOCK_M query rows of one (batch, head), and their
    delta = rowsum(do * o) - dlse, stored to DELTA (B, H, Lq) for _attn_bwd_dkdv."""
    start_m = M_BLOCKS - 1 - tl.program_id(0) % M_BLOCKS  # one grid axis, longest first, as in the forward
    off_hz = tl.program_id(0) // M_BLOCKS
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_h_kv = off_h // GROUP

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V

    q_ptrs = (Q + off_z * stride_qz + off_h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    o_ptrs = (O + off_z * stride_oz + off_h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_om
              + offs_dv[None, :] * stride_od)
    do_ptrs = (DO + off_z * stride_doz + off_h * stride_doh + offs_m.to(tl.int64)[:, None] * stride_dom
               + offs_dv[None, :] * stride_dod)
    k_ptrs = (K + off_z * stride_kz + off_h_kv * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kn
              + offs_d[None, :] * stride_kd)
    v_ptrs = (V + off_z * stride_vz + off_h_kv * stride_vh + offs_n.to(tl.int64)[:, None] * stride_vn
              + offs_dv[None, :] * stride_vd)
    mask_ptrs = (MASK + off_z * stride_mz + off_h * stride_mh + offs_m.to(tl.int64)[:, None] * stride_mm
                 + offs_n.to(tl.int64)[None, :] * stride_mn)

    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_ptrs, mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
    o = tl.load(o_ptrs, mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if WITH_DLSE:
        delta -= tl.load(DLSE + off_z * stride_dlz + off_h * stride_dlh + offs_m.to(tl.int64) * stride_dlm,
                         mask=m_ok, other=0.0)
    tl.store(DELTA + off_hz.to(tl.int64) * Lq + offs_m, delta, mask=m_ok)
    lse = tl.load(LSE + off_z * stride_lz + off_h * stride_lh + offs_m.to(tl.int64) * stride_lm,
                  mask=m_ok, other=float("inf"))
    # p = exp2(s * log2(e) - m2); a row with no visible key (lse = -inf) gets
    # m2 = +inf, so its p is 0 (SDPA's math backend: zero gradient).
    m2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    qk_scale = scale * LOG2E
    cap_in, cap_out = _cap_factors(scale, softcap, SOFTCAP)
    alibi, alibi_shift = _alibi_rows(SLOPES + off_z * stride_az + off_h * stride_ah, SHIFTS, stride_am, stride_as,
                                     offs_m, m_ok, ALIBI, False)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # In key blocks, as in the forward: the band's left edge [first, full_lo)
    # (masked), the blocks every row sees whole, then the band's right edge and
    # the ragged end of the keys (masked).
    row_lo, row_hi = _row_band(ROW_LO, ROW_HI, offs_m, m_ok, band_lo, band_hi, BANDED)
    first, full_lo, full_hi, end = _key_stages(offs_m, 0, tl.cdiv(Lk, BLOCK_N), Lk, row_lo, row_hi, BLOCK_N,
                                               BANDED)
    if BANDED:
        dq = _attn_bwd_dq_inner(
            dq, q, do, m2, delta, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
            offs_m, offs_n, offs_d, offs_dv, first, full_lo, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
            alibi, alibi_shift, seed, off_hz, dropout_p, dropout_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT,
            SOFTCAP, ALIBI,
        )
    dq = _attn_bwd_dq_inner(
        dq, q, do, m2, delta, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
        offs_m, offs_n, offs_d, offs_dv, full_lo, full_hi, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
        alibi, alibi_shift, seed, off_hz, dropout_p, dropout_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED, MASK_KIND, False, DOT_PRECISION, DROPOUT,
        SOFTCAP, ALIBI,
    )
    dq = _attn_bwd_dq_inner(
        dq, q, do, m2, delta, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
        offs_m, offs_n, offs_d, offs_dv, full_hi, end, Lq, Lk, row_lo, row_hi, qk_scale, cap_in, cap_out,
        alibi, alibi_shift, seed, off_hz, dropout_p, dropout_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT,
        SOFTCAP, ALIBI,
    )
    dq = dq * scale
    dq_ptrs = DQ + (off_hz.to(tl.int64) * Lq + offs_m[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v,
    q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, mask_ptrs, row_lo_ptr, row_hi_ptr,
    stride_qm, stride_dom, stride_lm, stride_mm,
    offs_m, offs_kn, offs_d, offs_dv, lo, hi, Lq, Lk, band_lo, band_hi, qk_scale, cap_in, cap_out,
    slope_ptr, shift_ptr, stride_am, stride_as, seed, head, dropout_p, dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """Add query blocks [lo, hi) of one query head to (dk, dv) (dk unscaled).

    Works on transposed scores (keys x rows), so that dv = p^T do and
    dk = ds^T q are plain products. MASKED: the blocks may hold rows past Lq
    or, when BANDED, rows whose band misses some of these keys; mask them. DROPOUT: the forward's
    mask, regenerated transposed (``head`` = batch·heads + query head).
    """
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    key_ok = offs_kn < Lk
    for i in range(lo, hi):
        start_m = tl.multiple_of(i * BLOCK_M, BLOCK_M)
        offs_qm = start_m + offs_m
        m_ok = offs_qm < Lq
        q = _load_tile(q_ptrs + start_m.to(tl.int64) * stride_qm, m_ok, d_ok, MASKED, BLOCK_D != HEAD_DIM)
        if MASKED:
            lse = tl.load(lse_ptrs + start_m.to(tl.int64) * stride_lm, mask=m_ok, other=float("inf"))
        else:
            lse = tl.load(lse_ptrs + start_m.to(tl.int64) * stride_lm)
        m2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != NO_MASK or SOFTCAP or ALIBI:
            # (keys x rows: ALiBi's |j - pos_i| = |pos_i - j|, the rows' slopes a (1, M) row)
            alibi, alibi_shift = _alibi_rows(slope_ptr, shift_ptr, stride_am, stride_as, offs_qm, m_ok, ALIBI, True)
            qkT, capT = _scores(qkT, offs_kn, offs_qm + alibi_shift, qk_scale, cap_in, cap_out, alibi, 0, SOFTCAP,
                                ALIBI)
            if MASKED and BANDED:
                row_lo, row_hi = _row_band(row_lo_ptr, row_hi_ptr, offs_qm, m_ok, band_lo, band_hi, BANDED)
                qkT = tl.where(tl.trans(_in_band(offs_qm, offs_kn, row_lo, row_hi)), qkT, float("-inf"))
            if MASK_KIND != NO_MASK:
                mask = tl.load(mask_ptrs + start_m.to(tl.int64) * stride_mm,
                               mask=key_ok[:, None] & m_ok[None, :], other=0)
                if MASK_KIND == BOOL_MASK:
                    qkT = tl.where(mask, qkT, float("-inf"))
                else:
                    qkT = qkT + mask.to(tl.float32) * LOG2E
            pT = tl.math.exp2(qkT - m2[None, :])
        else:
            pT = tl.math.exp2(qkT * qk_scale - m2[None, :])
        do = _load_tile(do_ptrs + start_m.to(tl.int64) * stride_dom, m_ok, dv_ok, MASKED, BLOCK_DV != HEAD_DIM_V)
        if MASKED:
            delta = tl.load(delta_ptrs + start_m, mask=m_ok, other=0.0)
        else:
            delta = tl.load(delta_ptrs + start_m)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keepT = tl.trans(_dropout_keep(seed, head, offs_qm, offs_kn, dropout_p))
            dv = tl.dot(tl.where(keepT, pT * dropout_scale, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - capT * capT)
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, MASK, SEED, SLOPES, SHIFTS, ROW_LO, ROW_HI, KEY_LO, KEY_HI,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_lz, stride_lh, stride_lm,
    stride_mz, stride_mh, stride_mm, stride_mn, stride_az, stride_ah, stride_am, stride_as,
    H_KV, GROUP, Lq, Lk, scale, N_BLOCKS, dropout_p, dropout_scale, band_lo, band_hi, softcap,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BANDED: tl.constexpr, MASK_KIND: tl.constexpr, DOT_PRECISION: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
):
    """One program: dk and dv of BLOCK_N keys of one (batch, K/V head), summed
    over the GROUP query heads that read them."""
    # One grid axis, as in the forward; first to last, which is already longest first
    # (a causal key block is seen by the row blocks from its own on).
    start_n = tl.program_id(0) % N_BLOCKS
    off_hz = tl.program_id(0) // N_BLOCKS
    off_z = (off_hz // H_KV).to(tl.int64)
    off_h_kv = (off_hz % H_KV).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_kn = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_kn < Lk
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V

    k = tl.load(K + off_z * stride_kz + off_h_kv * stride_kh + offs_kn.to(tl.int64)[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + off_z * stride_vz + off_h_kv * stride_vh + offs_kn.to(tl.int64)[:, None] * stride_vn
                + offs_dv[None, :] * stride_vd, mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
    qk_scale = scale * LOG2E
    cap_in, cap_out = _cap_factors(scale, softcap, SOFTCAP)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # In query blocks: the rows on the band's right edge (the causal diagonal)
    # [lo, full_lo) (masked), the rows that see every key here [full_lo, full_hi)
    # (unmasked), the rows on the band's left edge and the ragged end of the rows
    # [full_hi, hi) (masked). Row i sees key j iff j - band_hi <= i <= j - band_lo
    # (ROW_BANDS: iff j + key_lo_j <= i <= j + key_hi_j): _key_stages with rows
    # and keys swapped. Keys past Lk need no mask here: their rows of dk and dv
    # are not stored.
    key_lo, key_hi = _row_band(KEY_LO, KEY_HI, offs_kn, key_ok, -band_hi, -band_lo, BANDED)
    lo, full_lo, full_hi, hi = _key_stages(offs_kn, 0, tl.cdiv(Lq, BLOCK_M), Lq, key_lo, key_hi, BLOCK_M, BANDED)
    for g in range(GROUP):
        off_h = off_h_kv * GROUP + g
        q_ptrs = (Q + off_z * stride_qz + off_h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qm
                  + offs_d[None, :] * stride_qd)
        do_ptrs = (DO + off_z * stride_doz + off_h * stride_doh + offs_m.to(tl.int64)[:, None] * stride_dom
                   + offs_dv[None, :] * stride_dod)
        lse_ptrs = LSE + off_z * stride_lz + off_h * stride_lh + offs_m.to(tl.int64) * stride_lm
        head = off_z * H_KV * GROUP + off_h  # in (B·H): the rows of DELTA, the dropout mask's head
        slope_ptr = SLOPES + off_z * stride_az + off_h * stride_ah  # (query head g's; by row block in the loop)
        delta_ptrs = DELTA + head * Lq + offs_m
        mask_ptrs = (MASK + off_z * stride_mz + off_h * stride_mh + offs_m.to(tl.int64)[None, :] * stride_mm
                     + offs_kn.to(tl.int64)[:, None] * stride_mn)
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, mask_ptrs, ROW_LO, ROW_HI,
            stride_qm, stride_dom, stride_lm, stride_mm,
            offs_m, offs_kn, offs_d, offs_dv, lo, full_lo, Lq, Lk, band_lo, band_hi, qk_scale, cap_in, cap_out,
            slope_ptr, SHIFTS, stride_am, stride_as, seed, head, dropout_p, dropout_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT,
            SOFTCAP, ALIBI,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, mask_ptrs, ROW_LO, ROW_HI,
            stride_qm, stride_dom, stride_lm, stride_mm,
            offs_m, offs_kn, offs_d, offs_dv, full_lo, full_hi, Lq, Lk, band_lo, band_hi, qk_scale, cap_in, cap_out,
            slope_ptr, SHIFTS, stride_am, stride_as, seed, head, dropout_p, dropout_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, BANDED, MASK_KIND, False, DOT_PRECISION, DROPOUT,
            SOFTCAP, ALIBI,
        )
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, mask_ptrs, ROW_LO, ROW_HI,
            stride_qm, stride_dom, stride_lm, stride_mm,
            offs_m, offs_kn, offs_d, offs_dv, full_hi, hi, Lq, Lk, band_lo, band_hi, qk_scale, cap_in, cap_out,
            slope_ptr, SHIFTS, stride_am, stride_as, seed, head, dropout_p, dropout_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_D, BLOCK_DV, BANDED, MASK_KIND, True, DOT_PRECISION, DROPOUT,
            SOFTCAP, ALIBI,
        )
    dk = dk * scale
    rows = off_hz.to(tl.int64) * Lk + offs_kn[:, None]
    tl.store(DK + rows * HEAD_DIM + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=key_ok[:, None] & d_ok[None, :])
    tl.store(DV + rows * HEAD_DIM_V + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None] & dv_ok[None, :])


# -- the one-pass backward's launches before and after (impl_triton.gluon_backward.backward_fused) ----------

@triton.jit
def _one_pass_prologue(
    O, DO, DLSE, DELTA, DQ_SUM,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dlz, stride_dlh, stride_dlm,
    H, Lq, M_BLOCKS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, WITH_DLSE: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). delta = rowsum(do * o) - dlse into DELTA
    ((B·H, Lq) float32), and the rows' float32 dQ sum (DQ_SUM, contiguous (B, H, Lq, HEAD_DIM)) zeroed,
    which the one pass's key blocks then add into, from one read of O and dO."""
    start_m = tl.program_id(0) % M_BLOCKS
    off_hz = tl.program_id(0) // M_BLOCKS
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    tile_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(O + off_z * stride_oz + off_h * stride_oh + rows * stride_om + offs_d[None, :] * stride_od,
                mask=tile_ok, other=0.0)
    do = tl.load(DO + off_z * stride_doz + off_h * stride_doh + rows * stride_dom + offs_d[None, :] * stride_dod,
                 mask=tile_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if WITH_DLSE:
        delta -= tl.load(DLSE + off_z * stride_dlz + off_h * stride_dlh + offs_m.to(tl.int64) * stride_dlm,
                         mask=m_ok, other=0.0)
    tl.store(DELTA + off_hz.to(tl.int64) * Lq + offs_m, delta, mask=m_ok)
    tl.store(DQ_SUM + (off_hz.to(tl.int64) * Lq + rows) * HEAD_DIM + offs_d[None, :],
             tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=tile_ok)


@triton.jit
def _one_pass_epilogue(
    DQ_SUM, DQ, scale,
    Lq, M_BLOCKS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M rows of one (batch, head)'s float32 dQ sum (DQ_SUM, contiguous (B, H, Lq,
    HEAD_DIM)) times ``scale``, rounded once into DQ (contiguous, the inputs' dtype)."""
    start_m = tl.program_id(0) % M_BLOCKS
    off_hz = tl.program_id(0) // M_BLOCKS
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tile_ok = (offs_m < Lq)[:, None] & (offs_d < HEAD_DIM)[None, :]
    at = (off_hz.to(tl.int64) * Lq + offs_m.to(tl.int64)[:, None]) * HEAD_DIM + offs_d[None, :]
    dq = tl.load(DQ_SUM + at, mask=tile_ok, other=0.0) * scale
    tl.store(DQ + at, dq.to(DQ.dtype.element_ty), mask=tile_ok)
