"""paged_attention and append_kv: a paged KV cache against each sequence's dense keys (float64 reference)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from common import append_kv, attention, paged_attention
from common.backends import ANY_PAGE, get_backend
from common.plan import force_splits
from tests.conftest import DEVICE

f16, f32 = torch.float16, torch.float32

CASES = [  # (lens, Lq, H, H_kv, D, Dv, page, is_causal, dtype)
    ([37, 0, 70, 1], 1, 4, 2, 32, 32, 16, False, f32),  # decoding; an empty and a length-1 sequence
    ([37, 5, 70], 5, 4, 1, 32, 16, 16, True, f32),  # several new tokens, causal; MQA; Dv != D
    ([100, 33], 3, 2, 2, 16, 16, 32, True, f16),  # page size 32
    ([130, 64], 1, 8, 2, 16, 16, 64, False, f32),  # page size 64, lengths on and off a page boundary
    ([23, 40], 2, 4, 2, 16, 16, 1, True, f32),  # pages of one token (SGLang's): a table entry per key
    ([50, 7], 1, 2, 2, 16, 16, 3, False, f16),  # a page size that no power of two divides
    ([70, 33], 3, 4, 4, 16, 16, 48, True, f32),  # pages of 48: several tiles of 16 each (NineToothed)
    ([300, 130], 1, 2, 1, 16, 16, 256, False, f32),  # pages of 256 (FlashAttention's): a step is part of one
]


def _cache(lens, H_kv, D, Dv, page, dtype, spare=3):
    """Caches with every sequence's pages in a shuffled table (plus unused pages), and the sequences'
    dense keys and values (B lists of (H_kv, L, D))."""
    B = len(lens)
    max_pages = max(-(-n // page) for n in lens) + 1
    num_pages = B * max_pages + spare
    key_cache = torch.randn(num_pages, page, H_kv, D, device=DEVICE, dtype=dtype)
    value_cache = torch.randn(num_pages, page, H_kv, Dv, device=DEVICE, dtype=dtype)
    block_table = torch.randperm(num_pages, device=DEVICE)[:B * max_pages].view(B, max_pages).to(torch.int32)
    keys, values = [], []
    for b, n in enumerate(lens):
        pages = block_table[b].long()
        keys.append(key_cache[pages].flatten(0, 1)[:n].transpose(0, 1))
        values.append(value_cache[pages].flatten(0, 1)[:n].transpose(0, 1))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return key_cache, value_cache, block_table, seqlens, keys, values


def _reference(query, keys, values, is_causal, *, scale=None, window=None, softcap=None, sinks=None,
               alibi_slopes=None, leftpad=None, query_lengths=None, with_lse=False, top_left=False):
    """Each sequence's queries against its dense keys, in float64, from the definition: row i of a
    sequence of Lk keys sits at position p = Lk - Lq + i and sees keys j < Lk with j <= p (causal) and
    p - left <= j <= p + right (window; -1 unbounded); scores scaled (by scale, 1/sqrt(D) if None),
    then softcap * tanh(s / softcap), then ALiBi's -slope * |p - j| (slopes (H,) or (B, H)); keys
    before leftpad[b] unseen; with query_lengths, sequence b's first query_lengths[b] rows at
    p = Lk - query_lengths[b] + i, the others seeing no key; a head's sink logit joins each row's
    denominator with no value. Rows with no key: 0 (lse -inf, or the sink's logit). with_lse: also the
    (B, H, Lq) log-sum-exp. top_left: row i sits at position i instead (varlen's other alignment)."""
    outs, lses = [], []
    group = query.shape[1] // keys[0].shape[0]
    for b, (k, v) in enumerate(zip(keys, values)):
        q = query[b].double()
        k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
        Lq, Lk = q.shape[1], k.shape[1]
        s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        new_tokens = Lq if query_lengths is None else int(query_lengths[b])
        pos = torch.arange(Lq, device=q.device)[:, None] + (0 if top_left else Lk - new_tokens)
        j = torch.arange(Lk, device=q.device)[None, :]
        if alibi_slopes is not None:
            slopes = alibi_slopes.double().expand(len(keys), -1)[b]
            s = s - slopes[:, None, None] * (pos - j).abs()
        keep = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
        if leftpad is not None:
            keep &= j >= int(leftpad[b])
        keep &= torch.arange(Lq, device=q.device)[:, None] < new_tokens
        if is_causal:
            keep &= j <= pos
        if window is not None and window[0] >= 0:
            keep &= j >= pos - window[0]
        if window is not None and window[1] >= 0:
            keep &= j <= pos + window[1]
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:  # a column of each head's sink logit, with no value
            s = torch.cat([s, sinks.double()[:, None, None].expand(-1, Lq, 1)], -1)
            v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], 1)
        lse = s.logsumexp(-1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(p @ v if s.shape[-1] else q.new_zeros(q.shape[0], Lq, v.shape[-1]))
        lses.append(lse)
    out = torch.stack(outs)
    return (out, torch.stack(lses)) if with_lse else out


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_attention(backend, case, splits):
    lens, Lq, H, H_kv, D, Dv, page, is_causal, dtype = case
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, Dv, page, dtype)
    query = torch.randn(len(lens), H, Lq, D, device=DEVICE, dtype=dtype)
    if page % 16 and not get_backend(backend).supports(ANY_PAGE):  # (NineToothed's: multiples of 16)
        with pytest.raises(ValueError, match="page_size .* must be a multiple of 16"):
            paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal, enable_gqa=H_kv < H,
                            backend=backend)
        return
    if splits is None:
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal,
                              enable_gqa=H_kv < H, backend=backend)
    else:
        with force_splits(splits):
            out = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal,
                                  enable_gqa=H_kv < H, backend=backend)
    assert out.shape == (len(lens), H, Lq, Dv) and out.dtype == dtype
    tol = {f32: 2e-4, f16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), _reference(query, keys, values, is_causal), rtol=tol, atol=tol)


