"""Training: gradients of both kernel backends against SDPA's math backend in float64.

Every forward feature is differentiated: causal, any scale, grouped-query
heads (dK/dV summed over the group), masks (rows with no visible key get zero
gradients), Dv != D, odd lengths, head dims 16-256, any strides, 3-D inputs,
all dtypes, empty inputs, the split-KV forward; the log-sum-exp's gradient;
``attention_backward``; determinism; and the registered operators
(``torch.library.opcheck``, ``torch.compile`` with ``fullgraph=True``).
"""

from __future__ import annotations

import pytest
import torch

from common import attention, attention_backward
from tests.cases import Case, check_grads, check_output, committed_tiles, make_inputs, params, sdpa_kwargs
from tests.conftest import DEVICE

ON_GPU = DEVICE == "cuda"
f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def leaves(*tensors):
    """Leaf tensors that require grad, keeping each input's strides."""
    return [t.detach().requires_grad_() for t in tensors]


def run_grad_case(case: Case, backend: str, device: str):
    q, k, v, mask = make_inputs(case, device)
    q, k, v = leaves(q, k, v)
    kwargs = sdpa_kwargs(case, mask)
    out = attention(q, k, v, backend=backend, **kwargs)
    check_output(out, q, k, v, **kwargs)
    grad_out = torch.randn_like(out)
    if case.layout == "misaligned":  # the output's gradient off alignment too (the backward's dO tiles)
        grad_out = torch.cat([grad_out.new_ones(1), grad_out.flatten()])[1:].view(out.shape)
    out.backward(grad_out)
    return check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, out=out, **kwargs)


@pytest.mark.parametrize("backend_name, head_dim, tile", committed_tiles(backward=True))
def test_committed_backward_tiles(backend_name, head_dim, tile, device):
    """Each tile of a backend's committed backward table, forced on a call whose lengths are no
    multiple of it, causal and not: SDPA's gradients (see test_committed_forward_tiles)."""
    from common.configs import override

    for causal in (False, True):
        with override(tile):
            run_grad_case(Case(1, 2, 150, 150, head_dim, causal=causal), backend_name, device)


GRAD_CASES = [
    # lengths: 1, odd, Lq != Lk both ways, causal both ways
    *(Case(1, 2, Lq, Lk, 32, causal=causal)
      for (Lq, Lk) in [(1, 1), (17, 17), (65, 65), (1, 40), (40, 1), (17, 63), (63, 17), (130, 130)]
      for causal in (False, True)),
    # head dims, powers of two or not
    *(Case(1, 2, 33, 47, D, causal=True) for D in (1, 8, 12, 16, 40, 64, 80, 128)),
    # dtypes
    *(Case(2, 2, 50, 70, 64, dtype=dtype, causal=True) for dtype in (f16, bf16, f32)),
    # float32 at the widest head dims (twice the shared memory of half precision)
    Case(1, 1, 40, 72, 256, dtype=f32, causal=True),
    Case(1, 1, 70, 40, 200, dtype=f32),
    Case(1, 2, 64, 64, 32, dtype=bf16, scale=0.3),
    # scales, layouts, 3-D
    Case(1, 2, 40, 40, 32, scale=-0.5),
    Case(1, 2, 40, 40, 32, scale=2.0, causal=True),
    Case(2, 3, 40, 56, 32, layout="transposed", causal=True),
    Case(1, 2, 30, 20, 32, layout="strided"),
    Case(2, 2, 40, 56, 16, layout="misaligned", causal=True),
    Case(1, 2, 40, 40, 24, Dv=16, layout="misaligned"),
    Case(None, 3, 33, 50, 32),
    Case(None, 2, 50, 33, 48, causal=True, layout="transposed"),
    # Dv != D
    Case(1, 2, 40, 60, 64, Dv=32),
    Case(1, 2, 60, 40, 32, Dv=64, causal=True),
    # grouped- and multi-query heads
    Case(2, 8, 40, 56, 32, H_kv=2, causal=True),
    Case(1, 4, 33, 33, 32, H_kv=1),
    Case(None, 6, 20, 30, 32, H_kv=3, causal=True),
    # masks, broadcast, with rows that see no key at all
    Case(2, 3, 40, 56, 32, mask="bool", mask_shape="B11Lk"),
    Case(1, 2, 30, 40, 32, mask="additive", mask_shape="LqLk", dtype=f32),
    Case(2, 2, 30, 40, 32, mask="bool-empty-rows", mask_shape="B1LqLk"),
    Case(1, 4, 30, 30, 32, H_kv=2, mask="additive-empty-rows", mask_shape="BHLqLk"),
]
if ON_GPU:
    GRAD_CASES += [
        Case(1, 2, 33, 47, 256, causal=True), Case(1, 2, 48, 48, 192, Dv=128),
        Case(2, 4, 1000, 1000, 64, causal=True), Case(1, 4, 777, 1500, 128, H_kv=2, dtype=bf16),
        Case(2, 8, 2048, 2048, 128, causal=True), Case(1, 4, 4097, 4097, 64, dtype=bf16, causal=True),
        Case(1, 48, 1100, 1300, 128, H_kv=16),  # (sm_90 under triton 3.9: the one pass, off its tiles, past its guard)
        Case(2, 4, 300, 300, 96, dtype=f32, causal=True),
    ]


