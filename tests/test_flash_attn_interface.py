"""common.flash_attn_interface against FlashAttention 2's documented behaviour.

The reference below is written from FlashAttention's docstrings alone, in float64: its
(batch, seqlen, heads, head_dim) layout; causal and windows aligned bottom-right (query i
at key position i + Lk - Lq, seeing keys [pos - left, pos + right], causal a right bound
of 0); soft-capping of the scaled scores; key/value heads shared by consecutive query
heads; a row that sees no key gives 0 and a log-sum-exp of +inf; ALiBi's bias
-slope * |i + Lk - Lq - j| added to the (soft-capped) scores.
"""

from __future__ import annotations

import math

import pytest
import torch

from common import flash_attn_interface as fa
from common.backends import ANY_PAGE, get_backend
from tests.conftest import DEVICE

f32 = torch.float32


def _reference(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, alibi_slopes=None, keep=None,
               dropout_p=0.0, with_probs=False):
    """FlashAttention's forward in float64 on (B, Lq, H, D), (B, Lk, H_kv, D), (B, Lk, H_kv, Dv):
    (out (B, Lq, H, Dv), lse (B, H, Lq)); with ``keep`` ((B, H, Lq, Lk) bool), the probabilities
    dropout keeps, scaled by 1 / (1 - dropout_p); ``with_probs``: the softmax (B, H, Lq, Lk) too."""
    q, k, v = (t.double() for t in (q, k, v))
    B, Lq, H, D = q.shape
    Lk, H_kv = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(H // H_kv, dim=2) for t in (k, v))
    scale = 1 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    pos = torch.arange(Lq, device=q.device)[:, None] + Lk - Lq
    j = torch.arange(Lk, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.double().expand(B, H)[:, :, None, None] * (pos - j).abs().double()
    left, right = window
    right = 0 if causal else right
    seen = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
    if left >= 0:
        seen &= j >= pos - left
    if right >= 0:
        seen &= j <= pos + right
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # (a row with no key: 0)
    dropped = p if keep is None else p * keep / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", dropped, v)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    return (out, lse, p) if with_probs else (out, lse)


def _inputs(B, Lq, Lk, H, H_kv, D, Dv=None, dtype=f32, grad=False):
    q = torch.randn(B, Lq, H, D, device=DEVICE, dtype=dtype)
    k = torch.randn(B, Lk, H_kv, D, device=DEVICE, dtype=dtype)
    v = torch.randn(B, Lk, H_kv, Dv or D, device=DEVICE, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _close(got, expected, tol=2e-4):
    torch.testing.assert_close(got.double(), expected.double(), rtol=tol, atol=tol)


def _check_grads(out, expected, inputs, leaves):
    """One random output gradient through both: each input's gradient against its float64 leaf's."""
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.double())
    for got, leaf in zip(inputs, leaves):
        _close(got.grad, leaf.grad, 1e-3)


@pytest.mark.parametrize("Lq,Lk,causal,window,softcap", [
    (5, 9, True, (-1, -1), 0.0),  # decode-like rows at the bottom of the keys
    (9, 5, True, (-1, -1), 0.0),  # more rows than keys: the top rows see none
    (7, 7, False, (2, 1), 0.0),  # a window both ways
    (6, 11, True, (3, -1), 2.5),  # a causal sliding window, soft-capped
    (8, 6, False, (-1, -1), 0.0),
])
def test_func_matches_flash_attention(backend, Lq, Lk, causal, window, softcap):
    q, k, v = _inputs(2, Lq, Lk, 4, 2, 16)
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                         return_attn_probs=True, backend=backend)
    expected, expected_lse = _reference(q, k, v, causal, window, softcap)
    assert out.shape == (2, Lq, 4, 16) and out.is_contiguous() and out.dtype == q.dtype
    assert lse.shape == (2, 4, Lq) and lse.dtype == torch.float32
    assert probs.numel() == 0 and probs.dtype == q.dtype  # FlashAttention's S_dmask without dropout
    _close(out, expected)
    _close(lse, expected_lse)  # (+inf where a row sees no key)
    plain = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, backend=backend)
    torch.testing.assert_close(plain, out, rtol=0, atol=0)
    # the window as FlashAttention's own tests pass it: a (2,) integer tensor
    as_tensor = fa.flash_attn_func(q, k, v, causal=causal, window_size=torch.tensor(window), softcap=softcap,
                                   backend=backend)
    torch.testing.assert_close(as_tensor, out, rtol=0, atol=0)
    # any negative bound is unbounded, as FlashAttention's check (< 0) takes it
    if min(window) < 0:
        other = tuple(-7 if w < 0 else w for w in window)
        beyond = fa.flash_attn_func(q, k, v, causal=causal, window_size=other, softcap=softcap, backend=backend)
        torch.testing.assert_close(beyond, out, rtol=0, atol=0)


