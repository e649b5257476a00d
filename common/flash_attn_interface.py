"""FlashAttention 2's Python functions on our kernels: change the import, keep the calls.

    from flash_attn import flash_attn_func                    # before
    from common.flash_attn_interface import flash_attn_func   # after

Each function (``flash_attn_func``, its packed and variable-length forms, and
``flash_attn_with_kvcache``) takes FlashAttention 2's arguments, in its order and with its
defaults, in its layout ((batch, seqlen, heads, head_dim), or (total, heads,
head_dim) for packed sequences), and returns what it returns, with its
semantics:

- ``causal`` and ``window_size`` align bottom-right: query row i sits at key
  position ``i + seqlen_k - seqlen_q`` and sees keys ``[pos - window_size[0],
  pos + window_size[1]]`` (``-1``, or any negative bound as FlashAttention takes it:
  unbounded on that side; ``causal`` is a right bound of 0). A row that sees no key gives
  0 and a log-sum-exp of ``+inf``.
- ``softcap``: anything > 0 soft-caps the scaled scores, ``softcap * tanh(s / softcap)``;
  0 (or less) is none.
- ``alibi_slopes`` (every function): float32, (nheads,) or (batch, nheads); adds
  ``-slope * |i + seqlen_k - seqlen_q - j|`` to the (soft-capped) score of query row i
  and key j. The slopes get no gradient (as FlashAttention's).
- Grouped-query attention by the key/value heads alone: ``nheads`` a multiple of ``nheads_k``.
- ``softmax_scale=None`` is ``1 / sqrt(head_dim)``; ``dropout_p`` applies whenever it is > 0.
- ``deterministic``: in the dense functions, as FlashAttention's: True keeps the backward
  bit for bit the same from run to run. False (the default) lets the "triton" backend
  take its one-pass backward where it runs (sm_90, triton >= 3.9, head dims 64 and 128 from
  1024 keys, calls of at least 3e10 FLOPs; README), whose dQ sums land in any order;
  ``torch.use_deterministic_algorithms(True)`` asks for the deterministic one everywhere.
  The "torch" backend refuses True (SDPA's own backward: use torch's switch). In the varlen
  and KV-cache functions it has nothing to choose (their backward is always deterministic,
  or there is none).
- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``. Without dropout
  ``S_dmask`` is FlashAttention's empty tensor. With dropout it is what FlashAttention's
  tests read (it says: for testing only): (batch, nheads, seqlen_q, seqlen_k), each rounded
  up to 128, in q's dtype, each visible score's ``exp(s - m)`` (``m``: its row's maximum,
  so ``_get_block_size_n`` gives one block longer than any row), negated where dropout
  dropped it, 0 elsewhere. It is recomputed in torch from the inputs and the call's
  dropout seed (materialising the scores; a host sync); the output comes from the kernels
  as ever, and dropped exactly those. The "torch" backend (SDPA's own dropout, whose mask
  is not exposed) refuses it.

Beyond FlashAttention 2: float32 inputs, a value head dim other than the query's,
and ``backend=`` (keyword only, after FlashAttention's arguments; None chooses as
everywhere else: ``use_backend``, then ATTENTION_BACKEND, then "triton").

``flash_attn_with_kvcache`` runs on ``common.paged``: ``append_kv`` writes ``k`` and
``v`` into the caches in place at ``cache_seqlens`` (every check runs first: a refused
call writes nothing), then ``paged_attention`` attends over ``cache_seqlens +
seqlen_new`` keys per sequence, forward only (FlashAttention's has no backward either:
the output does not require grad). Its caches:

- with ``block_table`` (int32 (batch, max_blocks)), pages (num_blocks, page_block_size,
  nheads_k, head_dim) as they are, of any size on the Triton backend, multiples of 16 on
  NineToothed's (FlashAttention's: multiples of 256).
  ``cache_batch_idx`` with it is a ValueError (FlashAttention takes one or the other).
- without, (batch_size_cache, seqlen_cache, nheads_k, head_dim), any seqlen_cache >= 1,
  viewed as pages without a copy: pages of the largest power of two up to 64
  (``VIEW_PAGE``) that divides seqlen_cache and the rows' distance R, rows
  ``cache_batch_idx`` (None: 0 .. batch - 1). That needs a batch stride that is a whole
  number R of sequence strides, the same for both caches (``torch.empty(B, S, H, D)``
  gives R = S; a slice ``[:, :S]`` of a longer cache, or a heads-first cache transposed,
  gives more); anything else raises NotImplementedError saying which. (An odd
  seqlen_cache makes pages of one key, a table entry per key: the Triton backend's;
  NineToothed's needs pages of multiples of 16, a ValueError otherwise.)
- ``cache_seqlens``: an int, an int32 (batch,) tensor (not read back to the host: lengths
  that do not fit the cache are the caller's, as in FlashAttention; tokens with no slot are
  not written), or None for the whole cache (a ValueError with ``k``, ``v``: they would have
  nowhere to go). ``num_splits``: 0 leaves the split to the planner, n >= 1 is
  ``common.plan.force_splits(n)``. ``return_softmax_lse`` returns ``(out, softmax_lse)``.
- ``rotary_cos``/``rotary_sin`` (seqlen_ro, rotary_dim / 2), with new ``k``, ``v``: the new
  keys are rotated at positions ``cache_seqlens + i`` before they are written, the queries at
  the same positions where causal or local (a window bound short of the cache), else all
  at ``cache_seqlens`` (FlashAttention's rule); ``rotary_interleaved`` pairs dims (0, 1),
  (2, 3), ... or, False, i and rotary_dim / 2 + i (GPT-NeoX). A kernel of each backend
  (``common.rotary``); the caller's q and k are not changed.
- ``cache_leftpad`` (int32 (batch,), contiguous caches only, as FlashAttention's): sequence
  b's keys start at ``cache_leftpad[b]``; positions (causality, windows, ALiBi, the rotary
  angles) stay the cache's.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch

from common import ops, paged
from common.backends import ANY_PAGE, resolve
from common.dispatch import attention
from common.paged import append_kv, paged_attention
from common.plan import alibi_bias, band, band_mask, force_splits
from common.reference import dropout_keep
from common.rotary import apply_rotary
from common.validation import _check_real
from common.varlen import _check_cu_seqlens, varlen_attention

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, backend=None):
    """Attention of ``q`` (B, Lq, H, D) over ``k`` (B, Lk, H_kv, D) and ``v`` (B, Lk, H_kv, Dv).

    Returns out (B, Lq, H, Dv), contiguous, in the inputs' dtype; with ``return_attn_probs``,
    ``(out, softmax_lse (B, H, Lq) float32, S_dmask)``. Differentiable in q, k and v. The other
    arguments as FlashAttention 2's (module docstring)."""
    _check_dims(q=(q, 4), k=(k, 4), v=(v, 4))
    Lq, Lk = q.shape[1], k.shape[1]
    is_causal, window, alignment = _mask(causal, window_size, Lq, Lk, alibi_slopes is not None)
    with_lse = _wants_probs(return_attn_probs)
    seed = _probs_seed(backend, q, dropout_p) if with_lse else None
    result = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, softmax_scale,
                       dropout_p=dropout_p, enable_gqa=True, backend=backend, return_lse=with_lse,
                       alignment=alignment, window=window, softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                       dropout_seed=seed, deterministic=deterministic)
    if not with_lse:
        return result.transpose(1, 2).contiguous()
    out, lse = result
    probs = _no_probs(q)
    if seed is not None:  # (a host sync: S_dmask is for tests)
        keep = dropout_keep(int(seed.item()), q.shape[0], q.shape[2], Lq, Lk, dropout_p, device=q.device)
        probs = q.new_zeros(_s_dmask_shape(q.shape[0], q.shape[2], Lq, Lk))
        probs[:, :, :Lq, :Lk] = _dropped_probs(q, k, keep, softmax_scale, causal, window_size, softcap, alibi_slopes)
    return out.transpose(1, 2).contiguous(), _flash_lse(lse), probs


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              backend=None):
    """:func:`flash_attn_func` of ``qkv`` (B, L, 3, H, D): queries, keys and values stacked on dim 2."""
    _check_dims(qkv=(qkv, 5))
    _check_stacked("qkv", qkv, 2, 3)
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, backend=backend)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             backend=None):
    """:func:`flash_attn_func` of ``q`` (B, Lq, H, D) and ``kv`` (B, Lk, 2, H_kv, D): keys and values stacked."""
    _check_dims(q=(q, 4), kv=(kv, 5))
    _check_stacked("kv", kv, 2, 2)
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, backend=backend)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, backend=None):
    """Attention within each sequence of a packed batch: ``q`` (total_q, H, D), ``k`` (total_k, H_kv, D),
    ``v`` (total_k, H_kv, Dv); sequence b's rows are ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32,
    (batch + 1,)), its keys ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``; causal and windows align
    bottom-right within each sequence.

    With ``block_table`` (int32 (batch, max_blocks)), ``k``/``v`` are a paged cache
    (num_blocks, page_block_size, H_kv, D | Dv) and sequence b's ``cu_seqlens_k[b + 1] -
    cu_seqlens_k[b]`` keys are in its pages (FlashAttention 2.6's paged prefill): forward only,
    as there (the output does not require grad), ``alibi_slopes`` taken, no dropout.

    Returns out (total_q, H, Dv), contiguous; with ``return_attn_probs``, ``(out, softmax_lse
    (H, total_q) float32, S_dmask)``. Differentiable in q, k and v (without ``block_table``)."""
    if block_table is not None:
        return _varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, backend)
    _check_dims(q=(q, 3), k=(k, 3), v=(v, 3))
    _refuse(deterministic=deterministic)
    is_causal, window, alignment = _mask(causal, window_size, None, None, alibi_slopes is not None)
    with_lse = _wants_probs(return_attn_probs)
    seed = _probs_seed(backend, q, dropout_p) if with_lse else None
    result = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                              softmax_scale, enable_gqa=True, backend=backend, return_lse=with_lse,
                              alignment=alignment, window=window, softcap=_softcap(softcap), dropout_p=dropout_p,
                              alibi_slopes=alibi_slopes, dropout_seed=seed)
    if not with_lse:
        return result.contiguous()
    out, lse = result
    probs = _no_probs(q)
    if seed is not None:  # sequence by sequence, its draws counted by packed positions (host syncs: for tests)
        probs = q.new_zeros(_s_dmask_shape(cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, max_seqlen_k))
        starts_q, starts_k, key = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), int(seed.item())
        for b in range(len(starts_q) - 1):
            (r0, r1), (c0, c1) = starts_q[b:b + 2], starts_k[b:b + 2]
            keep = dropout_keep(key, 1, q.shape[1], r1 - r0, c1 - c0, dropout_p, device=q.device,
                                row_start=r0, key_start=c0)
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
            probs[b:b + 1, :, :r1 - r0, :c1 - c0] = _dropped_probs(
                q[None, r0:r1], k[None, c0:c1], keep, softmax_scale, causal, window_size, softcap, slopes)
    return out.contiguous(), _flash_lse(lse), probs


