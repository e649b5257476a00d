"""A fuzzer for paged_attention: random calls of both kernel backends against float64 attention of each
sequence's dense keys (``tests.test_paged._reference``).

Hypothesis draws the batch (empty sequences and sequences shorter than their queries too), the page size
(1, 3, 16, 32, 48: NineToothed takes multiples of 16 only), shuffled block tables with spare pages, value
pages row- or column-major, head dims and Dv != D, the query off 16-byte alignment, grouped-query groups,
dtypes, the scale (negative too), causal or not, windows, soft-capping, sinks, ALiBi slopes per head or per
sequence and head, left padding, per-sequence query lengths, the log-sum-exp, and the keys split into ranges
or not; FP8 caches under a 16-bit query, with their descales, in about one call in five. Same profiles as
``tests/test_fuzz.py`` (FUZZ_PROFILE, FUZZ_EXAMPLES): a few small calls under the interpreter in CI, more and
longer on the GPU.
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (extra 'test')")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from common import paged_attention  # noqa: E402
from common.plan import force_splits  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.fuzzing import TOLERANCE, profile, shard_settings  # noqa: E402
from tests.test_paged import _reference  # noqa: E402

PROFILE = profile(cpu=dict(examples=8, shards=1, max_len=70, shrink=True),
                  gpu=dict(examples=5, shards=4, max_len=600, shrink=False))



@st.composite
def paged_cases(draw, backend):
    """One call's arguments, as plain values (the tensors are made from them and the example's seed)."""
    B = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, PROFILE["max_len"]), min_size=B, max_size=B))
    Lq = draw(st.integers(1, 4))
    H_kv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    D = draw(st.sampled_from((8, 16, 24, 32, 40)))
    Dv = draw(st.sampled_from((D, 16, 24)))
    fp8 = draw(st.integers(0, 4)) == 0
    dtype = draw(st.sampled_from((torch.float16, torch.bfloat16) if fp8 else
                                 (torch.float16, torch.bfloat16, torch.float32)))
    page = draw(st.sampled_from((16, 32, 48) if backend == "ninetoothed" else (1, 3, 16, 32, 48)))
    is_causal = draw(st.booleans())
    window = None
    if draw(st.booleans()):
        window = (draw(st.integers(-1, 40)), draw(st.integers(-1, 0) if is_causal else st.integers(-1, 5)))
    case = dict(lens=lens, Lq=Lq, H_kv=H_kv, H=H_kv * group, D=D, Dv=Dv, dtype=dtype, fp8=fp8, page=page,
                spare=draw(st.integers(0, 3)), extra_pages=draw(st.integers(0, 2)),
                value_columns=draw(st.booleans()), is_causal=is_causal, window=window,
                scale=draw(st.sampled_from((None, None, 0.3, -0.5))),
                softcap=draw(st.sampled_from((None, None, 0.8, 2.5))), sinks=draw(st.booleans()),
                alibi=draw(st.sampled_from((None, None, "H", "BH"))),
                leftpad=draw(st.lists(st.integers(0, PROFILE["max_len"] + 1), min_size=B, max_size=B))
                if draw(st.integers(0, 3)) == 0 else None,
                query_lengths=draw(st.lists(st.integers(0, Lq), min_size=B, max_size=B))
                if draw(st.integers(0, 3)) == 0 else None,
                return_lse=draw(st.booleans()), splits=draw(st.sampled_from((None, 2, 3))),
                misaligned=draw(st.integers(0, 3)) == 0)
    return case


def _paged_inputs(case):
    """The caches (pages in a shuffled table, spare pages holding other values), the query, and each
    sequence's dense keys and values as the kernels must see them (an FP8 cache: its real values)."""
    lens, page, H_kv, D, Dv, dtype = case["lens"], case["page"], case["H_kv"], case["D"], case["Dv"], case["dtype"]
    B = len(lens)
    max_pages = max(-(-n // page) for n in lens) + case["extra_pages"]
    max_pages = max(max_pages, 1)
    num_pages = B * max_pages + case["spare"]
    table = torch.randperm(num_pages, device=DEVICE)[:B * max_pages].view(B, max_pages).to(torch.int32)
    caches, descales = [], []
    for width, magnitude in ((D, 3.0), (Dv, 1.0)):
        x = torch.randn(num_pages, page, H_kv, width, device=DEVICE) * magnitude
        if case["fp8"]:  # e4m3 values, and a descale of either sign per (sequence, K/V head)
            caches.append((x * 4).to(torch.float8_e4m3fn))
            signs = torch.randint(0, 2, (B, H_kv), device=DEVICE) * 2 - 1
            descales.append((torch.rand(B, H_kv, device=DEVICE) * 0.3 + 0.1) * signs)
        else:
            caches.append(x.to(dtype))
    keys, values = [], []
    for b, n in enumerate(lens):
        pages = table[b].long()
        dense = []
        for i, cache in enumerate(caches):  # (H_kv, n, width), real values
            x = cache[pages].double().flatten(0, 1)[:n].transpose(0, 1)
            dense.append(x * descales[i][b].double()[:, None, None] if case["fp8"] else x)
        keys.append(dense[0])
        values.append(dense[1])
    if case["value_columns"]:  # each value page stored (H_kv, Dv, page): column-major
        caches[1] = caches[1].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    query = torch.randn(B, case["H"], case["Lq"], D, device=DEVICE).to(dtype)
    if case["misaligned"]:  # one element past a 16-byte boundary: no vector copies of its rows
        query = torch.empty(query.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(query.shape).copy_(query)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return query, caches, table, seqlens, descales, keys, values


def _paged_fuzz_test(shard):
    @shard_settings(20261206 + shard, PROFILE)
    @given(data=st.data(), seed=st.integers(0, 2**31 - 1))
    @pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
    def test_fuzz_paged(backend, data, seed):
        case = data.draw(paged_cases(backend), label="case")
        torch.manual_seed(seed)
        query, (key_cache, value_cache), table, seqlens, descales, keys, values = _paged_inputs(case)
        B, H = len(case["lens"]), case["H"]

        def ints(values):
            return None if values is None else torch.tensor(values, dtype=torch.int32, device=DEVICE)

        keywords = dict(scale=case["scale"], window=case["window"], softcap=case["softcap"],
                        sinks=torch.randn(H, device=DEVICE) if case["sinks"] else None,
                        alibi_slopes={None: None, "H": torch.rand(H, device=DEVICE),
                                      "BH": torch.rand(B, H, device=DEVICE)}[case["alibi"]],
                        cache_leftpad=ints(case["leftpad"]), query_lengths=ints(case["query_lengths"]))
        if case["fp8"]:
            keywords.update(k_descale=descales[0], v_descale=descales[1])
        with force_splits(case["splits"] or 1):
            result = paged_attention(query, key_cache, value_cache, table, seqlens, case["is_causal"],
                                     enable_gqa=case["H_kv"] < H, return_lse=case["return_lse"], backend=backend,
                                     **keywords)
        out, lse = result if case["return_lse"] else (result, None)
        expected, expected_lse = _reference(
            query, keys, values, case["is_causal"], scale=case["scale"], window=case["window"],
            softcap=case["softcap"], sinks=keywords["sinks"], alibi_slopes=keywords["alibi_slopes"],
            leftpad=case["leftpad"], query_lengths=case["query_lengths"], with_lse=True)
        assert out.shape == (B, H, case["Lq"], case["Dv"]) and out.dtype == case["dtype"]
        tol = TOLERANCE[case["dtype"]]
        torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol, msg=lambda m: f"{case}\n{m}")
        if lse is not None:
            assert lse.shape == (B, H, case["Lq"]) and lse.dtype == torch.float32
            torch.testing.assert_close(lse.double(), expected_lse, rtol=tol, atol=tol, msg=lambda m: f"{case}\n{m}")

    test_fuzz_paged.__name__ = test_fuzz_paged.__qualname__ = f"test_fuzz_paged_shard{shard}"
    return test_fuzz_paged


for _shard in range(PROFILE["shards"]):
    globals()[f"test_fuzz_paged_shard{_shard}"] = _paged_fuzz_test(_shard)
