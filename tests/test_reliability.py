"""Reliability: any GPU, any size, any thread; bounded memory.

Each test here reproduces a failure seen on the H200 before the fix: tensors
on a GPU that is not the current one, more than 65535 (batch x heads),
tensors past 2^31 elements, concurrent first calls from many threads, and a
long loop of calls with changing shapes. Most need a GPU (sizes the
interpreter cannot run in minutes, a second device, threads the interpreter
cannot share); the CPU suite runs what can run there: offsets past 32 bits, NineToothed's
limit within a head, and the bounded caches.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from common import attention, attention_backward, paged_attention
from common.launch import _MAX_BY_VALUE
from common.reference import error_bound, reference
from common.validation import OFFSET_LIMIT
from tests.conftest import DEVICE

ON_GPU = DEVICE == "cuda"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="GPU only: too large or too parallel for Triton's interpreter")
f16 = torch.float16


def assert_matches(out, q, k, v, **kwargs):
    ref = reference(q, k, v, **kwargs)
    bound, _ = error_bound(ref, q.dtype)
    error = (out.double() - ref).abs().max().item()
    assert error <= bound, f"max error {error:.3g} > bound {bound:.3g}"


# -- a GPU that is not the current one ----------------------------------------------------------

@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_tensors_on_another_gpu(backend):
    """cuda:1 tensors while cuda:0 is current: forward, backward and split-KV run on
    cuda:1 (on its current stream) and leave cuda:0 current."""
    torch.cuda.set_device(0)
    other = torch.device("cuda", 1)
    side = torch.cuda.Stream(device=other)
    q, k, v = (torch.randn(2, 4, 100, 64, dtype=f16, device=other, requires_grad=True) for _ in range(3))
    with torch.cuda.stream(side):  # a non-default stream on cuda:1 (current there; cuda:0 stays current)
        out = attention(q, k, v, is_causal=True, backend=backend)
        out.backward(torch.ones_like(out))
        decode = attention(q[:, :, :1].detach(), k.detach().repeat(1, 1, 40, 1), v.detach().repeat(1, 1, 40, 1),
                           backend=backend)
    side.synchronize()
    assert torch.cuda.current_device() == 0
    assert out.device == other and q.grad.device == other and decode.device == other
    assert_matches(out, q, k, v, is_causal=True)
    assert_matches(decode, q[:, :, :1], k.repeat(1, 1, 40, 1), v.repeat(1, 1, 40, 1))
    assert q.grad.isfinite().all() and k.grad.abs().sum() > 0


# -- grid limits -----------------------------------------------------------------------------------

@needs_gpu
def test_more_than_65535_batch_heads(backend):
    """(2, 40000, 20, 32): 80000 (batch, head) pairs, past CUDA's 65535 on grid axes 1 and 2."""
    q, k, v = (torch.randn(2, 40000, 20, 32, dtype=f16, device=DEVICE, requires_grad=True) for _ in range(3))
    out = attention(q, k, v, is_causal=True, backend=backend)
    assert_matches(out, q, k, v, is_causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    leaves = [t.detach()[:, -300:].double().requires_grad_() for t in (q, k, v)]  # the last heads, in float64
    reference(*leaves, is_causal=True).backward(grad_out[:, -300:].double())
    for grad, leaf in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(grad[:, -300:].double(), leaf.grad, rtol=2e-2, atol=2e-2)


@needs_gpu
def test_more_than_65535_batch_heads_where_gluon_would_run(monkeypatch):
    """(2, 32800, 128, 128) bf16, causal, ATTENTION_GLUON=1 (every plan the Gluon forward serves, any
    length): its launches put B·H on grid axis 1, so past 65535 the tl kernel runs it (keys and values
    broadcast over the heads by stride 0)."""
    monkeypatch.setenv("ATTENTION_GLUON", "1")
    q = torch.randn(2, 32800, 128, 128, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(2, 1, 128, 128, dtype=torch.bfloat16, device=DEVICE).expand(-1, 32800, -1, -1)
            for _ in range(2))
    out = attention(q, k, v, is_causal=True, backend="triton")
    expected = reference(*(t[:, -4:].double() for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out[:, -4:].double(), expected, rtol=2e-2, atol=2e-2)


# -- 64-bit offsets --------------------------------------------------------------------------------

@needs_gpu
def test_tensors_past_2_31_elements(backend):
    """(1040, 64, 256, 128) fp16, causal: 2.2e9 elements per tensor (the issue's case); each
    batch and head within 32 bits, which NineToothed's generated code takes (its batch and
    head offsets are 64-bit)."""
    shape = (1040, 64, 256, 128)
    q, k, v = (torch.randn(shape, dtype=f16, device=DEVICE) for _ in range(3))
    assert q.numel() > OFFSET_LIMIT
    out = attention(q, k, v, is_causal=True, backend=backend)
    for b in (0, 517, 1039):  # the first, a middle and the last batch (past 2^31 elements from the start)
        assert_matches(out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], is_causal=True)
    del q, k, v, out


def test_batches_past_2_31_elements(backend):
    """Keys and values whose third batch starts past 2^31 elements, at a batch stride under
    2^31: each batch's offset (index x stride) needs 64 bits, as does NineToothed's (its batch
    and head strides are typed int64 at launch: ``common.launch._rejitted``; 32-bit, the
    interpreter read the wrong memory and crashed). Forward and backward, every batch against
    the reference in float64."""
    B, H, L, D = 3, 2, 4, 16
    stride = OFFSET_LIMIT // 2 + 64
    q, grad_out = (torch.randn(B, H, L, D, dtype=f16, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(B, H, L, D, dtype=f16, device=DEVICE) for _ in range(2))
    # (on a CPU, the pages never touched take no memory)
    key, value = (torch.empty(2 * stride + H * L * D, dtype=f16, device=DEVICE)
                  .as_strided((B, H, L, D), (stride, L * D, D, 1)) for _ in range(2))
    key.copy_(k)
    value.copy_(v)
    assert stride < OFFSET_LIMIT < 2 * stride
    out, lse = attention(q, key, value, is_causal=True, backend=backend, return_lse=True)
    assert_matches(out, q, k, v, is_causal=True)
    dq, dk, dv = attention_backward(grad_out, q, key, value, out, lse, is_causal=True, backend=backend)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, is_causal=True).backward(grad_out.double())
    for grad, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(grad.double(), leaf.grad, rtol=2e-2, atol=2e-2)
    del key, value


def test_ninetoothed_widens_only_a_launch_past_32_bits(monkeypatch):
    """NineToothed takes 64-bit batch and head strides only in a launch whose tensors span 2^31
    elements: a decode loop's launches keep their code until its cache moves to a buffer past
    2^31 elements, whose keys then take a wide kernel, not the launch bound for the last keys
    (``common.reuse._keys_fit``, ``common.reuse.AttentionPlan``); every step against the reference."""
    import impl_ninetoothed.attention as nt

    made, widths = nt._make, []

    def recording(*args, wide=False, **kwargs):
        widths.append(wide)
        return made(*args, wide=wide, **kwargs)

    monkeypatch.setattr(nt, "_make", recording)
    B, H, D = 3, 2, 16
    stride = OFFSET_LIMIT // 2 + 64
    q = torch.randn(B, H, 1, D, dtype=f16, device=DEVICE)
    storages = [torch.empty(2 * stride + H * 8 * D, dtype=f16, device=DEVICE) for _ in range(2)]
    for L in range(3, 8):
        widths.clear()
        k, v = (torch.randn(B, H, L, D, dtype=f16, device=DEVICE) for _ in range(2))
        if L < 5:  # the cache in buffers of its own size
            key, value = k, v
        else:  # moved to buffers whose third batch starts past 2^31 elements
            key, value = (storage.as_strided((B, H, L, D), (stride, L * D, D, 1)) for storage in storages)
            key.copy_(k)
            value.copy_(v)
        assert_matches(attention(q, key, value, backend="ninetoothed"), q, k, v)
        if L < 5:  # (a call through a bound launch asks for no kernel: none recorded)
            assert not any(widths), f"L {L}: kernels asked for, wide or not: {widths}"
        else:  # the full path, each call: a wide kernel
            assert widths and all(widths), f"L {L}: kernels asked for, wide or not: {widths}"
    del storages, key, value


def test_paged_caches_past_2_31_elements(backend, monkeypatch):
    """Paged caches of 2^31 elements or more whose table points at their last pages: a key's offset
    within its cache needs 64 bits, which both kernels take only then (Triton's WIDE_PAGES,
    NineToothed's wide launch; ``common.validation.in_wide_storage``), 32 below; against the reference."""
    import common.validation as validation
    import impl_ninetoothed.attention as nt
    import impl_triton.attention as ta

    asked = []

    def recording(*tensors):
        asked.append(validation.in_wide_storage(*tensors))
        return asked[-1]

    monkeypatch.setattr(ta if backend == "triton" else nt, "in_wide_storage", recording)
    page, H, D, lens = 16, 2, 16, [40, 23]
    num_pages = OFFSET_LIMIT // (page * H * D) + 8
    caches = [torch.empty(num_pages, page, H, D, dtype=f16, device=DEVICE) for _ in range(2)]  # (never touched
    for cache in caches:  # but for the last pages, on a CPU)
        cache[-8:] = torch.randn(8, page, H, D, dtype=f16, device=DEVICE)
    table = (num_pages - 1 - torch.arange(6, device=DEVICE)).view(3, 2).T.contiguous().to(torch.int32)
    q = torch.randn(2, H, 1, D, dtype=f16, device=DEVICE)
    out = paged_attention(q, *caches, table, torch.tensor(lens, dtype=torch.int32, device=DEVICE), backend=backend)
    assert asked and all(asked)
    for b, n in enumerate(lens):
        k, v = (c[table[b].long()].flatten(0, 1)[:n].transpose(0, 1)[None] for c in caches)
        assert_matches(out[b:b + 1], q[b:b + 1], k, v)
    del caches
    small = [torch.randn(8, page, H, D, dtype=f16, device=DEVICE) for _ in range(2)]
    asked.clear()
    paged_attention(q, *small, table - (num_pages - 8), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                    backend=backend)
    assert asked and not any(asked)


@needs_gpu
def test_long_sequence_in_blhd_layout_triton():
    """K/V in a (B, L, H, D) buffer with L·H·D > 2^31: every key step's offset
    (start_n * stride) passes 32 bits within one head; forward (split keys:
    short queries) and backward."""
    Lk, H, D = 132_000, 128, 128
    k, v = (torch.randn(1, Lk, H, D, dtype=f16, device=DEVICE).transpose(1, 2) for _ in range(2))
    q = torch.randn(1, 16, H, D, dtype=f16, device=DEVICE).transpose(1, 2)
    assert k.numel() > OFFSET_LIMIT
    out, lse = attention(q, k, v, backend="triton", return_lse=True)
    heads = slice(H - 2, H)  # the last heads: offsets past 2^31
    assert_matches(out[:, heads], q[:, heads], k[:, heads], v[:, heads])
    grad_out = torch.randn_like(out)
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, backend="triton")
    leaves = [t[:, heads].double().requires_grad_() for t in (q, k, v)]
    reference(*leaves).backward(grad_out[:, heads].double())
    for grad, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(grad[:, heads].double(), leaf.grad, rtol=2e-2, atol=2e-2)


