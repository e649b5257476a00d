"""The reference every test, the demo and the benchmark compare against.

SDPA's math backend on float64 copies of the inputs: the exact semantics of
``torch.nn.functional.scaled_dot_product_attention`` with rounding error far
below anything a half-precision kernel makes. (In float32, for shapes too large
to materialise the scores, SDPA picks its own fused kernel.)

The accuracy rule: a kernel's error against the reference may be at most
ERROR_MULTIPLE times the error SDPA's math backend makes in the same dtype,
plus a floor per dtype. That math backend computes in float32 and rounds the
result, so its error is the rounding of the exact answer to the dtype, which
we compute directly (no second SDPA call, and no dependence on which fused
SDPA kernel a device picks: on CUDA those disagree with the math backend for
negative scales and for rows whose every key is masked out). Flash-style
kernels round the probabilities to the input dtype before the second product,
so they land a few roundings above; the floor absorbs that on small outputs.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _upcast(t, dtype):
    return None if t is None else (t if t.dtype == torch.bool else t.to(dtype))


def reference(query, key, value, *, is_causal=False, scale=None, attn_mask=None,
              enable_gqa=False, dtype=torch.float64) -> torch.Tensor:
    """SDPA computed in ``dtype`` (float64 by default); returned in ``dtype``."""
    exact = sdpa_kernel(SDPBackend.MATH) if dtype == torch.float64 else contextlib.nullcontext()
    with exact:
        return F.scaled_dot_product_attention(
            query.to(dtype), key.to(dtype), value.to(dtype), attn_mask=_upcast(attn_mask, dtype),
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )


def reference_lse(query, key, *, is_causal=False, scale=None, attn_mask=None, dtype=torch.float64) -> torch.Tensor:
    """Natural-log log-sum-exp over the keys of each row's scaled, masked scores.

    Materialises the (..., Lq, Lk) scores: for tests only. Shape (..., Lq).
    """
    q, k = query.to(dtype), key.to(dtype)
    if k.shape[-3] != q.shape[-3]:  # grouped-query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    Lq, Lk = scores.shape[-2:]
    if is_causal:
        visible = torch.ones(Lq, Lk, dtype=torch.bool, device=scores.device).tril(0)
        scores = scores.masked_fill(~visible, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(dtype)
    return torch.logsumexp(scores, dim=-1)


# -- dropout: the kernels' mask, computed independently in plain torch ---------------------

_M32 = 0xFFFFFFFF
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)  # Philox-4x32's multipliers
_PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)  # and its Weyl key increments
_PHILOX_ROUNDS = 10


def _philox_first(seed: int, c0, c1, c2, c3):
    """The first of Philox-4x32-10's four outputs, on int64 tensors holding uint32
    values (products wrap mod 2^64 in int64, so their low 64 bits are exact)."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    a, b = _PHILOX_ROUND
    for _ in range(_PHILOX_ROUNDS):
        prod_a, prod_b = c0 * a, c2 * b
        c0, c1, c2, c3 = (
            ((prod_b >> 32) & _M32) ^ c1 ^ k0,
            prod_b & _M32,
            ((prod_a >> 32) & _M32) ^ c3 ^ k1,
            prod_a & _M32,
        )
        k0, k1 = (k0 + _PHILOX_KEY_STEP[0]) & _M32, (k1 + _PHILOX_KEY_STEP[1]) & _M32
    return c0


def dropout_keep(seed: int, B: int, H: int, Lq: int, Lk: int, dropout_p: float, device="cpu") -> torch.Tensor:
    """The kernels' dropout mask, (B, H, Lq, Lk) bool (True = kept), written from
    the definition (not from the kernels): score (b, h, i, j) draws Philox-4x32-10
    with key ``seed`` and counter (j, i, b·H + h, 0); its top 24 bits, times
    2^-24, are a uniform u; the score is kept when u >= dropout_p (compared in
    float32, as the kernels do). For tests: materialises (B, H, Lq, Lk)."""
    rows = torch.arange(Lq, dtype=torch.int64, device=device).view(1, 1, Lq, 1)
    keys = torch.arange(Lk, dtype=torch.int64, device=device).view(1, 1, 1, Lk)
    heads = torch.arange(B * H, dtype=torch.int64, device=device).view(B, H, 1, 1)
    zero = torch.zeros((B, H, Lq, Lk), dtype=torch.int64, device=device)
    r = _philox_first(int(seed), keys + zero, rows + zero, heads + zero, zero)
    uniform = (r >> 8).to(torch.float64) * 2.0**-24
    return uniform >= torch.tensor(dropout_p, dtype=torch.float32).item()


def reference_dropout(query, key, value, keep, dropout_p, *, is_causal=False, scale=None, attn_mask=None,
                      dtype=torch.float64) -> torch.Tensor:
    """SDPA with dropout, given the mask ``keep`` ((B, H, Lq, Lk) bool): the
    softmax of the scaled, masked scores, kept weights scaled by 1 / (1 - p),
    times value; in ``dtype``. A row whose every key is masked out gives 0."""
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if k.shape[-3] != q.shape[-3]:  # grouped-query heads
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    lse = reference_lse(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask, dtype=dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    Lq, Lk = scores.shape[-2:]
    if is_causal:
        scores = scores.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(0), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.to(dtype)
    lse = torch.where(lse == float("-inf"), 0.0, lse)
    weights = torch.exp(scores - lse[..., None])  # 0 where masked, and in rows with no key
    kept = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
    return (weights * keep * kept) @ v


ERROR_MULTIPLE = 3.0
ERROR_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


# Gradients: the same rule, with a floor relative to the gradient's size (a
# backward pass sums rounded products over a whole sequence).
GRAD_ERROR_FLOOR = {torch.float16: 3e-3, torch.bfloat16: 2.4e-2, torch.float32: 2e-5}


def grad_error_bound(expected, dtype) -> tuple[float, float]:
    """(bound, rounding): how far a kernel's ``dtype`` gradient may be from ``expected`` (in float32/64)."""
    if not expected.numel():
        return 0.0, 0.0
    rounding = (expected.to(dtype).to(expected.dtype) - expected).abs().max().item()
    return ERROR_MULTIPLE * rounding + GRAD_ERROR_FLOOR[dtype] * max(1.0, expected.abs().max().item()), rounding


def error_bound(expected, dtype) -> tuple[float, float]:
    """(bound, rounding): how far a kernel's ``dtype`` output may be from ``expected`` (in float32/64)."""
    rounding = (expected.to(dtype).to(expected.dtype) - expected).abs().max().item() if expected.numel() else 0.0
    return ERROR_MULTIPLE * rounding + ERROR_FLOOR[dtype], rounding