def _varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, backend):
    """flash_attn_varlen_func over a paged cache: the packed queries gathered into (batch, H,
    max_seqlen_q, D) rows (each sequence's first, the rest padding), paged_attention with the
    sequences' query and key lengths, the rows gathered back (all on the device: no host sync)."""
    _check_dims(q=(q, 3), k=(k_cache, 4), v=(v_cache, 4))
    _refuse(deterministic=deterministic)
    for name, t in (("k", k_cache), ("v", v_cache)):  # (FlashAttention 2's pages: q's dtype; no FP8 cache)
        if t.dtype != q.dtype:
            raise TypeError(f"{name} (the paged cache) must have q's dtype {q.dtype}, got {t.dtype}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 with block_table: a paged cache is read at inference, forward only "
                         f"(got {dropout_p!r})")
    with_lse = _wants_probs(return_attn_probs)
    chosen = resolve(backend)
    cu_q, cu_k = _cu_lengths(cu_seqlens_q, cu_seqlens_k, q)
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be an int >= 0 (the longest sequence's queries), got {max_seqlen_q!r}")
    is_causal, window, _ = _mask(causal, window_size, None, None)
    scale = None if softmax_scale is None else _check_real("softmax_scale", softmax_scale)
    total_q, H, D = q.shape
    B = cu_q.shape[0] - 1
    if total_q and not max_seqlen_q:
        raise ValueError(f"max_seqlen_q is 0 but q has {total_q} rows: it must be the longest sequence's queries")
    if total_q == 0:
        out = q.new_zeros((0, H, v_cache.shape[3]))
        return (out, q.new_zeros((H, 0), dtype=torch.float32), _no_probs(q)) if with_lse else out
    rows = torch.arange(max_seqlen_q, device=q.device)
    starts = cu_q[:-1].long()
    index = (starts[:, None] + rows[None, :]).clamp(0, max(total_q - 1, 0))  # (padding rows: any row)
    query = q[index.flatten()].view(B, max_seqlen_q, H, D).transpose(1, 2)
    with torch.no_grad():  # (FlashAttention's paged prefill: no backward)
        result = paged_attention(query, k_cache, v_cache, block_table, cu_k[1:] - cu_k[:-1], is_causal, scale,
                                 enable_gqa=True, window=window, softcap=_softcap(softcap), alibi_slopes=alibi_slopes,
                                 query_lengths=cu_q[1:] - cu_q[:-1], return_lse=with_lse, backend=chosen.name)
    out, lse = result if with_lse else (result, None)
    # packed row t of sequence b is padded row b * max_seqlen_q + t - cu_seqlens_q[b]
    t = torch.arange(total_q, device=q.device)
    seq = torch.searchsorted(cu_q[1:].contiguous(), t.to(cu_q.dtype), right=True).clamp(max=max(B - 1, 0))
    padded = seq * max_seqlen_q + t - starts[seq]
    out = out.transpose(1, 2).reshape(B * max_seqlen_q, H, -1)[padded]
    if not with_lse:
        return out
    lse = lse.transpose(1, 2).reshape(B * max_seqlen_q, H)[padded].t().contiguous()
    return out, _flash_lse(lse), _no_probs(q)


def _cu_lengths(cu_seqlens_q, cu_seqlens_k, like):
    """cu_seqlens_q and cu_seqlens_k (varlen_attention's checks): int32 (batch + 1,) on the
    inputs' device, of one batch of at least one sequence (the block table's rows)."""
    cu_q, cu_k = (_check_cu_seqlens(name, cu, like) for name, cu in (("cu_seqlens_q", cu_seqlens_q),
                                                                     ("cu_seqlens_k", cu_seqlens_k)))
    if cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, at least one; got shapes "
                         f"{tuple(cu_q.shape)} and {tuple(cu_k.shape)}")
    return cu_q, cu_k


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, backend=None):
    """:func:`flash_attn_varlen_func` of ``qkv`` (total, 3, H, D), queries and keys of the same lengths."""
    _check_dims(qkv=(qkv, 4))
    _check_stacked("qkv", qkv, 1, 3)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  backend=backend)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    backend=None):
    """:func:`flash_attn_varlen_func` of ``q`` (total_q, H, D) and ``kv`` (total_k, 2, H_kv, D)."""
    _check_dims(q=(q, 3), kv=(kv, 4))
    _check_stacked("kv", kv, 1, 2)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, backend=backend)