def test_ninetoothed_refuses_a_head_past_32_bit_offsets():
    """NineToothed's generated code indexes within one batch and head with 32-bit integers: a
    head whose rows span 2^31 elements gets a clear error before any launch, naming the limit
    (not an illegal access), and the Triton kernel (64-bit offsets throughout) runs it."""
    q, v = (torch.randn(1, 1, 2, 16, dtype=f16, device=DEVICE) for _ in range(2))
    k = torch.randn(1, 1, 2, 16, dtype=f16, device=DEVICE)
    storage = torch.empty(OFFSET_LIMIT + 16, dtype=f16, device=DEVICE)  # (on a CPU: pages never touched)
    key = storage.as_strided((1, 1, 2, 16), (OFFSET_LIMIT + 16, OFFSET_LIMIT + 16, OFFSET_LIMIT, 1))  # row 1 at 2^31
    key.copy_(k)
    with pytest.raises(ValueError, match=r"32-bit offsets .* fewer than 2\*\*31 = 2147483648 elements, but key's "
                                         r"spans 2147483664"):
        attention(q, key, v, backend="ninetoothed")
    assert_matches(attention(q, key, v, backend="triton"), q, k, v)
    out = attention(q, key[:, :, :1].expand(1, 1, 2, 16), v, backend="ninetoothed")  # a broadcast view is fine
    assert_matches(out, q, k[:, :, :1].expand(1, 1, 2, 16), v)
    del storage, key


