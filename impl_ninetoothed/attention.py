"""Scaled-dot-product attention forward, as a NineToothed kernel.

The same algorithm as ``impl_triton/attention.py``, with the same names
(``acc``, ``m_i``, ``l_i``, ``qk``, ``p``), written as NineToothed's
arrangement + application and compiled to Triton by ``ninetoothed.make``:

- the *arrangement* says which tiles each program sees: one (BLOCK_M, D) tile
  of the query and of the output, and the whole key/value sequence of the
  matching (grouped-query) head as a row of (BLOCK_N, D) tiles (likewise the
  attention mask); NineToothed writes the pointer arithmetic, strides and
  bounds masks for every load and store;
- the *application* is FlashAttention-2's online softmax over those tiles, in
  base 2, visiting key blocks in two stages (unmasked, then the diagonal band
  and the ragged tail with masks) and, when causal, never visiting a key block
  wholly above the diagonal.

Semantics are SDPA's: top-left causal alignment, boolean or additive masks, 0
for a row whose every key is masked out, optional natural-log log-sum-exp.
"""

from __future__ import annotations

import functools

import ninetoothed
import ninetoothed.language as ntl
import torch
from ninetoothed import Tensor

from common.configs import ConfigTable, padded_head_dim
from common.interpret import apply_interpreter_fixes, interpreter_requested
from common.outputs import new_output

# attn_mask kinds (the application's MASK_KIND), as in impl_triton
NO_MASK, BOOL_MASK, ADDITIVE_MASK = 0, 1, 2

CONFIGS = ConfigTable.load(__name__)


def arrangement(
    query, key, value, attn_mask, scale, output, lse,
    IS_CAUSAL, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION,
    block_m, block_n, block_d, block_dv,
):
    """One program per (batch, head, block of BLOCK_M query rows)."""

    def arrange_rows(x, block_size_last):
        # (B, H, Lq, D) -> programs (B, H, Lq / BLOCK_M), each a (BLOCK_M, D) tile
        arranged = x.tile((1, 1, block_m, block_size_last)).squeeze(3)
        arranged.dtype = arranged.dtype.squeeze((0, 1))
        return arranged

    def arrange_keys(x, block_size_last):
        # (B, H_kv, Lk, D) -> per program, the row of (BLOCK_N, D) tiles of the
        # K/V head that its query head reads: query head h uses K/V head
        # h // GROUP, so the H_kv heads are repeated GROUP times by broadcasting
        # (expand), never by copying.
        group = query.shape[1] // x.shape[1]
        arranged = x.tile((1, 1, block_n, block_size_last)).tile((1, 1, -1, -1)).squeeze((2, 3))
        arranged = arranged.unsqueeze(2).unsqueeze(3)
        arranged = arranged.expand((-1, -1, group, query_arranged.shape[2])).flatten(1, 3)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 3))
        arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
        return arranged

    query_arranged = arrange_rows(query, block_d)
    key_arranged = arrange_keys(key, block_d)
    value_arranged = arrange_keys(value, block_dv)
    # (B, H, Lq, Lk), broadcast views welcome -> per program a row of (BLOCK_M, BLOCK_N) tiles
    attn_mask_arranged = attn_mask.tile((1, 1, block_m, block_n)).tile((1, 1, 1, -1)).squeeze(3)
    attn_mask_arranged.dtype = attn_mask_arranged.dtype.squeeze((0, 1, 2))
    attn_mask_arranged.dtype.dtype = attn_mask_arranged.dtype.dtype.squeeze((0, 1))
    output_arranged = arrange_rows(output, block_dv)
    # (B, H, Lq) -> a (BLOCK_M,) slice per program
    lse_arranged = lse.tile((1, 1, block_m))
    lse_arranged.dtype = lse_arranged.dtype.squeeze((0, 1))
    return (
        query_arranged, key_arranged, value_arranged, attn_mask_arranged, scale,
        output_arranged, lse_arranged, IS_CAUSAL, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION,
    )