def test_paged_split_merge_in_the_kernel():
    """The Triton paged kernel merges its own splits, as the dense one does: the right answer,
    its counters back at 0."""
    from common import launch

    lens, Lq, H, H_kv, D, Dv, page, is_causal, dtype = CASES[3]  # (keys of several blocks, on a CPU too)
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, Dv, page, dtype)
    query = torch.randn(len(lens), H, Lq, D, device=DEVICE, dtype=dtype)
    with force_splits(3), launch.fresh_counters() as kept:
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal, enable_gqa=True,
                              backend="triton")
    torch.testing.assert_close(out.double(), _reference(query, keys, values, is_causal), rtol=2e-4, atol=2e-4)
    assert kept, "the call did not split (only a split launch asks for counters)"
    assert all(int(counters.abs().sum()) == 0 for counters in kept.values())


def test_paged_split_merge_as_its_own_launch(planner, monkeypatch):
    """Past the planner's kernel_merge_max the Triton paged kernel leaves the merge to a launch
    of its own, as the dense one does: the right answer (outputs poisoned), no ticket taken."""
    from common import launch
    from common import paged as paged_module

    planner(kernel_merge_max=0, kernel_merge_min_bytes=0)
    splits, partials = [], paged_module.partials

    def recording(rows_shape, num_splits, dv, device):  # (a split launch's partials: the calls that split)
        splits.append(num_splits)
        return partials(rows_shape, num_splits, dv, device)
    monkeypatch.setattr(paged_module, "partials", recording)
    with launch.fresh_counters() as kept:
        for case in (CASES[3], CASES[2]):  # (keys of several blocks, on a CPU too)
            lens, Lq, H, H_kv, D, Dv, page, is_causal, dtype = case
            key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, Dv, page, dtype)
            query = torch.randn(len(lens), H, Lq, D, device=DEVICE, dtype=dtype)
            with force_splits(3):
                out = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal,
                                      enable_gqa=H_kv < H, backend="triton")
            tol = {f32: 2e-4, f16: 1e-2}[dtype]
            torch.testing.assert_close(out.double(), _reference(query, keys, values, is_causal), rtol=tol, atol=tol)
        assert len(splits) == 2 and min(splits) > 1, f"both calls should split, got partials for {splits}"
        assert all(int(counters.abs().sum()) == 0 for counters in kept.values())


