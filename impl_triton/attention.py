"""Scaled-dot-product attention forward, as a hand-written Triton kernel.

Algorithm: FlashAttention-2. Each program owns one block of BLOCK_M query rows
of one (batch, head), keeps it on chip, and streams the keys and values in
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
  wholly above the diagonal.
- Causal masking is SDPA's top-left alignment, ``ones(Lq, Lk).tril(0)``: query
  row i sees keys 0..i, also when Lq != Lk.
- Grouped-query attention reads key/value head ``h // (H // H_kv)``: no copies.
- An optional ``attn_mask`` (boolean: True takes part; or additive) is read
  through its strides, so a broadcast mask costs no memory. A row whose every
  key is masked out gives 0, as SDPA's math backend does.
- The log-sum-exp of each row's scaled, masked scores (natural log) can be
  written out, for merging partial results.
- Short queries (decoding): the keys can be split across programs (grid axis
  2, BLOCKS_PER_SPLIT key blocks each); each program writes a float32 partial
  output and its log-sum-exp, and ``_attn_combine`` merges them. When and how
  much to split is ``common.splitkv``'s decision, shared with NineToothed.

Every tensor is read through its strides: transposed views need no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.configs import ConfigTable, next_power_of_2, padded_head_dim
from common.interpret import apply_interpreter_fixes
from common.launch import CachedLauncher
from common.outputs import new_output
from common.splitkv import combine_rows, plan_splits

# attn_mask kinds (the kernel's MASK_KIND)
NO_MASK, BOOL_MASK, ADDITIVE_MASK = 0, 1, 2

CONFIGS = ConfigTable.load(__name__)


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, mask_ptrs,
    stride_kn, stride_vn, stride_mn,
    offs_m, offs_n, offs_d, offs_dv, lo, hi, Lq, Lk, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i).

    MASKED: the blocks may hold keys past Lk or, when causal, above the
    diagonal; mask them. Unmasked blocks skip every comparison.
    """
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_kn = start_n + offs_n
        key_ok = offs_kn < Lk
        if MASKED:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs + start_n * stride_kn, mask=d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs + start_n * stride_kn)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != 0:
            qk = qk * qk_scale
            if MASKED:
                valid = key_ok[None, :]
                if IS_CAUSAL:
                    valid = valid & (offs_m[:, None] >= offs_kn[None, :])
                qk = tl.where(valid, qk, float("-inf"))
            if MASK_KIND != 0:
                mask_ok = (offs_m[:, None] < Lq) & key_ok[None, :]
                mask = tl.load(mask_ptrs + start_n * stride_mn, mask=mask_ok, other=0)
                if MASK_KIND == 1:
                    qk = tl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(tl.float32) * 1.4426950408889634
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            if MASK_KIND != 0 or SPLIT:
                # A row with no visible key yet has m_ij = -inf (a mask, or a
                # split that starts past a causal row's last key); subtract 0
                # instead so that its p and alpha are 0, not NaN.
                m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            else:
                m_sub = m_ij
            qk = qk - m_sub[:, None]
        else:
            # No mask: scale and subtract the maximum in one FMA per score. The
            # row maximum of qk * qk_scale is max(qk) * qk_scale, or min(qk) *
            # qk_scale for a negative scale.
            if NEGATIVE_SCALE:
                m_ij = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            qk = qk * qk_scale - m_sub[:, None]
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs + start_n * stride_vn, mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        elif BLOCK_DV != HEAD_DIM_V:
            v = tl.load(v_ptrs + start_n * stride_vn, mask=dv_ok[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs + start_n * stride_vn)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, MASK,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_os, stride_od,
    stride_mz, stride_mh, stride_mm, stride_mn,
    H, GROUP, Lq, Lk, scale, NUM_SPLITS, BLOCKS_PER_SPLIT,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, WITH_LSE: tl.constexpr,
    NEGATIVE_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head), against the key
    blocks of one split (all of them unless SPLIT).

    SPLIT: O is the float32 partial-output buffer (B, H, Lq, NUM_SPLITS, Dv)
    and LSE (B, H, Lq, NUM_SPLITS) its log-sum-exps, merged by _attn_combine.
    """
    tl.static_assert(BLOCK_D >= HEAD_DIM)
    tl.static_assert(BLOCK_DV >= HEAD_DIM_V)
    start_m = tl.program_id(0)
    off_hz = tl.program_id(1)
    split = tl.program_id(2)
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_h_kv = off_h // GROUP  # grouped-query attention: GROUP query heads share one K/V head

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Lq

    q_ptrs = Q + off_z * stride_qz + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    k_ptrs = K + off_z * stride_kz + off_h_kv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = V + off_z * stride_vz + off_h_kv * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    mask_ptrs = MASK + off_z * stride_mz + off_h * stride_mh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn

    q = tl.load(q_ptrs, mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Stage 1 ends where a block first needs a mask; stage 2 ends at the last
    # key any row of this block can see. Both stop at the end of this split's
    # keys [lo, hi).
    full_end = (Lk // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_end = tl.minimum(full_end, (start_m * BLOCK_M // BLOCK_N) * BLOCK_N)
        end = tl.minimum(Lk, (start_m + 1) * BLOCK_M)
    else:
        end = Lk
    lo = split * BLOCKS_PER_SPLIT * BLOCK_N
    hi = tl.minimum(lo + BLOCKS_PER_SPLIT * BLOCK_N, end)
    full_end = tl.maximum(lo, tl.minimum(full_end, hi))
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
        offs_m, offs_n, offs_d, offs_dv, lo, full_end, Lq, Lk, qk_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, False, NEGATIVE_SCALE,
        DOT_PRECISION, SPLIT,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, stride_kn, stride_vn, stride_mn,
        offs_m, offs_n, offs_d, offs_dv, full_end, hi, Lq, Lk, qk_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, True, NEGATIVE_SCALE,
        DOT_PRECISION, SPLIT,
    )

    if WITH_LSE:
        # Log-sum-exp of the scaled scores, from base 2 back to natural log;
        # -inf for a row whose every key is masked out (m_i = -inf, l_i = 0).
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + (off_hz.to(tl.int64) * Lq + offs_m) * NUM_SPLITS + split, lse, mask=m_ok)
    if MASK_KIND != 0 or SPLIT:
        # A row whose every key is masked out (or, in a split, that sees none of
        # the split's keys) has acc = 0 and l_i = 0: SDPA returns 0.
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    o_ptrs = (O + off_z * stride_oz + off_h * stride_oh + offs_m[:, None] * stride_om + split * stride_os
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=m_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _attn_combine(
    O_PART, LSE_PART, O, LSE, R, NUM_SPLITS,
    HEAD_DIM_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """Merge the splits of BLOCK_R rows: O_PART (R, NUM_SPLITS, Dv) float32 and
    LSE_PART (R, NUM_SPLITS) into O (R, Dv) and, WITH_LSE, LSE (R,); all contiguous.

    o = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max_s lse_s); a split
    whose rows saw no key has lse_s = -inf and weighs 0.
    """
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    r_ok = offs_r < R
    s_ok = offs_s < NUM_SPLITS
    offs_rs = offs_r.to(tl.int64)[:, None] * NUM_SPLITS + offs_s[None, :]
    lse_s = tl.load(LSE_PART + offs_rs, mask=r_ok[:, None] & s_ok[None, :], other=float("-inf"))
    m = tl.max(lse_s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, not NaN
    w = tl.exp(lse_s - m[:, None])
    l = tl.sum(w, 1)
    o_s = tl.load(
        O_PART + offs_rs[:, :, None] * HEAD_DIM_V + offs_dv[None, None, :],
        mask=(r_ok[:, None] & s_ok[None, :])[:, :, None] & (offs_dv < HEAD_DIM_V)[None, None, :],
        other=0.0,
    )
    o = tl.sum(w[:, :, None] * o_s, 1) / tl.where(l == 0.0, 1.0, l)[:, None]
    o_ptrs = O + offs_r.to(tl.int64)[:, None] * HEAD_DIM_V + offs_dv[None, :]
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=r_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :])
    if WITH_LSE:
        tl.store(LSE + offs_r, m + tl.log(l), mask=r_ok)  # log(0) = -inf: no key at all


def _interpreted() -> bool:
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


INTERPRETED = _interpreted()
if INTERPRETED:
    apply_interpreter_fixes()


def forward(query, key, value, *, is_causal: bool, scale: float, attn_mask=None, return_lse: bool = False):
    """Launch the kernel on validated inputs (see ``common.dispatch``).

    query (B, H, Lq, D), key (B, H_kv, Lk, D), value (B, H_kv, Lk, Dv), any
    strides, one dtype (float16, bfloat16 or float32), H a multiple of H_kv;
    Lq, Lk >= 1. attn_mask: None, or a bool / floating tensor already
    expanded (stride-0 views) to (B, H, Lq, Lk). Returns ``(out, lse)``:
    out (B, H, Lq, Dv) contiguous in value's dtype; lse (B, H, Lq) float32,
    or None unless ``return_lse``. When the launch would leave the GPU short
    of programs, the keys are split across programs and merged after (see
    ``common.splitkv``).
    """
    B, H, Lq, D = query.shape
    H_kv, Lk, Dv = key.shape[1], key.shape[2], value.shape[3]
    out = new_output((B, H, Lq, Dv), query.dtype, query.device)
    if attn_mask is None:
        mask_kind, mask, mask_strides = NO_MASK, out, (0, 0, 0, 0)
    else:
        mask_kind = BOOL_MASK if attn_mask.dtype == torch.bool else ADDITIVE_MASK
        mask, mask_strides = attn_mask, attn_mask.stride()
    block_d, block_dv = padded_head_dim(D), padded_head_dim(Dv)
    config = CONFIGS.lookup(max(block_d, block_dv), query.dtype, is_causal, Lq, Lk, INTERPRETED)
    m_blocks = -(-Lq // config.block_m)  # (triton.cdiv costs ~2 µs a call on the host)
    programs = m_blocks * B * H
    num_splits, blocks_per_split = plan_splits(programs, Lk, config.block_n, query.device)
    split = num_splits > 1
    if split:
        # float32 partial outputs and their log-sum-exps, one per split
        o_part = new_output((B, H, Lq, num_splits, Dv), torch.float32, query.device)
        lse_part = new_output((B, H, Lq, num_splits), torch.float32, query.device)
        o_strides = o_part.stride()
    else:
        o_part = out
        lse_part = new_output((B, H, Lq), torch.float32, query.device) if return_lse else out
        o_strides = (*out.stride()[:3], 0, out.stride(3))
    args = (
        query, key, value, o_part, lse_part, mask,
        *query.stride(), *key.stride(), *value.stride(), *o_strides, *mask_strides,
        H, H // H_kv, Lq, Lk, scale, num_splits, blocks_per_split,
    )
    constexprs = (
        D, Dv, config.block_m, config.block_n, block_d, block_dv,
        is_causal, mask_kind, return_lse or split, scale < 0, _dot_precision(query.dtype), split,
    )
    _fwd_launcher((m_blocks, B * H, num_splits), args + constexprs,
                  config.num_warps, config.num_stages)
    if not split:
        return out, (lse_part if return_lse else None)

    lse = new_output((B, H, Lq), torch.float32, query.device) if return_lse else out
    R = B * H * Lq
    block_r = combine_rows(R, INTERPRETED)
    _combine_launcher((-(-R // block_r), 1, 1),
                      (o_part, lse_part, out, lse, R, num_splits,
                       Dv, block_r, next_power_of_2(num_splits), block_dv, return_lse), 4, 1)
    return out, (lse if return_lse else None)


_fwd_launcher = CachedLauncher(_attn_fwd)  # compiled kernels, launched without Triton's dispatch
_combine_launcher = CachedLauncher(_attn_combine)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs get full-precision products, as torch computes them by
    # default (no TF32); half-precision products are exact on tensor cores anyway.
    return "ieee" if dtype == torch.float32 else "tf32"
