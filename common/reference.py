"""The reference every test, the demo and the benchmark compare against.

SDPA's math backend on float64 copies of the inputs: the exact semantics of
``torch.nn.functional.scaled_dot_product_attention`` with rounding error far
below anything a half-precision kernel makes. (In float32, for shapes too large
to materialise the scores, SDPA picks its own fused kernel.)

The accuracy rule: a kernel's error against the reference may be at most
ERROR_MULTIPLE times the error SDPA's math backend makes in the same dtype,
plus a floor per dtype. That error is at least the rounding of the exact
answer to the dtype (at least half an ulp of the largest value), computed
directly; the tests also run the math backend itself in the dtype
(:func:`same_dtype_math`, always the math backend: the fused CUDA kernels
disagree with it for negative scales and rows whose every key is masked out),
because with large scales its own error passes that rounding (in float32 the larger of it and
:func:`float32_scores_math`'s, the same rounding drawn twice). Flash-style
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


@contextlib.contextmanager
def ieee_float32():
    """float32 matrix products in float32, not TF32, whatever the process set: an error measured for
    the accuracy rule must be float32's (a TF32 one would loosen every float32 bound)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def same_dtype_math(query, key, value, *, is_causal=False, scale=None, attn_mask=None, enable_gqa=False):
    """SDPA's math backend in the inputs' own dtype: the error it makes is the
    measure the accuracy rule scales (an additive mask is cast to that dtype)."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(query.dtype)
    with sdpa_kernel(SDPBackend.MATH), ieee_float32():
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)


def float32_scores_math(query, key, value, *, is_causal=False, scale=None, attn_mask=None, enable_gqa=False):
    """Attention with the scores summed and scaled in float32 and all after them in float64: what
    rounding the scores alone costs a float32 kernel (every kernel here sums Q K^T in float32). At large
    scales that cost and SDPA's math in float32 are two draws of one rounding, and the math backend's
    can come out several times smaller, so the accuracy rule takes the larger of the two for float32
    inputs (``tests/cases.py``; benchmarks/NOTES.md has the draws)."""
    with ieee_float32():
        scores = reference_scores(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                                  dtype=torch.float32).double()
    v = value.double()
    if v.shape[-3] != scores.shape[-3]:  # grouped-query heads
        v = v.repeat_interleave(scores.shape[-3] // v.shape[-3], dim=-3)
    return torch.softmax(scores, dim=-1) @ v


def reference_scores(query, key, *, is_causal=False, scale=None, attn_mask=None, dtype=torch.float64):
    """The scaled, masked scores in ``dtype``, (..., H, Lq, Lk), grouped-query heads
    expanded; -inf where masked. Materialises them: for tests only."""
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
    return scores


def reference_lse(query, key, *, is_causal=False, scale=None, attn_mask=None, dtype=torch.float64) -> torch.Tensor:
    """Natural-log log-sum-exp over the keys of each row's scaled, masked scores.

    Materialises the (..., Lq, Lk) scores: for tests only. Shape (..., Lq).
    """
    scores = reference_scores(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask, dtype=dtype)
    return torch.logsumexp(scores, dim=-1)


# -- dropout: the kernels' mask, computed independently in plain torch ---------------------

_M32 = 0xFFFFFFFF
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)  # Philox-4x32's multipliers
_PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)  # and its Weyl key increments
_PHILOX_ROUNDS = 10


def _philox(seed: int, c0, c1, c2, c3):
    """Philox-4x32-10's four outputs, on int64 tensors holding uint32 values
    (products wrap mod 2^64 in int64, so their low 64 bits are exact)."""
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
    return c0, c1, c2, c3


def dropout_keep(seed: int, B: int, H: int, Lq: int, Lk: int, dropout_p: float, device="cpu", *,
                 row_start: int = 0, key_start: int = 0) -> torch.Tensor:
    """The kernels' dropout mask, (B, H, Lq, Lk) bool (True = kept), written from
    the definition (not from the kernels): Philox-4x32-10 with key ``seed`` and
    counter (j // 4, i, b·H + h, 0) gives four outputs, the (j % 4)-th of which
    decides score (b, h, i, j); its top 24 bits, times 2^-24, are a uniform u;
    the score is kept when u >= dropout_p (compared in float32, as the kernels
    do). ``row_start``/``key_start``: the mask of rows i and keys j from there on (one
    sequence of a packed varlen batch, whose draws count packed positions). Materialises
    (B, H, Lq, Lk): for tests, and FlashAttention's ``S_dmask``."""
    rows = torch.arange(row_start, row_start + Lq, dtype=torch.int64, device=device).view(1, 1, Lq, 1)
    keys = torch.arange(key_start, key_start + Lk, dtype=torch.int64, device=device).view(1, 1, 1, Lk)
    heads = torch.arange(B * H, dtype=torch.int64, device=device).view(B, H, 1, 1)
    zero = torch.zeros((B, H, Lq, Lk), dtype=torch.int64, device=device)
    outputs = torch.stack(_philox(int(seed), keys // 4 + zero, rows + zero, heads + zero, zero))
    r = outputs.gather(0, (keys % 4 + zero).unsqueeze(0))[0]
    uniform = (r >> 8).to(torch.float64) * 2.0**-24
    return uniform >= torch.tensor(dropout_p, dtype=torch.float32).item()


def reference_probs(query, key, *, is_causal=False, scale=None, attn_mask=None, dtype=torch.float64) -> torch.Tensor:
    """The attention weights, softmax of the scaled, masked scores, in ``dtype``:
    (..., H, Lq, Lk) with grouped-query heads expanded; 0 in rows with no visible key.
    Materialises the scores: for tests only."""
    scores = reference_scores(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask, dtype=dtype)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse))  # 0 where masked, and in empty rows


def reference_dropout(query, key, value, keep, dropout_p, *, is_causal=False, scale=None, attn_mask=None,
                      dtype=torch.float64) -> torch.Tensor:
    """SDPA with dropout, given the mask ``keep`` ((B, H, Lq, Lk) bool): the
    softmax of the scaled, masked scores, kept weights scaled by 1 / (1 - p),
    times value; in ``dtype``. A row whose every key is masked out gives 0."""
    v = value.to(dtype)
    if v.shape[-3] != query.shape[-3]:
        v = v.repeat_interleave(query.shape[-3] // v.shape[-3], dim=-3)
    weights = reference_probs(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask, dtype=dtype)
    kept = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
    return (weights * keep * kept) @ v


ERROR_MULTIPLE = 3.0
ERROR_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-5}


# Gradients: the same rule, with a floor relative to the gradient's size (a
# backward pass sums rounded products over a whole sequence).
GRAD_ERROR_FLOOR = {torch.float16: 3e-3, torch.bfloat16: 2.4e-2, torch.float32: 2e-5}


def _rounding(expected, dtype) -> float:
    """The rounding of the exact answer to ``dtype``: what it is on these values, or half
    an ulp of the largest one, whichever is larger (a kernel one ulp off the correctly
    rounded value is as good as the dtype allows, even where the exact values happen
    to lie close to representable ones)."""
    if not expected.numel():
        return 0.0
    realised = (expected.to(dtype).to(expected.dtype) - expected).abs().max().item()
    return max(realised, expected.abs().max().item() * torch.finfo(dtype).eps / 2)


def grad_error_bound(expected, dtype, same_dtype_error: float = 0.0, from_output: float = 0.0
                     ) -> tuple[float, float]:
    """(bound, rounding): how far a kernel's ``dtype`` gradient may be from ``expected`` (in float32/64).

    ``same_dtype_error``: the error of SDPA's math backend run in ``dtype``, where
    known (large scales make it exceed the rounding of the answer).
    ``from_output``: for dq and dk, how far the exact gradient moves when delta =
    rowsum(dO * O) is taken from the output rounded to ``dtype``, as every
    FlashAttention-style backward takes it (:func:`delta_rounding_effect`; it
    grows with the scale).
    """
    if not expected.numel():
        return 0.0, 0.0
    rounding = max(_rounding(expected, dtype), same_dtype_error) + from_output
    return ERROR_MULTIPLE * rounding + GRAD_ERROR_FLOOR[dtype] * max(1.0, expected.abs().max().item()), rounding


def delta_rounding_effect(query, key, value, out, grad_out, *, is_causal=False, scale=None, attn_mask=None,
                          stored=None):
    """(dq, dk): how far, at most, the rounding of delta = rowsum(dO * O) can move the
    largest elements of dq and dk in a FlashAttention-style backward, which takes
    delta from the output as stored (``stored``, the kernel's output; by default the
    exact ``out``, float64, rounded to the inputs' dtype) and computes it and
    dp = dO V^T in float32. ds = p (dp - delta), so an
    error e_i in row i moves dq_i by at most |scale| |e_i| sum_j p_ij |k_j| and dk_j
    by |scale| sum_i p_ij |e_i| |q_i|: negligible at the usual scales, large where
    |scale| makes the softmax nearly one-hot."""
    probs = reference_probs(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask)
    q, k, v, do = query.double(), key.double(), value.double(), grad_out.double()
    group = q.shape[-3] // k.shape[-3]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    eps32 = torch.finfo(torch.float32).eps
    largest_v = v.abs().amax(dim=-2, keepdim=True).repeat_interleave(group, dim=-3)  # (..., H, 1, Dv)
    stored = out.to(query.dtype) if stored is None else stored
    e = ((do * (stored.double() - out)).sum(-1, keepdim=True).abs()
         + eps32 * (do.abs() * (out.abs() + largest_v)).sum(-1, keepdim=True))  # (..., H, Lq, 1)
    dq = abs(scale) * e * (probs @ k.abs().repeat_interleave(group, dim=-3))
    dk = abs(scale) * (probs * e).transpose(-2, -1) @ q.abs()
    dk = dk.unflatten(-3, (k.shape[-3], group)).sum(-3)
    return dq.max().item() if dq.numel() else 0.0, dk.max().item() if dk.numel() else 0.0


def score_rounding_effect(query, key, value, grad_out, *, is_causal=False, scale=None, attn_mask=None):
    """(dq, dk, dv): how far, at most, the gradients of a FlashAttention-style backward
    move because it recomputes p = exp(s - lse) in float32 from the scores and the
    stored log-sum-exp. Each is rounded to about eps32 times its magnitude (for a
    score, |scale| sum_d |q_d k_d| or |s|), so p_ij carries a relative error up to
    r_i = 2 eps32 max_j (|scale| |q_i|.|k_j| + |s_ij|) over row i's visible keys.
    dv_j then moves by sum_i p_ij r_i |do_i|, and through ds = p (dp - delta), dq_i by
    |scale| r_i sum_j p_ij |dp_ij - delta_i| |k_j| and dk_j by |scale| sum_i p_ij r_i
    |dp_ij - delta_i| |q_i|: negligible where scores are a few units, the largest
    error of all where |scale| puts them in the hundreds (the softmax nearly one-hot)."""
    scores = reference_scores(query, key, is_causal=is_causal, scale=scale, attn_mask=attn_mask)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse))
    q, k, v, do = query.double(), key.double(), value.double(), grad_out.double()
    group = q.shape[-3] // k.shape[-3]
    kx, vx = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    visible = scores.isfinite()
    magnitude = abs(scale) * (q.abs() @ kx.abs().transpose(-2, -1)) + torch.where(visible, scores.abs(), 0.0)
    r = 2 * torch.finfo(torch.float32).eps * torch.where(visible, magnitude, 0.0).amax(-1, keepdim=True)
    dp = do @ vx.transpose(-2, -1)
    delta = (probs * dp).sum(-1, keepdim=True)
    w = probs * r * (dp - delta).abs()
    dq = abs(scale) * w @ kx.abs()
    dk = (abs(scale) * w.transpose(-2, -1) @ q.abs()).unflatten(-3, (k.shape[-3], group)).sum(-3)
    dv = ((probs * r).transpose(-2, -1) @ do.abs()).unflatten(-3, (k.shape[-3], group)).sum(-3)
    return tuple(t.max().item() if t.numel() else 0.0 for t in (dq, dk, dv))