@pytest.mark.parametrize("case", params(GRAD_CASES))
def test_gradients(case, backend, device):
    run_grad_case(case, backend, device)


def test_gradient_of_a_sum(backend, device):
    """out.sum() hands the backward a broadcast gradient (stride 0): read through its strides."""
    q, k, v = leaves(*(torch.randn(1, 2, 24, 32, dtype=f16, device=device) for _ in range(3)))
    out = attention(q, k, v, is_causal=True, backend=backend)
    out.sum().backward()
    assert out.grad_fn is not None
    check_grads((q.grad, k.grad, v.grad), q, k, v, torch.ones_like(out), is_causal=True)


@pytest.mark.parametrize("num_splits", [3])
def test_gradients_through_split_keys(num_splits, backend, device):
    """A forward that splits the keys across programs (decoding shapes) is differentiable too."""
    from common.plan import force_splits

    case = Case(1, 8, 2, 300, 64, H_kv=2)
    q, k, v, _ = make_inputs(case, device)
    q, k, v = leaves(q, k, v)
    with force_splits(num_splits):
        out = attention(q, k, v, enable_gqa=True, backend=backend)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, enable_gqa=True)


@pytest.mark.parametrize("case", params([
    Case(1, 2, 40, 50, 32, causal=True),
    Case(2, 4, 30, 30, 32, H_kv=2, mask="bool-empty-rows", mask_shape="B1LqLk"),
]))
def test_gradient_through_lse(case, backend, device):
    """return_lse=True: a loss of both the output and the log-sum-exp (d lse / d s = p)."""
    q, k, v, mask = make_inputs(case, device)
    q, k, v = leaves(q, k, v)
    kwargs = sdpa_kwargs(case, mask)
    out, lse = attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (grad_out, grad_lse))
    check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, grad_lse=grad_lse, **kwargs)

    for t in (q, k, v):
        t.grad = None
    out, lse = attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    lse.backward(grad_lse)  # the lse alone
    check_grads((q.grad, k.grad, v.grad), q, k, v, torch.zeros_like(out), grad_lse=grad_lse, **kwargs)


@pytest.mark.parametrize("shape_q, shape_kv", [
    ((0, 2, 8, 32), (0, 2, 8, 32)),
    ((2, 2, 0, 32), (2, 2, 8, 32)),
    ((2, 2, 8, 32), (2, 2, 0, 32)),
], ids=["B0", "Lq0", "Lk0"])
def test_empty_gradients(shape_q, shape_kv, backend, device):
    q, k, v = leaves(*(torch.randn(s, dtype=f16, device=device) for s in (shape_q, shape_kv, shape_kv)))
    out = attention(q, k, v, backend=backend)
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