@pytest.mark.parametrize("Lq,Lk,causal,window,softcap,per_batch", [
    (5, 9, False, (-1, -1), 0.0, False),  # no mask: the alignment still matters (the bias)
    (9, 5, True, (-1, -1), 0.0, True),
    (6, 11, True, (3, -1), 2.5, False),
    (7, 7, False, (2, 1), 0.0, True),
    (1, 12, True, (-1, -1), 0.0, False),  # a decode step
])
def test_func_with_alibi(backend, Lq, Lk, causal, window, softcap, per_batch):
    q, k, v = _inputs(2, Lq, Lk, 4, 2, 16, grad=True)
    slopes = torch.rand((2, 4) if per_batch else (4,), device=DEVICE) * 0.5 + 0.1
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                     alibi_slopes=slopes, return_attn_probs=True, backend=backend)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = _reference(*leaves, causal, window, softcap, alibi_slopes=slopes)
    _close(out, expected)
    _close(lse, expected_lse)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad.double())
    for got, leaf in zip((q, k, v), leaves):
        _close(got.grad, leaf.grad, 1e-3)
    kv = torch.stack([k.detach(), v.detach()], 2)
    packed = fa.flash_attn_kvpacked_func(q.detach(), kv, causal=causal, window_size=window, softcap=softcap,
                                         alibi_slopes=slopes, backend=backend)
    _close(packed, expected.detach())


def test_func_gradients(backend):
    """Causal, grouped heads, a scale and Dv != D: dq, dk, dv as the float64 reference's."""
    q, k, v = _inputs(1, 6, 10, 4, 1, 16, Dv=32, grad=True)
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, backend=backend)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _ = _reference(*leaves, causal=True, scale=0.3)
    _check_grads(out, expected, (q, k, v), leaves)


def test_func_half_precision_and_one_query_row(backend):
    """A decode step, fp16: bottom-right causal with one row sees every key."""
    q, k, v = _inputs(3, 1, 40, 8, 2, 64, dtype=torch.float16)
    out = fa.flash_attn_func(q, k, v, causal=True, backend=backend)
    _close(out, _reference(q, k, v, causal=True)[0], 2e-3)


def test_dropout_is_seeded_and_applied(backend):
    q, k, v = _inputs(1, 8, 8, 2, 2, 16)
    torch.manual_seed(3)
    first = fa.flash_attn_func(q, k, v, dropout_p=0.4, backend=backend)
    torch.manual_seed(3)
    again = fa.flash_attn_func(q, k, v, dropout_p=0.4, backend=backend)
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first, fa.flash_attn_func(q, k, v, backend=backend))


def test_packed_functions_match_unpacked(backend):
    qkv = torch.randn(2, 7, 3, 4, 16, device=DEVICE, requires_grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, backend=backend)
    _close(out, _reference(*qkv.detach().unbind(2), causal=True)[0])
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and torch.isfinite(qkv.grad).all()
    slopes = torch.rand(4, device=DEVICE)
    out = fa.flash_attn_qkvpacked_func(qkv.detach(), causal=True, alibi_slopes=slopes, backend=backend)
    _close(out, _reference(*qkv.detach().unbind(2), causal=True, alibi_slopes=slopes)[0])
    q = torch.randn(2, 3, 4, 16, device=DEVICE)
    kv = torch.randn(2, 9, 2, 2, 16, device=DEVICE)
    out, lse, _ = fa.flash_attn_kvpacked_func(q, kv, window_size=(4, 0), return_attn_probs=True, backend=backend)
    expected, expected_lse = _reference(q, *kv.unbind(2), window=(4, 0))
    _close(out, expected)
    _close(lse, expected_lse)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _varlen_reference(q, k, v, lens_q, lens_k, **kwargs):
    """Each sequence alone through _reference: (out (total_q, H, Dv), lse (H, total_q))."""
    outs, lses = [], []
    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for b in range(len(lens_q)):
        out, lse = _reference(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                              v[None, cu_k[b]:cu_k[b + 1]], **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (2, 1), 3.0)])
def test_varlen_matches_flash_attention(backend, causal, window, softcap):
    lens_q, lens_k = [3, 0, 7, 4], [5, 2, 4, 4]  # an empty sequence; one with more rows than keys
    q = torch.randn(sum(lens_q), 4, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                                causal=causal, window_size=window, softcap=softcap,
                                                return_attn_probs=True, backend=backend)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = _varlen_reference(*leaves, lens_q, lens_k, causal=causal, window=window,
                                               softcap=softcap)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (4, sum(lens_q)) and probs.numel() == 0
    _close(out, expected)
    torch.testing.assert_close(lse.double(), expected_lse.detach(), rtol=2e-4, atol=2e-4)
    _check_grads(out, expected, (q, k, v), leaves)


