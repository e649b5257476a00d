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


@pytest.fixture
def layouts(monkeypatch):
    """The layout each varlen call of the test took: the rows per sequence, or None (packed)."""
    import common.varlen

    taken, choose = [], common.varlen._rows_per_sequence
    monkeypatch.setattr(common.varlen, "_rows_per_sequence", lambda *a: taken.append(choose(*a)) or taken[-1])
    return taken


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_varlen_forward_and_backward(backend, case, layouts):
    """Each case against every sequence alone; these short batches run laid out per sequence
    (a row block per sequence's rows)."""
    lens_q = _check_case(backend, case)
    assert layouts and layouts[0] is not None and layouts[0] % 16 == 0 and layouts[0] >= max(lens_q)


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=["case2", "case4"])
def test_varlen_packed_layout(backend, case, monkeypatch, layouts):
    """The packed layout (every row after the last, a row block holding several sequences' rows,
    each row its own band), which long sequences take, on the short batches: the same results."""
    import common.varlen

    monkeypatch.setattr(common.varlen, "SHORT_QUERIES", 0)
    _check_case(backend, case)
    assert layouts == [None]


def _check_case(backend, case):
    """Run one case through varlen_attention (output, log-sum-exp, gradients) against every
    sequence alone; returns its query lengths."""
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
    return lens_q


def test_varlen_short_maximum_gives_nan(backend, layouts):
    """Laid out per sequence, a sequence longer than max_seqlen_q (a wrong maximum: no host sync
    checks it) gives NaN in its rows past the maximum, never a silent 0; the others are right."""
    lens = [1, 150, 1, 2]  # (the second sequence longer than any row block)
    q, k, v = (torch.randn(sum(lens), 2, 16, device=DEVICE) for _ in range(3))
    out, lse = varlen_attention(q, k, v, _cu(lens), _cu(lens), 2, 150, True, backend=backend,
                                alignment="bottom_right", return_lse=True)
    rows = layouts[0]  # (max_seqlen_q rounded up to a row block)
    assert rows is not None and rows < 150
    past = torch.zeros(sum(lens), dtype=torch.bool, device=DEVICE)
    past[1 + rows:151] = True  # the second sequence's rows past the layout's
    assert out[past].isnan().all() and lse[:, past].isnan().all()
    expected, _ = _reference(*(t.double() for t in (q, k, v)), lens, lens, True, "bottom_right", None, None)
    torch.testing.assert_close(out[~past].double(), expected[~past], rtol=2e-4, atol=2e-4)


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


def _packed_reference(q, k, v, lens_q, lens_k, *, keep=None, dropout_p=0.0, sinks=None):
    """Bottom-right causal attention of the packed batch as one problem over its packed
    positions, in float64: row i sees key j when both are in sequence b and j's place in
    b is at most i's place + Lk_b - Lq_b; a sink logit per head joins each row's softmax;
    dropout keeps ``keep`` ((H, total_q, total_k), the kernels' mask at packed positions)
    scaled by 1 / (1 - p). Returns (total_q, H, Dv)."""
    seq_q = torch.repeat_interleave(torch.arange(len(lens_q)), torch.tensor(lens_q)).to(q.device)
    seq_k = torch.repeat_interleave(torch.arange(len(lens_k)), torch.tensor(lens_k)).to(q.device)
    cu_q, cu_k = _cu(lens_q).long(), _cu(lens_k).long()
    place_q = torch.arange(q.shape[0], device=q.device) - cu_q[seq_q]
    place_k = torch.arange(k.shape[0], device=q.device) - cu_k[seq_k]
    shift = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
    seen = (seq_q[:, None] == seq_k[None, :]) & (place_k[None, :] <= place_q[:, None] + shift[seq_q][:, None])
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.transpose(0, 1) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
    s = (qd @ kd.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[:, None, None].expand(-1, s.shape[1], 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :k.shape[0]]  # (rows with no key and no sink: 0)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return (p @ vd).transpose(0, 1)


def test_varlen_dropout_matches_its_mask(backend):
    """Dropout over packed sequences: the kernels' Philox mask at packed positions, forward and
    backward against the float64 reference with exactly that mask; the same seed, the same output."""
    from common.reference import dropout_keep

    lens_q, lens_k, p, seed = [3, 0, 9, 5], [6, 2, 9, 1], 0.3, 0x5EED
    q = torch.randn(sum(lens_q), 4, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    seed_tensor = torch.tensor([seed], dtype=torch.int64, device=DEVICE)
    out = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), 9, 9, True, enable_gqa=True, backend=backend,
                           alignment="bottom_right", dropout_p=p, dropout_seed=seed_tensor)
    keep = dropout_keep(seed, 1, 4, sum(lens_q), sum(lens_k), p, device=DEVICE)[0]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = _packed_reference(*leaves, lens_q, lens_k, keep=keep, dropout_p=p)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    _check_grads(out, expected, (q, k, v), leaves, 1e-3)
    again = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), 9, 9, True, enable_gqa=True, backend=backend,
                             alignment="bottom_right", dropout_p=p, dropout_seed=seed_tensor)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_varlen_sinks(backend):
    """A sink logit per head in every packed row's softmax (a row of an empty-keyed sequence gives 0);
    the sinks' gradient too."""
    lens_q, lens_k = [4, 2, 7], [6, 0, 7]
    q = torch.randn(sum(lens_q), 4, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 4, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    out, lse = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), 7, 7, True, backend=backend,
                                alignment="bottom_right", sinks=sinks, return_lse=True)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    expected = _packed_reference(*leaves[:3], lens_q, lens_k, sinks=leaves[3])
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    assert torch.isfinite(lse).all()  # (the sink is in every row's log-sum-exp)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.double())
    for name, got, leaf in zip(("dq", "dk", "dv", "dsinks"), (q, k, v, sinks), leaves):
        torch.testing.assert_close(got.grad.double(), leaf.grad, rtol=1e-3, atol=1e-3,
                                   msg=lambda m, n=name: f"{n}: {m}")