# -- FlashAttention's arguments in our terms -------------------------------------------------------

def _mask(causal, window_size, Lq, Lk, alibi=False) -> tuple[bool, tuple[int, int] | None, str]:
    """``(is_causal, window, alignment)`` for FlashAttention's ``causal`` and ``window_size``
    (Lq, Lk: the lengths where one pair holds them all; None for packed sequences). Causal is a
    window's right bound of 0; where the rows' alignment cannot change the answer (no mask and no
    ALiBi, whose bias depends on the rows' positions; equal lengths; one causal query row, which
    sees every key) the call asks for SDPA's top-left, the alignment ``attention()``'s reused plans take."""
    _check_flag("causal", causal)
    left, right = _window_size(window_size)
    if causal:
        right = 0
    window = None if left < 0 and (right < 0 or (causal and right == 0)) else (left, right)
    if Lq is not None and window is None and causal and Lq == 1:
        causal = False  # (bottom-right, a single query row sees every key)
    masked = causal or window is not None or alibi
    alignment = "bottom_right" if masked and (Lq is None or Lq != Lk) else "top_left"
    return causal, window, alignment


def _check_flag(name: str, value) -> None:
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


_WINDOW_ERROR = "window_size must be a pair of ints (left, right), negative for unbounded; got {!r}"


