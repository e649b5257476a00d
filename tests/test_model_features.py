"""Model features beyond SDPA, forward and backward: bottom-right alignment, sliding
windows and SDPA's CausalBias objects (against SDPA's math in float64 given the same band
as a boolean mask), soft-capping and attention sinks (against their formulas in float64).

Row i sits at position i (top-left) or i + Lk - Lq (bottom-right); ``window=(left,
right)`` keeps the keys within left before and right after it (-1: unbounded); with
is_causal nothing after it. The kernels skip key blocks outside the band, and mask the
blocks on its edges. ``softcap`` turns each scaled score s into softcap * tanh(s / softcap).
``sinks`` (H,) adds one logit per query head to every row's softmax, with no value.
"""

from __future__ import annotations

import pytest
import torch

from common import attention, plan
from common.plan import band, band_mask, force_splits
from tests.cases import check_grads, check_lse, check_output
from tests.conftest import DEVICE

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32

# (B, H, H_kv, Lq, Lk, D, Dv, is_causal, alignment, window, dtype)
CASES = [
    (1, 2, 2, 37, 37, 32, 32, True, "top_left", (5, 0), f32),  # sliding window (Mistral)
    (2, 4, 2, 20, 53, 32, 48, True, "bottom_right", None, f16),  # a KV cache: the last row sees every key
    (1, 2, 1, 53, 20, 16, 16, True, "bottom_right", None, f32),  # Lq > Lk: the first rows see nothing
    (1, 2, 2, 40, 70, 32, 32, False, "top_left", (7, 3), f16),  # two-sided window
    (1, 2, 2, 33, 33, 32, 32, False, "bottom_right", (-1, 2), f32),  # right bound only
    (1, 2, 2, 30, 45, 16, 16, True, "bottom_right", (9, -1), f32),  # causal + left bound
    (1, 2, 2, 24, 24, 16, 16, False, "top_left", (0, 0), f32),  # each row its own key
]
IDS = [f"{c[3]}x{c[4]}-{'causal-' if c[7] else ''}{c[8]}-{c[9]}" for c in CASES]


def _inputs(B, H, H_kv, Lq, Lk, D, Dv, dtype):
    q = torch.randn(B, H, Lq, D, dtype=dtype, device=DEVICE)
    k = torch.randn(B, H_kv, Lk, D, dtype=dtype, device=DEVICE)
    v = torch.randn(B, H_kv, Lk, Dv, dtype=dtype, device=DEVICE)
    return q, k, v


