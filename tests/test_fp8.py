"""FP8 inputs to attention(): float8_e4m3fn query, key and value with FlashAttention-3's descales,
or a 16-bit query with FP8 keys and values (decoding from an FP8 cache). Forward only.

Accuracy: against float64 attention of the dequantized inputs (stored value x descale), within
the bound of what the kernels round (``common.reference.fp8_error_bound``: each probability rounded
for the P·V product, to e4m3 with an FP8 query and FP8 values, else to float16; the output; on a GPU,
the FP8 MMAs' sums).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common import attention, quantize_fp8
from common.fp8 import dequantize_fp8
from common.plan import current_planner, force_splits, use_planner
from common.reference import (
    E4M3_ROUNDING,
    HALF_UNITS,
    HOPPER_FP8_SUMS,
    fp8_error_bound,
    fp8_score_error,
    reference,
    reference_lse,
    reference_probs,
)

from .conftest import DEVICE

ACCUMULATION = HOPPER_FP8_SUMS if DEVICE == "cuda" else 0.0  # an FP8 MMA's sum, per product (float32's here)


def _inputs(B, H, H_kv, Lq, Lk, D, Dv, query_dtype=torch.float8_e4m3fn):
    """(q, k, v, q_descale, k_descale, v_descale, real q, k, v): fresh random inputs in FP8 (a
    16-bit query as it is) with per-(batch, K/V head) descales, and their float64 real values."""
    q = torch.randn(B, H, Lq, D, device=DEVICE) * 2.0
    k = torch.randn(B, H_kv, Lk, D, device=DEVICE) * 3.0
    v = torch.randn(B, H_kv, Lk, Dv, device=DEVICE)
    k8, kd = quantize_fp8(k)
    v8, vd = quantize_fp8(v)
    if query_dtype == torch.float8_e4m3fn:
        q8, qd = quantize_fp8(q, heads=H_kv)
        q_real = dequantize_fp8(q8, qd, torch.float64)
    else:
        q8, qd = q.to(query_dtype), None
        q_real = q8.double()
    return q8, k8, v8, qd, kd, vd, q_real, dequantize_fp8(k8, kd, torch.float64), dequantize_fp8(v8, vd, torch.float64)


def _score_error(q_real, k_real, scale):
    """Per row (B, H, Lq): how far the FP8 MMAs' sums may move a score of an FP8 query on this device."""
    return fp8_score_error(q_real, k_real, scale, ACCUMULATION)


def _pv_rounding(query_dtype, fp8_pv=True):
    if query_dtype == torch.float8_e4m3fn and fp8_pv:
        return E4M3_ROUNDING
    return HALF_UNITS[torch.float16]  # the values widened to float16, the probabilities rounded to it


@pytest.mark.parametrize("query_dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16],
                         ids=["fp8", "bf16_query", "fp16_query"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 37, 53, 32, 32), (2, 2, 2, 16, 16, 64, 48)],
                         ids=["gqa_ragged", "dv48"])
def test_fp8_matches_float64_of_dequantized(backend, query_dtype, is_causal, shape):
    B, H, H_kv, Lq, Lk, D, Dv = shape
    q, k, v, qd, kd, vd, q_real, k_real, v_real = _inputs(B, H, H_kv, Lq, Lk, D, Dv, query_dtype)
    out = attention(q, k, v, is_causal=is_causal, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd,
                    backend=backend)
    out_dtype = torch.bfloat16 if query_dtype == torch.float8_e4m3fn else query_dtype
    assert out.dtype == out_dtype and out.shape == (B, H, Lq, Dv)
    expected = reference(q_real, k_real, v_real, is_causal=is_causal, enable_gqa=True)
    probs = reference_probs(q_real, k_real, is_causal=is_causal)
    score_error = _score_error(q_real, k_real, D**-0.5) if query_dtype == torch.float8_e4m3fn else 0.0
    bound = fp8_error_bound(probs, v_real, expected, out_dtype, _pv_rounding(query_dtype), score_error)
    error = (out.double() - expected).abs()
    assert torch.isfinite(out).all()
    assert (error <= bound).all(), f"max error {error.max():.3g}, max excess {(error - bound).max():.3g}"


@pytest.mark.parametrize("fp8_pv", [True, False], ids=["pv_e4m3", "pv_fp16"])
def test_fp8_probabilities_rounding_choice(backend, fp8_pv):
    """Planner.fp8_pv: P·V in e4m3 (FlashAttention-3's) or with the values widened to float16;
    the second rounds its probabilities 2^7 times finer, and its bound says so."""
    q, k, v, qd, kd, vd, q_real, k_real, v_real = _inputs(1, 2, 2, 24, 70, 32, 32)
    with use_planner(dataclasses.replace(current_planner(), fp8_pv=fp8_pv)):
        out = attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, backend=backend, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    expected = reference(q_real, k_real, v_real)
    bound = fp8_error_bound(reference_probs(q_real, k_real), v_real, expected, torch.float16,
                            _pv_rounding(torch.float8_e4m3fn, fp8_pv), _score_error(q_real, k_real, 32**-0.5))
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("value_columns", [False, True], ids=["value_rows", "value_columns"])
def test_fp8_values_widened_by_their_layout(backend, value_columns):
    """A 16-bit query over FP8 keys and values: values stored row-major (keys a row apart) are widened
    as Widen.FLOAT16_ROWS (kept in registers through a no-op select until widened, so that the P·V
    product's transpose moves float16 pairs, not e4m3 bytes), column-major ones as FLOAT16; keys always
    as FLOAT16. The plan says so, and the answer keeps the float64 bound either way. Paged caches:
    the same rule on the value pages, at each launch (common.paged.cache_widen)."""
    from common import validation
    from common.backends import resolve
    from common.paged import cache_widen
    from common.plan import Widen, make_forward

    B, H, H_kv, Lq, Lk, D = 2, 4, 2, 1, 77, 32
    q, k, v, _, kd, vd, q_real, k_real, v_real = _inputs(B, H, H_kv, Lq, Lk, D, D, torch.bfloat16)
    if value_columns:
        v = v.transpose(2, 3).contiguous().transpose(2, 3)
    call = validation.check_call(resolve(backend), q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=True, return_lse=False, fp8=(None, kd, vd, None))
    plan = make_forward(call, resolve(backend), with_lse=False)
    assert (plan.widen_k, plan.widen_v) == (Widen.FLOAT16, Widen.FLOAT16 if value_columns else Widen.FLOAT16_ROWS)
    out = attention(q, k, v, enable_gqa=True, k_descale=kd, v_descale=vd, backend=backend)
    expected = reference(q_real, k_real, v_real, enable_gqa=True)
    bound = fp8_error_bound(reference_probs(q_real, k_real), v_real, expected, torch.bfloat16,
                            _pv_rounding(torch.bfloat16), 0.0)
    assert ((out.double() - expected).abs() <= bound).all()
    pages = v.view(torch.uint8).permute(0, 2, 1, 3)[:, :64].contiguous().view(torch.float8_e4m3fn)  # (B, 64, H_kv, D)
    descales = (kd, vd)
    assert cache_widen(descales, pages) == Widen.FLOAT16_ROWS
    assert cache_widen(descales, pages.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)) == Widen.FLOAT16
    assert cache_widen(None, pages.view(torch.uint8).to(torch.bfloat16)) == Widen.NONE