def error_bound(expected, dtype, same_dtype_error: float = 0.0) -> tuple[float, float]:
    """(bound, rounding): how far a kernel's ``dtype`` output may be from ``expected`` (in float32/64);
    ``same_dtype_error`` as for :func:`grad_error_bound`."""
    rounding = max(_rounding(expected, dtype), same_dtype_error)
    return ERROR_MULTIPLE * rounding + ERROR_FLOOR[dtype], rounding


# -- FP8 inputs: the bound of what the kernels round ----------------------------------------

E4M3_ROUNDING = (2.0**-4, 2.0**-10)  # (u, a): relative rounding of a normal e4m3 value, absolute of a subnormal one
HALF_UNITS = {torch.bfloat16: (2.0**-8, 0.0), torch.float16: (2.0**-11, 2.0**-25)}  # (u, a) of the 16-bit types
FP8_FP32_SLACK = 1e-5  # float32 sums of products, exp2, the scale's product, relative to v's largest
HOPPER_FP8_SUMS = 2.0**-13  # an FP8 MMA's sum on Hopper, per product (fp8_error_bound)


def fp8_score_error(q_real, k_real, scale: float, per_product: float = HOPPER_FP8_SUMS) -> torch.Tensor:
    """Per row (B, H, Lq): how far FP8 MMAs' sums may move a score of an FP8 query, ``per_product``
    x |scale| x D x the row's largest |q_d k_jd| (0 where the sums are float32's, as under the
    interpreter). The largest product is max_d |q_d| max_j |k_jd|: no (Lq, Lk, D) tensor is formed.
    q_real (B, H, Lq, D), k_real (B, H_kv, Lk, D): real values (descales included)."""
    k = k_real.repeat_interleave(q_real.shape[1] // k_real.shape[1], dim=1)
    largest = (q_real.abs() * k.abs().amax(dim=-2, keepdim=True)).amax(dim=-1)
    return per_product * abs(scale) * q_real.shape[-1] * largest


def fp8_error_bound(probs, v_real, out_ref, out_dtype, pv_rounding, score_error=0.0) -> torch.Tensor:
    """How far an FP8 forward's output may lie from float64 attention of the dequantized inputs,
    per output element (B, H, Lq, Dv).

    The FP8 products are exact; their sums are float32's under the interpreter, and on Hopper's
    tensor cores keep about 14 bits below the largest addend's leading bit (DeepSeek-V3's report,
    section 3.3.2), so a score of an FP8 query may be off by ``score_error`` (:func:`fp8_score_error`),
    which moves a probability by a factor of at most exp(2 x that). What else rounds is each
    probability on its way into the P·V product (``pv_rounding``: E4M3_ROUNDING when values and
    query are FP8, else HALF_UNITS[float16], the values widened to float16) and the output. A
    probability p <= 1 (taken against a running maximum, so the online softmax's rescaling only
    shrinks its error) rounds with a relative error of at most u where normal, an absolute one of
    at most a below the smallest normal; the row sum takes the unrounded ones. So row i moves by at most
        u * sum_j P_ij |v_j| + a * sum_(j visible) |v_j|,
    plus the output's own rounding (``out_dtype``) and float32's slack.

    probs (B, H, Lq, Lk): the exact normalised probabilities (float64); v_real (B, H_kv, Lk, Dv) the
    real values; out_ref the float64 output; score_error (B, H, Lq) or 0.
    """
    u, a = pv_rounding
    H, H_kv = probs.shape[1], v_real.shape[1]
    v_abs = v_real.abs().repeat_interleave(H // H_kv, dim=1)
    visible = (probs > 0).to(torch.float64)
    u = u + torch.expm1(2 * torch.as_tensor(score_error, dtype=torch.float64, device=probs.device))[..., None]
    moved = u * (probs @ v_abs) + a * visible @ v_abs
    u_out = HALF_UNITS[out_dtype][0]
    return (1 + u_out) * moved + u_out * out_ref.abs() + FP8_FP32_SLACK * v_abs.amax()
