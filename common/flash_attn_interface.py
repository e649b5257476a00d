"""FlashAttention 2's Python functions on our kernels: change the import, keep the calls.

    from flash_attn import flash_attn_func                    # before
    from common.flash_attn_interface import flash_attn_func   # after

Each function takes FlashAttention 2's arguments, in its order and with its
defaults, in its layout ((batch, seqlen, heads, head_dim), or (total, heads,
head_dim) for packed sequences), and returns what it returns, with its
semantics:

- ``causal`` and ``window_size`` align bottom-right: query row i sits at key
  position ``i + seqlen_k - seqlen_q`` and sees keys ``[pos - window_size[0],
  pos + window_size[1]]`` (``-1``: unbounded on that side; ``causal`` is a right
  bound of 0). A row that sees no key gives 0 and a log-sum-exp of ``+inf``.
- ``softcap``: anything > 0 soft-caps the scaled scores, ``softcap * tanh(s / softcap)``;
  0 (or less) is none.
- ``alibi_slopes`` (dense functions): float32, (nheads,) or (batch, nheads); adds
  ``-slope * |i + seqlen_k - seqlen_q - j|`` to the (soft-capped) score of query row i
  and key j. The slopes get no gradient (as FlashAttention's).
- Grouped-query attention by the key/value heads alone: ``nheads`` a multiple of ``nheads_k``.
- ``softmax_scale=None`` is ``1 / sqrt(head_dim)``; ``dropout_p`` applies whenever it is > 0.
- ``deterministic`` is accepted and has nothing to choose: our backward is always
  deterministic (no atomics), bit for bit from one run to the next.
- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``; ``S_dmask``
  is FlashAttention's empty tensor without dropout, and with dropout we do not
  produce the probabilities (a ValueError says so).

Beyond FlashAttention 2: float32 inputs, a value head dim other than the query's,
and ``backend=`` (keyword only, after FlashAttention's arguments; None chooses as
everywhere else: ``use_backend``, then ATTENTION_BACKEND, then "triton").

Not here yet (each raises NotImplementedError naming the argument):
``alibi_slopes`` and ``block_table`` in the variable-length functions, and
``flash_attn_with_kvcache``.
"""

from __future__ import annotations

import math

import torch

from common.dispatch import attention
from common.varlen import varlen_attention

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, backend=None):
    """Attention of ``q`` (B, Lq, H, D) over ``k`` (B, Lk, H_kv, D) and ``v`` (B, Lk, H_kv, Dv).

    Returns out (B, Lq, H, Dv), contiguous, in the inputs' dtype; with ``return_attn_probs``,
    ``(out, softmax_lse (B, H, Lq) float32, S_dmask)``. Differentiable in q, k and v. The other
    arguments as FlashAttention 2's (module docstring)."""
    _check_dims(q=(q, 4), k=(k, 4), v=(v, 4))
    _refuse(deterministic=deterministic)
    Lq, Lk = q.shape[1], k.shape[1]
    is_causal, window, alignment = _mask(causal, window_size, Lq, Lk, alibi_slopes is not None)
    with_lse = _wants_probs(return_attn_probs, dropout_p)
    result = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal, softmax_scale,
                       dropout_p=dropout_p, enable_gqa=True, backend=backend, return_lse=with_lse,
                       alignment=alignment, window=window, softcap=_softcap(softcap), alibi_slopes=alibi_slopes)
    if not with_lse:
        return result.transpose(1, 2).contiguous()
    out, lse = result
    return out.transpose(1, 2).contiguous(), _flash_lse(lse), _no_probs(q)


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

    Returns out (total_q, H, Dv), contiguous; with ``return_attn_probs``, ``(out, softmax_lse
    (H, total_q) float32, S_dmask)``. Differentiable in q, k and v."""
    _check_dims(q=(q, 3), k=(k, 3), v=(v, 3))
    _refuse(alibi_slopes=alibi_slopes, deterministic=deterministic, block_table=block_table)
    is_causal, window, alignment = _mask(causal, window_size, None, None)
    with_lse = _wants_probs(return_attn_probs, dropout_p)
    result = varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                              softmax_scale, enable_gqa=True, backend=backend, return_lse=with_lse,
                              alignment=alignment, window=window, softcap=_softcap(softcap), dropout_p=dropout_p)
    if not with_lse:
        return result.contiguous()
    out, lse = result
    return out.contiguous(), _flash_lse(lse), _no_probs(q)


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


def _window_size(window_size) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(type(w) is not int for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded; got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise ValueError(f"window_size must hold ints >= -1 (-1: unbounded), got {tuple(window_size)}")
    return left, right


def _softcap(softcap):
    """FlashAttention's softcap (a float; > 0 soft-caps, anything else does not) as ours (None or > 0)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or math.isnan(softcap):
        raise TypeError(f"softcap must be a float (0.0: none), got {softcap!r}")
    return float(softcap) if softcap > 0 else None


def _wants_probs(return_attn_probs, dropout_p) -> bool:
    _check_flag("return_attn_probs", return_attn_probs)
    if return_attn_probs and not isinstance(dropout_p, bool) and isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise ValueError("return_attn_probs=True with dropout_p > 0 asks for the dropped attention probabilities "
                         "(S_dmask), which these kernels never form; call with return_attn_probs=False, or "
                         "dropout_p=0 for the log-sum-exp")
    return return_attn_probs


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