def test_paged_reference_backend():
    """The torch backend (SDPA over the gathered pages) agrees too."""
    lens = [21, 0, 40]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, 16, f32)
    query = torch.randn(3, 4, 2, 16, device=DEVICE)
    out = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, enable_gqa=True,
                          backend="torch", validate=True)
    torch.testing.assert_close(out.double(), _reference(query, keys, values, True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["triton", "ninetoothed", "torch"])
def test_append_then_attend(name):
    """Serving: append each sequence's new tokens, then attend the new queries over the whole
    cache; the same as dense bottom-right attention over the old and new tokens together.
    Tokens past the table and page entries outside the cache are not written."""
    lens, new, page = [30, 0, 15], 6, 16
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, page, f32)
    snapshot = key_cache.clone(), value_cache.clone()
    new_keys = torch.randn(3, 2, new, 16, device=DEVICE)
    new_values = torch.randn(3, 2, new, 16, device=DEVICE)
    lengths = append_kv(key_cache, value_cache, block_table, seqlens, new_keys, new_values, backend=name)
    assert lengths.tolist() == [n + new for n in lens] and seqlens.tolist() == lens
    query = torch.randn(3, 4, new, 16, device=DEVICE)
    out = paged_attention(query, key_cache, value_cache, block_table, lengths, True, enable_gqa=True,
                          backend=name if name != "torch" else "triton")
    full_keys = [torch.cat([k, nk], 1) for k, nk in zip(keys, new_keys)]
    full_values = [torch.cat([v, nv], 1) for v, nv in zip(values, new_values)]
    torch.testing.assert_close(out.double(), _reference(query, full_keys, full_values, True), rtol=2e-4, atol=2e-4)
    for b in range(3):  # the same thing through the dense kernel
        dense = attention(query[b:b + 1], full_keys[b][None], full_values[b][None], True, enable_gqa=True,
                          alignment="bottom_right", backend="torch")
        torch.testing.assert_close(out[b:b + 1], dense, rtol=2e-4, atol=2e-4)
    # Only the new tokens' slots changed.
    written = torch.zeros_like(key_cache, dtype=torch.bool)
    for b, n in enumerate(lens):
        for i in range(n, n + new):
            written[block_table[b, i // page].long(), i % page] = True
    assert torch.equal(key_cache[~written], snapshot[0][~written])
    assert torch.equal(value_cache[~written], snapshot[1][~written])

    # Positions past the table, a negative entry, an entry past the cache: not written, nothing else touched.
    before = key_cache.clone()
    table = block_table.clone()
    table[1, 0], table[2, 0] = -1, key_cache.shape[0] + 5
    starts = [table.shape[1] * page - 2, 0, 10]  # sequence 0 runs off its table after two tokens
    append_kv(key_cache, value_cache, table, torch.tensor(starts, dtype=torch.int32, device=DEVICE), new_keys,
              new_values, backend=name)
    expected = {}
    for b, start in enumerate(starts):
        for i in range(new):
            pos = start + i
            if pos < table.shape[1] * page and 0 <= table[b, pos // page] < key_cache.shape[0]:
                expected[(table[b, pos // page].item(), pos % page)] = new_keys[b, :, i]
    assert len(expected) == 2  # (sequences 1 and 2 point outside the cache)
    changed = {tuple(ps) for ps in (key_cache != before).any(-1).any(-1).nonzero().tolist()}
    assert changed <= set(expected)
    for (p, slot), k in expected.items():
        assert torch.equal(key_cache[p, slot], k)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU (the CPU suite checks the no-sync rule above)")
def test_decode_steps_in_a_cuda_graph(backend):
    """A serving loop's step, append_kv then paged_attention then the lengths advanced, captured
    once in a CUDA graph and replayed step after step with new tokens: every step's output is
    the dense attention over the sequence so far (no host sync, no allocation outside the graph,
    no shape that changes between steps)."""
    lens, page, H, H_kv, D, steps = [30, 1, 47], 16, 8, 2, 64, 5
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(
        [n + steps for n in lens], H_kv, D, D, page, f16)
    seqlens.copy_(torch.tensor(lens, dtype=torch.int32, device=DEVICE))  # the last `steps` tokens come one by one
    query, new_key, new_value = (torch.empty(3, n, 1, D, device=DEVICE, dtype=f16) for n in (H, H_kv, H_kv))
    token_keys = [torch.randn(3, H_kv, 1, D, device=DEVICE, dtype=f16) for _ in range(steps + 1)]
    token_values = [torch.randn(3, H_kv, 1, D, device=DEVICE, dtype=f16) for _ in range(steps + 1)]
    queries = [torch.randn(3, H, 1, D, device=DEVICE, dtype=f16) for _ in range(steps + 1)]

    def step():
        lengths = append_kv(key_cache, value_cache, block_table, seqlens, new_key, new_value, backend=backend)
        out = paged_attention(query, key_cache, value_cache, block_table, lengths, enable_gqa=True, backend=backend)
        seqlens.copy_(lengths)
        return out

    # Warm up (compiles) on a side stream, as CUDA graph capture wants, then put the state back.
    query.copy_(queries[0])
    new_key.copy_(token_keys[0])
    new_value.copy_(token_values[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    seqlens.copy_(torch.tensor(lens, dtype=torch.int32, device=DEVICE))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seqlens.copy_(torch.tensor(lens, dtype=torch.int32, device=DEVICE))  # capture ran nothing; to be safe
    history_k = [k.clone() for k in keys]
    history_v = [v.clone() for v in values]
    for t in range(1, steps + 1):
        query.copy_(queries[t])
        new_key.copy_(token_keys[t])
        new_value.copy_(token_values[t])
        graph.replay()
        for b, n in enumerate(lens):  # sequence b now holds its first n keys and this run's t new tokens
            history_k[b] = torch.cat([keys[b][:, :n] if t == 1 else history_k[b], token_keys[t][b]], 1)
            history_v[b] = torch.cat([values[b][:, :n] if t == 1 else history_v[b], token_values[t][b]], 1)
        assert seqlens.tolist() == [n + t for n in lens]
        torch.testing.assert_close(out.double(), _reference(queries[t], history_k, history_v, False),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("splits", [None, 2])
def test_paged_length_past_the_table(backend, splits):
    """Bad input without validate=True: a length past the table's pages reads those pages once
    each, as if the length were the table's (no page twice, no entry outside the table)."""
    lens, page = [40, 20], 16
    key_cache, value_cache, block_table, _, keys, values = _cache(lens, 2, 16, 16, page, f32)
    capacity = block_table.shape[1] * page
    full_keys, full_values = _cache_sequences(key_cache, value_cache, block_table, capacity)
    seqlens = torch.tensor([capacity + 7, 20], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 4, 3, 16, device=DEVICE)
    with force_splits(splits or 1):
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, enable_gqa=True,
                              backend=backend)
    expected = _reference(query, [full_keys[0], keys[1]], [full_values[0], values[1]], True)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)


def _cache_sequences(key_cache, value_cache, block_table, length):
    """Every sequence's first ``length`` keys and values as its table lists them (B lists of (H_kv, L, D))."""
    keys = [key_cache[pages.long()].flatten(0, 1)[:length].transpose(0, 1) for pages in block_table]
    values = [value_cache[pages.long()].flatten(0, 1)[:length].transpose(0, 1) for pages in block_table]
    return keys, values


def test_paged_without_host_sync(backend, monkeypatch):
    lens = [20, 3]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, 16, f32)
    query = torch.randn(2, 2, 1, 16, device=DEVICE)
    new = torch.randn(2, 2, 1, 16, device=DEVICE)

    def refuse(*args, **kwargs):
        raise AssertionError("a host sync on the launch path")

    for name in ("item", "tolist", "__int__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    sinks = torch.randn(2, device=DEVICE)
    features = dict(window=(4, 0), softcap=1.5, sinks=sinks, return_lse=True)
    try:
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, backend=backend)
        with_features, lse = paged_attention(query, key_cache, value_cache, block_table, seqlens, backend=backend,
                                             **features)
        append_kv(key_cache, value_cache, block_table, seqlens, new, new, backend=backend)
    finally:
        monkeypatch.undo()
    torch.testing.assert_close(out.double(), _reference(query, keys, values, False), rtol=2e-4, atol=2e-4)
    expected, expected_lse = _reference(query, keys, values, False, window=(4, 0), softcap=1.5, sinks=sinks,
                                        with_lse=True)
    torch.testing.assert_close(with_features.double(), expected, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=2e-4, atol=2e-4)


def test_paged_errors():
    key_cache, value_cache, block_table, seqlens, _, _ = _cache([20, 3], 2, 16, 16, 16, f32)
    q = torch.randn(2, 2, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="query must be 4-D"):
        paged_attention(q[0], key_cache, value_cache, block_table, seqlens)
    with pytest.raises(TypeError, match="block_table must be int32"):
        paged_attention(q, key_cache, value_cache, block_table.long(), seqlens)
    with pytest.raises(ValueError, match=r"cache_seqlens must be \(B,\) with B = 2"):
        paged_attention(q, key_cache, value_cache, block_table, seqlens[:1])
    with pytest.raises(TypeError, match="key_cache has dtype float16"):
        paged_attention(q, key_cache.half(), value_cache, block_table, seqlens)
    with pytest.raises(ValueError, match="same head dim"):
        paged_attention(q[..., :8].contiguous(), key_cache, value_cache, block_table, seqlens)
    with pytest.raises(ValueError, match="enable_gqa"):
        paged_attention(torch.randn(2, 4, 1, 16, device=DEVICE), key_cache, value_cache, block_table, seqlens)
    with pytest.raises(ValueError, match="block_table points outside the cache"):
        bad = block_table.clone()
        bad[0, 0] = key_cache.shape[0]
        paged_attention(q, key_cache, value_cache, bad, seqlens, validate=True)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        paged_attention(q, key_cache, value_cache, block_table, seqlens + 1000, validate=True)
    with pytest.raises(ValueError, match="value must be"):
        append_kv(key_cache, value_cache, block_table, seqlens, q, q[:, :, :, :8])
    with pytest.raises(ValueError, match="key must be"):
        append_kv(key_cache, value_cache, block_table, seqlens, torch.randn(2, 3, 1, 16, device=DEVICE), q)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        append_kv(key_cache, value_cache, block_table, seqlens + 47, q, q, validate=True)


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_plan_reused(backend, splits, monkeypatch):
    """A serving loop's calls (the same caches, table and lengths tensors, new contents) validate and
    plan only the first time: later calls give the right answer for the new contents and lengths, with
    fresh outputs; a layout that differs (another page count in the table) is checked again."""
    import common.paged as paged

    paged._templates.clear()
    lens, Lq, H, H_kv, D, Dv, page, is_causal, dtype = CASES[1]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, Dv, page, dtype)
    query = torch.randn(len(lens), H, Lq, D, device=DEVICE, dtype=dtype)
    with force_splits(splits):
        first = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal, enable_gqa=True,
                                backend=backend)

        def no_planning(*args, **kw):
            raise AssertionError("planned again")

        for name in ("_make_plan", "_check_caches", "_check_table"):
            monkeypatch.setattr(paged, name, no_planning)
        monkeypatch.setattr(get_backend(backend).load(), "refine_paged", no_planning)
        shorter = [n - 3 for n in lens]
        key_cache2, value_cache2, block_table2, seqlens2, keys2, values2 = _cache(shorter, H_kv, D, Dv, page, dtype)
        block_table.copy_(block_table2[:, :block_table.shape[1]])
        key_cache.copy_(key_cache2), value_cache.copy_(value_cache2), seqlens.copy_(seqlens2)
        query2 = torch.randn_like(query)
        out = paged_attention(query2, key_cache, value_cache, block_table, seqlens, is_causal, enable_gqa=True,
                              backend=backend)
    assert out.data_ptr() != first.data_ptr() and len(paged._templates) == 1
    tol = 2e-4
    torch.testing.assert_close(first.double(), _reference(query, keys, values, is_causal), rtol=tol, atol=tol)
    torch.testing.assert_close(out.double(), _reference(query2, keys2, values2, is_causal), rtol=tol, atol=tol)
    with pytest.raises(AssertionError, match="planned again"):  # a table of another width: a new layout
        paged_attention(query2, key_cache, value_cache, block_table[:, :-1], seqlens, is_causal, enable_gqa=True,
                        backend=backend)


def test_paged_tile_widths_follow_alignment(backend):
    """The paged plan keeps the dense rule (``common.plan.tile_widths``): key and value tiles of two
    widths only where every input is read in 16-byte pieces, one width where the query starts off
    alignment; a kept plan tells the two layouts apart, and both give the right answer."""
    import common.paged as paged

    paged._templates.clear()
    lens, H, H_kv, D, Dv, page = [37, 20], 4, 2, 64, 32, 16
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, Dv, page, f32)
    aligned = torch.randn(len(lens), H, 1, D, device=DEVICE)
    misaligned = torch.randn(aligned.numel() + 1, device=DEVICE)[1:].view(aligned.shape)  # (4 bytes past)
    misaligned.copy_(aligned)
    widths = [(plan.block_d, plan.block_dv) for plan in (
        paged._make_plan(get_backend(backend), q, key_cache, value_cache, block_table, seqlens, False, 0.125)
        for q in (aligned, misaligned))]
    assert widths == [(64, 32), (64, 64)]
    expected = _reference(aligned, keys, values, False)
    for q in (aligned, misaligned, misaligned, aligned):  # (kept plans, both layouts)
        out = paged_attention(q, key_cache, value_cache, block_table, seqlens, enable_gqa=True, backend=backend)
        torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    assert len(paged._templates) == 2


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("value_columns", [False, True], ids=["value_rows", "value_columns"])
def test_paged_leftpad_reads_nothing_before_it(backend, splits, value_columns):
    """Keys before a sequence's left padding never count: NaN there, the answer still right (the
    value pages row-major or column-major)."""
    lens, leftpad = [300, 40], [170, 3]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, 16, f32)
    for b, start in enumerate(leftpad):
        for cache in (key_cache, value_cache):
            pages = block_table[b, :start // 16].long()
            cache[pages] = float("nan")
            cache[block_table[b, start // 16].long(), :start % 16] = float("nan")
    if value_columns:
        value_cache = _value_columns(value_cache)
    query = torch.randn(2, 2, 2, 16, device=DEVICE)
    starts = torch.tensor(leftpad, dtype=torch.int32, device=DEVICE)
    clean = [(k[:, s:], v[:, s:]) for k, v, s in zip(keys, values, leftpad)]
    expected = _reference(query, [k for k, _ in clean], [v for _, v in clean], True)
    with force_splits(splits or 1):
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, cache_leftpad=starts,
                              backend=backend)
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)


def _value_columns(value_cache):
    """The same value cache, each page stored column-major ((num_pages, H_kv, Dv, page) in memory)."""
    return value_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


@pytest.mark.parametrize("page", [1, 16, 48])
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("value_columns", [False, True], ids=["value_rows", "value_columns"])
def test_paged_slots_past_the_length_never_count(backend, page, splits, value_columns):
    """Slots past each sequence's length, in its last page and in the pages after it, and every page
    no sequence uses hold NaN: the answer is still right, the value pages row-major or column-major
    (Triton's kernel reads column-major ones without a key mask, zeroing the keys past the length)."""
    if page % 16 and backend == "ninetoothed":
        pytest.skip("NineToothed's paged kernel takes pages of multiples of 16 (test_paged_errors checks its error)")
    lens = [37, 70, 5]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, page, f32)
    used = torch.zeros(key_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, n in enumerate(lens):
        for pos in range(n):
            used[block_table[b, pos // page].long(), pos % page] = True
    for cache in (key_cache, value_cache):
        cache[~used] = float("nan")
    if value_columns:
        value_cache = _value_columns(value_cache)
    query = torch.randn(3, 4, 2, 16, device=DEVICE)
    with force_splits(splits or 1):
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, enable_gqa=True,
                              backend=backend)
    torch.testing.assert_close(out.double(), _reference(query, keys, values, True), rtol=2e-4, atol=2e-4)


def test_triton_reads_column_pages_as_runs(monkeypatch):
    """The Triton kernel reads column-major value pages of 16 or 32 keys a page's run at a time (PAGE_BLOCKS:
    each head's (Dv, page) block one run of memory, several pages a step), the path really taken, with
    the stray slots and left padding of the two tests above (NaN there) and the same answers; other
    layouts and page sizes keep the key-by-key tile."""
    import impl_triton.attention as ta

    taken, shipped = [], ta.page_blocks
    monkeypatch.setattr(ta, "page_blocks", lambda *args: taken.append(shipped(*args)) or taken[-1])
    test_paged_slots_past_the_length_never_count("triton", 16, 3, True)
    test_paged_leftpad_reads_nothing_before_it("triton", None, True)
    assert taken and all(taken), taken
    # a value head dim the tile pads (Dv 24 in a 32-column tile: each run's last columns masked), FP8 too
    lens = [70, 21]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 24, 24, 16, f32)
    query = torch.randn(2, 4, 3, 24, device=DEVICE)
    out = paged_attention(query, key_cache, _value_columns(value_cache), block_table, seqlens, True,
                          enable_gqa=True, backend="triton")
    torch.testing.assert_close(out.double(), _reference(query, keys, values, True), rtol=2e-4, atol=2e-4)
    from tests.test_fp8 import test_paged_fp8_cache  # (here: a module-level import would collect it twice)

    test_paged_fp8_cache("triton", torch.bfloat16, 3, True)
    assert taken and all(taken), taken
    taken.clear()
    test_paged_slots_past_the_length_never_count("triton", 16, None, False)
    assert taken and not any(taken), taken

    def cache(page, columns=True, dv=16):
        c = torch.empty(4, page, 2, dv)
        return _value_columns(c) if columns else c

    assert shipped(cache(16), 64) and shipped(cache(32), 64) and shipped(cache(16, dv=12), 128)
    assert not shipped(cache(16, columns=False), 64)  # row-major pages
    assert not shipped(cache(64), 64) and not shipped(cache(128), 64)  # a page a step or more
    assert not shipped(cache(64), 128) and not shipped(cache(64), 256)  # past PAGE_BLOCKS_MAX_PAGE
    assert not shipped(cache(8), 64) and not shipped(cache(48), 128)  # under 16 keys; not a power of two
    heads_inner = torch.empty(4, 16, 2, 16).permute(0, 3, 2, 1)  # stored (num_pages, Dv, H_kv, page)
    assert heads_inner.stride(1) == 1 and not shipped(heads_inner, 64)  # keys contiguous, a head's block not one run


@pytest.mark.parametrize("join", [True, False], ids=["joined", "per_tile"])
def test_ninetoothed_paged_step_forms_never_count_stray_slots(join, monkeypatch):
    """Both forms of NineToothed's paged step (PAGED_JOIN) zero the values of slots past the length
    and before a left pad (NaN there) in the steps that hold them, the first and last, and only there."""
    import impl_ninetoothed.attention as nt

    monkeypatch.setattr(nt, "PAGED_JOIN", join)
    for splits in (None, 3):
        test_paged_slots_past_the_length_never_count("ninetoothed", 16, splits, False)
        test_paged_leftpad_reads_nothing_before_it("ninetoothed", splits, False)


def test_paged_alibi_through_a_kept_plan(backend, monkeypatch):
    """A kept plan takes each call's slopes (new values, the same layout), never the first call's;
    grouped-query heads stay packed into rows (K/V read once per group), each row its head's slope."""
    import common.paged as paged

    paged._templates.clear()
    lens = [37, 5]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, 16, f32)
    query = torch.randn(2, 4, 3, 16, device=DEVICE)
    outs, slopes = [], [torch.rand(4, device=DEVICE) for _ in range(2)]
    for i, s in enumerate(slopes):
        if i:
            monkeypatch.setattr(paged, "_make_plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("planned")))
        outs.append(paged_attention(query, key_cache, value_cache, block_table, seqlens, True, alibi_slopes=s,
                                    enable_gqa=True, backend=backend))
    assert len(paged._templates) == 1
    (template,) = paged._templates.values()
    assert template[0] == (2, 2, 6, 16)  # the packed query's shape
    for out, s in zip(outs, slopes):
        torch.testing.assert_close(out.double(), _reference(query, keys, values, True, alibi_slopes=s), rtol=2e-4,
                                   atol=2e-4)


def test_paged_shallow_stages_at_a_large_batch(backend, monkeypatch):
    """The paged plan asks the dense decode's rule (common.plan.shallow_stages) with its own
    launch: every (batch, K/V head, row block) program, its split count, its padded head dim;
    the 2-stage, register-capped config it returns is what launches, with the right answer."""
    import common.paged as paged
    from common.configs import Config
    from common.plan import Planner, use_planner

    asked = []
    shallow = Config(16, 64, 4, 2, maxnreg=Planner.shallow_max_registers)

    class Recording(Planner):
        def shallow_stages(self, config, programs, num_splits, device, block_d):
            asked.append((config.block_m, programs, num_splits, block_d))
            return dataclasses.replace(shallow, block_n=config.block_n)

    lens, Lq, H, H_kv, D, Dv, page, is_causal, dtype = CASES[0]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, Dv, page, dtype)
    query = torch.randn(len(lens), H, Lq, D, device=DEVICE, dtype=dtype)
    with use_planner(Recording(num_splits=1)):
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal, enable_gqa=True,
                              backend=backend)
        plan = paged._make_plan(get_backend(backend), query, key_cache, value_cache, block_table, seqlens,
                                is_causal, None)
    # (GQA packs each K/V head's 2 query heads into rows: one 16-row block a head)
    assert asked[0] == (16, len(lens) * H_kv, 1, 32)
    assert (plan.config.num_stages, plan.config.maxnreg) == (2, Planner.shallow_max_registers)
    torch.testing.assert_close(out.double(), _reference(query, keys, values, is_causal), rtol=2e-4, atol=2e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="the SMs of a GPU decide it (the CPU's part: the test above)")
def test_paged_decode_at_a_large_batch(backend):
    """Paged decode at a batch whose unsplit launch has more programs than 2 per SM: the 2-stage
    pipeline and the register cap (as the dense decode's), SDPA's answer on the gathered pages."""
    import common.paged as paged
    from common.plan import Planner

    batch = 3 * torch.cuda.get_device_properties(0).multi_processor_count // 8 + 1
    for page, heads in ((16, 8), (64, 8), (64, 32)):
        lens = [300 + 7 * b for b in range(batch)]
        key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, heads, 128, 128, page,
                                                                            torch.bfloat16)
        query = torch.randn(batch, 32, 1, 128, device=DEVICE, dtype=torch.bfloat16)
        plan = paged._make_plan(get_backend(backend), query, key_cache, value_cache, block_table, seqlens,
                                False, None)
        assert (plan.num_splits, plan.config.num_stages, plan.config.maxnreg) == (1, 2, Planner.shallow_max_registers)
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, enable_gqa=True, backend=backend)
        torch.testing.assert_close(out.double(), _reference(query, keys, values, False), rtol=2e-2, atol=2e-2)