def _check_s_dmask(S, q, k, v, p, **mask):
    """One sequence's S_dmask (B, H, Lq, Lk) against the float64 reference: |S| over its row sums is
    the softmax, nonzero exactly where a row sees a key; its sign is the dropout mask, by which the
    reference then drops. Returns that reference's (out, leaves, number of scores seen, dropped)."""
    S = S.double()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected, _, weights = _reference(*leaves, keep=S >= 0, dropout_p=p, with_probs=True, **mask)
    seen = weights.detach() > 0
    assert torch.equal(S != 0, seen)
    _close(S.abs() / S.abs().sum(-1, keepdim=True).clamp_min(1e-300), weights.detach())
    return expected, leaves, int(seen.sum()), int((S < 0).sum())


@pytest.mark.parametrize("Lq,Lk,causal,window,alibi", [
    (7, 11, True, (-1, -1), False),  # rows at the bottom of the keys
    (9, 5, False, (2, 1), True),  # a window both ways, ALiBi
    (12, 12, False, (-1, -1), False),
])
def test_func_dropout_probs_are_its_mask(backend, Lq, Lk, causal, window, alibi):
    """return_attn_probs with dropout (what FlashAttention's own tests read): S_dmask of shape (B, H,
    Lq, Lk) rounded up to 128, q's dtype, 0 past the lengths; the probabilities, and the mask by which
    the output and its gradients were dropped (``_check_s_dmask``); about p of the scores dropped."""
    B, H, p = 2, 4, 0.3
    q, k, v = _inputs(B, Lq, Lk, H, 2, 16, grad=True)
    slopes = torch.rand(H, device=DEVICE) * 0.5 + 0.1 if alibi else None
    out, lse, probs = fa.flash_attn_func(q, k, v, p, causal=causal, window_size=window, alibi_slopes=slopes,
                                         return_attn_probs=True, backend=backend)
    assert probs.shape == (B, H, 128, 128) and probs.dtype == q.dtype and not probs.requires_grad
    assert not probs[:, :, Lq:].any() and not probs[:, :, :, Lk:].any()
    expected, leaves, seen, dropped = _check_s_dmask(probs[:, :, :Lq, :Lk], q, k, v, p, causal=causal,
                                                     window=window, alibi_slopes=slopes)
    _close(out, expected)
    _check_grads(out, expected, (q, k, v), leaves)
    assert abs(dropped / seen - p) < 0.12  # (some 300-1200 scores: 5 standard deviations)


def test_varlen_dropout_probs_are_its_mask(backend):
    """S_dmask of packed sequences: (batch, H, max_seqlen_q, max_seqlen_k) rounded up to 128, sequence
    b's probabilities and mask in its corner (its draws counted by packed positions), 0 elsewhere."""
    lens_q, lens_k, p = [3, 0, 7, 4], [5, 2, 4, 9], 0.4
    q = torch.randn(sum(lens_q), 4, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    out, _, probs = fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), 7, 9, p, causal=True,
                                              return_attn_probs=True, backend=backend)
    assert probs.shape == (4, 4, 128, 128) and probs.dtype == q.dtype and not probs.requires_grad
    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    seen = dropped = 0
    grad = torch.randn_like(out)
    out.backward(grad)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        assert not probs[b, :, lq:].any() and not probs[b, :, :, lk:].any()
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        expected, leaves, n_seen, n_dropped = _check_s_dmask(probs[b:b + 1, :, :lq, :lk], q[None, rows],
                                                             k[None, keys], v[None, keys], p, causal=True)
        seen, dropped = seen + n_seen, dropped + n_dropped
        _close(out[rows], expected[0])
        expected.backward(grad[None, rows].double())
        for got, leaf, part in zip((q, k, v), leaves, (rows, keys, keys)):
            _close(got.grad[part], leaf.grad[0], 1e-3)
    assert abs(dropped / seen - p) < 0.15


def test_varlen_dropout_is_seeded_and_applied(backend):
    lens = [5, 3]
    q, k, v = (torch.randn(8, 2, 16, device=DEVICE) for _ in range(3))
    outs = []
    for p in (0.5, 0.5, 0.0):
        torch.manual_seed(11)
        outs.append(fa.flash_attn_varlen_func(q, k, v, _cu(lens), _cu(lens), 5, 5, dropout_p=p, causal=True,
                                              backend=backend))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[2])


