"""A fuzzer for varlen_attention: random packed batches through both kernel backends against float64
attention of each sequence alone (``tests.test_paged._reference``, which places rows top-left or
bottom-right).

Hypothesis draws the sequences' query and key lengths (empty ones, and queries longer than their keys
too), max_seqlen_q as the longest or a bound above it, the packed tensors' strides (contiguous,
heads-first buffers, every other element), head dims and Dv != D, grouped-query groups, dtypes, the scale
(negative too), causal or not in either alignment, windows, soft-capping, sinks, ALiBi slopes per head or
per sequence, the log-sum-exp; FP8 keys and values under a 16-bit query, with per-sequence descales of
either sign; and in about one call in three, with the features SDPA's arguments express, the gradients,
each sequence's judged by the dense tests' rule against SDPA on that sequence alone. Same profiles as
``tests/test_fuzz.py`` (FUZZ_PROFILE, FUZZ_EXAMPLES): a few small calls under the interpreter in CI, more
and longer on the GPU.
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (extra 'test')")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from common import varlen_attention  # noqa: E402
from tests.cases import check_grads  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.fuzzing import TOLERANCE, profile, shard_settings  # noqa: E402
from tests.test_paged import _reference  # noqa: E402

PROFILE = profile(cpu=dict(examples=8, shards=1, max_len=40, shrink=True),
                  gpu=dict(examples=5, shards=4, max_len=400, shrink=False))


@st.composite
def varlen_cases(draw):
    """One call's arguments, as plain values (the tensors are made from them and the example's seed)."""
    B = draw(st.integers(1, 4))
    lens_q = draw(st.lists(st.integers(0, PROFILE["max_len"]), min_size=B, max_size=B))
    lens_k = lens_q if draw(st.booleans()) else draw(
        st.lists(st.integers(0, PROFILE["max_len"]), min_size=B, max_size=B))
    H_kv = draw(st.integers(1, 2))
    D = draw(st.sampled_from((8, 16, 24, 32, 40)))
    # about one call in three checks gradients, by SDPA's rule (tests.cases.check_grads): its features then
    # those SDPA's arguments express (no soft-capping, sinks, ALiBi or FP8)
    grads = draw(st.integers(0, 2)) == 0
    fp8 = not grads and draw(st.integers(0, 4)) == 0
    is_causal = draw(st.booleans())
    window = None
    if draw(st.booleans()):
        window = (draw(st.integers(-1, 30)), draw(st.integers(-1, 0) if is_causal else st.integers(-1, 5)))
    return dict(lens_q=lens_q, lens_k=lens_k, H_kv=H_kv, H=H_kv * draw(st.integers(1, 3)), D=D,
                Dv=draw(st.sampled_from((D, 16, 24))), fp8=fp8,
                dtype=draw(st.sampled_from((torch.float16, torch.bfloat16) if fp8 else
                                           (torch.float16, torch.bfloat16, torch.float32))),
                layout=draw(st.sampled_from(("contiguous", "heads_first", "strided"))),
                extra_rows=draw(st.sampled_from((0, 0, 3))), is_causal=is_causal,
                alignment=draw(st.sampled_from(("top_left", "bottom_right"))), window=window,
                scale=draw(st.sampled_from((None, None, 0.3, -0.5))),
                softcap=None if grads else draw(st.sampled_from((None, None, 0.8, 2.5))),
                sinks=not grads and draw(st.booleans()),
                alibi=None if grads else draw(st.sampled_from((None, None, "H", "BH"))),
                return_lse=draw(st.booleans()), grads=grads)


def _packed(total, heads, width, layout):
    """A (total, heads, width) float32 tensor in the drawn layout."""
    if layout == "heads_first":
        return torch.randn(heads, total, width, device=DEVICE).transpose(0, 1)
    if layout == "strided":
        return torch.randn(total, heads, 2 * width, device=DEVICE)[..., ::2]
    return torch.randn(total, heads, width, device=DEVICE)


def _check_sequence_grads(case, q, k, v, out, cu):
    """Backpropagate a random output gradient through the packed call, then judge each sequence's slices
    of dq, dk and dv as SDPA's gradients of that sequence alone (its rows' places among its keys, causal
    or windowed, as a boolean mask; a sequence with no query or no key: zero gradients)."""
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    starts_q, starts_k = cu[0].tolist(), cu[1].tolist()
    for b in range(len(case["lens_q"])):
        rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        Lq, Lk = rows.stop - rows.start, keys.stop - keys.start
        if Lq == 0 or Lk == 0:
            for grad in (q.grad[rows], k.grad[keys], v.grad[keys]):
                assert torch.equal(grad, torch.zeros_like(grad)), f"{case}, sequence {b}: not zero"
            continue
        offset = torch.arange(Lk, device=DEVICE)[None, :] - torch.arange(Lq, device=DEVICE)[:, None]
        offset = offset - (Lk - Lq if case["alignment"] == "bottom_right" else 0)
        seen = torch.ones(Lq, Lk, dtype=torch.bool, device=DEVICE)
        if case["is_causal"]:
            seen &= offset <= 0
        if case["window"] is not None:
            left, right = case["window"]
            seen &= (offset >= -left) if left >= 0 else seen
            seen &= (offset <= right) if right >= 0 else seen

        def one(x, span):  # (1, heads, length, width): the sequence's slice as SDPA takes it
            return x[span].transpose(0, 1)[None]

        check_grads((one(q.grad, rows), one(k.grad, keys), one(v.grad, keys)), one(q, rows).detach(),
                    one(k, keys).detach(), one(v, keys).detach(), one(grad_out, rows),
                    out=one(out, rows).detach(), attn_mask=seen[None, None], scale=case["scale"],
                    enable_gqa=case["H_kv"] < case["H"])


def _varlen_fuzz_test(shard):
    @shard_settings(20261207 + shard, PROFILE)
    @given(case=varlen_cases(), seed=st.integers(0, 2**31 - 1))
    @pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
    def test_fuzz_varlen(backend, case, seed):
        torch.manual_seed(seed)
        lens_q, lens_k, H, H_kv, dtype = case["lens_q"], case["lens_k"], case["H"], case["H_kv"], case["dtype"]
        B = len(lens_q)
        q = (_packed(sum(lens_q), H, case["D"], case["layout"]) * 2).to(dtype)
        k, v = (_packed(sum(lens_k), H_kv, width, case["layout"]) for width in (case["D"], case["Dv"]))
        if case["grads"]:  # (leaves in the drawn layout)
            q, k, v = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
        descales = {}
        if case["fp8"]:  # e4m3 keys and values, a descale of either sign per (sequence, K/V head)
            k, v = ((x * 4).to(torch.float8_e4m3fn) for x in (k, v))
            for name in ("k_descale", "v_descale"):
                signs = torch.randint(0, 2, (B, H_kv), device=DEVICE) * 2 - 1
                descales[name] = (torch.rand(B, H_kv, device=DEVICE) * 0.3 + 0.1) * signs
        else:
            k, v = k.to(dtype), v.to(dtype)
        cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
              for lens in (lens_q, lens_k)]
        sinks = torch.randn(H, device=DEVICE) if case["sinks"] else None
        slopes = {None: None, "H": torch.rand(H, device=DEVICE), "BH": torch.rand(B, H, device=DEVICE)}[case["alibi"]]
        result = varlen_attention(q, k, v, cu[0], cu[1], max(lens_q) + case["extra_rows"], max(lens_k),
                                  case["is_causal"], case["scale"], enable_gqa=H_kv < H, backend=backend,
                                  return_lse=case["return_lse"], alignment=case["alignment"], window=case["window"],
                                  softcap=case["softcap"], sinks=sinks, alibi_slopes=slopes, **descales)
        out, lse = result if case["return_lse"] else (result, None)
        assert out.shape == (sum(lens_q), H, case["Dv"]) and out.dtype == dtype
        if case["grads"]:
            _check_sequence_grads(case, q, k, v, out, cu)

        tol = TOLERANCE[dtype]
        starts_q, starts_k = cu[0].tolist(), cu[1].tolist()
        for b in range(B):  # each sequence alone, its real keys and values (an FP8 one's times its descales)
            rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            kb, vb = (x[keys].double().transpose(0, 1) for x in (k, v))
            if case["fp8"]:
                kb = kb * descales["k_descale"][b].double()[:, None, None]
                vb = vb * descales["v_descale"][b].double()[:, None, None]
            expected, expected_lse = _reference(
                q[rows].transpose(0, 1)[None], [kb], [vb], case["is_causal"], scale=case["scale"],
                window=case["window"], softcap=case["softcap"], sinks=sinks,
                alibi_slopes=None if slopes is None else slopes.expand(B, H)[b], with_lse=True,
                top_left=case["alignment"] == "top_left")
            note = f"{case}, sequence {b}"
            torch.testing.assert_close(out[rows].double().transpose(0, 1)[None], expected, rtol=tol, atol=tol,
                                       msg=lambda m: f"{note}\n{m}")
            if lse is not None:
                assert lse.shape == (H, sum(lens_q)) and lse.dtype == torch.float32
                torch.testing.assert_close(lse[:, rows].double()[None], expected_lse, rtol=tol, atol=tol,
                                           msg=lambda m: f"{note}\n{m}")

    test_fuzz_varlen.__name__ = test_fuzz_varlen.__qualname__ = f"test_fuzz_varlen_shard{shard}"
    return test_fuzz_varlen


for _shard in range(PROFILE["shards"]):
    globals()[f"test_fuzz_varlen_shard{_shard}"] = _varlen_fuzz_test(_shard)
