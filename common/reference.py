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