def test_varlen_packed_functions(backend):
    lens = [4, 1, 6]
    qkv = torch.randn(sum(lens), 3, 2, 16, device=DEVICE)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, _cu(lens), max(lens), causal=True, backend=backend)
    _close(out, _varlen_reference(*qkv.unbind(1), lens, lens, causal=True)[0])
    q = torch.randn(sum(lens), 4, 16, device=DEVICE)
    kv = torch.randn(12, 2, 2, 16, device=DEVICE)
    lens_k = [2, 7, 3]
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, _cu(lens), _cu(lens_k), max(lens), max(lens_k), causal=True,
                                             backend=backend)
    _close(out, _varlen_reference(q, *kv.unbind(1), lens, lens_k, causal=True)[0])


@pytest.mark.parametrize("causal,window,per_seq", [(True, (-1, -1), False), (False, (-1, -1), True),
                                                    (True, (3, -1), True)])
def test_varlen_with_alibi(backend, causal, window, per_seq):
    """ALiBi over packed sequences: each row biased from its position in its own sequence
    (bottom-right, as FlashAttention's), the slopes per head or per sequence and head; the output,
    its log-sum-exp and the gradients as each sequence alone in float64."""
    lens_q, lens_k = [3, 0, 7, 4], [5, 2, 4, 9]
    q = torch.randn(sum(lens_q), 4, 16, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), 2, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    slopes = torch.rand((4, 4) if per_seq else (4,), device=DEVICE) * 0.5 + 0.1
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                            causal=causal, window_size=window, alibi_slopes=slopes,
                                            return_attn_probs=True, backend=backend)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    for b in range(len(lens_q)):
        one, one_lse = _reference(leaves[0][None, cu_q[b]:cu_q[b + 1]], leaves[1][None, cu_k[b]:cu_k[b + 1]],
                                  leaves[2][None, cu_k[b]:cu_k[b + 1]], causal, window,
                                  alibi_slopes=slopes[b] if per_seq else slopes)
        outs.append(one[0])
        lses.append(one_lse[0])
    expected, expected_lse = torch.cat(outs), torch.cat(lses, dim=1)
    _close(out, expected)
    torch.testing.assert_close(lse.double(), expected_lse.detach(), rtol=2e-4, atol=2e-4)
    _check_grads(out, expected, (q, k, v), leaves)
    if backend == "triton":  # (once) the torch backend: SDPA on the padded sequences, the bias as a mask
        padded = fa.flash_attn_varlen_func(q.detach(), k.detach(), v.detach(), _cu(lens_q), _cu(lens_k),
                                           max(lens_q), max(lens_k), causal=causal, window_size=window,
                                           alibi_slopes=slopes, backend="torch")
        _close(padded, expected.detach())
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(4, 4\)"):
        fa.flash_attn_varlen_func(q, k, v, _cu(lens_q), _cu(lens_k), 7, 9, alibi_slopes=slopes[:3],
                                  backend=backend)


def test_arguments_it_does_not_take_yet_are_refused():
    """What block_table refuses; S_dmask with dropout on the torch backend."""
    q, k, v = _inputs(1, 4, 4, 2, 2, 16)
    packed = q[0], k[0], v[0]
    cu = _cu([4])
    pages = torch.randn(2, 16, 2, 16, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="dropout_p must be 0 with block_table"):
        fa.flash_attn_varlen_func(packed[0], pages, pages, cu, cu, 4, 4, dropout_p=0.1, block_table=table)
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        fa.flash_attn_varlen_func(*packed, cu, cu, 4, 4, block_table=table)
    with pytest.raises(ValueError, match="max_seqlen_q is 0"):
        fa.flash_attn_varlen_func(packed[0], pages, pages, cu, cu, 0, 4, block_table=table)
    with pytest.raises(ValueError, match="S_dmask"):  # (SDPA's dropout mask is not exposed)
        fa.flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True, backend="torch")


@pytest.mark.parametrize("call,error,words", [
    (lambda q, k, v: fa.flash_attn_func(q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=(2,)), TypeError, "window_size"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=torch.tensor([2.0, 1.0])), TypeError, "window_size"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, window_size=(True, 0)), TypeError, "window_size"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, softcap="none"), TypeError, "softcap"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, causal=1), TypeError, "causal"),
    (lambda q, k, v: fa.flash_attn_func(q, k, v, deterministic=None), TypeError, "deterministic"),
    (lambda q, k, v: fa.flash_attn_qkvpacked_func(torch.stack([q, k], 2)), ValueError, "qkv must stack 3"),
    (lambda q, k, v: fa.flash_attn_func(q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)),
     ValueError, "multiple"),
])
def test_bad_arguments_name_themselves(call, error, words):
    q, k, v = _inputs(1, 4, 4, 2, 2, 16)
    with pytest.raises(error, match=words):
        call(q, k, v)