def test_append_checks_a_layout_once(backend, monkeypatch):
    """append_kv checks a layout the first time only (a serving loop's later steps launch at once and
    still write where they should); a call of another layout is checked."""
    import common.paged as paged

    paged._appends.clear()
    lens, page = [20, 3], 16
    key_cache, value_cache, block_table, seqlens, _, _ = _cache(lens, 2, 16, 16, page, f32)
    new = [torch.randn(2, 2, 1, 16, device=DEVICE) for _ in range(4)]
    lengths = append_kv(key_cache, value_cache, block_table, seqlens, new[0], new[1], backend=backend)
    check_caches = paged._check_caches

    def no_checks(*args, **kw):
        raise AssertionError("checked again")

    monkeypatch.setattr(paged, "_check_caches", no_checks)
    lengths = append_kv(key_cache, value_cache, block_table, lengths, new[2], new[3], backend=backend)
    assert lengths.tolist() == [n + 2 for n in lens]
    for b, n in enumerate(lens):
        for i, (k, v) in ((n, new[:2]), (n + 1, new[2:])):
            slot = block_table[b, i // page].long(), i % page
            assert torch.equal(key_cache[slot], k[b, :, 0]) and torch.equal(value_cache[slot], v[b, :, 0])
    monkeypatch.setattr(paged, "_check_caches", check_caches)
    with pytest.raises(ValueError, match="value must be"):
        append_kv(key_cache, value_cache, block_table, lengths, new[2], new[3][:, :, :, :8], backend=backend)


# -- windows, soft-capping, sinks and the log-sum-exp ----------------------------------------

FEATURES = {  # name -> (lens, Lq, H, H_kv, page, is_causal, keywords); the first sequence's keys span 3 blocks on a CPU
    "window": ([300, 0, 5, 37], 3, 4, 2, 16, False, dict(window=(150, 2))),  # an empty and a shorter sequence
    "window_causal": ([290, 3, 33], 2, 2, 2, 16, True, dict(window=(20, -1))),  # 3 keys: shorter than its window
    "softcap": ([270, 21], 2, 4, 2, 64, True, dict(softcap=0.7)),
    "sinks": ([280, 0, 21], 1, 4, 2, 64, False, dict(sinks=True)),  # GQA (packed: each row its head's sink)
    "lse": ([300, 0, 21], 3, 4, 1, 32, True, dict(return_lse=True)),  # MQA, packed rows
    "alibi": ([260, 0, 19], 2, 4, 2, 16, True, dict(alibi_slopes="H")),  # GQA (packed: each row its head's slope)
    "alibi_full": ([230, 7], 3, 2, 2, 32, False, dict(alibi_slopes="BH")),  # not causal: the bias both sides
    # (keys from a start: one past its length, one at 0, one in the first split's last block)
    "leftpad": ([260, 30, 19, 40], 2, 4, 2, 16, True, dict(cache_leftpad=[150, 35, 0, 5])),
    # (per-sequence queries: 3 of 3, none, 1, 2; MQA, packed rows; a window)
    "query_lengths": ([280, 9, 30, 3], 3, 4, 1, 16, True, dict(query_lengths=[3, 0, 1, 2], window=(40, 0),
                                                                return_lse=True)),
    # (queries padded far past their lengths, as to a CUDA graph's bound: blocks of padding rows only)
    "query_padding": ([200, 20, 45], 40, 4, 2, 32, True, dict(query_lengths=[3, 0, 40], return_lse=True)),
    # (the first sequence's window misses the first split: its sink joins through a split with no key)
    "all": ([300, 0, 4, 47], 2, 4, 2, 16, True, dict(window=(150, 0), softcap=0.9, sinks=True, alibi_slopes="BH",
                                                     return_lse=True)),
}


def _feature_call(backend, name, splits, dtype=f32):
    """paged_attention with one FEATURES case (fresh inputs; sinks=True: random sink logits) against
    the float64 reference: (out, expected, lse, expected lse or None)."""
    lens, Lq, H, H_kv, page, is_causal, keywords = FEATURES[name]
    keywords = dict(keywords)
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, 16, 16, page, dtype)
    query = torch.randn(len(lens), H, Lq, 16, device=DEVICE, dtype=dtype)
    if keywords.get("sinks") is True:
        keywords["sinks"] = torch.randn(H, device=DEVICE)
    for name in ("cache_leftpad", "query_lengths"):
        if name in keywords:
            keywords[name] = torch.tensor(keywords[name], dtype=torch.int32, device=DEVICE)
    if "alibi_slopes" in keywords:  # "H" or "BH": slopes per head, or per sequence and head
        keywords["alibi_slopes"] = torch.rand(*((len(lens),) if keywords["alibi_slopes"] == "BH" else ()), H,
                                              device=DEVICE)
    with force_splits(splits or 1):
        result = paged_attention(query, key_cache, value_cache, block_table, seqlens, is_causal, enable_gqa=H_kv < H,
                                 backend=backend, **keywords)
    expected = _reference(query, keys, values, is_causal, window=keywords.get("window"),
                          softcap=keywords.get("softcap"), sinks=keywords.get("sinks"),
                          alibi_slopes=keywords.get("alibi_slopes"), leftpad=keywords.get("cache_leftpad"),
                          query_lengths=keywords.get("query_lengths"), with_lse=True)
    if keywords.get("return_lse"):
        return result[0], expected[0], result[1], expected[1]
    return result, expected[0], None, None


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_features(backend, name, splits):
    """Each feature alone and all together, unsplit and with the keys split in 3, against the reference."""
    out, expected, lse, expected_lse = _feature_call(backend, name, splits)
    lens, Lq, H = FEATURES[name][:3]
    assert out.shape == (len(lens), H, Lq, 16) and out.dtype == f32
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    if lse is not None:
        assert lse.shape == (len(lens), H, Lq) and lse.dtype == f32
        torch.testing.assert_close(lse.double(), expected_lse, rtol=2e-4, atol=2e-4)
        if "sinks" not in FEATURES[name][6]:
            assert bool(torch.isneginf(lse[1]).all()), "the empty sequence's rows: lse -inf"


