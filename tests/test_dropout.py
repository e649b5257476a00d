"""Dropout in both kernel backends, forward and backward.

The kernels draw each score's keep/drop decision from Philox, counted by the
score's position, and regenerate it in both backward passes. These tests hold
them to ``common.reference.dropout_keep``, the same mask written in plain torch
from its definition: the output and every gradient must be those of SDPA's
math with exactly that mask (float64, the usual error bound). The mask's
statistics are checked on what the kernel itself kept (value = identity makes
the output the dropped attention weights), and seeding on the public API.
"""

from __future__ import annotations

import math

import pytest
import torch

from common import attention, attention_backward
from common.plan import force_splits
from common.reference import dropout_keep, error_bound, grad_error_bound, reference_dropout
from tests.cases import Case, make_inputs, params, sdpa_kwargs

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def seed_tensor(value, device):
    return torch.tensor([value], dtype=torch.int64, device=device)


def check_dropout_case(case: Case, backend, device, dropout_p, seed=0x5EED_1234_ABCD):
    q, k, v, mask = make_inputs(case, device)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kwargs = sdpa_kwargs(case, mask)
    out = attention(q, k, v, backend=backend, dropout_p=dropout_p, dropout_seed=seed_tensor(seed, device), **kwargs)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    B = case.B if case.B is not None else 1
    keep = dropout_keep(seed, B, case.H, case.Lq, case.Lk, dropout_p, device=device)
    keep = keep if case.B is not None else keep[0]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_kwargs = {name: value for name, value in kwargs.items() if name != "enable_gqa"}
    ref = reference_dropout(*leaves, keep, dropout_p, **ref_kwargs)
    ref.backward(grad_out.double())

    assert not out.isnan().any()
    bound, _ = error_bound(ref.detach(), q.dtype)
    error = (out.double() - ref).abs().max().item()
    assert error <= bound, f"output: max error {error:.3g} > bound {bound:.3g}"
    for name, grad, leaf in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), leaves):
        bound, _ = grad_error_bound(leaf.grad, q.dtype)
        error = (grad.double() - leaf.grad).abs().max().item()
        assert error <= bound, f"{name}: max error {error:.3g} > bound {bound:.3g}"


DROPOUT_CASES = [
    Case(2, 4, 19, 23, 32, H_kv=2, dtype=f32),  # grouped-query heads, odd lengths
    Case(1, 2, 40, 40, 32, causal=True),
    Case(1, 2, 20, 44, 16, Dv=24, dtype=bf16, mask="bool-empty-rows", mask_shape="B1LqLk"),
    Case(None, 2, 17, 30, 32, dtype=f32, scale=-0.5, layout="transposed", mask="additive", mask_shape="LqLk"),
]


@pytest.mark.parametrize("case", params(DROPOUT_CASES))
def test_dropout_matches_reference_mask(case, backend, device):
    """Output and gradients equal SDPA's math with the reference mask: the kernels
    drop exactly the scores the definition drops, in the forward and both backward passes."""
    check_dropout_case(case, backend, device, dropout_p=0.3)


def test_dropout_split_keys(backend, device):
    """A split-KV forward (short queries, keys cut across programs) keeps the same mask."""
    with force_splits(3):
        check_dropout_case(Case(1, 2, 3, 150, 32, dtype=f32), backend, device, dropout_p=0.25)


def kept_weights(backend, device, dropout_p, seed, B=2, H=2, Lq=48, L=64):
    """What the kernel kept: with value = identity the output row i is the dropped,
    rescaled attention weights of row i."""
    q = torch.randn(B, H, Lq, 32, device=device)
    k = torch.randn(B, H, L, 32, device=device)
    v = torch.eye(L, device=device).expand(B, H, L, L)
    out = attention(q, k, v, dropout_p=dropout_p, dropout_seed=seed_tensor(seed, device), backend=backend)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), dim=-1)
    return out, weights


@pytest.mark.parametrize("dropout_p", [0.1, 0.5])
def test_keep_rate_and_scaling(backend, device, dropout_p):
    """The kernel keeps each weight with probability 1 - p (within 5 sigma), scales
    kept ones by 1 / (1 - p), and its decisions are the reference mask's."""
    out, weights = kept_weights(backend, device, dropout_p, seed=2024)
    kept = out != 0
    n = kept.numel()
    rate = kept.double().mean().item()
    assert abs(rate - (1 - dropout_p)) <= 5 * math.sqrt(dropout_p * (1 - dropout_p) / n), rate
    torch.testing.assert_close(out[kept], (weights / (1 - dropout_p))[kept], rtol=1e-5, atol=1e-6)
    assert torch.equal(kept, dropout_keep(2024, *out.shape[:3], out.shape[3], dropout_p, device=device))
    # unbiased: the mean over many weights of (kept / (1 - p)) is 1
    ratio = (out / weights).mean().item()
    assert abs(ratio - 1) <= 5 * math.sqrt(dropout_p / (1 - dropout_p) / n), ratio
    # no structure across heads, rows or keys: neighbouring masks differ
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0], kept[1])
    assert not torch.equal(kept[..., 0, :], kept[..., 1, :]) and not torch.equal(kept[..., 0], kept[..., 1])


def test_seeding(backend, device):
    """torch.manual_seed reproduces a run; another seed draws another mask; an explicit
    seed gives the same mask whatever the generator's state."""
    q, k, v = (torch.randn(1, 2, 24, 32, device=device) for _ in range(3))

    def run(**kwargs):
        return attention(q, k, v, dropout_p=0.4, backend=backend, **kwargs)

    torch.manual_seed(7)
    first = run()
    torch.manual_seed(7)
    assert torch.equal(run(), first)
    torch.manual_seed(8)
    assert not torch.equal(run(), first)
    explicit = run(dropout_seed=seed_tensor(99, device))
    torch.manual_seed(123)
    assert torch.equal(run(dropout_seed=seed_tensor(99, device)), explicit)


