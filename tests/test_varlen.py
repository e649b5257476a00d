"""varlen_attention: packed variable-length batches against each sequence alone (float64 reference)."""

from __future__ import annotations

import pytest
import torch

from common import varlen_attention
from tests.conftest import DEVICE

f16, f32 = torch.float16, torch.float32

CASES = [  # (lens_q, lens_k, H, H_kv, D, Dv, is_causal, alignment, window, softcap, dtype)
    ([5, 0, 17, 70, 1], None, 4, 2, 32, 32, False, "top_left", None, None, f32),  # empty and length-1 sequences
    ([5, 0, 17, 70, 1], None, 2, 2, 32, 32, True, "top_left", None, None, f16),
    ([3, 20, 0, 9, 6], [10, 5, 7, 0, 6], 2, 1, 16, 16, True, "bottom_right", (4, 0), None, f32),  # rows with no keys
    ([40, 23], [31, 64], 2, 2, 16, 32, False, "top_left", (3, 5), 2.0, f32),  # Dv != D, window, soft-capping
    ([1] * 9, None, 2, 2, 16, 16, True, "top_left", None, None, f32),  # decoding-like: one row per sequence
]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _reference(q, k, v, lens_q, lens_k, is_causal, alignment, window, softcap):
    """Each sequence alone, in float64: (out (total_q, H, Dv), lse (H, total_q))."""
    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for b in range(len(lens_q)):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        Lq, Lk = qs.shape[1], ks.shape[1]
        s = qs @ ks.transpose(-1, -2) * q.shape[-1] ** -0.5
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        offset = torch.arange(Lk, device=q.device)[None, :] - torch.arange(Lq, device=q.device)[:, None]
        offset = offset - (Lk - Lq if alignment == "bottom_right" else 0)
        keep = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
        if is_causal:
            keep &= offset <= 0
        if window is not None:
            keep &= (offset >= -window[0]) if window[0] >= 0 else keep
            keep &= (offset <= window[1]) if window[1] >= 0 else keep
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def _case_inputs(case, dtype):
    """A case's lengths and packed (q, k, v) leaves that require grad, and their float64 copies."""
    lens_q, lens_k, H, H_kv, D, Dv = case[:6]
    lens_k = lens_k or lens_q
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(sum(lens_k), H_kv, D, device=DEVICE, dtype=dtype)
    v = torch.randn(sum(lens_k), H_kv, Dv, device=DEVICE, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return lens_q, lens_k, leaves, [t.double().requires_grad_() for t in (q, k, v)]


def _check_grads(out, expected, leaves, refs, tol):
    """Backpropagate one random grad_out through both and compare dq, dk, dv."""
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, refs):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_varlen_forward_and_backward(backend, case):
    _, _, H, H_kv, D, Dv, is_causal, alignment, window, softcap, dtype = case
    lens_q, lens_k, leaves, refs = _case_inputs(case, dtype)
    out, lse = varlen_attention(*leaves, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), is_causal,
                                enable_gqa=H_kv < H, backend=backend, return_lse=True, alignment=alignment,
                                window=window, softcap=softcap)
    expected, expected_lse = _reference(*refs, lens_q, lens_k, is_causal, alignment, window, softcap)
    assert out.shape == (sum(lens_q), H, Dv) and out.dtype == dtype and lse.shape == (H, sum(lens_q))
    tol = {f32: 2e-4, f16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), expected.detach(), rtol=tol, atol=tol)
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)  # -inf exactly for the rows with no key
    torch.testing.assert_close(lse[seen].double(), expected_lse[seen].detach(), rtol=tol, atol=tol)
    _check_grads(out, expected, leaves, refs, tol)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_varlen_torch_backend(case):
    """The reference backend (SDPA on the sequences padded to the maxima, each row's keys as
    a mask) agrees too, forward and backward (it gives no log-sum-exp and no soft-capping)."""
    _, _, H, H_kv, D, Dv, is_causal, alignment, window, _, _ = case
    lens_q, lens_k, leaves, refs = _case_inputs(case, f32)
    out = varlen_attention(*leaves, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), is_causal,
                           enable_gqa=H_kv < H, backend="torch", alignment=alignment, window=window)
    expected, _ = _reference(*refs, lens_q, lens_k, is_causal, alignment, window, None)
    assert out.shape == (sum(lens_q), H, Dv)
    torch.testing.assert_close(out.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    _check_grads(out, expected, leaves, refs, 1e-5)


def test_varlen_torch_backend_checks_the_maxima():
    """The reference pads to the maxima: maxima shorter than a sequence are an error there."""
    lens = [3, 9]
    q, k, v = (torch.randn(sum(lens), 2, 16, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match="max_seqlen_q is 8 but a sequence has 9 tokens"):
        varlen_attention(q, k, v, _cu(lens), _cu(lens), 8, 9, backend="torch")
    with pytest.raises(ValueError, match="max_seqlen_k is 4 but a sequence has 9 tokens"):
        varlen_attention(q, k, v, _cu(lens), _cu(lens), 9, 4, backend="torch")


def test_varlen_without_host_sync(backend, monkeypatch):
    """Nothing on the launch path reads a device value back (``.item()``, ``.tolist()``,
    ``int()``, ``bool()``); on a GPU, CUDA's sync debug mode checks the same."""
    lens = [6, 0, 11]
    q, k, v = (torch.randn(sum(lens), 2, 16, device=DEVICE) for _ in range(3))
    cu = _cu(lens)

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync on varlen_attention's launch path")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = varlen_attention(q, k, v, cu, cu, 11, 11, True, backend=backend)
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    expected, _ = _reference(q.double(), k.double(), v.double(), lens, lens, True, "top_left", None, None)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)


def test_varlen_compiles_in_one_graph(backend):
    """torch.compile(fullgraph=True), forward and backward, matches eager execution."""
    import torch._dynamo

    torch._dynamo.reset()
    lens = [9, 0, 20]
    cu = _cu(lens)

    def loss_fn(q, k, v):
        return (varlen_attention(q, k, v, cu, cu, 20, 20, True, backend=backend).float() ** 2).sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    q, k, v = (torch.randn(sum(lens), 2, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    expected = torch.autograd.grad(loss_fn(q, k, v), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_varlen_errors():
    q = torch.randn(10, 2, 16, device=DEVICE)
    cu = _cu([4, 6])
    with pytest.raises(ValueError, match="query must be 3-D"):
        varlen_attention(q[None], q, q, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        varlen_attention(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        varlen_attention(q, q, q, cu, [0, 4, 10], 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must be 1-D"):
        varlen_attention(q, q, q, cu, cu[None], 6, 6)
    with pytest.raises(ValueError, match="as many sequences"):
        varlen_attention(q, q, q, cu, _cu([4, 3, 3]), 6, 6)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int >= 0"):
        varlen_attention(q, q, q, cu, cu, 6, 6.0)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int >= 0"):
        varlen_attention(q, q, q, cu, cu, -1, 6)
    with pytest.raises(ValueError, match="describe no sequence"):
        varlen_attention(q, q, q, cu[:1], cu[:1], 0, 0)
    with pytest.raises(ValueError, match="enable_gqa"):
        varlen_attention(q, q[:, :1], q[:, :1], cu, cu, 6, 6)
    with pytest.raises(TypeError, match="dtype"):
        varlen_attention(q, q.half(), q, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="window must be None or a pair"):
        varlen_attention(q, q, q, cu, cu, 6, 6, window=(2,))