@pytest.mark.parametrize("splits", [None, 3])
def test_paged_features_half(backend, splits):
    """Every feature together on float16 caches (on a GPU: the soft-cap's tanh.approx.f32 kind)."""
    out, expected, lse, expected_lse = _feature_call(backend, "all", splits, dtype=f16)
    assert out.dtype == f16 and lse.dtype == f32
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-2, atol=1e-2)


def test_ninetoothed_paged_step_tiles(monkeypatch):
    """NineToothed's paged step: the largest power of two dividing the page (at most the step) as its
    tile, at most PAGED_TILES_PER_STEP such tiles unrolled (a longer step: that many; 8 under triton 3.6,
    4 under later versions, whose compile of 8 takes over a minute), all of them one softmax update with
    PAGED_JOIN, each its own without; FP8 caches at most PAGED_FP8_TILES_PER_STEP (4: 8 spill on sm_90)."""
    import impl_ninetoothed.attention as nt
    from common import compat

    assert nt.PAGED_TILES_PER_STEP == (8 if compat.triton_version() <= (3, 6) else 4)
    monkeypatch.setattr(nt, "PAGED_TILES_PER_STEP", 8)
    monkeypatch.setattr(nt, "PAGED_JOIN", True)
    assert nt.paged_tiles(16, 64) == (16, 4, 4)
    assert nt.paged_tiles(48, 128) == (16, 8, 8)
    assert nt.paged_tiles(16, 256) == (16, 8, 8) and nt.paged_tiles(32, 64) == (32, 2, 2)
    assert nt.paged_tiles(256, 64) == (64, 1, 1)
    # FP8 caches: at most PAGED_FP8_TILES_PER_STEP (4) on any version
    assert nt.PAGED_FP8_TILES_PER_STEP == 4
    assert nt.paged_tiles(16, 256, fp8=True) == (16, 4, 4) and nt.paged_tiles(32, 64, fp8=True) == (32, 2, 2)
    monkeypatch.setattr(nt, "PAGED_TILES_PER_STEP", 2)
    assert nt.paged_tiles(16, 256, fp8=True) == (16, 2, 2)
    monkeypatch.setattr(nt, "PAGED_TILES_PER_STEP", 8)
    monkeypatch.setattr(nt, "PAGED_JOIN", False)
    assert nt.paged_tiles(16, 64) == (16, 4, 1) and nt.paged_tiles(16, 256) == (16, 8, 1)
    assert nt.paged_tiles(16, 256, fp8=True) == (16, 4, 1)
    assert nt.paged_tiles(256, 64) == (64, 1, 1)