def _window_size(window_size) -> tuple[int, int]:
    """(left, right) as Python ints from a pair of integers: a tuple or list of ints, or what
    FlashAttention's own tests pass, a (2,) integer tensor (``torch.randint(0, seqlen_k, (2,))``).
    A negative bound is unbounded, -1 (FlashAttention tests ``< 0``, so -2 means what -1 does)."""
    pair = window_size.tolist() if isinstance(window_size, torch.Tensor) and window_size.dim() == 1 else window_size
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or any(isinstance(w, bool) or not isinstance(w, (int, torch.Tensor)) for w in pair)):
        raise TypeError(_WINDOW_ERROR.format(window_size))
    try:
        left, right = (operator.index(w) for w in pair)  # (a 0-d integer tensor too; no float, no bool tensor)
    except TypeError:
        raise TypeError(_WINDOW_ERROR.format(window_size)) from None
    return max(left, -1), max(right, -1)


def _softcap(softcap):
    """FlashAttention's softcap (a float; > 0 soft-caps, anything else does not) as ours (None or > 0)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or math.isnan(softcap):
        raise TypeError(f"softcap must be a float (0.0: none), got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def _wants_probs(return_attn_probs) -> bool:
    _check_flag("return_attn_probs", return_attn_probs)
    return return_attn_probs


# -- S_dmask: the probabilities and dropout's choices, recomputed for FlashAttention's tests ------

_S_DMASK_BLOCK = 1 << 30  # S_dmask relates a row's entries to its maximum over all keys: one block


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key block by which FlashAttention's tests renormalise ``S_dmask`` (a block's entries
    are relative to the running maximum its kernel had reached there): ours are relative to
    each row's maximum over all its keys, so one block, longer than any row."""
    return _S_DMASK_BLOCK