def _attn_fwd_inner(
    acc, l_i, m_i, q, key, value, attn_mask, offs_m, lo, hi, qk_scale,
    IS_CAUSAL, MASK_KIND, MASKED, NEGATIVE_SCALE, DOT_PRECISION,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i); inlined by NineToothed.

    MASKED: the blocks may hold keys past Lk or, when causal, above the
    diagonal; mask them. Unmasked blocks skip every comparison.
    """
    for j in range(lo, hi):
        k = key[j]
        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != 0:
            qk = qk * qk_scale
            if MASKED:
                offs_n = key[j].offsets(-2)
                valid = offs_n[None, :] < key.source.shape[-2]
                if IS_CAUSAL:
                    valid = valid & (offs_m[:, None] >= offs_n[None, :])
                qk = ntl.where(valid, qk, float("-inf"))
            if MASK_KIND != 0:
                mask = attn_mask[j]
                if MASK_KIND == 1:
                    qk = ntl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(ntl.float32) * 1.4426950408889634
            m_ij = ntl.maximum(m_i, ntl.max(qk, 1))
            if MASK_KIND != 0:
                # A row with no visible key yet has m_ij = -inf; subtract 0
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
        v = value[j]
        acc = ntl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


def application(
    query, key, value, attn_mask, scale, output, lse,
    IS_CAUSAL, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION,
):
    q = query
    offs_m = query.offsets(-2)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    acc = ntl.zeros(output.shape, dtype=ntl.float32)
    l_i = ntl.zeros((query.shape[0],), dtype=ntl.float32)
    m_i = ntl.full((query.shape[0],), float("-inf"), dtype=ntl.float32)

    # Stage 1 ends where a block first needs a mask; stage 2 ends at the last
    # key block any row of this block can see. Both count in key blocks.
    BLOCK_N = key.dtype.shape[0]
    full_end = key.source.shape[-2] // BLOCK_N
    if IS_CAUSAL:
        full_end = ntl.minimum(full_end, ntl.min(offs_m, 0) // BLOCK_N)
        end = ntl.cdiv(ntl.minimum(key.source.shape[-2], ntl.max(offs_m, 0) + 1), BLOCK_N)
    else:
        end = key.shape[0]
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, key, value, attn_mask, offs_m, 0, full_end, qk_scale,
        IS_CAUSAL, MASK_KIND, False, NEGATIVE_SCALE, DOT_PRECISION,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, key, value, attn_mask, offs_m, full_end, end, qk_scale,
        IS_CAUSAL, MASK_KIND, True, NEGATIVE_SCALE, DOT_PRECISION,
    )

    if WITH_LSE:
        # Log-sum-exp of the scaled scores, from base 2 back to natural log;
        # -inf for a row whose every key is masked out (m_i = -inf, l_i = 0).
        lse = (m_i + ntl.log2(l_i)) * 0.6931471805599453  # noqa: F841 (a store)
    if MASK_KIND != 0:
        # A row whose every key is masked out has acc = 0 and l_i = 0: SDPA returns 0.
        l_i = ntl.where(l_i == 0.0, 1.0, l_i)
    output = acc / l_i[:, None]  # noqa: F841 (a store)


def premake(head_dim, head_dim_v, block_m, block_n):
    """(arrangement, application, tensors) for one head-dim pair and block shape."""
    arrangement_ = functools.partial(
        arrangement,
        block_m=block_m,
        block_n=block_n,
        block_d=padded_head_dim(head_dim),
        block_dv=padded_head_dim(head_dim_v),
    )
    # Out-of-range elements must read as 0 (padded head dims enter the dot
    # products; past-the-end keys and values meet p = 0, and 0 * garbage may be
    # NaN); NineToothed leaves them undefined unless told.
    query = Tensor(4, shape=(None, None, None, head_dim), other=0)
    key = Tensor(4, shape=(None, None, None, head_dim), other=0)
    value = Tensor(4, shape=(None, None, None, head_dim_v), other=0)
    output = Tensor(4, shape=(None, None, None, head_dim_v))
    tensors = (
        query, key, value,
        Tensor(4, other=0),  # attn_mask
        Tensor(0),  # scale (runtime float)
        output,
        Tensor(3),  # lse
        Tensor(0, constexpr=True),  # IS_CAUSAL
        Tensor(0, constexpr=True),  # MASK_KIND
        Tensor(0, constexpr=True),  # WITH_LSE
        Tensor(0, constexpr=True),  # NEGATIVE_SCALE
        Tensor(0, constexpr=True),  # DOT_PRECISION
    )
    return arrangement_, application, tensors


@functools.cache
def _kernel(head_dim, head_dim_v, block_m, block_n, num_warps, num_stages):
    # ninetoothed.make generates, writes and imports Triton code on every call
    # (0.1-0.5 s): make each kernel once per process.
    apply_interpreter_fixes()
    return ninetoothed.make(
        *premake(head_dim, head_dim_v, block_m, block_n),
        kernel_name=f"nt_attention_d{head_dim}_dv{head_dim_v}_m{block_m}_n{block_n}",
        num_warps=num_warps,
        num_stages=num_stages,
    )


INTERPRETED = interpreter_requested()


def forward(query, key, value, *, is_causal: bool, scale: float, attn_mask=None, return_lse: bool = False):
    """Launch the kernel on validated inputs (see ``common.dispatch``).

    Same contract as ``impl_triton.attention.forward``: query (B, H, Lq, D),
    key (B, H_kv, Lk, D), value (B, H_kv, Lk, Dv), any strides, one dtype;
    attn_mask None or expanded to (B, H, Lq, Lk). Returns ``(out, lse)``.
    """
    B, H, Lq, D = query.shape
    Lk, Dv = key.shape[2], value.shape[3]
    out = new_output((B, H, Lq, Dv), query.dtype, query.device)
    if return_lse:
        lse = new_output((B, H, Lq), torch.float32, query.device)
    else:
        lse = out.new_empty(()).expand(B, H, Lq)  # never written: WITH_LSE is off
    if attn_mask is None:
        mask_kind, attn_mask = NO_MASK, out.new_empty(()).expand(B, H, Lq, Lk)
    else:
        mask_kind = BOOL_MASK if attn_mask.dtype == torch.bool else ADDITIVE_MASK
    config = CONFIGS.lookup(
        max(padded_head_dim(D), padded_head_dim(Dv)), query.dtype, is_causal, Lq, Lk, INTERPRETED
    )
    kernel = _kernel(D, Dv, config.block_m, config.block_n, config.num_warps, config.num_stages)
    kernel(
        query, key, value, attn_mask, scale, out, lse,
        is_causal, mask_kind, return_lse, scale < 0, _dot_precision(query.dtype),
    )
    return out, (lse if return_lse else None)


def _dot_precision(dtype: torch.dtype) -> str:
    # as in impl_triton: full-precision float32 products, as torch's default
    return "ieee" if dtype == torch.float32 else "tf32"