@pytest.mark.parametrize("join", [True, False], ids=["joined", "per_tile"])
@pytest.mark.parametrize("name, splits", [("all", None), ("all", 3), ("query_padding", None), ("lse", 3)])
def test_ninetoothed_paged_step_forms(name, splits, join, monkeypatch):
    """NineToothed's paged kernel at small pages in both its forms, a step's tiles joined into one
    softmax update (``PAGED_JOIN``) or each its own (shipped): the same answers as the reference, and
    the form asked for really taken (more than one tile a step, joined or not)."""
    import impl_ninetoothed.attention as nt

    taken = []
    shipped = nt.paged_tiles

    def tiles(*args):
        result = shipped(*args)
        taken.append(result)
        return result

    monkeypatch.setattr(nt, "PAGED_JOIN", join)
    monkeypatch.setattr(nt, "paged_tiles", tiles)
    out, expected, lse, expected_lse = _feature_call("ninetoothed", name, splits)
    assert taken and min(per_step for _, per_step, _ in taken) > 1, taken
    assert all((joined == per_step) if join else joined == 1 for _, per_step, joined in taken), taken
    torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    if lse is not None:
        torch.testing.assert_close(lse.double(), expected_lse, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("window, splits", [((20, 0), None), ((20, 0), 3), ((130, 0), 3)])
def test_paged_window_reads_only_its_window(backend, window, splits):
    """A sliding-window decode visits only the key blocks its window reaches: keys and values in
    the blocks before it are NaN, and the answer is still right (one visit would make it NaN).
    A window the planner would not split runs unsplit, split keys forced or not."""
    import common.paged as paged

    lens, page = [400, 300], 16
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, page, f32)
    query = torch.randn(2, 2, 1, 16, device=DEVICE)
    with force_splits(splits or 1):
        plan = paged._make_plan(get_backend(backend), query, key_cache, value_cache, block_table, seqlens, True,
                                None, window=window)
        assert plan.split == (window[0] > plan.config.block_n and splits is not None)
        block_n = plan.config.block_n
        for b, n in enumerate(lens):
            unread = (n - 1 - window[0]) // block_n * block_n  # the keys of the blocks before the window
            for cache in (key_cache, value_cache):
                cache[block_table[b, :unread // page].long()] = float("nan")
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, window=window,
                              backend=backend)
    torch.testing.assert_close(out.double(), _reference(query, keys, values, True, window=window), rtol=2e-4,
                               atol=2e-4)


def test_paged_features_plan_reuse(backend):
    """The window, softcap, sinks and return_lse are part of the template's key: a call with them
    never reuses the plan of a call without; new sink logits are read on reuse."""
    import common.paged as paged

    paged._templates.clear()
    lens = [40, 7]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, 16, f32)
    query = torch.randn(2, 2, 2, 16, device=DEVICE)
    calls = [dict(), dict(window=(5, 0)), dict(window=(5, 0), softcap=1.0), dict(sinks=torch.randn(2, device=DEVICE)),
             dict(sinks=torch.randn(2, device=DEVICE)), dict(return_lse=True)]
    for keywords in calls:
        out = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, backend=backend, **keywords)
        out = out[0] if keywords.get("return_lse") else out
        expected = _reference(query, keys, values, True, window=keywords.get("window"),
                              softcap=keywords.get("softcap"), sinks=keywords.get("sinks"))
        torch.testing.assert_close(out.double(), expected, rtol=2e-4, atol=2e-4)
    assert len(paged._templates) == 5  # (the two sinks calls share one)