def test_edge_probabilities(backend, device):
    """p = 0 is no dropout; p = 1 drops everything: output and gradients 0."""
    q, k, v = (torch.randn(1, 2, 24, 32, device=device, requires_grad=True) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.0, backend=backend), attention(q, k, v, backend=backend))
    out = attention(q, k, v, dropout_p=1.0, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_attention_backward_with_dropout(backend, device):
    """The public backward regenerates the forward's mask from the same seed."""
    q, k, v = (torch.randn(1, 2, 30, 32, device=device, requires_grad=True) for _ in range(3))
    seed = seed_tensor(31337, device)
    out, lse = attention(q, k, v, is_causal=True, dropout_p=0.2, dropout_seed=seed, backend=backend,
                         return_lse=True)
    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), grad_out)
    got = attention_backward(grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                             is_causal=True, dropout_p=0.2, dropout_seed=seed, backend=backend)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs the forward's dropout_seed"):
        attention_backward(grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                           is_causal=True, dropout_p=0.2, backend=backend)


def test_torch_backend_dropout(device):
    """The "torch" backend hands dropout to SDPA (its own generator: no seed argument)."""
    q, k, v = (torch.randn(1, 2, 24, 32, device=device) for _ in range(3))
    torch.manual_seed(0)
    out = attention(q, k, v, dropout_p=0.5, backend="torch")
    assert not torch.equal(out, attention(q, k, v, backend="torch"))
    with pytest.raises(ValueError, match="dropout_seed is not supported by the 'torch' backend"):
        attention(q, k, v, dropout_p=0.5, dropout_seed=seed_tensor(1, device), backend="torch")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(dropout_p=-0.1), ValueError, r"dropout_p must be a probability, 0 <= dropout_p <= 1, got -0.1"),
        (dict(dropout_p=1.5), ValueError, r"dropout_p must be a probability"),
        (dict(dropout_p="0.1"), TypeError, r"dropout_p must be a real number"),
        (dict(dropout_p=0.1, dropout_seed=7), TypeError, r"dropout_seed must be a torch.Tensor or None, got int"),
        (dict(dropout_p=0.1, dropout_seed=torch.tensor([7])), None, None),
        (dict(dropout_p=0.1, dropout_seed=torch.tensor([7], dtype=torch.int32)), ValueError,
         r"dropout_seed must be an int64 tensor of one element, got int32 of shape \(1,\)"),
        (dict(dropout_p=0.1, dropout_seed=torch.tensor([7, 8])), ValueError, r"one element, got int64 of shape \(2,\)"),
    ],
)
def test_dropout_argument_errors(backend, device, kwargs, error, message):
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    if "dropout_seed" in kwargs and isinstance(kwargs["dropout_seed"], torch.Tensor):
        kwargs = dict(kwargs, dropout_seed=kwargs["dropout_seed"].to(device))
    if error is None:
        attention(q, k, v, backend=backend, **kwargs)  # a valid seed: accepted
        return
    with pytest.raises(error, match=message):
        attention(q, k, v, backend=backend, **kwargs)


def test_dropout_seed_on_another_device(backend, device):
    if device == "cpu":
        pytest.skip("needs a second device type: runs on the GPU")
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    with pytest.raises(ValueError, match="dropout_seed is on cpu but query is on"):
        attention(q, k, v, dropout_p=0.1, dropout_seed=torch.tensor([1]), backend=backend)


def test_dropout_compiles(backend, device):
    """torch.compile(fullgraph=True) with dropout drawn inside the graph: one graph,
    forward and backward; with an explicit seed it matches eager execution exactly."""
    import torch._dynamo

    from tests.conftest import DEVICE

    torch._dynamo.reset()
    seed = seed_tensor(5, device)

    def loss_fn(q, k, v, seed):
        out = attention(q, k, v, is_causal=True, dropout_p=0.3, dropout_seed=seed, backend=backend)
        return (out.float() ** 2).sum()

    def drawn(q, k, v):
        return attention(q, k, v, dropout_p=0.3, backend=backend)

    compiler = "inductor" if DEVICE == "cuda" else "aot_eager"
    q, k, v = (torch.randn(1, 2, 33, 32, dtype=f16, device=device, requires_grad=True) for _ in range(3))
    expected = torch.autograd.grad(loss_fn(q, k, v, seed), (q, k, v))
    got = torch.autograd.grad(torch.compile(loss_fn, fullgraph=True, backend=compiler)(q, k, v, seed), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    out = torch.compile(drawn, fullgraph=True, backend=compiler)(q, k, v)
    assert out.shape == q.shape and not out.isnan().any()


def test_opcheck_with_dropout(backend, device):
    from common.ops import OPS

    forward_op, backward_op = OPS[backend]
    q, k, v = (torch.randn(1, 2, 20, 32, dtype=f32, device=device) for _ in range(3))
    seed = seed_tensor(11, device)
    torch.library.opcheck(forward_op, (q, k, v, None, False, 0.2, 0.3, seed, [-1, -1, 0], 0.0, None))
    out, lse = forward_op(q, k, v, None, False, 0.2, 0.3, seed, [-1, -1, 0], 0.0, None)
    torch.library.opcheck(backward_op, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), None,
                                        out.detach(), lse.detach(), None, False, 0.2, 0.3, seed, [-1, -1, 0], 0.0))