def _probs_seed(backend, q, dropout_p) -> torch.Tensor | None:
    """The dropout seed a call that returns ``S_dmask`` fixes beforehand (None without dropout,
    or for an invalid ``dropout_p``, which the call itself then refuses)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 < dropout_p < 1:
        return None
    if not resolve(backend).kernels:
        raise ValueError("return_attn_probs=True with dropout_p > 0 returns the probabilities with the dropout "
                         "mask the kernel drew (S_dmask); the 'torch' backend runs SDPA's dropout, whose mask "
                         "it never exposes: use the 'triton' or 'ninetoothed' backend, or dropout_p=0")
    return ops.new_seed(q.device)


@torch.no_grad()
def _dropped_probs(q, k, keep, softmax_scale, causal, window_size, softcap, alibi_slopes) -> torch.Tensor:
    """``S_dmask`` of (B, Lq, H, D) queries over (B, Lk, H_kv, D) keys, (B, H, Lq, Lk) in float32:
    ``exp(s - m)`` for each score ``s`` a row sees (scaled, soft-capped, ALiBi's bias added, as the
    kernels), ``m`` the row's maximum, negated where ``keep`` (the call's dropout mask) is False;
    0 where the row does not see the key (causal and windows bottom-right, FlashAttention's).
    Outside autograd: S_dmask, as FlashAttention's, has no gradient."""
    B, Lq, H, D = q.shape
    Lk = k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    keys = k.float().repeat_interleave(H // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), keys) * scale
    softcap = _softcap(softcap)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:  # (every row at its bottom-right position, as the kernels bias it)
        slopes = alibi_slopes.float().expand(B, H)[:, :, None].expand(B, H, Lq)
        s = s + alibi_bias(slopes, torch.full((Lq,), Lk - Lq, device=q.device), Lk)
    seen = band(causal, _window_size(window_size), True, Lq, Lk)
    if seen is not None:
        s = s.masked_fill(~band_mask(seen, Lq, Lk, q.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m.masked_fill(m == float("-inf"), 0.0))
    return torch.where(keep, p, -p)


def _s_dmask_shape(B, H, Lq, Lk) -> tuple[int, int, int, int]:
    """FlashAttention's S_dmask shape: both lengths rounded up to 128 (zeros past them)."""
    return B, H, -(-Lq // 128) * 128, -(-Lk // 128) * 128


def _refuse(deterministic=False, **unsupported) -> None:
    """A clear error for an argument whose feature is not in our kernels yet (None: not asked for)."""
    _check_flag("deterministic", deterministic)
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by common.flash_attn_interface yet; "
                                      f"call without it (got {_describe(value)})")


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def _check_dims(**tensors) -> None:
    for name, (tensor, dims) in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions (FlashAttention's layout), "
                             f"got shape {tuple(tensor.shape)}")


def _check_stacked(name: str, tensor: torch.Tensor, dim: int, count: int) -> None:
    if tensor.shape[dim] != count:
        raise ValueError(f"{name} must stack {count} tensors on dim {dim}, got shape {tuple(tensor.shape)}")


def _flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashAttention's log-sum-exp: +inf, where ours has -inf, for a row that sees no key."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _no_probs(q: torch.Tensor) -> torch.Tensor:
    """FlashAttention's S_dmask without dropout: an empty tensor of the inputs' dtype."""
    return torch.empty((0,), dtype=q.dtype, device=q.device)


# -- flash_attn_with_kvcache: a KV cache, contiguous or paged ----------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, backend=None):
    """Attention of ``q`` (batch, seqlen_q, nheads, D) over a KV cache, after appending ``k``, ``v``.

    ``k_cache``/``v_cache``: (batch_size_cache, seqlen_cache, nheads_k, D/Dv) contiguous per row,
    or pages (num_blocks, page_block_size, nheads_k, D/Dv) with ``block_table`` (batch,
    max_blocks) int32. With ``k``, ``v`` (batch, seqlen_new, nheads_k, D/Dv), the caches are
    written in place at positions ``cache_seqlens[b]`` .. ``+ seqlen_new - 1`` (``cache_seqlens``
    itself unchanged), and attention sees ``cache_seqlens + seqlen_new`` keys per sequence.
    ``cache_seqlens``: an int, an int32 (batch,) tensor, or None (the whole cache; not with
    ``k``). ``cache_batch_idx`` (int32 (batch,)): each sequence's cache row (contiguous caches
    only). ``num_splits``: 0 lets the planner choose, n >= 1 splits the keys n ways.

    Returns out (batch, seqlen_q, nheads, Dv), contiguous; with ``return_softmax_lse``,
    ``(out, softmax_lse (batch, nheads, seqlen_q) float32)``. Forward only, as FlashAttention's:
    no gradient flows (the output does not require grad). Every check runs before the caches
    are written; a contiguous cache is paged as a view (module docstring for what it needs)."""
    chosen = resolve(backend)
    B, Lq, H = _check_kvcache_tensors(q, k_cache, v_cache, k, v)
    if type(rotary_interleaved) is not bool:
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    is_causal, window, _ = _mask(causal, window_size, Lq, None)
    softcap = _softcap(softcap)
    scale = None if softmax_scale is None else _check_real("softmax_scale", softmax_scale)
    if type(return_softmax_lse) is not bool:
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    splits = _num_splits(num_splits)
    L_new = 0 if k is None else k.shape[1]
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache; with block_table the table "
                             "already says which pages each sequence uses (FlashAttention takes one or the "
                             "other): drop cache_batch_idx, or permute block_table's rows")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad is for a contiguous cache (FlashAttention takes no left padding with "
                             "block_table): a paged sequence starts at its first page")
        key_cache, value_cache, table = k_cache, v_cache, block_table
        capacity = block_table.shape[1] * k_cache.shape[1] if _is_table(block_table, B, q) else 0
    else:
        key_cache, value_cache, table = _as_pages(chosen, k_cache, v_cache, cache_batch_idx, B, q)
        capacity = k_cache.shape[1]
    seqlens = _cache_seqlens(cache_seqlens, B, L_new, capacity, q)
    query = q.transpose(1, 2)
    new = None if k is None else (k.transpose(1, 2), v.transpose(1, 2))
    _check_paged(chosen, query, key_cache, value_cache, table, seqlens, new,
                 (window, softcap, alibi_slopes, cache_leftpad, return_softmax_lse))
    rotary = _check_rotary(rotary_cos, rotary_sin, q, k, capacity)
    with torch.no_grad():  # (FlashAttention's: no backward; the caches change in place)
        if rotary:  # q at the new tokens' positions (one position for all rows, unmasked), the new k
            per_row = causal or _local(window_size, capacity)
            q = apply_rotary(chosen, q, rotary_cos, rotary_sin, seqlens, per_row=per_row,
                             interleaved=rotary_interleaved)
            k = apply_rotary(chosen, k, rotary_cos, rotary_sin, seqlens, per_row=True, interleaved=rotary_interleaved)
            query, new = q.transpose(1, 2), (k.transpose(1, 2), new[1])
        lengths = seqlens if new is None else append_kv(key_cache, value_cache, table, seqlens, *new,
                                                        backend=chosen.name)
        with contextlib.nullcontext() if splits == 0 else force_splits(splits):
            result = paged_attention(query, key_cache, value_cache, table, lengths, is_causal, scale,
                                     enable_gqa=True, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                     cache_leftpad=cache_leftpad, return_lse=return_softmax_lse, backend=chosen.name)
    if not return_softmax_lse:
        return result.transpose(1, 2).contiguous()
    out, lse = result
    return out.transpose(1, 2).contiguous(), _flash_lse(lse)


def _check_rotary(rotary_cos, rotary_sin, q, k, capacity) -> bool:
    """Whether the call rotates (both tables given, with new k, v), after FlashAttention's
    checks: (seqlen_ro, rotary_dim / 2) tables of q's dtype and device, rotary_dim a
    multiple of 16 up to the head dim, a row for each of the cache's positions."""
    if rotary_cos is None and rotary_sin is None:
        return False
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin come together: pass both or neither")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin rotate the new k as well as q: pass k and v too "
                         "(FlashAttention's rule)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype} on "
                            f"{t.device}")
    if rotary_cos.ndim != 2 or rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2), got shapes "
                         f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    rotary_dim = 2 * rotary_cos.shape[1]
    if rotary_dim == 0 or rotary_dim % 16 or rotary_dim > q.shape[3]:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be a positive multiple of 16 "
                         f"up to the head dim ({q.shape[3]})")
    if rotary_cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos/rotary_sin must have a row for each of the cache's {capacity} positions, "
                         f"got {rotary_cos.shape[0]}")
    return True