def test_backend_is_chosen_as_everywhere(monkeypatch):
    """The environment variable and use_backend reach these functions too; "torch" is SDPA."""
    from common import use_backend

    q, k, v = _inputs(1, 5, 7, 2, 1, 16)
    expected = _reference(q, k, v, causal=True)[0]
    with use_backend("torch"):
        _close(fa.flash_attn_func(q, k, v, causal=True), expected)
    monkeypatch.setenv("ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="ATTENTION_BACKEND"):
        fa.flash_attn_func(q, k, v)


# -- flash_attn_with_kvcache ---------------------------------------------------------------------------

def _kvcache_reference(q, keys, values, alibi_slopes=None, **kwargs):
    """Each sequence over its own keys (lists of (Lk_b, H_kv, D)): (out (B, Lq, H, Dv), lse (B, H, Lq))."""
    def slopes(b):
        return alibi_slopes if alibi_slopes is None or alibi_slopes.ndim == 1 else alibi_slopes[b:b + 1]

    outs, lses = zip(*(_reference(q[b:b + 1], keys[b][None], values[b][None], alibi_slopes=slopes(b), **kwargs)
                       for b in range(len(keys))))
    return torch.cat(outs), torch.cat(lses)


def _appended(cache, rows, seqlens, new):
    """The cache as FlashAttention leaves it: row rows[b] holds new[b] from position seqlens[b]."""
    expected = cache.clone()
    if new is not None:
        for b, (row, n) in enumerate(zip(rows, seqlens)):
            expected[row, n:n + new.shape[1]] = new[b]
    return expected


@pytest.mark.parametrize("B_cache,rows,seqlens,L_new,causal,window,softcap,num_splits", [
    (2, None, None, 0, False, (-1, -1), 0.0, 0),  # the whole cache, nothing appended
    (2, None, 20, 2, True, (-1, -1), 0.0, 1),  # an int for every sequence, unsplit
    (2, None, [5, 27], 3, True, (4, 0), 2.0, 3),  # append; a causal window, soft-capped (3 splits of 1 block)
    (3, [2, 0], [9, 0], 2, False, (-1, -1), 0.0, 0),  # more cache rows than sequences, an empty cache
    (2, [1, 0], [30, 12], 2, True, (-1, -1), 0.0, 0),  # a permutation; a cache filled to its end
    (2, None, [0, 1], 0, True, (-1, -1), 0.0, 0),  # no keys, one key: rows that see none (0, lse +inf)
])
def test_kvcache_contiguous(backend, B_cache, rows, seqlens, L_new, causal, window, softcap, num_splits):
    B, S, H, H_kv, D, Lq = 2, 32, 4, 2, 16, 3
    q = torch.randn(B, Lq, H, D, device=DEVICE, requires_grad=True)
    k_cache, v_cache = (torch.randn(B_cache, S, H_kv, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, L_new, H_kv, D, device=DEVICE) if L_new else None for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    lens = [S] * B if seqlens is None else [seqlens] * B if isinstance(seqlens, int) else seqlens
    arg = seqlens if not isinstance(seqlens, list) else torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    idx = None if rows is None else torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=arg, cache_batch_idx=idx,
                                          causal=causal, window_size=window, softcap=softcap,
                                          num_splits=num_splits, return_softmax_lse=True, backend=backend)
    rows = list(range(B)) if rows is None else rows
    expected_k, expected_v = (_appended(c, rows, lens, new) for c, new in zip(before, (k, v)))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)  # those slots, and only those
    ends = [n + L_new for n in lens]
    keys = [expected_k[row, :end] for row, end in zip(rows, ends)]
    values = [expected_v[row, :end] for row, end in zip(rows, ends)]
    expected, expected_lse = _kvcache_reference(q.detach(), keys, values, causal=causal, window=window,
                                                softcap=softcap)
    assert out.shape == (B, Lq, H, D) and out.is_contiguous() and not out.requires_grad
    assert lse.shape == (B, H, Lq) and lse.dtype == torch.float32
    _close(out, expected)
    _close(lse, expected_lse)  # (+inf for the rows of an empty sequence)