def test_paged_reference_backend_window_and_lse():
    """The torch backend takes a window (a boolean mask), ALiBi (a float one), left padding, query
    lengths and returns the log-sum-exp."""
    lens = [40, 0, 9]
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, 2, 16, 16, 16, f32)
    query = torch.randn(3, 4, 3, 16, device=DEVICE)
    slopes = torch.rand(4, device=DEVICE)
    leftpad = torch.tensor([30, 0, 12], dtype=torch.int32, device=DEVICE)  # (12: past its sequence's 9 keys)
    new_tokens = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEVICE)
    out, lse = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, enable_gqa=True,
                               window=(4, -1), alibi_slopes=slopes, cache_leftpad=leftpad, query_lengths=new_tokens,
                               return_lse=True, backend="torch")
    expected, expected_lse = _reference(query, keys, values, True, window=(4, -1), alibi_slopes=slopes,
                                        leftpad=leftpad, query_lengths=new_tokens, with_lse=True)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-5, atol=1e-5)


def test_paged_feature_errors():
    """Bad windows, soft-caps, sinks, slopes and return_lse: the dense path's messages, before any launch;
    the torch backend refuses softcap and sinks as attention() does."""
    key_cache, value_cache, block_table, seqlens, _, _ = _cache([20, 3], 2, 16, 16, 16, f32)
    q = torch.randn(2, 2, 1, 16, device=DEVICE)
    args = (q, key_cache, value_cache, block_table, seqlens)
    bad = [
        (dict(window=(-2, 0)), ValueError, "window's left bound must be >= 0"),
        (dict(window=(3,)), TypeError, "window must be None or a pair"),
        (dict(window=(1.5, 0)), TypeError, "window's left bound must be an int"),
        (dict(softcap=0.0), ValueError, "softcap must be a positive number"),
        (dict(softcap="2"), TypeError, "softcap must be a real number"),
        (dict(sinks=torch.zeros(3, device=DEVICE)), ValueError, r"sinks must have shape \(2,\)"),
        (dict(sinks=torch.zeros(2, dtype=torch.int32, device=DEVICE)), TypeError, "sinks must be a float tensor"),
        (dict(sinks=[0.0, 0.0]), TypeError, "sinks must be a torch.Tensor"),
        (dict(return_lse=1), TypeError, "return_lse must be a bool"),
        (dict(alibi_slopes=torch.zeros(3, device=DEVICE)), ValueError, r"alibi_slopes must have shape \(2,\)"),
        (dict(alibi_slopes=torch.zeros(2, dtype=torch.float16, device=DEVICE)), TypeError, "must be a float32"),
        (dict(alibi_slopes=[0.5, 0.25]), TypeError, "alibi_slopes must be a torch.Tensor"),
        (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE)), ValueError, "leftpad must be int32"),
        (dict(cache_leftpad=[0, 1]), TypeError, "cache_leftpad must be a torch.Tensor"),
        (dict(softcap=2.0, backend="torch"), ValueError, "the 'torch' backend cannot soft-cap scores"),
        (dict(sinks=torch.zeros(2, device=DEVICE), backend="torch"), ValueError,
         "the 'torch' backend has no attention sinks"),
    ]
    for keywords, error, message in bad:
        with pytest.raises(error, match=message):
            paged_attention(*args, **keywords)