def test_deterministic(backend, device):
    """Same inputs, same gradients, bit for bit (no atomics)."""
    q, k, v = leaves(*(torch.randn(1, 4, 70, 32, dtype=f16, device=device) for _ in range(3)))
    grad_out = torch.randn(1, 4, 70, 32, dtype=f16, device=device)
    grads = []
    for _ in range(2):
        out = attention(q, k, v, is_causal=True, backend=backend)
        grads.append(torch.autograd.grad(out, (q, k, v), grad_out))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_deterministic_reaches_the_backward_plan(backend, device, monkeypatch):
    """Asking for a deterministic backward (``deterministic=True`` of attention, attention_backward and
    FlashAttention's flash_attn_func; torch.use_deterministic_algorithms(True)) reaches the backend's backward
    plan, which a plain call leaves free (the Triton backend's one pass runs only where it is); here, off
    sm_90, every way gives the same gradients bit for bit."""
    from common import flash_attn_interface as fa
    from common.backends import get_backend
    from common.reuse import BACKWARDS

    module = get_backend(backend).load()
    seen, run = [], module.backward
    monkeypatch.setattr(module, "backward", lambda plan: seen.append(plan.deterministic) or run(plan))
    q, k, v = leaves(*(torch.randn(1, 2, 40, 32, dtype=f16, device=device) for _ in range(3)))
    grad_out = torch.randn(1, 2, 40, 32, dtype=f16, device=device)

    def through_attention(**kw):
        return torch.autograd.grad(attention(q, k, v, is_causal=True, backend=backend, **kw), (q, k, v), grad_out)

    def through_flash_attn():
        out = fa.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, deterministic=True,
                                 backend=backend)
        return torch.autograd.grad(out.transpose(1, 2), (q, k, v), grad_out)

    def through_the_building_block():
        with torch.no_grad():
            out, lse = attention(q, k, v, is_causal=True, backend=backend, return_lse=True)
        return attention_backward(grad_out, q, k, v, out, lse, is_causal=True, backend=backend, deterministic=True)

    grads = []
    for way in (through_attention, lambda: through_attention(deterministic=True), through_flash_attn,
                through_the_building_block):
        BACKWARDS.clear()  # (each way's first call of its layout plans: the spy sees it)
        grads.append(way())
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        BACKWARDS.clear()
        grads.append(through_attention())
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen == [False, True, True, True, True]
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


# -- attention_backward: the public building block ------------------------------------

def test_attention_backward_matches_autograd(backend, device):
    case = Case(2, 4, 33, 47, 32, H_kv=2, causal=True)
    q, k, v, _ = make_inputs(case, device)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend, return_lse=True)
    grad_out = torch.randn_like(out)
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, is_causal=True, enable_gqa=True, backend=backend)
    check_grads((dq, dk, dv), q, k, v, grad_out, is_causal=True, enable_gqa=True)
    # 3-D inputs give 3-D gradients
    dq3, dk3, dv3 = attention_backward(grad_out[0], q[0], k[0], v[0], out[0], lse[0], is_causal=True,
                                       enable_gqa=True, backend=backend)
    assert dq3.shape == q[0].shape and dk3.shape == k[0].shape
    torch.testing.assert_close(dq3, dq[0])


def test_attention_backward_errors(backend, device):
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=f16, device=device) for _ in range(3))
    out, lse = attention(q, k, v, backend=backend, return_lse=True)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 8\), got \(1, 2, 7\)"):
        attention_backward(out, q, k, v, out, lse[..., :7], backend=backend)
    with pytest.raises(TypeError, match="lse must have dtype float32, got float16"):
        attention_backward(out, q, k, v, out, lse.half(), backend=backend)
    with pytest.raises(TypeError, match="grad_out must be a torch.Tensor"):
        attention_backward(None, q, k, v, out, lse, backend=backend)
    with pytest.raises(ValueError, match="the 'torch' backend has no backward kernels"):
        attention_backward(out, q, k, v, out, lse, backend="torch")


# -- kept backward launches ------------------------------------------------------------------