@pytest.mark.parametrize("layout,S,stored", [
    ("slice", 32, 48),  # rows 48 positions apart: pages of 16
    ("heads_first", 32, 32),  # a (B, H_kv, S, D) cache transposed
    ("rows", 37, 37),  # seqlen_cache odd (FlashAttention's tests take 339, 799, ...): pages of one key
    ("slice", 36, 40),  # rows 40 positions apart, 36 of them used: pages of 4
])
def test_kvcache_strided_caches(backend, layout, S, stored):
    """Contiguous caches of any seqlen_cache, rows seqlen_cache or more positions apart, paged
    as views all the same (pages of the largest power of two that divides both)."""
    B, H, H_kv, D, L_new = 2, 2, 2, 16, 2
    q = torch.randn(B, 2, H, D, device=DEVICE)
    if layout == "heads_first":
        buffers = [torch.randn(B, H_kv, S, D, device=DEVICE) for _ in range(2)]
        k_cache, v_cache = (t.transpose(1, 2) for t in buffers)
    else:
        buffers = [torch.randn(B, stored, H_kv, D, device=DEVICE) for _ in range(2)]
        k_cache, v_cache = (t[:, :S] for t in buffers)
    k, v = (torch.randn(B, L_new, H_kv, D, device=DEVICE) for _ in range(2))
    lens = [7, 30]
    rows = [1, 0]
    before = [t.clone() for t in buffers]
    expected_k, expected_v = (_appended(c.clone(), rows, lens, new) for c, new in zip((k_cache, v_cache), (k, v)))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    batch_idx = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    if math.gcd(S, stored) % 16 and not get_backend(backend).supports(ANY_PAGE):  # (NineToothed's: 16s)
        with pytest.raises(ValueError, match="multiples of 16"):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                       causal=True, backend=backend)
        assert all(torch.equal(t, old) for t, old in zip(buffers, before))  # (refused before writing)
        return
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
                                     causal=True, backend=backend)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    if stored > S:  # (the positions past the slice untouched)
        assert all(torch.equal(t[:, S:], old[:, S:]) for t, old in zip(buffers, before))
    expected, _ = _kvcache_reference(q, [expected_k[r, :n + L_new] for r, n in zip(rows, lens)],
                                     [expected_v[r, :n + L_new] for r, n in zip(rows, lens)], causal=True)
    _close(out, expected)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kvcache_num_splits(backend, monkeypatch, num_splits):
    """num_splits reaches the planner: 384 keys (pages of 64, three key blocks of the interpreter's 128)."""
    import common.paged as paged

    launched = []
    launch = paged._launch
    monkeypatch.setattr(paged, "_launch", lambda chosen, plan: launched.append(plan.num_splits) or launch(chosen, plan))
    B, S, H, H_kv, D = 2, 384, 2, 1, 16
    q = torch.randn(B, 2, H, D, device=DEVICE)
    k_cache, v_cache = (torch.randn(B, S, H_kv, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, 2, H_kv, D, device=DEVICE) for _ in range(2))
    lens = [100, 382]
    before = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                     cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE), causal=True,
                                     num_splits=num_splits, backend=backend)
    assert launched == [num_splits]
    expected_k, expected_v = (_appended(c, range(B), lens, new) for c, new in zip(before, (k, v)))
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    expected, _ = _kvcache_reference(q, [expected_k[b, :lens[b] + 2] for b in range(B)],
                                     [expected_v[b, :lens[b] + 2] for b in range(B)], causal=True)
    _close(out, expected)


def test_kvcache_paged(backend):
    """A shuffled block table of 16-key pages, grouped heads, an append across a page boundary; a causal
    window, soft-capping and ALiBi's slopes per sequence and head."""
    B, H, H_kv, D, Lq, page, L_new = 2, 4, 1, 16, 2, 16, 3
    num_blocks, per_seq = 7, 3
    q = torch.randn(B, Lq, H, D, device=DEVICE)
    k_cache, v_cache = (torch.randn(num_blocks, page, H_kv, D, device=DEVICE) for _ in range(2))
    table = torch.randperm(num_blocks, device=DEVICE)[:B * per_seq].view(B, per_seq).to(torch.int32)
    k, v = (torch.randn(B, L_new, H_kv, D, device=DEVICE) for _ in range(2))
    lens = [14, 40]
    slopes = torch.rand(B, H, device=DEVICE)
    before = k_cache.clone(), v_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                          cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                          block_table=table, causal=True, window_size=(5, -1), softcap=3.0,
                                          alibi_slopes=slopes, return_softmax_lse=True, backend=backend)
    expected_caches = []
    for cache, new in zip(before, (k, v)):
        dense = cache[table.long()].flatten(1, 2)  # (B, per_seq * page, H_kv, D): each sequence's keys in order
        dense = _appended(dense, range(B), lens, new)
        written = cache.clone()
        written[table.long()] = dense.view(B, per_seq, page, H_kv, D)
        expected_caches.append((written, dense))
    (expected_k, keys), (expected_v, values) = expected_caches
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    ends = [n + L_new for n in lens]
    expected, expected_lse = _kvcache_reference(q, [keys[b, :ends[b]] for b in range(B)],
                                                [values[b, :ends[b]] for b in range(B)], causal=True,
                                                window=(5, -1), softcap=3.0, alibi_slopes=slopes)
    _close(out, expected)
    _close(lse, expected_lse)
    ends = torch.tensor(ends, dtype=torch.int32, device=DEVICE)  # the same cache, nothing appended
    plain = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=ends, block_table=table, causal=True,
                                       window_size=(5, -1), softcap=3.0, alibi_slopes=slopes, backend=backend)
    _close(plain, expected)


