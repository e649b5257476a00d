"""ALiBi (``alibi_slopes``), forward and backward, against its definition in float64.

Query row i sits at position pos_i = i (top-left) or i + Lk - Lq (bottom-right), key j
at j; ALiBi adds ``-slope[b, h] * |pos_i - j|`` to the scaled (and soft-capped) score,
before any mask: a masked score stays masked. Slopes are float32, (H,) or (B, H)
(FlashAttention's convention), and get no gradient.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from common import attention
from common.plan import band, band_mask, force_splits
from tests.conftest import DEVICE

f16, f32 = torch.float16, torch.float32


def _reference(q, k, v, slopes, *, is_causal=False, alignment="top_left", window=None, softcap=None,
               attn_mask=None):
    """(out, lse) in float64 from the definition, and the float64 leaves (q, k, v)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    group = H // k.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * D**-0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(Lq, device=q.device)[:, None] + (Lk - Lq if alignment == "bottom_right" else 0)
    dist = (pos - torch.arange(Lk, device=q.device)[None, :]).abs().double()
    s = s - slopes.double().expand(B, H)[:, :, None, None] * dist
    b = band(is_causal, window, alignment == "bottom_right", Lq, Lk)
    if b is not None:
        s = s.masked_fill(~band_mask(b, Lq, Lk, q.device), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no visible key: 0
    return p @ vd, lse, leaves


def _slopes(B, H, per_batch):
    shape = (B, H) if per_batch else (H,)
    return (torch.rand(shape, device=DEVICE) * 0.6 + 0.05).float()


# (B, H, H_kv, Lq, Lk, per_batch, is_causal, alignment, window, softcap, mask, dtype)
CASES = [
    (2, 2, 2, 13, 21, False, False, "top_left", None, None, None, f32),
    (2, 2, 2, 21, 13, True, False, "bottom_right", None, None, None, f32),
    (1, 2, 2, 19, 27, False, True, "bottom_right", None, None, None, f32),
    (2, 2, 2, 24, 24, True, True, "top_left", None, None, None, f32),
    (1, 2, 2, 17, 30, False, False, "bottom_right", (4, 2), None, None, f32),  # a window
    (1, 2, 2, 20, 20, True, True, "top_left", None, 4.0, None, f32),  # soft-capped, then biased
    (2, 4, 2, 11, 23, True, False, "bottom_right", None, None, None, f32),  # grouped-query heads
    (2, 2, 2, 15, 22, False, False, "top_left", None, None, "additive", f32),
    (1, 2, 2, 15, 22, True, False, "bottom_right", None, None, "bool", f32),
    (1, 2, 2, 18, 26, False, True, "bottom_right", None, None, None, f16),
]
IDS = [f"{c[3]}x{c[4]}-{'BH' if c[5] else 'H'}-{'causal-' if c[6] else ''}{c[7]}"
       f"{'-window' if c[8] else ''}{'-softcap' if c[9] else ''}{'-gqa' if c[1] != c[2] else ''}"
       f"{'-' + c[10] if c[10] else ''}-{str(c[11])[6:]}" for c in CASES]


def _case_inputs(case):
    B, H, H_kv, Lq, Lk, per_batch, _, _, _, _, mask_kind, dtype = case
    q = torch.randn(B, H, Lq, 16, device=DEVICE, dtype=dtype)
    k = torch.randn(B, H_kv, Lk, 16, device=DEVICE, dtype=dtype)
    v = torch.randn(B, H_kv, Lk, 16, device=DEVICE, dtype=dtype)
    mask = None
    if mask_kind == "additive":
        mask = torch.randn(B, 1, Lq, Lk, device=DEVICE)
    elif mask_kind == "bool":
        mask = torch.rand(Lq, Lk, device=DEVICE) > 0.3
    return q, k, v, _slopes(B, H, per_batch), mask


def _check(case, backend, splits=None):
    _, _, _, _, _, _, is_causal, alignment, window, softcap, _, dtype = case
    q, k, v, slopes, mask = _case_inputs(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with force_splits(splits) if splits else contextlib.nullcontext():
        result = attention(*leaves, is_causal, attn_mask=mask, enable_gqa=True, backend=backend,
                           alignment=alignment, window=window, softcap=softcap, alibi_slopes=slopes,
                           return_lse=backend != "torch")  # (SDPA gives no log-sum-exp)
    out, lse = result if backend != "torch" else (result, None)
    expected, expected_lse, ref_leaves = _reference(q, k, v, slopes, is_causal=is_causal, alignment=alignment,
                                                    window=window, softcap=softcap, attn_mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    tol = {f32: 2e-4, f16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), rtol=tol, atol=tol)
    if lse is not None:
        torch.testing.assert_close(lse.double(), expected_lse.detach(), rtol=tol, atol=tol)
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_alibi_forward_and_backward(backend, case):
    _check(case, backend)


def test_alibi_with_split_keys(backend):
    """Short queries against keys of several blocks, split across programs: every split adds the bias
    at the keys' absolute positions."""
    _check((2, 4, 2, 3, 150, True, False, "bottom_right", None, None, None, f32), backend, splits=3)


def test_alibi_keeps_grouped_heads_packed(backend):
    """Short queries of grouped heads pack into rows of their K/V head (K/V read once per group),
    each packed row with its own head's slope and its own position (bottom-right)."""
    from common.backends import get_backend
    from common.plan import make_forward
    from common.validation import check_call

    case = (2, 4, 2, 3, 40, True, False, "bottom_right", None, None, None, f32)
    q, k, v, slopes, _ = _case_inputs(case)
    call = check_call(get_backend(backend), q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=True, return_lse=False, alignment="bottom_right", alibi_slopes=slopes)
    plan = make_forward(call, get_backend(backend), with_lse=False)
    assert plan.query.shape[:3] == plan.alibi.shape == (2, 2, 6) and plan.alibi_shift.tolist() == [37] * 3 + [34] * 3
    _check(case, backend)


@pytest.mark.parametrize("case", [CASES[2], CASES[6], CASES[7]], ids=[IDS[2], IDS[6], IDS[7]])
def test_alibi_torch_backend(case):
    """The torch backend (SDPA with the bias as an additive mask) against the same reference."""
    _check(case, "torch")


def test_alibi_slopes_get_no_gradient(backend):
    """A slopes tensor that requires grad is used as a constant (FlashAttention gives none)."""
    q = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    slopes = torch.rand(2, device=DEVICE).requires_grad_()
    attention(q, q, q, backend=backend, alibi_slopes=slopes).sum().backward()
    assert slopes.grad is None and q.grad is not None


@pytest.mark.parametrize("slopes,error,words", [
    (torch.ones(2, dtype=torch.float16), TypeError, "alibi_slopes must be a float32 tensor, got float16"),
    (torch.ones(3), ValueError, r"alibi_slopes must have shape \(2,\) or \(1, 2\)"),
    (torch.ones(1, 2, 1), ValueError, "alibi_slopes must have shape"),
    ([1.0, 1.0], TypeError, "alibi_slopes must be a torch.Tensor or None, got list"),
    (torch.ones(2, device="meta"), ValueError, "alibi_slopes is on meta but query is on"),
])
def test_bad_alibi_slopes(slopes, error, words):
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    if isinstance(slopes, torch.Tensor) and slopes.device.type != "meta":
        slopes = slopes.to(DEVICE)
    for backend in ("triton", "ninetoothed", "torch"):
        with pytest.raises(error, match=words):
            attention(q, q, q, backend=backend, alibi_slopes=slopes)


def test_alibi_through_the_operators(backend):
    """torch.library's checks of the operators given slopes, and one torch.compile graph (fullgraph) with them."""
    import torch._dynamo

    from common.ops import OPS

    forward_op, backward_op = OPS[backend]
    q, k, v = (torch.randn(1, 4, 20, 16, device=DEVICE) for _ in range(3))
    slopes = torch.rand(4, device=DEVICE).expand(1, 4)
    args = (q, k[:, :2, :13], v[:, :2, :13], None, True, 0.3, 0.0, None, [-1, -1, 1], 0.0, None, None, slopes)
    torch.library.opcheck(forward_op, args)
    out, lse = forward_op(*args)
    torch.library.opcheck(backward_op, (torch.randn_like(out), *args[:3], None, out, lse, None, True, 0.3, 0.0, None,
                                        [-1, -1, 1], 0.0, None, slopes))
    torch._dynamo.reset()

    def loss_fn(q, k, v):
        return attention(q, k, v, is_causal=True, backend=backend, alignment="bottom_right",
                         alibi_slopes=slopes[0]).square().sum()

    leaves = [t.requires_grad_() for t in (q, k[:, :, :13].clone(), v[:, :, :13].clone())]
    compiled = torch.compile(loss_fn, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    expected = torch.autograd.grad(loss_fn(*leaves), leaves)
    for got, want in zip(torch.autograd.grad(compiled(*leaves), leaves), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