@pytest.fixture
def planned(monkeypatch):
    """The kept backwards emptied for this test (common.reuse.BACKWARDS), and a list that grows by
    one each time a backward is planned (common.plan.make_backward)."""
    import common.plan as planning
    from common.reuse import BACKWARDS

    BACKWARDS.clear()
    made = []
    make = planning.make_backward
    monkeypatch.setattr(planning, "make_backward", lambda *args, **kw: made.append(1) or make(*args, **kw))
    yield made
    BACKWARDS.clear()


def _fresh_backward(*args, **kwargs):
    """attention_backward planned afresh (no kept launch): what a kept layout must reproduce."""
    from common.reuse import BACKWARDS

    kept = dict(BACKWARDS._plans)
    BACKWARDS.clear()
    try:
        return attention_backward(*args, **kwargs)
    finally:
        BACKWARDS._plans.update(kept)


@pytest.mark.parametrize("causal, with_dlse, aliased", [(False, False, False), (True, True, False),
                                                        (True, False, True)],
                         ids=["full", "causal-dlse", "causal-one-tensor"])
def test_backward_calls_keep_bound_launches(causal, with_dlse, aliased, backend, device, planned):
    """A layout's first backward is planned, its second binds its launches, and later calls run them
    on their own tensors: planned twice in four calls, each call's gradients bitwise those of a
    backward planned afresh and SDPA's within bounds (fresh inputs each call; gradients poisoned
    before the launch). ``aliased``: the binding call passes one tensor as query, key and value,
    later calls three."""
    for i in range(4):
        q, k, v = (torch.randn(1, 4, 37, 32, dtype=f16, device=device) for _ in range(3))
        if aliased and i == 1:
            k = v = q
        out, lse = attention(q, k, v, is_causal=causal, backend=backend, return_lse=True)
        grad_out = torch.randn_like(out)
        grad_lse = torch.randn_like(lse) if with_dlse else None
        args = (grad_out, q, k, v, out, lse)
        kwargs = dict(grad_lse=grad_lse, is_causal=causal, backend=backend)
        grads = attention_backward(*args, **kwargs)
        for got, fresh in zip(grads, _fresh_backward(*args, **kwargs)):
            assert torch.equal(got, fresh)
        check_grads(grads, q, k, v, grad_out, grad_lse=grad_lse, out=out, is_causal=causal)
    assert len(planned) == 2 + 4  # (the layout's first two calls; each fresh backward)


def test_kept_backward_by_layout(backend, device, planned):
    """Another layout (a strided output gradient, a gradient of the lse, another scale) is kept apart
    and its gradients are right; a call with a mask is planned each time (its mask is its own)."""
    q, k, v = (torch.randn(1, 2, 40, 32, dtype=f16, device=device) for _ in range(3))
    out, lse = attention(q, k, v, backend=backend, return_lse=True)
    wide = torch.randn(1, 2, 40, 64, dtype=f16, device=device)
    for grad_out, grad_lse, scale in ((torch.randn_like(out), None, None), (wide[..., ::2], None, None),
                                      (torch.randn_like(out), torch.randn_like(lse), None),
                                      (torch.randn_like(out), None, 0.3)):
        out_s, lse_s = (out, lse) if scale is None else attention(q, k, v, scale=scale, backend=backend,
                                                                    return_lse=True)
        for _ in range(3):
            grads = attention_backward(grad_out, q, k, v, out_s, lse_s, grad_lse=grad_lse, scale=scale,
                                       backend=backend)
            check_grads(grads, q, k, v, grad_out, grad_lse=grad_lse, out=out_s, scale=scale)
    assert len(planned) == 4 * 2
    mask = torch.rand(40, 40, device=device) > 0.3
    out, lse = attention(q, k, v, attn_mask=mask, backend=backend, return_lse=True)
    for _ in range(3):
        grad_out = torch.randn_like(out)
        grads = attention_backward(grad_out, q, k, v, out, lse, attn_mask=mask, backend=backend)
        check_grads(grads, q, k, v, grad_out, out=out, attn_mask=mask)
    assert len(planned) == 4 * 2 + 3