def _rotated(x, cos, sin, positions, interleaved):
    """FlashAttention's rotary embedding in float64, from its definition: x (B, L, H, D) at
    positions (B, L); pairs (0, 1), (2, 3), ... (interleaved) or (i, R / 2 + i) of the first R dims."""
    R = 2 * cos.shape[1]
    c, s = (t.double()[positions.long()][:, :, None, :] for t in (cos, sin))  # (B, L, 1, R / 2)
    x = x.double()
    if interleaved:
        x1, x2 = x[..., 0:R:2], x[..., 1:R:2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)
    else:
        x1, x2 = x[..., :R // 2], x[..., R // 2:R]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([rotated, x[..., R:]], -1)


@pytest.mark.parametrize("interleaved,causal,window,R", [
    (True, True, (-1, -1), 16),  # causal: q row i at cache_seqlens + i; part of the head dim rotated
    (False, False, (-1, -1), 32),  # neither causal nor local: every q row at cache_seqlens; the whole head dim
    (False, False, (3, -1), 16),  # local: q rows at their own positions
    (True, False, (-1, 100), 32),  # a bound past the cache is no bound: not local
])
def test_kvcache_rotary(backend, interleaved, causal, window, R):
    """rotary_cos/rotary_sin: the new keys rotated at their positions before they are written, the
    queries at FlashAttention's positions; the caller's q and k unchanged."""
    B, S, H, H_kv, D, Lq, L_new = 2, 48, 4, 2, 32, 3, 2
    q = torch.randn(B, Lq, H, D, device=DEVICE)
    k_cache, v_cache = (torch.randn(B, S, H_kv, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, L_new, H_kv, D, device=DEVICE) for _ in range(2))
    angles = torch.rand(S, R // 2, device=DEVICE) * 6.0
    cos, sin = angles.cos(), angles.sin()
    lens = [5, 40]
    before = k_cache.clone(), v_cache.clone()
    q_before, k_before = q.clone(), k.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                     causal=causal, window_size=window, rotary_interleaved=interleaved,
                                     backend=backend)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    starts = torch.tensor(lens, device=DEVICE)[:, None]
    k_rot = _rotated(k, cos, sin, starts + torch.arange(L_new, device=DEVICE), interleaved).float()
    per_row = causal or any(0 <= bound < S for bound in window)  # (causal or local: rows at their positions)
    q_rot = _rotated(q, cos, sin, (starts + torch.arange(Lq, device=DEVICE) * per_row), interleaved)
    expected_k, expected_v = (_appended(c, range(B), lens, new) for c, new in zip(before, (k_rot, v)))
    _close(k_cache, expected_k, tol=1e-5)  # (the rotation in float32)
    assert torch.equal(v_cache, expected_v)
    keys, values = ([t[b, :n + L_new] for b, n in enumerate(lens)] for t in (expected_k, expected_v))
    expected, _ = _kvcache_reference(q_rot, keys, values, causal=causal, window=window)
    _close(out, expected)


def test_kvcache_leftpad(backend):
    """cache_leftpad: each sequence's keys start there; the positions (causality, the rotary angles)
    stay the cache's."""
    B, S, H, H_kv, D, Lq, L_new = 2, 48, 2, 2, 16, 2, 2
    q = torch.randn(B, Lq, H, D, device=DEVICE)
    k_cache, v_cache = (torch.randn(B, S, H_kv, D, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, L_new, H_kv, D, device=DEVICE) for _ in range(2))
    angles = torch.rand(S, 8, device=DEVICE) * 6.0
    lens, leftpad = [10, 30], [3, 20]
    before = k_cache.clone(), v_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                     cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                                     cache_leftpad=torch.tensor(leftpad, dtype=torch.int32, device=DEVICE),
                                     causal=True, rotary_interleaved=False, backend=backend)
    starts = torch.tensor(lens, device=DEVICE)[:, None]
    k_rot = _rotated(k, angles.cos(), angles.sin(), starts + torch.arange(L_new, device=DEVICE), False).float()
    q_rot = _rotated(q, angles.cos(), angles.sin(), starts + torch.arange(Lq, device=DEVICE), False)
    expected_k, expected_v = (_appended(c, range(B), lens, new) for c, new in zip(before, (k_rot, v)))
    _close(k_cache, expected_k, tol=1e-5)
    keys, values = ([t[b, p:n + L_new] for b, (n, p) in enumerate(zip(lens, leftpad))] for t in (expected_k, v_cache))
    expected, _ = _kvcache_reference(q_rot, keys, values, causal=True)
    _close(out, expected)


