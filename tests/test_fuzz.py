"""A fuzzer: random calls of both kernel backends against SDPA's math in float64.

Hypothesis draws the shapes (3-D and 4-D, odd lengths, Lq != Lk both ways),
head dims (1 to 128, powers of two and not, Dv != D), dtypes, grouped-query groups,
memory layouts (misaligned too), masks (bool or additive, broadcast from any of their shapes,
rows with no visible key), scales (negative and large too) and causal or not;
about one call in three also checks the gradients. Each example must pass the
same accuracy rule as the hand-written cases.

Two profiles, fixed seeds (one per shard, no example database), picked by the
device or by the environment variable FUZZ_PROFILE (FUZZ_EXAMPLES sets the
number of examples per shard):
- "cpu": small sizes and few examples, for CI under Triton's interpreter;
- "gpu": longer sequences, 6 shards of 5 examples per backend, for the H200.
  It is compile-bound there (nearly every example is a new specialisation, a few
  seconds each), so the examples come in shards, separate tests with their own
  seeds that pytest-xdist runs side by side (``-n 12``), not one long test. It does
  not shrink a failing example (every shrinking step would compile again, and one
  shard then outlives the call): the failure names the example as drawn.
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (extra 'test')")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from common import attention  # noqa: E402
from tests.cases import Case, check_grads, check_output, make_inputs, sdpa_kwargs  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.fuzzing import profile, shard_settings  # noqa: E402

PROFILE = profile(cpu=dict(examples=10, shards=1, max_len=40, shrink=True),
                  gpu=dict(examples=5, shards=6, max_len=300, shrink=False))
HEAD_DIMS = (1, 8, 12, 16, 24, 32, 40, 64, 80, 128)
MASK_SHAPES_4D = ("LqLk", "1Lk", "B11Lk", "B1LqLk", "1HLqLk", "BHLqLk")
MASK_SHAPES_3D = ("LqLk", "1Lk", "HLqLk")


@st.composite
def cases(draw):
    B = draw(st.sampled_from([None, 1, 2]))
    H_kv = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    Lq = draw(st.integers(1, PROFILE["max_len"]))
    Lk = draw(st.integers(1, PROFILE["max_len"]))
    D = draw(st.sampled_from(HEAD_DIMS))
    Dv = draw(st.sampled_from((None, *HEAD_DIMS)))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    causal = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(-3.0, 3.0).filter(lambda s: abs(s) > 1e-3),
                           st.sampled_from([-20.0, 12.0])))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "misaligned"]))
    mask, mask_shape = None, "BHLqLk"
    if not causal:
        mask = draw(st.sampled_from([None, "bool", "additive", "bool-empty-rows", "additive-empty-rows"]))
        mask_shape = draw(st.sampled_from(MASK_SHAPES_3D if B is None else MASK_SHAPES_4D))
    return Case(B, H_kv * group, Lq, Lk, D, Dv=Dv, H_kv=H_kv if group > 1 else None, dtype=dtype, causal=causal,
                scale=scale, layout=layout, mask=mask, mask_shape=mask_shape)


def _fuzz_test(shard: int):
    """The fuzz test of one shard: its own fixed seed, so the shards draw different examples."""

    @shard_settings(20261130 + shard, PROFILE)
    @given(case=cases(), with_grads=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
    @pytest.mark.parametrize("backend", ["triton", "ninetoothed"])
    def test_fuzz(backend, case, with_grads, seed):
        torch.manual_seed(seed)
        q, k, v, mask = make_inputs(case, DEVICE)
        kwargs = sdpa_kwargs(case, mask)
        note = f"{case.id} seed={seed}"
        if with_grads == 0:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = attention(q, k, v, backend=backend, **kwargs)
        check_output(out, q, k, v, **kwargs)
        if with_grads == 0:
            grad_out = torch.randn_like(out)
            out.backward(grad_out)
            check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, out=out, **kwargs)
        hypothesis.note(note)

    test_fuzz.__name__ = test_fuzz.__qualname__ = f"test_fuzz_shard{shard}"
    return test_fuzz


for _shard in range(PROFILE["shards"]):
    globals()[f"test_fuzz_shard{_shard}"] = _fuzz_test(_shard)