def _local(window_size, capacity: int) -> bool:
    """Whether FlashAttention counts the window as local (a bound on either side short of
    the cache's capacity; a wider bound is none)."""
    return any(0 <= bound < capacity for bound in window_size)


def _check_kvcache_tensors(q, k_cache, v_cache, k, v) -> tuple[int, int, int]:
    """q, the caches and the new k, v: FlashAttention's layouts, one dtype and device; (batch, seqlen_q, nheads)."""
    _check_dims(q=(q, 4), k_cache=(k_cache, 4), v_cache=(v_cache, 4))
    if (k is None) != (v is None):
        raise ValueError("k and v come together: pass both (new tokens to append) or neither")
    if k is not None:
        _check_dims(k=(k, 4), v=(v, 4))
    B, Lq, H, D = q.shape
    H_kv = k_cache.shape[2]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is None:
            continue
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), "
                            f"got {t.dtype} on {t.device}")
    if k_cache.shape[3] != D:
        raise ValueError(f"k_cache's head dim must be q's ({D}), got shape {tuple(k_cache.shape)}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must match k_cache but for the head dim, got shapes {tuple(v_cache.shape)} "
                         f"and {tuple(k_cache.shape)}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"q's nheads ({H}) must be a multiple of the cache's nheads_k ({H_kv})")
    if k is not None:
        L_new = k.shape[1]
        if tuple(k.shape) != (B, L_new, H_kv, D) or tuple(v.shape) != (B, L_new, H_kv, v_cache.shape[3]):
            raise ValueError(f"k and v must be (batch, seqlen_new, nheads_k, head_dim) = ({B}, seqlen_new, {H_kv}, "
                             f"{D} / {v_cache.shape[3]}), got {tuple(k.shape)} and {tuple(v.shape)}")
    return B, Lq, H


def _num_splits(num_splits) -> int:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int (0: the planner chooses), got {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: the planner chooses, n: n splits of the keys), "
                         f"got {num_splits}")
    return num_splits