@pytest.mark.parametrize("causal,window,alibi", [(True, (-1, -1), False), (False, (4, 2), True)])
def test_varlen_with_block_table(backend, causal, window, alibi):
    """flash_attn_varlen_func over a paged cache (FlashAttention 2.6's paged prefill): packed queries of
    several lengths (one sequence without any), each sequence's keys in its pages, bottom-right."""
    lens_q, lens_k, H, H_kv, D, page = [3, 0, 5], [20, 7, 40], 4, 2, 16, 16
    per_seq = 3
    k_cache, v_cache = (torch.randn(10, page, H_kv, D, device=DEVICE) for _ in range(2))
    table = torch.randperm(10, device=DEVICE)[:3 * per_seq].view(3, per_seq).to(torch.int32)
    q = torch.randn(sum(lens_q), H, D, device=DEVICE, requires_grad=True)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
                  for n in (lens_q, lens_k))
    slopes = torch.rand(3, H, device=DEVICE) if alibi else None
    out, lse, _ = fa.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            window_size=window, alibi_slopes=slopes, return_attn_probs=True,
                                            block_table=table, backend=backend)
    assert out.shape == (sum(lens_q), H, D) and lse.shape == (H, sum(lens_q)) and not out.requires_grad
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        if not n_q:
            continue
        keys, values = (c[table[b].long()].flatten(0, 1)[:n_k][None] for c in (k_cache, v_cache))
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        expected, expected_lse = _reference(q[rows][None].detach(), keys, values, causal=causal, window=window,
                                            alibi_slopes=None if slopes is None else slopes[b:b + 1])
        _close(out[rows], expected[0])
        _close(lse[:, rows], expected_lse[0])


def test_kvcache_rotary_on_the_torch_backend():
    """The torch backend rotates too (common.rotary's reference, the same call)."""
    test_kvcache_rotary("torch", False, True, (-1, -1), 16)


def test_kvcache_refusals_leave_the_cache_alone():
    q = torch.randn(2, 1, 2, 16, device=DEVICE)
    k_cache, v_cache = (torch.randn(2, 32, 2, 16, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 16, device=DEVICE) for _ in range(2))
    before = k_cache.clone()
    seqlens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    ones = torch.ones(2, 8, device=DEVICE)
    for kwargs, error, words in [
        (dict(rotary_cos=ones, rotary_sin=ones), ValueError, "a row for each of the cache's 32 positions"),
        (dict(rotary_cos=torch.ones(32, 8, device=DEVICE)), ValueError, "come together"),
        (dict(rotary_cos=torch.ones(32, 4, device=DEVICE), rotary_sin=torch.ones(32, 4, device=DEVICE)), ValueError,
         "multiple of 16"),
        (dict(rotary_cos=torch.ones(32, 8, device=DEVICE).half(), rotary_sin=torch.ones(32, 8, device=DEVICE).half()),
         TypeError, "q's dtype"),
        (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32, device=DEVICE),
              block_table=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)), ValueError, "cache_leftpad is for"),
        (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE)), ValueError, "cache_leftpad must be"),
        (dict(alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, "alibi_slopes"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
              cache_batch_idx=torch.zeros(2, dtype=torch.int32, device=DEVICE)), ValueError, "cache_batch_idx"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(softmax_scale="0.5"), TypeError, "softmax_scale"),
        (dict(window_size=(1,)), TypeError, "window_size"),
        (dict(softcap=3.0, backend="torch"), ValueError, "softcap"),
        (dict(cache_seqlens=seqlens.long()), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=None), ValueError, "cache_seqlens"),
        (dict(cache_seqlens=32), ValueError, "cache_seqlens"),  # (no room for k)
        (dict(cache_batch_idx=torch.tensor([0, 1], device=DEVICE)), ValueError, "cache_batch_idx"),
    ]:
        kwargs = {"cache_seqlens": seqlens, **kwargs}
        with pytest.raises(error, match=words):
            fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    with pytest.raises(ValueError, match="k and v come together"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="k and v must be"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k[:, :, :1], v[:, :, :1], cache_seqlens=seqlens)
    assert torch.equal(k_cache, before)
    batch_minor = torch.randn(32, 2, 16, 2, device=DEVICE).permute(3, 0, 1, 2)  # batch stride 1
    with pytest.raises(NotImplementedError, match="batch stride"):
        fa.flash_attn_with_kvcache(q, batch_minor, v_cache, k, v, cache_seqlens=seqlens)
    longer = torch.randn(2, 48, 2, 16, device=DEVICE)[:, :32]  # rows 48 positions apart, v_cache's 32
    with pytest.raises(NotImplementedError, match="same number of positions apart"):
        fa.flash_attn_with_kvcache(q, longer, v_cache, k, v, cache_seqlens=seqlens)
    empty = torch.randn(2, 0, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="seqlen_cache 0"):
        fa.flash_attn_with_kvcache(q, empty, empty.clone(), cache_seqlens=0)
    assert torch.equal(k_cache, before)