# Features that combine with FP8: compared with the same call on the dequantized inputs in float32
# (the same backend, the same features, nothing rounded to e4m3), within the bound with every
# probability at most 1 and summing to at most 1: v_descale * max|v| * (u + Lk * a).
FEATURES = {
    "bool_mask": lambda B, H, Lq, Lk: dict(attn_mask=torch.rand(B, 1, Lq, Lk, device=DEVICE) > 0.3),
    "float_mask": lambda B, H, Lq, Lk: dict(attn_mask=torch.randn(B, H, Lq, Lk, device=DEVICE)),
    "window_bottom_right": lambda B, H, Lq, Lk: dict(is_causal=True, window=(9, 0), alignment="bottom_right"),
    "softcap": lambda B, H, Lq, Lk: dict(softcap=3.0),
    "sinks": lambda B, H, Lq, Lk: dict(sinks=torch.randn(H, device=DEVICE)),
    "alibi": lambda B, H, Lq, Lk: dict(alibi_slopes=torch.rand(H, device=DEVICE) * 0.3, is_causal=True),
    "negative_scale": lambda B, H, Lq, Lk: dict(scale=-0.2),
    "dropout": lambda B, H, Lq, Lk: dict(dropout_p=0.2, dropout_seed=torch.tensor([7], device=DEVICE)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_fp8_combines_with_features(backend, feature):
    B, H, H_kv, Lq, Lk, D = 1, 4, 2, 19, 45, 32
    q, k, v, qd, kd, vd, q_real, k_real, v_real = _inputs(B, H, H_kv, Lq, Lk, D, D)
    kwargs = FEATURES[feature](B, H, Lq, Lk)
    out, lse = attention(q, k, v, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True,
                         backend=backend, **kwargs)
    real = [t.float() for t in (q_real, k_real, v_real)]
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype != torch.bool:
        kwargs["attn_mask"] = mask.float()
    expected, expected_lse = attention(*real, enable_gqa=True, return_lse=True, backend=backend, **kwargs)
    u, a = E4M3_ROUNDING
    v_max = v_real.abs().amax().float() / (1 - kwargs.get("dropout_p", 0.0))  # (kept weights scaled up)
    score_error = _score_error(q_real, k_real, kwargs.get("scale", D**-0.5)).float()
    u = u + torch.expm1(2 * score_error)[..., None]
    bound = v_max * (u + Lk * a) + HALF_UNITS[torch.bfloat16][0] * expected.abs() + 1e-4 * v_max
    assert ((out.float() - expected).abs() <= bound).all()
    # the log-sum-exp takes no rounded probability: float32's error and the MMAs' sums (a log-sum-exp
    # moves by at most its largest score's move; soft-capping only shrinks one)
    finite = torch.isfinite(expected_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    slack = 1e-5 * expected_lse.abs() + 1e-4 + score_error
    assert ((lse - expected_lse).abs()[finite] <= slack[finite]).all()


def _signed(descale, signs):
    """``descale`` (rows, heads) times ``signs`` (rows, 2), each sign repeated over its half of the heads."""
    return descale * signs.repeat_interleave(descale.shape[1] // 2, dim=1).to(descale.device)


# Signs of the descales per (batch or sequence, K/V head): every combination of the query's and the
# keys' (their product: -, -, +, +), and the values' flipped beside them.
Q_SIGNS = torch.tensor([[-1.0, 1.0], [-1.0, 1.0]])
K_SIGNS = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])


@pytest.mark.parametrize("query_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16_query"])
@pytest.mark.parametrize("scale", [None, -0.2], ids=["scale", "negative_scale"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_fp8_descales_of_either_sign(backend, query_dtype, scale, is_causal):
    """A real value is its stored one times its descale, whatever the descale's sign. The kernels
    move the sign of a row's scores' scale onto the query's row so that the key blocks every row sees
    whole take their maximum from the raw products (one FMA a score); with the query's and keys'
    descales of each sign (and a negative scale on top) each head matches float64 attention of the
    real values within the bound."""
    B, H, H_kv, Lq, Lk, D = 2, 4, 2, 21, 300, 32  # (keys past the interpreter's block of 128: whole blocks)
    q, k, v, qd, kd, vd, *_ = _inputs(B, H, H_kv, Lq, Lk, D, D, query_dtype)
    kd, vd = _signed(kd, K_SIGNS), _signed(vd, -K_SIGNS)
    q_real = q.double()
    if qd is not None:
        qd = _signed(qd, Q_SIGNS)
        q_real = dequantize_fp8(q, qd, torch.float64)
    k_real, v_real = dequantize_fp8(k, kd, torch.float64), dequantize_fp8(v, vd, torch.float64)
    out = attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True, q_descale=qd, k_descale=kd,
                    v_descale=vd, alignment="bottom_right", backend=backend)
    out_dtype = torch.bfloat16 if qd is not None else query_dtype
    mask = torch.ones(Lq, Lk, dtype=torch.bool, device=DEVICE).tril(Lk - Lq) if is_causal else None
    expected = reference(q_real, k_real, v_real, attn_mask=mask, scale=scale, enable_gqa=True)
    scale = D**-0.5 if scale is None else scale
    probs = reference_probs(q_real, k_real, attn_mask=mask, scale=scale)
    score_error = _score_error(q_real, k_real, scale) if qd is not None else 0.0
    bound = fp8_error_bound(probs, v_real, expected, out_dtype, _pv_rounding(query_dtype), score_error)
    error = (out.double() - expected).abs()
    assert torch.isfinite(out).all()
    assert (error <= bound).all(), f"max error {error.max():.3g}, max excess {(error - bound).max():.3g}"


@pytest.mark.parametrize("splits", [1, 3])
def test_fp8_decode_with_split_keys(backend, splits):
    """A 16-bit query row against an FP8 cache (decoding), the keys split across programs or not."""
    q, k, v, _, kd, vd, q_real, k_real, v_real = _inputs(2, 8, 2, 1, 200, 64, 64, torch.bfloat16)
    with force_splits(splits):
        out = attention(q, k, v, enable_gqa=True, k_descale=kd, v_descale=vd, backend=backend)
    expected = reference(q_real, k_real, v_real, enable_gqa=True)
    bound = fp8_error_bound(reference_probs(q_real, k_real), v_real, expected, torch.bfloat16,
                            HALF_UNITS[torch.bfloat16])
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("magnitude", [2.0**20, 2.0**-20], ids=["past_float16", "tiny"])
def test_bfloat16_query_of_any_magnitude_on_fp8_keys(backend, magnitude):
    """A bfloat16 query meets float16-widened keys narrowed by a power of two: one far past
    float16's range (2^20, scaled down to it) or far under its normals stays exact, so the
    float16 bound still holds (with the scale brought back, the scores are the same)."""
    q, k, v, _, kd, vd, q_real, k_real, v_real = _inputs(1, 4, 2, 7, 40, 64, 64, torch.bfloat16)
    q = (q.float() * magnitude).bfloat16()
    q_real = q.double()
    scale = 1 / (magnitude * 8.0)  # scores of the size the unscaled query gives
    out = attention(q, k, v, enable_gqa=True, scale=scale, k_descale=kd, v_descale=vd, backend=backend)
    expected = reference(q_real, k_real, v_real, enable_gqa=True, scale=scale)
    bound = fp8_error_bound(reference_probs(q_real, k_real, scale=scale), v_real, expected, torch.bfloat16,
                            HALF_UNITS[torch.float16])
    assert torch.isfinite(out).all()
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("L", [260, 256], ids=["key_order", "pv_order"])
def test_fp8_prefill_reads_values_column_major(backend, L):
    """At fp8_v_columns_rows query rows per K/V head or more the plan copies the values column-major
    for the e4m3 P·V product, each group of 32 keys in the P·V order where the keys fill the groups
    (Widen.PV_ORDER, 256 keys; 260: in key order): the same answer as the values read row-major or
    given column-major, within the bound (bit for bit in key order)."""
    from common import validation
    from common.backends import resolve
    from common.plan import Widen, make_forward

    B, H, H_kv, D = 1, 2, 1, 32
    q, k, v, qd, kd, vd, q_real, k_real, v_real = _inputs(B, H, H_kv, L, L, D, D)
    kw = dict(is_causal=True, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd, backend=backend)
    assert L * H // H_kv >= current_planner().fp8_v_columns_rows
    call = validation.check_call(resolve(backend), q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True,
                                 scale=None, enable_gqa=True, return_lse=False, fp8=(qd, kd, vd, None))
    plan = make_forward(call, resolve(backend), with_lse=False)
    assert plan.value.stride(2) == 1 and plan.widen_v == (Widen.PV_ORDER if L % 32 == 0 else Widen.NONE)
    out = attention(q, k, v, **kw)
    with use_planner(dataclasses.replace(current_planner(), fp8_v_columns_rows=1 << 30)):
        rows = attention(q, k, v, **kw)
    columns = attention(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), **kw)  # given column-major
    if L % 32:
        assert torch.equal(out, columns)
    expected = reference(q_real, k_real, v_real, is_causal=True, enable_gqa=True)
    bound = fp8_error_bound(reference_probs(q_real, k_real, is_causal=True), v_real, expected, torch.bfloat16,
                            E4M3_ROUNDING, _score_error(q_real, k_real, D**-0.5))
    for result in (out, rows, columns):
        assert ((result.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("shape", [(2, 3, 130, 48), (1, 1, 5, 16), (2, 2, 96, 32)], ids=["ragged", "short", "groups"])
def test_values_copied_column_major_by_each_kernel(backend, shape):
    """The backends' own copy of FP8 values into column-major (common.plan.value_columns): every
    element, bit for bit, into a poisoned target; a value tensor read through other strides too. Keys
    in whole groups of 32 (96 here, a copy tile and a half) also in the P·V order: key l at row
    pv_position(l), each group's keys all there once."""
    from common.backends import get_backend
    from common.plan import pv_position, value_columns

    module = get_backend(backend).load()
    value = (torch.randn(*shape, device=DEVICE) * 3).to(torch.float8_e4m3fn)
    columns = value_columns(get_backend(backend), value)
    assert columns.shape == value.shape and columns.stride(2) == 1
    assert torch.equal(columns.view(torch.uint8), value.view(torch.uint8))
    B, H, L, D = shape
    strided = torch.randn(B, L, H, D, device=DEVICE).to(torch.float8_e4m3fn).transpose(1, 2)  # (B, L, H, D) layout
    out = torch.full((B, H, D, L), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn).transpose(2, 3)
    module.copy_values(strided, out)  # (0x7F: e4m3's NaN, where an element went unwritten)
    assert torch.equal(out.view(torch.uint8), strided.view(torch.uint8))
    if L % 32 == 0:
        keys = torch.arange(L, device=DEVICE)
        positions = pv_position(keys)
        assert sorted(positions.tolist()) == list(range(L)) and (positions // 32 == keys // 32).all()
        out.view(torch.uint8).fill_(0x7F)
        module.copy_values(strided, out, pv_order=True)
        assert torch.equal(out[:, :, positions].view(torch.uint8), strided.view(torch.uint8))
        ordered = value_columns(get_backend(backend), value, pv_order=True)
        assert ordered.stride(2) == 1
        assert torch.equal(ordered[:, :, positions].view(torch.uint8), value.view(torch.uint8))
    else:  # (the order would move keys of the last group past the last key)
        with pytest.raises(ValueError, match="whole groups of 32 keys"):
            value_columns(get_backend(backend), value, pv_order=True)


# (case, B, H, H_kv, Lq, Lk, D, query dtype, is_causal, descales given: q, k, v)
KEPT_PLAN_CASES = {
    "prefill_values_copied": (2, 2, 1, 40, 40, 32, torch.float8_e4m3fn, True, (True, True, True)),
    # causal, more keys than rows: the plan drops the keys no row sees, then copies the values it keeps
    "prefill_keys_dropped": (2, 2, 1, 24, 40, 32, torch.float8_e4m3fn, True, (True, True, True)),
    # keys in whole groups of 32: the values copied in the P·V order (Widen.PV_ORDER) at every call
    "prefill_values_in_pv_order": (2, 2, 1, 32, 64, 32, torch.float8_e4m3fn, False, (True, True, True)),
    "decode_growing_keys": (2, 8, 2, 1, 70, 32, torch.bfloat16, False, (False, True, True)),
    "unbatched_some_descales": (None, 2, 2, 9, 21, 16, torch.float8_e4m3fn, False, (False, True, False)),
}


@pytest.mark.parametrize("case", sorted(KEPT_PLAN_CASES))
def test_fp8_calls_keep_a_plan(backend, case, planner, plans, monkeypatch):
    """FP8 calls of one layout keep a plan, as plain calls do: later calls validate and plan
    nothing (decode keys growing included) and launch bound from the second, each taking its own
    descales (never the first call's) and, where the plan copies the values column-major, its own
    values copied; the kept plan holds no tensor; every result equals, bit for bit, the call planned
    afresh."""
    from common import dispatch
    from common import plan as planning
    from common.reuse import AttentionPlan, BoundLaunch

    B, H, H_kv, Lq, Lk, D, query_dtype, is_causal, given = KEPT_PLAN_CASES[case]
    copied = case.startswith("prefill")
    if copied:
        planner(fp8_v_columns_rows=16)  # (the plan copies the values at 48 or 80 rows a K/V head)

    def inputs(Lk):
        q, k, v, qd, kd, vd, *_ = _inputs(B or 1, H, H_kv, Lq, Lk, D, D, query_dtype)
        descales = [d * (1 + torch.rand_like(d)) if g else None for d, g in zip((qd, kd, vd), given)]
        if B is None:  # unbatched: (H, L, D) tensors, (H_kv,) descales
            q, k, v = q[0], k[0], v[0]
            descales = [None if d is None else d[0] for d in descales]
        return (q, k, v), dict(zip(("q_descale", "k_descale", "v_descale"), descales))

    kw = dict(is_causal=is_causal, enable_gqa=True, backend=backend)
    first_inputs = inputs(Lk)
    first = attention(*first_inputs[0], **kw, **first_inputs[1])
    (kept,) = plans.values()
    assert not any(isinstance(f, torch.Tensor) or (isinstance(f, tuple) and any(isinstance(x, torch.Tensor)
                                                                              for x in f)) for f in kept._fields)
    assert kept._value_columns == copied
    assert kept._pv_order == (case == "prefill_values_in_pv_order")
    assert (kept._key_length is not None) == (case == "prefill_keys_dropped")

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again")

    copies = []
    value_columns = planning.value_columns
    monkeypatch.setattr(planning, "make_forward", no_planning)
    monkeypatch.setattr(dispatch, "check_call", no_planning)
    monkeypatch.setattr(planning, "value_columns", lambda *a: copies.append(a[1]) or value_columns(*a))
    later = []
    for step in range(3):
        length = Lk + step if case == "decode_growing_keys" else Lk  # (a decode loop's cache, a key longer a step)
        tensors, descales = inputs(length)
        later.append((tensors, descales, attention(*tensors, **kw, **descales)))
    monkeypatch.undo()
    assert len(plans) == 1 and isinstance(kept, AttentionPlan)
    # bound from the second call: the later calls launched through a bound launch, descales as its tensors
    assert (kept._grown is not None) if case == "decode_growing_keys" else isinstance(kept._bound, BoundLaunch)
    if copied:  # each call's own values (the keys it keeps)
        assert [c.data_ptr() == t[2].data_ptr() for c, (t, _, _) in zip(copies, later)] == [True] * 3
    for tensors, descales, out in [(*first_inputs, first)] + later:
        fresh = dispatch.full_attention(*tensors, **kw, **descales)
        assert out.dtype == fresh.dtype and torch.equal(out, fresh)
    # a call's descales are its own: twice the values' descale, twice the output (a power of two: exact)
    tensors, descales, out = later[-1]
    v_descale = descales["v_descale"] if descales["v_descale"] is not None else torch.ones_like(descales["k_descale"])
    doubled = attention(*tensors, **kw, **{**descales, "v_descale": 2 * v_descale})
    assert len(plans) == 1 + (descales["v_descale"] is None)  # (a given descale is another layout than None)
    assert torch.equal(doubled, (2 * out.float()).to(out.dtype))


def test_fp8_kept_plan_in_the_pv_order_takes_keys_of_other_lengths(backend, planner, plans):
    """A kept plan whose values it copies in the P·V order (64 keys), called with keys of other lengths
    (its keys grow: not causal): 96 keys copied in that order by the kept plan; 70, which do not fill
    the order's groups, planned afresh (their values copied in key order). Every result equals the call
    planned afresh, bit for bit, and the plan is kept."""
    from common import dispatch

    planner(fp8_v_columns_rows=16)
    kw = dict(enable_gqa=True, backend=backend)
    results = []
    for Lk in (64, 96, 70, 96):
        q, k, v, qd, kd, vd, *_ = _inputs(2, 2, 1, 32, Lk, 32, 32)
        descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        results.append((attention(q, k, v, **kw, **descales), dispatch.full_attention(q, k, v, **kw, **descales)))
    (kept,) = plans.values()
    assert kept.grows_keys and kept._pv_order
    for out, fresh in results:
        assert torch.equal(out, fresh)


def test_fp8_bound_launch_takes_descales_by_position(backend, plans):
    """A bound FP8 launch takes each descale by its position, never by which tensor it was at binding:
    bound from calls that pass one tensor as both the keys' and the values' descale, later calls'
    distinct descales are each read where given, bit for bit the call planned afresh (an unaligned
    descale too: a view one float in)."""
    from common import dispatch
    from common.reuse import BoundLaunch

    q, k, v, qd, kd, vd, *_ = _inputs(2, 4, 2, 24, 40, 32, 32)
    kw = dict(is_causal=False, enable_gqa=True, backend=backend)
    shared = kd * 1.5
    for _ in range(2):
        attention(q, k, v, q_descale=qd, k_descale=shared, v_descale=shared, **kw)
    (kept,) = plans.values()
    assert isinstance(kept._bound, BoundLaunch)
    unaligned = torch.cat([torch.ones(1, device=DEVICE), (vd * 0.25).flatten()])[1:].view(vd.shape)
    for descales in ((qd, kd, vd), (vd * 2, qd, kd * 4), (qd, kd, unaligned)):
        given = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
        out = attention(q, k, v, **given, **kw)
        assert torch.equal(out, dispatch.full_attention(q, k, v, **given, **kw))
    assert len(plans) == 1


def test_fp8_backends_agree_and_descales_default_to_one(backend):
    """Without descales each is 1 (the stored values are the real ones); unbatched 3-D inputs
    take (H_kv,) descales; both kernels compute the same algorithm, to the bit or nearly."""
    q = (torch.randn(3, 11, 16, device=DEVICE)).to(torch.float8_e4m3fn)
    k = (torch.randn(3, 29, 16, device=DEVICE)).to(torch.float8_e4m3fn)
    v = (torch.randn(3, 29, 16, device=DEVICE)).to(torch.float8_e4m3fn)
    out = attention(q, k, v, backend=backend)
    ones = torch.ones(3, device=DEVICE)
    assert torch.equal(out, attention(q, k, v, q_descale=ones, k_descale=ones, v_descale=ones, backend=backend))
    twice = attention(q, k, v, v_descale=2 * ones, backend=backend)
    assert torch.equal(twice, (2 * out.float()).to(out.dtype))  # a power of two: exact
    other = attention(q, k, v, backend="triton" if backend == "ninetoothed" else "ninetoothed")
    assert (out.float() - other.float()).abs().max() <= 2.0**-8 * out.float().abs().max()
    reference_out = attention(q, k, v, backend="torch")
    assert reference_out.dtype == torch.bfloat16


def test_fp8_outliers_stay_near_bf16(backend):
    """Real-looking activations: keys with a few outlier channels (as LLM keys have), quantized per
    (batch, head). Stated distance: the FP8 output's RMS error against the bf16 inputs' output is
    at most 8% of that output's RMS (e4m3 rounds each input by up to 2^-4 relative, the
    probabilities by as much again), and no element is off by more than a quarter of v's largest."""
    B, H, L, D = 1, 2, 64, 64
    q = torch.randn(B, H, L, D, device=DEVICE)
    k = torch.randn(B, H, L, D, device=DEVICE)
    k[..., [3, 40]] *= 12.0  # outlier channels
    q[..., [3, 40]] *= 0.5
    v = torch.randn(B, H, L, D, device=DEVICE)
    bf16 = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, backend=backend).float()
    (q8, qd), (k8, kd), (v8, vd) = quantize_fp8(q), quantize_fp8(k), quantize_fp8(v)
    fp8 = attention(q8, k8, v8, is_causal=True, q_descale=qd, k_descale=kd, v_descale=vd, backend=backend).float()
    rms = (fp8 - bf16).pow(2).mean().sqrt() / bf16.pow(2).mean().sqrt()
    assert rms <= 0.08, f"relative RMS error {rms:.3f}"
    assert (fp8 - bf16).abs().max() <= 0.25 * v.abs().max()


def test_quantize_fp8_round_trip():
    x = torch.randn(2, 6, 5, 8, device=DEVICE) * 10
    x8, d = quantize_fp8(x, heads=3)
    assert x8.dtype == torch.float8_e4m3fn and d.shape == (2, 3) and d.dtype == torch.float32
    back = dequantize_fp8(x8, d)
    # each group's largest magnitude maps to 448 exactly; every value within half an e4m3 ulp
    assert torch.allclose(back.abs().reshape(2, 3, -1).amax(-1), x.abs().reshape(2, 3, -1).amax(-1), rtol=1e-6)
    assert ((back - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * d.repeat_interleave(2, 1)[..., None, None]).all()
    with pytest.raises(ValueError, match="heads must be a positive int dividing H = 6"):
        quantize_fp8(x, heads=4)


# -- bad input: clear errors before any launch -----------------------------------------------

def _fp8(*shape):
    return torch.randn(*shape, device=DEVICE).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("case, error, message", [
    ("e5m2", TypeError, "the only 8-bit float taken is float8_e4m3fn"),
    ("float32_query", TypeError, "query must be float8_e4m3fn, float16 or bfloat16"),
    ("fp8_query_16bit_keys", TypeError, "key and value must both be float8_e4m3fn"),
    ("mixed_key_value", TypeError, "key and value must both be float8_e4m3fn"),
    ("descale_shape", ValueError, r"k_descale must have shape \(2, 2\)"),
    ("descale_dtype", TypeError, "v_descale must be a float32 tensor"),
    ("descale_not_tensor", TypeError, "q_descale must be a torch.Tensor or None"),
    ("descale_for_16bit", ValueError, "q_descale was given but query is bfloat16"),
    ("out_dtype_fp8_query", ValueError, "out_dtype must be torch.bfloat16 or torch.float16"),
    ("out_dtype_16bit_query", ValueError, "out_dtype chooses the output of an FP8 query only"),
    ("requires_grad", ValueError, "query requires grad, but attention with FP8 inputs is forward-only"),
    ("fp8_mask", TypeError, r"float32 or the output's dtype \(bfloat16\)"),
])
def test_fp8_errors(backend, case, error, message):
    q, k, v = _fp8(2, 4, 8, 16), _fp8(2, 2, 8, 16), _fp8(2, 2, 8, 16)
    d = torch.ones(2, 2, device=DEVICE)
    kwargs = dict(enable_gqa=True, backend=backend)
    if case == "e5m2":
        k = k.float().to(torch.float8_e5m2)
    elif case == "float32_query":
        q = q.float()
    elif case == "fp8_query_16bit_keys":
        k, v = k.bfloat16(), v.bfloat16()
    elif case == "mixed_key_value":
        v = v.bfloat16()
    elif case == "descale_shape":
        kwargs["k_descale"] = torch.ones(2, 4, device=DEVICE)
    elif case == "descale_dtype":
        kwargs["v_descale"] = d.double()
    elif case == "descale_not_tensor":
        kwargs["q_descale"] = 1.0
    elif case == "descale_for_16bit":
        q = q.bfloat16()
        kwargs["q_descale"] = d
    elif case == "out_dtype_fp8_query":
        kwargs["out_dtype"] = torch.float32
    elif case == "out_dtype_16bit_query":
        q = q.bfloat16()
        kwargs["out_dtype"] = torch.float16
    elif case == "requires_grad":
        q = q.bfloat16().requires_grad_()
    elif case == "fp8_mask":
        kwargs["attn_mask"] = _fp8(8, 8)
    with pytest.raises(error, match=message):
        attention(q, k, v, **kwargs)


def test_fp8_elsewhere_is_a_clear_error():
    """Entry points that take no FP8 yet say so (the backward)."""
    from common import attention_backward

    b = (_fp8(1, 2, 4, 16), _fp8(1, 2, 4, 16), _fp8(1, 2, 4, 16))
    grads = torch.randn(1, 2, 4, 16, device=DEVICE).bfloat16()
    with pytest.raises(TypeError, match="taken by attention\\(\\) .* so far"):
        attention_backward(grads, *b, grads, torch.zeros(1, 2, 4, device=DEVICE))


def _packed_fp8(lengths_q, lengths_k, H, H_kv, D, query_dtype):
    """A packed batch in FP8 with a descale per sequence and K/V head (FlashAttention-3's varlen
    convention): (q, k, v (total, heads, D)), descales (B, H_kv) (None for a 16-bit query), the
    cumulative lengths, and each sequence's float64 real (q, k, v) as (1, heads, L, D)."""
    packed, descales, real = [], [], []
    for lq, lk in zip(lengths_q, lengths_k):
        q, k, v, qd, kd, vd, *reals = _inputs(1, H, H_kv, lq, lk, D, D, query_dtype)
        packed.append([t[0].transpose(0, 1) for t in (q, k, v)])
        descales.append((qd, kd, vd))
        real.append(reals)
    q, k, v = (torch.cat([p[i] for p in packed]) for i in range(3))
    qd, kd, vd = (None if descales[0][i] is None else torch.cat([d[i] for d in descales]) for i in range(3))

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)

    return (q, k, v), (qd, kd, vd), (cu(lengths_q), cu(lengths_k)), real


@pytest.mark.parametrize("query_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16_query"])
@pytest.mark.parametrize("lengths", [((70, 0, 66), (90, 5, 40)), ((1, 3, 1), (37, 0, 64))],
                         ids=["packed_rows", "rows_per_sequence"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_varlen_fp8_descales_per_sequence(backend, query_dtype, lengths, is_causal):
    """varlen_attention on FP8 sequences, each with its own descales: each sequence's rows match
    float64 attention of its dequantized inputs within the bound of the module docstring, in
    both row layouts (long queries packed; short ones laid out per sequence)."""
    from common import varlen_attention

    H, H_kv, D = 4, 2, 32
    (q, k, v), (qd, kd, vd), (cu_q, cu_k), real = _packed_fp8(*lengths, H, H_kv, D, query_dtype)
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lengths[0]), max(lengths[1]), is_causal=is_causal,
                           alignment="bottom_right", enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd,
                           backend=backend)
    out_dtype = torch.bfloat16 if query_dtype == torch.float8_e4m3fn else query_dtype
    assert out.dtype == out_dtype and out.shape == (q.shape[0], H, D)
    for b, (q_real, k_real, v_real) in enumerate(real):
        rows = out[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None].double()
        if rows.numel() == 0:
            continue
        if k_real.shape[2] == 0:  # a sequence without keys: zeros
            assert (rows == 0).all()
            continue
        Lq, Lk = q_real.shape[2], k_real.shape[2]
        mask = (torch.ones(Lq, Lk, dtype=torch.bool, device=DEVICE).tril(Lk - Lq) if is_causal else None)
        expected = reference(q_real, k_real, v_real, attn_mask=mask, enable_gqa=True)
        probs = reference_probs(q_real, k_real, attn_mask=mask)
        fp8_query = query_dtype == torch.float8_e4m3fn
        score_error = _score_error(q_real, k_real, D**-0.5) if fp8_query else 0.0
        bound = fp8_error_bound(probs, v_real, expected, out_dtype, _pv_rounding(query_dtype), score_error)
        error = (rows - expected).abs()
        assert torch.isfinite(rows).all()
        assert (error <= bound).all(), f"sequence {b}: max error {error.max():.3g}, excess {(error - bound).max():.3g}"


@pytest.mark.parametrize("query_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16_query"])
def test_varlen_fp8_descales_of_either_sign(backend, query_dtype):
    """Descales per sequence of either sign (each row's scale a column in the kernels, its sign moved
    onto the row of the query): each sequence matches float64 attention of its real values."""
    from common import varlen_attention

    H, H_kv, D = 4, 2, 32
    lengths = ((256, 40), (300, 270))  # (rows and keys past the interpreter's blocks of 128: whole blocks)
    (q, k, v), (qd, kd, vd), (cu_q, cu_k), real = _packed_fp8(*lengths, H, H_kv, D, query_dtype)
    kd, vd = _signed(kd, K_SIGNS), _signed(vd, -K_SIGNS)
    qd = _signed(qd, Q_SIGNS) if qd is not None else None
    out = varlen_attention(q, k, v, cu_q, cu_k, max(lengths[0]), max(lengths[1]), enable_gqa=True, q_descale=qd,
                           k_descale=kd, v_descale=vd, backend=backend)
    for b, (q_real, k_real, v_real) in enumerate(real):
        q_signs, k_signs = (signs[b].repeat_interleave(H_kv // 2).to(DEVICE) for signs in (Q_SIGNS, K_SIGNS))
        if qd is not None:
            q_real = q_real * q_signs.repeat_interleave(H // H_kv)[None, :, None, None].double()
        k_real = k_real * k_signs[None, :, None, None].double()
        v_real = v_real * -k_signs[None, :, None, None].double()
        rows = out[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None].double()
        expected = reference(q_real, k_real, v_real, enable_gqa=True)
        score_error = _score_error(q_real, k_real, D**-0.5) if qd is not None else 0.0
        bound = fp8_error_bound(reference_probs(q_real, k_real), v_real, expected, out.dtype,
                                _pv_rounding(query_dtype), score_error)
        error = (rows - expected).abs()
        assert torch.isfinite(rows).all()
        assert (error <= bound).all(), f"sequence {b}: max error {error.max():.3g}, excess {(error - bound).max():.3g}"


def test_varlen_fp8_matches_the_torch_backend_and_checks_descales(backend):
    """The kernels' per-row descales against the torch backend's (each sequence dequantized, then
    SDPA), eager and in one torch.compile graph; descales of the wrong shape (per batch of the packed
    view, or per query head) refused."""
    from common import varlen_attention

    (q, k, v), (qd, kd, vd), (cu_q, cu_k), _ = _packed_fp8((5, 9), (12, 9), 4, 2, 16, torch.float8_e4m3fn)
    kwargs = dict(is_causal=True, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16)
    out = varlen_attention(q, k, v, cu_q, cu_k, 9, 12, backend=backend, **kwargs)
    expected = varlen_attention(q, k, v, cu_q, cu_k, 9, 12, backend="torch", **kwargs)
    assert out.dtype == expected.dtype == torch.float16
    u, a = E4M3_ROUNDING
    bound = vd.amax() * 448 * (u + 12 * a) + 2.0**-11 * expected.float().abs() + 1e-3
    assert ((out.float() - expected.float()).abs() <= bound).all()
    with pytest.raises(ValueError, match="k_descale must have shape \\(2, 2\\) \\(one descale per sequence"):
        varlen_attention(q, k, v, cu_q, cu_k, 9, 12, backend=backend, enable_gqa=True, k_descale=kd[:1])
    with pytest.raises(ValueError, match="q_descale must have shape \\(2, 2\\)"):
        varlen_attention(q, k, v, cu_q, cu_k, 9, 12, backend=backend, enable_gqa=True,
                         q_descale=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="descales go with float8_e4m3fn inputs"):
        varlen_attention(q.bfloat16(), k, v, cu_q, cu_k, 9, 12, backend=backend, enable_gqa=True, q_descale=qd)
    # one torch.compile graph (fullgraph): the descales reach the operator, per row
    compiled = torch.compile(lambda *args: varlen_attention(*args, 9, 12, backend=backend, **kwargs), fullgraph=True,
                             backend="inductor" if DEVICE == "cuda" else "aot_eager")
    assert ((compiled(q, k, v, cu_q, cu_k).float() - expected.float()).abs() <= bound).all()


def test_fp8_through_the_operator_and_compile(backend):
    """torch.library's checks of the forward operator given FP8 inputs and descales, and one
    torch.compile graph (fullgraph) of an FP8 call: the output's dtype is the fake's too."""
    from common.ops import OPS

    forward_op = OPS[backend][0]
    q, k, v, qd, kd, vd, *_ = _inputs(1, 4, 2, 9, 21, 16, 16)
    args = (q, k, v, None, True, 0.25, 0.0, None, [-1, -1, 0], 0.0, None, None, None, None, qd, kd, vd,
            torch.float16)
    torch.library.opcheck(forward_op, args, test_utils=("test_faketensor",))  # (test_schema multiplies FP8 tensors)
    out, lse = forward_op(*args)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32

    def call(q, k, v, qd, kd, vd):
        return attention(q, k, v, is_causal=True, enable_gqa=True, q_descale=qd, k_descale=kd, v_descale=vd,
                         backend=backend)

    compiled = torch.compile(call, fullgraph=True, backend="inductor" if DEVICE == "cuda" else "aot_eager")
    got = compiled(q, k, v, qd, kd, vd)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, call(q, k, v, qd, kd, vd))


# -- a paged FP8 cache (paged_attention) -------------------------------------------------------

def _fp8_pages(B, H_kv, D, page, max_pages, spare=3, value_columns=False):
    """FP8 caches of pages of ``page`` keys, each sequence's max_pages pages in a shuffled table
    (unused pages hold other values), its keys and values quantized per (sequence, K/V head);
    and their real values, float64 (B, H_kv, max_pages * page, D). With ``value_columns`` the
    value cache is a view of pages stored column-major ((num_pages, H_kv, D, page) in memory)."""
    num_pages = B * max_pages + spare
    L = max_pages * page
    table = torch.randperm(num_pages, device=DEVICE)[:B * max_pages].view(B, max_pages).to(torch.int32)
    caches, descales, reals = [], [], []
    for magnitude in (3.0, 1.0):
        x8, d = quantize_fp8(torch.randn(B, H_kv, L, D, device=DEVICE) * magnitude)
        cache = torch.randn(num_pages, page, H_kv, D, device=DEVICE) * 5  # (pages no sequence uses)
        cache[table.long()] = x8.float().view(B, H_kv, max_pages, page, D).permute(0, 2, 3, 1, 4)
        caches.append(cache.to(torch.float8_e4m3fn))  # (exact: the written values are e4m3's)
        descales.append(d)
        reals.append(dequantize_fp8(x8, d, torch.float64))
    if value_columns:
        caches[1] = caches[1].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        assert caches[1].stride(1) == 1
    return (*caches, table, *descales, *reals)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("value_columns", [False, True], ids=["value_rows", "value_columns"])
def test_paged_fp8_cache(backend, query_dtype, splits, value_columns):
    """New tokens (3 a sequence, causal, bottom-right) over FP8 caches, grouped-query heads packed:
    within the bound of float64 attention of the dequantized pages (keys and values widened to
    float16, the probabilities in float16), split or not, the value pages row-major or column-major;
    the torch backend (dequantized, SDPA) within it too; the log-sum-exp within float32's error."""
    from common import paged_attention

    lens, Lq, H, H_kv, D, page = [37, 70, 5], 3, 4, 2, 32, 16
    B = len(lens)
    key_cache, value_cache, table, kd, vd, k_real, v_real = _fp8_pages(B, H_kv, D, page, max_pages=5,
                                                                       value_columns=value_columns)
    q = (torch.randn(B, H, Lq, D, device=DEVICE) * 2).to(query_dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(is_causal=True, enable_gqa=True, k_descale=kd, v_descale=vd, return_lse=True)
    with force_splits(splits):
        out, lse = paged_attention(q, key_cache, value_cache, table, seqlens, backend=backend, **kw)
    torch_out = paged_attention(q, key_cache, value_cache, table, seqlens, backend="torch", **kw)[0]
    assert out.dtype == query_dtype and out.shape == (B, H, Lq, D)
    for b, n in enumerate(lens):
        qb, kb, vb = q[b:b + 1].double(), k_real[b:b + 1, :, :n], v_real[b:b + 1, :, :n]
        seen = torch.arange(n, device=DEVICE)[None, :] <= torch.arange(Lq, device=DEVICE)[:, None] + n - Lq
        expected = reference(qb, kb, vb, attn_mask=seen, enable_gqa=True)
        probs = reference_probs(qb, kb.repeat_interleave(H // H_kv, 1), attn_mask=seen)
        bound = fp8_error_bound(probs, vb, expected, query_dtype, HALF_UNITS[torch.float16])
        for result in (out, torch_out):
            assert ((result[b:b + 1].double() - expected).abs() <= bound).all()
        expected_lse = reference_lse(qb, kb.repeat_interleave(H // H_kv, 1), attn_mask=seen)
        torch.testing.assert_close(lse[b:b + 1].double(), expected_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("form", ["joined", "tiles", "per_tile"])
@pytest.mark.parametrize("value_columns", [False, True], ids=["value_rows", "value_columns"])
def test_ninetoothed_paged_fp8_step_forms(value_columns, form, monkeypatch):
    """test_paged_fp8_cache's bound on NineToothed's paged kernel at pages of 16 in each of its forms,
    a step's tiles joined into one softmax update (``PAGED_JOIN``, shipped), their key and value tiles
    joined before one product each too (``PAGED_FP8_JOIN_TILES``) or each tile its own, the form asked for
    really taken; column-major value pages by the kernel's variant for them (its value tiles (Dv, tile),
    keys last, on PAGED_FP8_SMALL_TILE_WARPS warps), row-major ones by the other."""
    import impl_ninetoothed.attention as nt
    from impl_ninetoothed.paged_kernels import premake_paged

    join = form != "per_tile"
    monkeypatch.setattr(nt, "PAGED_JOIN", join)
    monkeypatch.setattr(nt, "PAGED_FP8_JOIN_TILES", form == "tiles")
    taken, shipped = [], nt.paged_tiles
    made, shipped_make = [], nt._make
    launched = []  # (each paged launch's JOIN_TILES: the form taken)

    def make(premake, *args, **kw):
        made.append((premake, args, kw["num_warps"], kw["maxnreg"]))
        kernel = shipped_make(premake, *args, **kw)
        if premake is not premake_paged:
            return kernel
        return lambda *a, **flags: launched.append(flags["JOIN_TILES"]) or kernel(*a, **flags)
    monkeypatch.setattr(nt, "paged_tiles", lambda *args: taken.append(shipped(*args)) or taken[-1])
    monkeypatch.setattr(nt, "_make", make)
    import dataclasses

    import common.paged as paged

    shipped_config = paged.paged_config  # (a register cap, as the plan sets at a large batch)
    monkeypatch.setattr(paged, "paged_config", lambda *a: dataclasses.replace(shipped_config(*a), maxnreg=128))
    paged._templates.clear()
    test_paged_fp8_cache("ninetoothed", torch.bfloat16, 3, value_columns)
    assert taken and min(per_step for _, per_step, _ in taken) > 1, taken
    assert max(per_step for _, per_step, _ in taken) <= nt.PAGED_FP8_TILES_PER_STEP, taken
    paged = [(args, warps, cap) for premake, args, warps, cap in made if premake is premake_paged]
    assert paged and all(args[5] is value_columns for args, _, _ in paged), paged
    # (tiles of 16 keys with column-major value pages: PAGED_FP8_SMALL_TILE_WARPS and no register cap, the
    # plan's warps and cap otherwise)
    assert all(args[3] == 16 for args, _, _ in paged), paged
    expected = (nt.PAGED_FP8_SMALL_TILE_WARPS, None) if value_columns else (4, 128)
    assert {(warps, cap) for _, warps, cap in paged} == {expected}, paged
    assert all((joined == per_step) if join else joined == 1 for _, per_step, joined in taken), taken
    assert launched and set(launched) == {form == "tiles"}, launched


def test_paged_fp8_through_a_kept_plan(backend):
    """A decode loop's second call of a layout takes the kept plan: the descales (given or not)
    are the call's own, not the first call's, and the kept plan holds none of them."""
    import gc
    import weakref

    from common import paged_attention

    key_cache, value_cache, table, kd, vd, *_ = _fp8_pages(2, 2, 16, 16, max_pages=3)
    q = torch.randn(2, 2, 1, 16, device=DEVICE).bfloat16()
    seqlens = torch.tensor([40, 9], dtype=torch.int32, device=DEVICE)
    first_descales = [kd.clone(), vd.clone()]
    paged_attention(q, key_cache, value_cache, table, seqlens, k_descale=first_descales[0],
                    v_descale=first_descales[1], backend=backend)
    held = [weakref.ref(d) for d in first_descales]
    del first_descales
    gc.collect()
    assert [r() is None for r in held] == [True, True]  # (a kept plan holds no call's tensor)
    first = paged_attention(q, key_cache, value_cache, table, seqlens, k_descale=kd, v_descale=vd, backend=backend)
    again = paged_attention(q, key_cache, value_cache, table, seqlens, k_descale=kd, v_descale=2 * vd,
                            backend=backend)
    assert torch.equal(again, (2 * first.float()).to(first.dtype))  # a power of two: exact
    ones = paged_attention(q, key_cache, value_cache, table, seqlens, backend=backend)
    assert torch.equal(ones, paged_attention(q, key_cache, value_cache, table, seqlens, backend=backend,
                                             k_descale=torch.ones_like(kd), v_descale=torch.ones_like(vd)))


def test_paged_fp8_errors():
    """FP8 caches with an FP8 or float32 query, one cache in FP8 and one not, float8_e5m2 caches,
    descales of the wrong shape or dtype or for 16-bit caches, FP8 caches in append_kv: clear
    errors before any launch."""
    from common import append_kv, paged_attention

    key_cache, value_cache, table, kd, vd, *_ = _fp8_pages(1, 2, 16, 16, max_pages=2)
    q = torch.randn(1, 2, 1, 16, device=DEVICE).bfloat16()
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="query"):
        paged_attention(q.to(torch.float8_e4m3fn), key_cache, value_cache, table, lens)
    with pytest.raises(TypeError, match="float16 or bfloat16 query"):
        paged_attention(q.float(), key_cache, value_cache, table, lens)
    with pytest.raises(TypeError, match="both be float8_e4m3fn or neither"):
        paged_attention(q, key_cache, value_cache.bfloat16(), table, lens)
    with pytest.raises(TypeError, match="float8_e5m2"):
        paged_attention(q, key_cache.to(torch.float8_e5m2), value_cache.to(torch.float8_e5m2), table, lens)
    with pytest.raises(ValueError, match="k_descale must have shape"):
        paged_attention(q, key_cache, value_cache, table, lens, k_descale=kd[0])
    with pytest.raises(TypeError, match="v_descale must be a float32"):
        paged_attention(q, key_cache, value_cache, table, lens, v_descale=vd.double())
    with pytest.raises(ValueError, match="descales go with float8_e4m3fn caches"):
        paged_attention(q, key_cache.bfloat16(), value_cache.bfloat16(), table, lens, k_descale=kd)
    with pytest.raises(TypeError, match="FP8 cache takes a float16 or bfloat16 key"):
        append_kv(key_cache, value_cache, table, lens, q.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="descales go with float8_e4m3fn caches"):
        append_kv(key_cache.bfloat16(), value_cache.bfloat16(), table, lens, q, q, v_descale=vd)
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):  # (FlashAttention 2's call: no FP8)
        from common.flash_attn_interface import flash_attn_with_kvcache

        flash_attn_with_kvcache(q.transpose(1, 2), key_cache, value_cache, cache_seqlens=lens, block_table=table)
    with pytest.raises(TypeError, match="must have q's dtype"):
        from common.flash_attn_interface import flash_attn_varlen_func

        cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=DEVICE) for n in (1, 20))
        flash_attn_varlen_func(q[0].transpose(0, 1), key_cache, value_cache, cu_q, cu_k, 1, 20, block_table=table)


@pytest.mark.parametrize("chosen", ["triton", "ninetoothed", "torch"])
@pytest.mark.parametrize("value_columns", [False, True], ids=["value_rows", "value_columns"])
def test_append_kv_quantizes_into_fp8_caches(chosen, value_columns):
    """16-bit new keys and values into FP8 caches (the value pages row-major or column-major):
    each element divided by its sequence and head's descale, rounded to e4m3 and saturated at
    +-448 (values past it included), in its slot; every other slot as it was. Bitwise
    quantize_fp8's rule."""
    from common import append_kv

    B, H_kv, D, page = 2, 2, 16, 16
    key_cache, value_cache, table, kd, vd, *_ = _fp8_pages(B, H_kv, D, page, max_pages=3,
                                                           value_columns=value_columns)
    before = [c.clone() for c in (key_cache, value_cache)]
    lens = torch.tensor([13, 30], dtype=torch.int32, device=DEVICE)
    L_new = 5  # (the first sequence's cross a page boundary)
    key = torch.randn(B, H_kv, L_new, D, device=DEVICE).bfloat16() * 300
    value = torch.randn(B, H_kv, L_new, D, device=DEVICE).bfloat16()
    new_lens = append_kv(key_cache, value_cache, table, lens, key, value, k_descale=kd, v_descale=vd,
                         backend=chosen)
    assert torch.equal(new_lens, lens + L_new)
    written = torch.zeros_like(key_cache, dtype=torch.bool)
    for b in range(B):
        for i in range(L_new):
            pos = int(lens[b]) + i
            slot = (int(table[b, pos // page]), pos % page)
            written[slot] = True
            for cache, new, d in ((key_cache, key, kd), (value_cache, value, vd)):
                expected = (new[b, :, i].float() / d[b][:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert torch.equal(cache[slot].view(torch.uint8), expected.view(torch.uint8))
    assert (key.float().abs() / kd[:, :, None, None] > 448).any()  # (saturation taken)
    for cache, old in zip((key_cache, value_cache), before):
        assert torch.equal(cache.view(torch.uint8)[~written], old.view(torch.uint8)[~written])