# -- threads ------------------------------------------------------------------------------------------

@needs_gpu
def test_concurrent_first_calls(backend):
    """Eight threads each make a configuration nobody has compiled yet, at the same
    moment (NineToothed's code generation and Triton's compile cache, racing)."""
    head_dims = (24, 40, 48, 56, 72, 88, 104, 120)
    inputs = [tuple(torch.randn(1, 2, 50, d, dtype=f16, device=DEVICE) for _ in range(3)) for d in head_dims]
    barrier = threading.Barrier(len(head_dims))
    results, errors = {}, []

    def work(i):
        try:
            barrier.wait()
            results[i] = attention(*inputs[i], is_causal=True, backend=backend)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - reported below, with its thread
            errors.append((head_dims[i], repr(error)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(head_dims))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (q, k, v) in enumerate(inputs):
        assert_matches(results[i], q, k, v, is_causal=True)


@needs_gpu
def test_concurrent_split_calls(backend):
    """Two threads make split calls on the same stream at once, outside poisoning (so their partials
    come from the scratch buffers): each thread's answers right, whatever the interleaving of
    NineToothed's two launches."""
    from common import outputs
    from common.plan import force_splits

    barrier = threading.Barrier(2)
    errors = []

    def work():
        try:
            assert outputs.allocator() is outputs._empty  # a new thread: no poisoning
            barrier.wait()
            with force_splits(4):
                for _ in range(20):
                    q = torch.randn(2, 8, 1, 64, dtype=f16, device=DEVICE)
                    k, v = (torch.randn(2, 2, 3000, 64, dtype=f16, device=DEVICE) for _ in range(2))
                    out = attention(q, k, v, enable_gqa=True, backend=backend)
                    assert_matches(out, q, k, v, enable_gqa=True)
        except Exception as error:  # noqa: BLE001 - reported below, with its thread
            errors.append(repr(error))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- memory -------------------------------------------------------------------------------------------

def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@needs_gpu
def test_no_growth_over_10000_calls(backend):
    """10,000 calls with changing lengths (every 100th with gradients), twice: the
    first pass compiles what the loop needs and fills the launchers' caches to
    their bound; over the second, identical pass nothing is compiled, and
    resident memory, Python's heap (tracemalloc, over its last 1,000 calls)
    and device memory stay where they were. Printed and asserted."""
    import tracemalloc

    from impl_triton import attention as kernels

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (10_000, 2), generator=gen).tolist()
    k_all = torch.randn(1, 2, 300, 64, dtype=f16, device=DEVICE)
    q_all = torch.randn(1, 2, 300, 64, dtype=f16, device=DEVICE)
    launchers = (kernels._fwd_launcher, kernels._dq_launcher, kernels._dkdv_launcher)

    def calls(pairs):
        for i, (lq, lk) in enumerate(pairs):
            q, k = q_all[:, :, :lq], k_all[:, :, :lk]
            if i % 100 == 0:
                q = q.detach().requires_grad_()
                attention(q, k, k, backend=backend).sum().backward()
            else:
                attention(q, k, k, is_causal=i % 2 == 0, backend=backend)
        torch.cuda.synchronize()
        gc.collect()

    calls(lengths)  # the first pass: compiles
    compiled = [len(launcher._by_class) for launcher in launchers]
    rss, device = _resident_mb(), torch.cuda.memory_allocated()
    calls(lengths[:9000])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    calls(lengths[9000:])
    heap = (tracemalloc.get_traced_memory()[0] - before) / 2**20
    tracemalloc.stop()
    grown = _resident_mb() - rss
    print(f"{backend}: resident {rss:.0f} MB, {grown:+.1f} MB over the second 10,000 calls; Python heap "
          f"{heap:+.2f} MB over its last 1,000; device allocated {device} -> {torch.cuda.memory_allocated()} bytes")
    assert [len(launcher._by_class) for launcher in launchers] == compiled, "the second pass compiled kernels"
    assert grown < 16, f"resident memory grew {grown:.1f} MB over 10,000 calls"
    assert heap < 4, f"Python's heap grew {heap:.2f} MB over 1,000 calls"
    assert torch.cuda.memory_allocated() == device
    assert all(len(launcher._by_value) <= _MAX_BY_VALUE for launcher in launchers)