def test_training_forward_keeps_a_plan(backend, device, monkeypatch):
    """The operators' forward of a plain call (a training step's, which autograd calls) is planned once per
    layout (common.reuse.FORWARDS) and bound from its second call: later steps plan nothing and run on their
    own tensors, the output and gradients right each step; a call with a mask is planned every time."""
    from common import plan as planning
    from common.reuse import FORWARDS, AttentionPlan, BoundLaunch

    FORWARDS.clear()
    made = []
    make = planning.make_forward
    monkeypatch.setattr(planning, "make_forward", lambda *args, **kw: made.append(1) or make(*args, **kw))
    rebind = AttentionPlan._rebind

    def step(**kwargs):
        q = leaves(torch.randn(1, 4, 37, 32, dtype=f16, device=device))[0]
        k, v = leaves(*(torch.randn(1, 2, 45, 32, dtype=f16, device=device) for _ in range(2)))
        out = attention(q, k, v, enable_gqa=True, backend=backend, **kwargs)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        check_output(out.detach(), q.detach(), k.detach(), v.detach(), enable_gqa=True, **kwargs)
        check_grads(grads, q, k, v, grad_out, enable_gqa=True, **kwargs)

    try:
        for i in range(4):
            if i == 2:  # (bound by the second call: the third and fourth only launch)
                monkeypatch.setattr(AttentionPlan, "_rebind", lambda *a, **kw: pytest.fail("planned again"))
            step(is_causal=True)
        assert len(made) == 1 and len(FORWARDS) == 1
        assert isinstance(FORWARDS.values()[0]._bound, BoundLaunch)
        monkeypatch.setattr(AttentionPlan, "_rebind", rebind)
        mask = torch.rand(37, 45, device=device) > 0.3
        mask[:, 0] = True
        for _ in range(2):
            step(attn_mask=mask)
        assert len(made) == 3 and len(FORWARDS) == 1
    finally:
        FORWARDS.clear()


# -- the registered operators ---------------------------------------------------------------

def test_opcheck(backend, device):
    """torch.library's own checks of the forward and backward operators (schema, fake, autograd)."""
    from common.ops import OPS

    forward_op, backward_op = OPS[backend]
    # (the operators carry no autograd kernel: attention() differentiates them through
    # ops.FUNCTIONS, checked by every gradient test; opcheck sees inputs without grad)
    q, k, v = (torch.randn(1, 4, 20, 32, dtype=f32, device=device) for _ in range(3))
    mask = torch.rand(20, 20, device=device) > 0.3
    plain = ([-1, -1, 0], 0.0)  # no window, top-left, no soft-capping
    sinks = torch.randn(4, device=device)
    for args in ((q, k, v, None, True, 0.2, 0.0, None, *plain, None),
                 (q, k[:, :2], v[:, :2], mask.expand(1, 4, 20, 20), False, -0.3, 0.0, None, *plain, None),
                 (q, k, v, None, True, 0.2, 0.0, None, [6, 0, 1], 3.0, sinks)):  # window, bottom-right, capped, sinks
        torch.library.opcheck(forward_op, args)
    for extras in (plain, ([6, 0, 1], 3.0)):
        out, lse = forward_op(q, k, v, None, True, 0.2, 0.0, None, *extras, None)
        # (the backward operator has no gradient of its own: inputs that need none)
        torch.library.opcheck(backward_op, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), None,
                                            out.detach(), lse.detach(), torch.randn_like(lse), True, 0.2, 0.0, None,
                                            *extras))


def test_double_backward_is_rejected_clearly(backend, device):
    q, k, v = leaves(*(torch.randn(1, 2, 16, 32, device=device) for _ in range(3)))
    out = attention(q, k, v, backend=backend)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_torch_compile_fullgraph(backend, device):
    """One graph, forward and backward, that matches eager execution."""
    import torch._dynamo

    torch._dynamo.reset()

    def loss_fn(q, k, v):
        out = attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
        return (out.float() ** 2).sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    q = torch.randn(2, 4, 33, 32, dtype=f16, device=device, requires_grad=True)
    k = torch.randn(2, 2, 33, 32, dtype=f16, device=device, requires_grad=True)
    v = torch.randn(2, 2, 33, 32, dtype=f16, device=device, requires_grad=True)
    expected = torch.autograd.grad(loss_fn(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