def _reference_mask(is_causal, alignment, window, Lq, Lk):
    b = band(is_causal, window, alignment == "bottom_right", Lq, Lk)
    return band_mask(b, Lq, Lk, DEVICE) if b is not None else None


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_band_forward_and_backward(backend, case):
    B, H, H_kv, Lq, Lk, D, Dv, is_causal, alignment, window, dtype = case
    q, k, v = _inputs(B, H, H_kv, Lq, Lk, D, Dv, dtype)
    mask = _reference_mask(is_causal, alignment, window, Lq, Lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention(*leaves, is_causal, enable_gqa=True, backend=backend, alignment=alignment, window=window,
                         return_lse=True)
    check_output(out, q, k, v, attn_mask=mask, enable_gqa=True)
    check_lse(lse, q, k.repeat_interleave(H // H_kv, 1), attn_mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_grads([t.grad for t in leaves], q, k, v, grad_out, out=out, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_band_with_split_keys(backend, num_splits):
    """Short queries split the keys across programs: every split honours the band."""
    q, k, v = _inputs(1, 4, 2, 3, 150, 32, 32, f32)
    window = (40, 0)
    mask = _reference_mask(True, "bottom_right", window, 3, 150)
    with force_splits(num_splits):
        out = attention(q, k, v, True, enable_gqa=True, backend=backend, alignment="bottom_right", window=window)
    check_output(out, q, k, v, attn_mask=mask, enable_gqa=True)


def test_band_with_mask(backend):
    """A window combines with an attn_mask (both must allow a key)."""
    q, k, v = _inputs(1, 2, 2, 30, 30, 16, 16, f32)
    user = torch.rand(30, 30, device=DEVICE) > 0.3
    out = attention(q, k, v, attn_mask=user, backend=backend, window=(6, 6))
    check_output(out, q, k, v, attn_mask=user & _reference_mask(False, "top_left", (6, 6), 30, 30))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_bias_objects(backend, alignment):
    """SDPA's CausalBias objects mean is_causal with their alignment; no mask tensor is read."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q, k, v = _inputs(1, 2, 2, 12, 29, 16, 16, f32)
    bias = (causal_upper_left if alignment == "top_left" else causal_lower_right)(12, 29)
    out = attention(q, k, v, attn_mask=bias, backend=backend)
    check_output(out, q, k, v, attn_mask=_reference_mask(True, alignment, None, 12, 29))
    torch.testing.assert_close(out, attention(q, k, v, True, backend=backend, alignment=alignment),
                               rtol=0, atol=0)


def test_torch_backend_takes_the_band_as_a_mask():
    q, k, v = _inputs(1, 2, 2, 20, 31, 16, 16, f32)
    out = attention(q, k, v, True, backend="torch", alignment="bottom_right", window=(4, -1))
    check_output(out, q, k, v, attn_mask=_reference_mask(True, "bottom_right", (4, -1), 20, 31))


def test_band_is_dropped_when_every_row_sees_every_key():
    """One query row, bottom-right causal (decoding): no band, the unmasked fast path."""
    assert band(True, None, True, 1, 4096) is None
    assert band(True, None, False, 1, 4096) == (-2**30, 0)
    assert band(False, (3, 0), False, 5, 5) == (-3, 0)
    assert band(True, (-1, 5), False, 5, 5) == (-2**30, 0)  # causal caps the right bound


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(alignment="bottom-right"), ValueError, "alignment must be one of 'top_left', 'bottom_right'"),
    (dict(window=(3,)), TypeError, "window must be None or a pair"),
    (dict(window=(2.0, 0)), TypeError, "window's left bound must be an int"),
    (dict(window=(-2, 0)), ValueError, "window's left bound must be >= 0, or -1 for unbounded"),
    (dict(window=(0, True)), TypeError, "window's right bound must be an int"),
])
def test_band_argument_errors(kwargs, error, match):
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(error, match=match):
        attention(q, q, q, **kwargs)


def test_causal_bias_errors():
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="already causal: pass is_causal=False"):
        attention(q, q, q, True, attn_mask=causal_upper_left(8, 8))
    with pytest.raises(ValueError, match="CausalBias for 8 query rows and 9 keys, but the call has 8 and 8"):
        attention(q, q, q, attn_mask=causal_lower_right(8, 9))
    with pytest.raises(ValueError, match="means alignment='top_left', but alignment='bottom_right'"):
        attention(q, q, q, attn_mask=causal_upper_left(8, 8), alignment="bottom_right")


# -- soft-capping (Gemma 2) --------------------------------------------------------------------

def _capped_reference(q, k, v, softcap, *, scale=None, mask=None):
    """softmax(softcap * tanh(scale q k^T / softcap) masked) v in float64, and its leaves."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    qd, kd, vd = leaves
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * (scale if scale is not None else qd.shape[-1] ** -0.5)
    s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a row with no visible key gives 0
    return p @ vd, leaves


SOFTCAP_CASES = [  # (Lq, Lk, is_causal, alignment, window, scale, softcap, dtype)
    (37, 37, False, "top_left", None, None, 5.0, f32),
    (37, 37, True, "top_left", None, None, 2.0, f16),
    (20, 53, True, "bottom_right", (6, 0), -0.8, 3.0, f32),  # with a window, negative scale
    (1, 70, False, "top_left", None, 2.0, 1.0, f32),  # one row: the split-keys path
    (45, 45, False, "top_left", (4, 4), None, 50.0, f32),  # a cap that hardly bites
    (70, 70, True, "top_left", None, None, 50.0, bf16),  # Gemma 2's cap (on a GPU: tanh.approx)
    # saturated scores of both signs, 2 * 50 * log2(e) apart: a row maximum taken at the wrong end
    # overflows exp2 to inf; 256 keys: blocks with no mask (the ragged end is masked)
    (33, 256, False, "top_left", None, -20.0, 50.0, f32),
]


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=[f"{c[0]}x{c[1]}-cap{c[6]}" for c in SOFTCAP_CASES])
def test_softcap_forward_and_backward(backend, case):
    Lq, Lk, is_causal, alignment, window, scale, softcap, dtype = case
    q, k, v = _inputs(2, 4, 2, Lq, Lk, 32, 32, dtype)
    q = q * 2  # scores large enough for the cap to matter
    mask = _reference_mask(is_causal, alignment, window, Lq, Lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, is_causal, scale, enable_gqa=True, backend=backend, alignment=alignment, window=window,
                    softcap=softcap)
    expected, ref_leaves = _capped_reference(q, k, v, softcap, scale=scale, mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    tol = {f32: 2e-4, f16: 1e-2, bf16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), rtol=tol, atol=tol)
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        # (bf16's 8-bit mantissa: an error relative to the gradient's largest element)
        atol = tol * max(1.0, ref.grad.abs().max().item()) if dtype == bf16 else tol
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=tol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_softcap_kind():
    """16-bit inputs on a GPU with tanh.approx get it; float32 inputs, other targets and
    the interpreter compute tanh from exp2. (The planner's tanh_approx stands in for the
    device's answer.)"""
    cuda = torch.device("cuda", 0)
    with_approx = plan.Planner(tanh_approx=True)
    assert with_approx.softcap_kind(0.0, bf16, cuda, False) == plan.Softcap.OFF
    assert with_approx.softcap_kind(50.0, bf16, cuda, False) == plan.Softcap.APPROX
    assert with_approx.softcap_kind(50.0, f16, cuda, False) == plan.Softcap.APPROX
    assert with_approx.softcap_kind(50.0, f32, cuda, False) == plan.Softcap.EXP2
    assert with_approx.softcap_kind(50.0, bf16, cuda, True) == plan.Softcap.EXP2
    assert with_approx.softcap_kind(50.0, bf16, torch.device("cpu"), False) == plan.Softcap.EXP2
    assert plan.Planner(tanh_approx=False).softcap_kind(50.0, bf16, cuda, False) == plan.Softcap.EXP2


def test_softcap_errors():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        attention(q, q, q, softcap=0.0)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        attention(q, q, q, softcap="1")
    with pytest.raises(ValueError, match="the 'torch' backend cannot soft-cap scores"):
        attention(q, q, q, softcap=5.0, backend="torch")


# -- attention sinks (gpt-oss) ------------------------------------------------------------------

def _sinks_reference(q, k, v, sinks, *, is_causal=False, alignment="top_left", window=None, softcap=None):
    """softmax over [scores, sink] in float64, the sink's column dropped; and the leaves."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    qd, kd, vd, sd = leaves
    group = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * qd.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    mask = _reference_mask(is_causal, alignment, window, q.shape[2], k.shape[2])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    column = sd[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    return p @ vd, leaves


SINK_CASES = [  # (Lq, Lk, is_causal, alignment, window, softcap, splits, dtype)
    (37, 37, False, "top_left", None, None, None, f32),
    (30, 30, True, "top_left", None, None, None, f16),
    (20, 53, True, "bottom_right", (6, 0), 3.0, None, f32),  # with a window and soft-capping
    (53, 20, True, "bottom_right", None, None, None, f32),  # rows with no key: 0, and lse = the sink
    (2, 150, False, "top_left", None, None, 3, f32),  # split keys: the sink joins one split only
]


@pytest.mark.parametrize("case", SINK_CASES, ids=[f"{c[0]}x{c[1]}-{'causal-' if c[2] else ''}{c[3]}"
                                                  f"{'-split' if c[6] else ''}" for c in SINK_CASES])
def test_sinks_forward_and_backward(backend, case):
    import contextlib

    Lq, Lk, is_causal, alignment, window, softcap, splits, dtype = case
    q, k, v = _inputs(2, 4, 2, Lq, Lk, 32, 32, dtype)
    sinks = torch.randn(4, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    with force_splits(splits) if splits else contextlib.nullcontext():
        out = attention(*leaves[:3], is_causal, enable_gqa=True, backend=backend, alignment=alignment, window=window,
                        softcap=softcap, sinks=leaves[3])
    expected, ref_leaves = _sinks_reference(q, k, v, sinks, is_causal=is_causal, alignment=alignment, window=window,
                                            softcap=softcap)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    tol = {f32: 2e-4, f16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), rtol=tol, atol=tol)
    for name, leaf, ref in zip(("dq", "dk", "dv", "dsinks"), leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def test_sinks_with_no_keys(backend):
    """No key at all (Lk = 0, where nothing launches): each row's log-sum-exp is its head's sink logit, as in a
    row that sees no key among others; the output 0; the sinks' gradient that of the lse (d lse / d sink = 1)."""
    q = torch.randn(2, 4, 3, 16, device=DEVICE)
    k, v = torch.randn(2, 2, 0, 16, device=DEVICE), torch.randn(2, 2, 0, 16, device=DEVICE)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    out, lse = attention(q, k, v, enable_gqa=True, sinks=sinks, return_lse=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sinks.detach()[None, :, None].expand(2, 4, 3))
    grad_lse = torch.randn_like(lse)
    (out.sum() + (lse * grad_lse).sum()).backward()
    torch.testing.assert_close(sinks.grad, grad_lse.sum((0, 2)))


def test_sinks_keep_grouped_heads_packed(backend):
    """A short-query call with sinks packs each group's query heads into rows of its K/V head (K/V
    read once per group), each row reading its own head's sink logit; the same answer."""
    from common.backends import get_backend
    from common.plan import make_forward
    from common.validation import check_call

    q, k, v = _inputs(2, 4, 2, 3, 40, 32, 32, f32)
    sinks = torch.randn(4, device=DEVICE)
    call = check_call(get_backend(backend), q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=True, return_lse=False, sinks=sinks)
    plan = make_forward(call, get_backend(backend), with_lse=False)
    assert plan.query.shape == (2, 2, 6, 32) and plan.sinks.shape == (2, 2, 6)
    out = attention(q, k, v, enable_gqa=True, sinks=sinks, backend=backend)
    expected, _ = _sinks_reference(q, k, v, sinks, is_causal=False, alignment="top_left", window=None, softcap=None)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=2e-4, atol=2e-4)


def test_sinks_errors():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"sinks must have shape \(2,\): one logit per query head"):
        attention(q, q, q, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        attention(q, q, q, sinks=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        attention(q, q, q, sinks=[0.0, 0.0])
    with pytest.raises(ValueError, match="the 'torch' backend has no attention sinks"):
        attention(q, q, q, sinks=torch.zeros(2, device=DEVICE), backend="torch")
