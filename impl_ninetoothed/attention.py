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

Short queries split the keys as the Triton kernel does: the arrangement tiles
each K/V row once more into splits of ``blocks_per_split`` blocks, one program
per split, and a second arrangement + application merges the partial outputs
by their log-sum-exps (``combine_arrangement``, ``combine_application``).

Semantics are SDPA's: top-left causal alignment, boolean or additive masks, 0
for a row whose every key is masked out, optional natural-log log-sum-exp.
"""

from __future__ import annotations

import functools

import ninetoothed
import ninetoothed.language as ntl
import torch
from ninetoothed import Tensor

from common.configs import ConfigTable, next_power_of_2, padded_head_dim
from common.interpret import apply_interpreter_fixes, interpreter_requested
from common.launch import route_generated_launch
from common.outputs import new_output
from common.splitkv import combine_rows, plan_splits

# attn_mask kinds (the application's MASK_KIND), as in impl_triton
NO_MASK, BOOL_MASK, ADDITIVE_MASK = 0, 1, 2

CONFIGS = ConfigTable.load(__name__)


def arrangement(
    query, key, value, attn_mask, scale, output, lse,
    IS_CAUSAL, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
    block_m, block_n, block_d, block_dv, blocks_per_split=None,
):
    """One program per (batch, head, block of BLOCK_M query rows), and per split
    of the keys when ``blocks_per_split`` is given.

    Unsplit, output is (B, H, Lq, Dv) and lse (B, H, Lq); split, output is the
    float32 partial-output buffer (B, H, Lq, S, Dv) and lse (B, H, Lq, S), and
    each program sees ``blocks_per_split`` key blocks instead of all of them.
    """
    split = blocks_per_split is not None

    def arrange_rows(x, block_size_last):
        # (B, H, Lq, D) -> programs (B, H, Lq / BLOCK_M), each a (BLOCK_M, D) tile;
        # split: the same tile for each of the S programs (B, H, Lq / BLOCK_M, S)
        arranged = x.tile((1, 1, block_m, block_size_last)).squeeze(3)
        arranged.dtype = arranged.dtype.squeeze((0, 1))
        if split:
            arranged = arranged.unsqueeze(3).expand((-1, -1, -1, output_arranged.shape[3]))
        return arranged

    def arrange_keys(x, block_size_last):
        # (B, H_kv, Lk, D) -> per program, the row of (BLOCK_N, D) tiles of the
        # K/V head that its query head reads (split: its split's part of that
        # row): query head h uses K/V head h // GROUP, so the H_kv heads are
        # repeated GROUP times by broadcasting (expand), never by copying.
        group = query.shape[1] // x.shape[1]
        arranged = x.tile((1, 1, block_n, block_size_last))
        if split:
            arranged = arranged.tile((1, 1, blocks_per_split, -1)).squeeze(3)  # (B, H_kv, S)
            arranged = arranged.unsqueeze(2).unsqueeze(3)
            arranged = arranged.expand((-1, -1, group, query_arranged.shape[2], -1)).flatten(1, 3)
        else:
            arranged = arranged.tile((1, 1, -1, -1)).squeeze((2, 3))  # (B, H_kv)
            arranged = arranged.unsqueeze(2).unsqueeze(3)
            arranged = arranged.expand((-1, -1, group, query_arranged.shape[2])).flatten(1, 3)
        arranged.dtype = arranged.dtype.squeeze((0, 1, 3))
        arranged.dtype.dtype = arranged.dtype.dtype.squeeze((0, 1))
        return arranged

    if split:
        # (B, H, Lq, S, Dv) -> programs (B, H, Lq / BLOCK_M, S), each (BLOCK_M, Dv)
        output_arranged = output.tile((1, 1, block_m, 1, block_dv)).squeeze(4)
        output_arranged.dtype = output_arranged.dtype.squeeze((0, 1, 3))
        # (B, H, Lq, S) -> a (BLOCK_M,) slice per program
        lse_arranged = lse.tile((1, 1, block_m, 1))
        lse_arranged.dtype = lse_arranged.dtype.squeeze((0, 1, 3))
    else:
        output_arranged = None
    query_arranged = arrange_rows(query, block_d)
    key_arranged = arrange_keys(key, block_d)
    value_arranged = arrange_keys(value, block_dv)
    # (B, H, Lq, Lk), broadcast views welcome -> per program a row of (BLOCK_M, BLOCK_N) tiles
    attn_mask_arranged = attn_mask.tile((1, 1, block_m, block_n))
    attn_mask_arranged = attn_mask_arranged.tile((1, 1, 1, blocks_per_split if split else -1))
    if not split:
        attn_mask_arranged = attn_mask_arranged.squeeze(3)
    attn_mask_arranged.dtype = attn_mask_arranged.dtype.squeeze((0, 1, 2))
    attn_mask_arranged.dtype.dtype = attn_mask_arranged.dtype.dtype.squeeze((0, 1))
    if not split:
        output_arranged = arrange_rows(output, block_dv)
        # (B, H, Lq) -> a (BLOCK_M,) slice per program
        lse_arranged = lse.tile((1, 1, block_m))
        lse_arranged.dtype = lse_arranged.dtype.squeeze((0, 1))
    return (
        query_arranged, key_arranged, value_arranged, attn_mask_arranged, scale,
        output_arranged, lse_arranged, IS_CAUSAL, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
    )


def _attn_fwd_inner(
    acc, l_i, m_i, q, key, value, attn_mask, offs_m, lo, hi, first, qk_scale,
    IS_CAUSAL, MASK_KIND, MASKED, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
):
    """Fold key blocks [lo, hi) into (acc, l_i, m_i); inlined by NineToothed.

    Blocks count from the first key; the program's tiles start at block
    ``first`` (0 unless the keys are split). MASKED: the blocks may hold keys
    past Lk or, when causal, above the diagonal; mask them. Unmasked blocks
    skip every comparison.
    """
    for j in range(lo, hi):
        k = key[j - first]
        qk = ntl.dot(q, ntl.trans(k), input_precision=DOT_PRECISION)
        if MASKED or MASK_KIND != 0:
            qk = qk * qk_scale
            if MASKED:
                offs_n = key[j - first].offsets(-2)
                valid = offs_n[None, :] < key.source.shape[-2]
                if IS_CAUSAL:
                    valid = valid & (offs_m[:, None] >= offs_n[None, :])
                qk = ntl.where(valid, qk, float("-inf"))
            if MASK_KIND != 0:
                mask = attn_mask[j - first]
                if MASK_KIND == 1:
                    qk = ntl.where(mask, qk, float("-inf"))
                else:
                    qk = qk + mask.to(ntl.float32) * 1.4426950408889634
            m_ij = ntl.maximum(m_i, ntl.max(qk, 1))
            if MASK_KIND != 0 or SPLIT:
                # A row with no visible key yet has m_ij = -inf (a mask, or a
                # split that starts past a causal row's last key); subtract 0
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
        v = value[j - first]
        acc = ntl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


def application(
    query, key, value, attn_mask, scale, output, lse,
    IS_CAUSAL, MASK_KIND, WITH_LSE, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
):
    q = query
    offs_m = query.offsets(-2)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e))
    acc = ntl.zeros(output.shape, dtype=ntl.float32)
    l_i = ntl.zeros((query.shape[0],), dtype=ntl.float32)
    m_i = ntl.full((query.shape[0],), float("-inf"), dtype=ntl.float32)

    # Stage 1 ends where a block first needs a mask; stage 2 ends at the last
    # key block any row of this block can see. Both count in key blocks and
    # stop at the end of this program's blocks [lo, hi): the split's, when split.
    BLOCK_N = key.dtype.shape[0]
    full_end = key.source.shape[-2] // BLOCK_N
    if IS_CAUSAL:
        full_end = ntl.minimum(full_end, ntl.min(offs_m, 0) // BLOCK_N)
        end = ntl.cdiv(ntl.minimum(key.source.shape[-2], ntl.max(offs_m, 0) + 1), BLOCK_N)
    else:
        end = ntl.cdiv(key.source.shape[-2], BLOCK_N)
    first = ntl.min(key[0].offsets(-2), 0) // BLOCK_N  # the split's first key block
    lo = first
    hi = ntl.minimum(first + key.shape[0], end)
    full_end = ntl.maximum(lo, ntl.minimum(full_end, hi))
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, key, value, attn_mask, offs_m, lo, full_end, first, qk_scale,
        IS_CAUSAL, MASK_KIND, False, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, key, value, attn_mask, offs_m, full_end, hi, first, qk_scale,
        IS_CAUSAL, MASK_KIND, True, NEGATIVE_SCALE, DOT_PRECISION, SPLIT,
    )

    if WITH_LSE:
        # Log-sum-exp of the scaled scores, from base 2 back to natural log;
        # -inf for a row whose every key is masked out (m_i = -inf, l_i = 0).
        lse = (m_i + ntl.log2(l_i)) * 0.6931471805599453  # noqa: F841 (a store)
    if MASK_KIND != 0 or SPLIT:
        # A row whose every key is masked out (or, in a split, that sees none of
        # the split's keys) has acc = 0 and l_i = 0: SDPA returns 0.
        l_i = ntl.where(l_i == 0.0, 1.0, l_i)
    output = acc / l_i[:, None]  # noqa: F841 (a store)


def combine_arrangement(o_part, lse_part, output, lse, WITH_LSE, block_r, block_s, block_dv):
    """One program per BLOCK_R rows of the flattened (B·H·Lq) rows."""
    # (R, S, Dv) -> programs (R / BLOCK_R,), each a (BLOCK_R, BLOCK_S, Dv) tile: every split at once
    o_part_arranged = o_part.tile((block_r, block_s, block_dv)).squeeze((1, 2))
    # (R, S) -> (BLOCK_R, BLOCK_S) tiles
    lse_part_arranged = lse_part.tile((block_r, block_s)).squeeze(1)
    # (R, Dv) -> (BLOCK_R, Dv) tiles; (R,) -> (BLOCK_R,) slices
    output_arranged = output.tile((block_r, block_dv)).squeeze(1)
    lse_arranged = lse.tile((block_r,))
    return o_part_arranged, lse_part_arranged, output_arranged, lse_arranged, WITH_LSE


def combine_application(o_part, lse_part, output, lse, WITH_LSE):
    """Merge the splits: o = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s).

    A split whose rows saw no key has lse_s = -inf and weighs 0.
    """
    m = ntl.max(lse_part, 1)
    m = ntl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, not NaN
    w = ntl.exp(lse_part - m[:, None])
    l = ntl.sum(w, 1)  # noqa: E741
    output = ntl.sum(w[:, :, None] * o_part, 1) / ntl.where(l == 0.0, 1.0, l)[:, None]  # noqa: F841
    if WITH_LSE:
        lse = m + ntl.log(l)  # noqa: F841 (a store; log(0) = -inf: no key at all)


def premake(head_dim, head_dim_v, block_m, block_n, blocks_per_split=None):
    """(arrangement, application, tensors) for one head-dim pair and block shape;
    with ``blocks_per_split``, the split-KV variant (see ``arrangement``)."""
    split = blocks_per_split is not None
    arrangement_ = functools.partial(
        arrangement,
        block_m=block_m,
        block_n=block_n,
        block_d=padded_head_dim(head_dim),
        block_dv=padded_head_dim(head_dim_v),
        blocks_per_split=blocks_per_split,
    )
    # Out-of-range elements must read as 0 (padded head dims enter the dot
    # products; past-the-end keys and values meet p = 0, and 0 * garbage may be
    # NaN); NineToothed leaves them undefined unless told.
    query = Tensor(4, shape=(None, None, None, head_dim), other=0)
    key = Tensor(4, shape=(None, None, None, head_dim), other=0)
    value = Tensor(4, shape=(None, None, None, head_dim_v), other=0)
    if split:
        output = Tensor(5, shape=(None, None, None, None, head_dim_v))  # float32 partial outputs
        lse = Tensor(4)
    else:
        output = Tensor(4, shape=(None, None, None, head_dim_v))
        lse = Tensor(3)
    tensors = (
        query, key, value,
        Tensor(4, other=0),  # attn_mask
        Tensor(0),  # scale (runtime float)
        output,
        lse,
        Tensor(0, constexpr=True),  # IS_CAUSAL
        Tensor(0, constexpr=True),  # MASK_KIND
        Tensor(0, constexpr=True),  # WITH_LSE
        Tensor(0, constexpr=True),  # NEGATIVE_SCALE
        Tensor(0, constexpr=True),  # DOT_PRECISION
        Tensor(0, constexpr=True),  # SPLIT
    )
    return arrangement_, application, tensors


def premake_combine(head_dim_v, block_r, block_s):
    """(arrangement, application, tensors) of the split merge."""
    arrangement_ = functools.partial(
        combine_arrangement, block_r=block_r, block_s=block_s, block_dv=padded_head_dim(head_dim_v)
    )
    tensors = (
        Tensor(3, shape=(None, None, head_dim_v), other=0),  # o_part (R, S, Dv)
        Tensor(2, other=float("-inf")),  # lse_part (R, S): a missing split weighs 0
        Tensor(2, shape=(None, head_dim_v)),  # output (R, Dv)
        Tensor(1),  # lse (R,)
        Tensor(0, constexpr=True),  # WITH_LSE
    )
    return arrangement_, combine_application, tensors


@functools.cache
def _kernel(head_dim, head_dim_v, block_m, block_n, num_warps, num_stages, blocks_per_split=None):
    # ninetoothed.make generates, writes and imports Triton code on every call
    # (0.1-0.5 s): make each kernel once per process.
    apply_interpreter_fixes()
    split = "" if blocks_per_split is None else f"_s{blocks_per_split}"
    return route_generated_launch(ninetoothed.make(
        *premake(head_dim, head_dim_v, block_m, block_n, blocks_per_split),
        kernel_name=f"nt_attention_d{head_dim}_dv{head_dim_v}_m{block_m}_n{block_n}{split}",
        num_warps=num_warps,
        num_stages=num_stages,
    ))


@functools.cache
def _combine_kernel(head_dim_v, block_r, block_s):
    apply_interpreter_fixes()
    return route_generated_launch(ninetoothed.make(
        *premake_combine(head_dim_v, block_r, block_s),
        kernel_name=f"nt_attention_combine_dv{head_dim_v}_r{block_r}_s{block_s}",
        num_warps=4,
        num_stages=1,
    ))


INTERPRETED = interpreter_requested()


def forward(query, key, value, *, is_causal: bool, scale: float, attn_mask=None, return_lse: bool = False):
    """Launch the kernel on validated inputs (see ``common.dispatch``).

    Same contract as ``impl_triton.attention.forward``: query (B, H, Lq, D),
    key (B, H_kv, Lk, D), value (B, H_kv, Lk, Dv), any strides, one dtype;
    attn_mask None or expanded to (B, H, Lq, Lk). Returns ``(out, lse)``.
    Splits the keys across programs when the GPU would be short of them
    (``common.splitkv``).
    """
    B, H, Lq, D = query.shape
    Lk, Dv = key.shape[2], value.shape[3]
    out = new_output((B, H, Lq, Dv), query.dtype, query.device)
    if attn_mask is None:
        mask_kind, attn_mask = NO_MASK, out.new_empty(()).expand(B, H, Lq, Lk)
    else:
        mask_kind = BOOL_MASK if attn_mask.dtype == torch.bool else ADDITIVE_MASK
    config = CONFIGS.lookup(
        max(padded_head_dim(D), padded_head_dim(Dv)), query.dtype, is_causal, Lq, Lk, INTERPRETED
    )
    programs = -(-Lq // config.block_m) * B * H
    num_splits, blocks_per_split = plan_splits(programs, Lk, config.block_n, query.device)
    split = num_splits > 1
    if split:
        # float32 partial outputs and their log-sum-exps, one per split
        o_part = new_output((B, H, Lq, num_splits, Dv), torch.float32, query.device)
        lse_part = new_output((B, H, Lq, num_splits), torch.float32, query.device)
    else:
        o_part = out
        if return_lse:
            lse_part = new_output((B, H, Lq), torch.float32, query.device)
        else:
            lse_part = out.new_empty(()).expand(B, H, Lq)  # never written: WITH_LSE is off
    kernel = _kernel(D, Dv, config.block_m, config.block_n, config.num_warps, config.num_stages,
                     blocks_per_split if split else None)
    kernel(
        query, key, value, attn_mask, scale, o_part, lse_part,
        is_causal, mask_kind, return_lse or split, scale < 0, _dot_precision(query.dtype), split,
    )
    if not split:
        return out, (lse_part if return_lse else None)

    R = B * H * Lq
    lse = new_output((R,), torch.float32, query.device) if return_lse else out.new_empty(()).expand(R)
    block_r = combine_rows(R, INTERPRETED)
    _combine_kernel(Dv, block_r, next_power_of_2(num_splits))(
        o_part.view(R, num_splits, Dv), lse_part.view(R, num_splits), out.view(R, Dv), lse, return_lse,
    )
    return out, (lse.view(B, H, Lq) if return_lse else None)


def _dot_precision(dtype: torch.dtype) -> str:
    # as in impl_triton: full-precision float32 products, as torch's default
    return "ieee" if dtype == torch.float32 else "tf32"