def _is_table(table, B, like) -> bool:
    """Whether ``table`` is an int32 (batch, max_blocks) tensor on ``like``'s device (else a clear error)."""
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"block_table must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int32 or table.ndim != 2 or table.shape[0] != B or table.device != like.device:
        raise ValueError(f"block_table must be int32 (batch, max_blocks) with batch = {B} on {like.device}, "
                         f"got {table.dtype} of shape {tuple(table.shape)} on {table.device}")
    return True


# The largest page a contiguous cache is viewed as: the paged kernels' key step, so that a
# step is whole pages (a larger page would not make it faster, and fewer sizes compile).
VIEW_PAGE = 64


def _as_pages(chosen, k_cache, v_cache, cache_batch_idx, B, like):
    """A contiguous cache (B_cache, S, H_kv, D) as pages (P, H_kv, D), a view of the same memory,
    and the block table that walks row ``cache_batch_idx[b]``'s S / P pages in order. P is the
    largest power of two up to VIEW_PAGE that divides S and the rows' distance R (R = S from
    torch.empty; more for a slice of a longer cache): rows are R / P pages apart, the pages
    between them never listed."""
    B_cache, S = k_cache.shape[:2]
    if S == 0:
        raise ValueError("k_cache/v_cache: a cache of seqlen_cache 0 holds no key; give it room for the tokens")
    span = _row_span(k_cache, v_cache) or S
    page = min(math.gcd(S, span) & -math.gcd(S, span), VIEW_PAGE)
    if page % 16 and not chosen.supports(ANY_PAGE):
        raise ValueError(f"k_cache/v_cache: the {chosen.name!r} backend views a contiguous cache as pages of "
                         f"multiples of 16 keys, which needs seqlen_cache ({S}) and the distance between rows "
                         f"({span}) multiples of 16; pad the cache, or use backend='triton' (any length)")
    rows = _cache_rows(cache_batch_idx, B, B_cache, like)
    table = (rows[:, None] * (span // page)
             + torch.arange(S // page, device=like.device, dtype=torch.int32)[None, :])
    return _paged_view(k_cache, page, span), _paged_view(v_cache, page, span), table


def _row_span(k_cache, v_cache) -> int | None:
    """How many sequence strides apart the caches' rows are, the same for both (None: one row)."""
    if k_cache.shape[0] == 1:
        return None
    spans = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        batch, seq = cache.stride()[:2]
        if seq <= 0 or batch <= 0 or batch % seq:
            raise NotImplementedError(f"{name}: a contiguous cache is paged as a view, which needs its batch "
                                      f"stride to be a whole number of sequence strides (as torch.empty(B, S, H, "
                                      f"D) gives: S of them); got strides {cache.stride()}")
        spans.append(batch // seq)
    if spans[0] != spans[1]:
        raise NotImplementedError(f"k_cache and v_cache: a contiguous cache is paged as a view with one block table "
                                  f"for both, which needs their rows the same number of positions apart; got "
                                  f"{spans[0]} and {spans[1]} (strides {k_cache.stride()} and {v_cache.stride()})")
    return spans[0]


def _cache_rows(cache_batch_idx, B, B_cache, like) -> torch.Tensor:
    """Each sequence's cache row, int32 (batch,): ``cache_batch_idx`` (not read back: a row
    outside the cache is FlashAttention's caller's to avoid), or 0 .. batch - 1."""
    if cache_batch_idx is None:
        if B_cache < B:
            raise ValueError(f"k_cache has {B_cache} rows for a batch of {B}: pass cache_batch_idx, or a cache "
                             "with a row per sequence")
        return torch.arange(B, device=like.device, dtype=torch.int32)
    if not isinstance(cache_batch_idx, torch.Tensor):
        raise TypeError(f"cache_batch_idx must be a torch.Tensor, got {type(cache_batch_idx).__name__}")
    if (cache_batch_idx.dtype != torch.int32 or tuple(cache_batch_idx.shape) != (B,)
            or cache_batch_idx.device != like.device):
        raise ValueError(f"cache_batch_idx must be int32 (batch,) = ({B},) on {like.device}, got "
                         f"{cache_batch_idx.dtype} of shape {tuple(cache_batch_idx.shape)} on {cache_batch_idx.device}")
    return cache_batch_idx


def _paged_view(cache: torch.Tensor, page: int, span: int) -> torch.Tensor:
    """(B_cache, S, H_kv, D), rows ``span`` positions apart, as ((B_cache - 1) * span + S) / page pages."""
    B_cache, S, H_kv, D = cache.shape
    s_seq, s_head, s_dim = cache.stride()[1:]
    pages = ((B_cache - 1) * span + S) // page
    return cache.as_strided((pages, page, H_kv, D), (page * s_seq, s_seq, s_head, s_dim))


def _cache_seqlens(cache_seqlens, B, L_new, capacity, like) -> torch.Tensor:
    """``cache_seqlens`` as an int32 (batch,) tensor: an int for every sequence, a tensor as it
    is (not read back: lengths past the cache are FlashAttention's caller's to avoid), None the
    whole cache (not with new tokens: they would have nowhere to go)."""
    if cache_seqlens is None:
        if L_new:
            raise ValueError("cache_seqlens is needed with k and v: it says where the new tokens go")
        return torch.full((B,), capacity, dtype=torch.int32, device=like.device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= capacity - L_new:
            raise ValueError(f"cache_seqlens ({cache_seqlens}) plus seqlen_new ({L_new}) must fit the cache's "
                             f"{capacity} positions, and cache_seqlens be >= 0")
        return torch.full((B,), cache_seqlens, dtype=torch.int32, device=like.device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int, an int32 tensor or None, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32 or tuple(cache_seqlens.shape) != (B,) or cache_seqlens.device != like.device:
        raise ValueError(f"cache_seqlens must be int32 (batch,) = ({B},) on {like.device}, got {cache_seqlens.dtype} "
                         f"of shape {tuple(cache_seqlens.shape)} on {cache_seqlens.device}")
    return cache_seqlens


def _check_paged(chosen, query, key_cache, value_cache, table, seqlens, new, features) -> None:
    """What append_kv and paged_attention would refuse (the backend's page sizes, head dims,
    devices, softcap), checked before either writes or launches."""
    window, softcap, alibi_slopes, leftpad, return_lse = features
    B, H, _, _ = query.shape
    paged._check_query(query)
    paged._check_caches(key_cache, value_cache, query, chosen)
    paged._check_table(table, seqlens, B, query)
    paged._check_heads(H, key_cache.shape[2], True)
    paged._check_features(chosen, window, softcap, None, return_lse, H, query.device)
    if alibi_slopes is not None:
        paged._check_alibi(alibi_slopes, B, H, query.device)
    if leftpad is not None:
        paged._check_lengths("cache_leftpad", leftpad, B, query)
    if new is not None:
        paged._check_append(chosen, key_cache, value_cache, table, seqlens, *new, False, (None, None))