def test_paged_no_query_rows_with_lse(backend):
    """No query rows: an empty output and an empty log-sum-exp, nothing launched."""
    key_cache, value_cache, block_table, seqlens, _, _ = _cache([20, 3], 2, 16, 16, 16, f32)
    out, lse = paged_attention(torch.randn(2, 2, 0, 16, device=DEVICE), key_cache, value_cache, block_table, seqlens,
                               window=(3, 0), return_lse=True, backend=backend)
    assert out.shape == (2, 2, 0, 16) and lse.shape == (2, 2, 0) and lse.dtype == f32


@pytest.mark.skipif(DEVICE != "cuda", reason="a GPU's kinds: tanh.approx.f32 soft-capping, its tiles, its splits")
@pytest.mark.parametrize("page", [16, 64])
def test_paged_features_on_gpu(backend, page):
    """Decode and a few speculative tokens over a long bf16 cache with the features together (a
    sliding window or none, softcap, sinks, lse): the planner's own splits (merged in the kernel)
    and forced ones, against the float64 reference."""
    lens, H, H_kv, D = [8000, 1, 5000], 32, 8, 128
    key_cache, value_cache, block_table, seqlens, keys, values = _cache(lens, H_kv, D, D, page, torch.bfloat16)
    sinks = torch.randn(H, device=DEVICE)
    for Lq, window, splits in [(1, (128, 0), None), (1, None, None), (4, (1000, 0), 4), (1, None, 4)]:
        query = torch.randn(3, H, Lq, D, device=DEVICE, dtype=torch.bfloat16)
        with force_splits(splits) if splits else contextlib.nullcontext():
            out, lse = paged_attention(query, key_cache, value_cache, block_table, seqlens, True, enable_gqa=True,
                                       window=window, softcap=2.0, sinks=sinks, return_lse=True, backend=backend)
        expected, expected_lse = _reference(query, keys, values, True, window=window, softcap=2.0, sinks=sinks,
                                            with_lse=True)
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse.double(), expected_lse, rtol=2e-2, atol=2e-2)
