"""The Gluon Hopper forward (impl_triton.gluon_attention): on an sm_90 GPU against SDPA in float32;
on any machine, compiled for sm_90 (Gluon does not run under Triton's interpreter)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# a warp-group wait followed at once by a barrier of all warps (in PTX): what triton 3.9 adds after a wait that
# is not marked as its warp group's own
WAIT_THEN_BARRIER = re.compile(r"wgmma\.wait_group\.sync\.aligned \d+;(\s*//[^\n]*)*\s*bar\.sync")


def assert_as_close_as_tl(named, got, tl_got, want):
    """Each of ``got`` within twice the tl kernel's own error (``tl_got``) of the reference ``want``, plus a hair
    (a thousandth of the reference's largest magnitude): ``named`` names them in a failure."""
    for name, a, b, ref in zip(named, got, tl_got, want):
        ref = ref.double()
        error, tl_error = ((x.double() - ref).abs().max().item() for x in (a, b))
        assert error <= 2 * tl_error + 1e-3 * ref.abs().max().item(), (name, error, tl_error)


VARIANTS = {"one-partition": {}, "producer-warp": {"specialized": True}, "ping-pong": {"pingpong": True},
            "persistent": {"pingpong": True, "persistent": True}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiles_for_sm90_with_the_overlap(variant, tmp_path):
    """Built for sm_90 with the installed Triton: warp-group MMAs, TMA copies in (K, V, Q) and out (the
    output, once per consumer), no spill inside the key loop (and outside it a few words at most, in persistent
    programs), and the loop waiting for a tile's S while the previous tile's P V is in flight."""
    # (each test its own output folder: tests running side by side would write the same files)
    command = [sys.executable, str(ROOT / "tools" / "gluon_sass.py"), "--dims", "128", "--causal",
               "--out", str(tmp_path)]
    command += [f"--{option}" for option in VARIANTS[variant]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"D=128 .*", result.stdout).group(0)
    fields = dict(item.split("=") for item in line.split())
    # no spill (P is carried over the loop in 16 bits, _softmax_step), but for a persistent program, which keeps
    # its loops' values over items and row blocks on the stack around the key loop, read and written once a row
    # block (48 bytes under triton 3.6, 40 under 3.9, its loop split; benchmarks/NOTES.md). (The key loop is the
    # shortest loop holding both products: the whole tiles' where the loop is split.)
    allowed = {"persistent": 48}.get(variant, 0)
    assert int(fields["STACK"]) <= allowed and int(fields["HGMMA"]) > 0 and int(fields["UTMALDG"]) > 0, line
    assert int(fields["KEY_LOOP_LOCAL"]) == 0, line
    assert int(fields["UTMASTG"]) == (2 if VARIANTS[variant].get("pingpong") else 1), line
    assert fields["OVERLAP"] == "1", line


def test_three_consumer_pingpong_compiles_for_sm90(tmp_path):
    """Ping-pong with three consumer warp groups (D 64, 192 rows, keys of 64, 12 warps at 160 registers
    each) builds for sm_90 with the installed Triton: no spill, the overlap, TMA in and out."""
    command = [sys.executable, str(ROOT / "tools" / "gluon_sass.py"), "--dims", "64", "--causal", "--pingpong",
               "--config", "192", "64", "4", "12", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    fields = dict(item.split("=") for item in re.search(r"D=64 .*", result.stdout).group(0).split())
    assert int(fields["STACK"]) == 0 and int(fields["HGMMA"]) > 0 and fields["OVERLAP"] == "1", fields
    assert int(fields["UTMALDG"]) > 0 and int(fields["UTMASTG"]) >= 2, fields


def test_fp8_pingpong_compiles_for_sm90(tmp_path):
    """The ping-pong variant with FP8 inputs builds for sm_90 with the installed Triton (D 128, causal): FP8
    warp-group MMAs (QGMMA) for both products, TMA in and out, no spills, the in-warp-group overlap; with the
    values in the P·V order, P reaches its operand without shuffles: the key loop keeps only the rows'
    reductions' (8 at two rows a thread) and is shorter."""
    lines = {}
    for pv_order in (False, True):
        command = [sys.executable, str(ROOT / "tools" / "gluon_sass.py"), "--dims", "128", "--causal", "--pingpong",
                   "--dtype", "float8_e4m3fn", "--out", str(tmp_path / str(pv_order))] + ["--pv-order"] * pv_order
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-3000:]
        line = re.search(r"D=128 .*", result.stdout).group(0)
        fields = lines[pv_order] = dict(item.split("=") for item in line.split())
        assert int(fields["STACK"]) == 0 and int(fields["QGMMA"]) > 0 and int(fields["HGMMA"]) == 0, line
        assert int(fields["UTMALDG"]) > 0 and int(fields["UTMASTG"]) == 2 and fields["OVERLAP"] == "1", line
    plain, ordered = lines[False], lines[True]
    assert int(ordered["KEY_LOOP_SHFL"]) <= 8 < int(plain["KEY_LOOP_SHFL"]), (plain, ordered)
    assert int(ordered["KEY_LOOP"]) < int(plain["KEY_LOOP"]), (plain, ordered)


def test_exponentials_on_the_fma_units_where_measured_faster():
    """A quarter of the exponentials go to the FMA units (``_exp2_fma``) only where that timed faster: D 64
    without a causal mask, 16-bit inputs, triton >= 3.9; never causal, FP8, at D 128 or 256, or under 3.6."""
    from common import compat
    from impl_triton import gluon_attention as ga

    assert ga._fma_quarter(64, False, False) == (compat.triton_version() >= (3, 9))
    assert not ga._fma_quarter(64, False, True) and not ga._fma_quarter(64, True, False)
    assert not ga._fma_quarter(128, False, False) and not ga._fma_quarter(256, False, False)


def test_persistent_prefetch_compiles_for_sm90(tmp_path):
    """Persistent programs at D 64 in 16 bits (causal) load each row block's next Q early
    (``prefetch_q``'s default there): they build for sm_90 with the installed Triton with an output tile
    of their own beside Q's and the K/V ring (128 KiB of tiles), no spill on the key loop's hot path."""
    command = [sys.executable, str(ROOT / "tools" / "gluon_sass.py"), "--dims", "64", "--causal", "--pingpong",
               "--persistent", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"D=64 .*", result.stdout).group(0)
    fields = dict(item.split("=") for item in line.split())
    assert int(fields["SMEM"]) >= 2 * 128 * 64 * 2 + 2 * 3 * 128 * 64 * 2, line  # (Q, the output, K and V)
    # (no spill since P is carried over the key loop in 16 bits: before, triton 3.9 read two words from the stack
    # inside the loop's branches taken once a row block)
    assert int(fields["KEY_LOOP_LOCAL"]) == 0 and int(fields["STACK"]) == 0 and fields["OVERLAP"] == "1", line


CASES = [  # (B, H, H_kv, Lq, Lk, scale)
    (2, 4, 2, 300, 517, 0.3),  # grouped heads, lengths off the tiles
    (1, 8, 8, 1000, 1000, -0.2),  # a negative scale (the unmasked tiles' maximum is the scores' minimum)
    (2, 2, 1, 700, 129, 0.3),  # more queries than keys (causal top-left: rows with no key)
]


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-Lq{c[3]}-Lk{c[4]}-s{c[5]}" for c in CASES])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gluon_forward_matches_sdpa(D, dtype, causal, case, variant):
    _check_forward(D, dtype, causal, case, **VARIANTS[variant])


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-Lq{c[3]}-Lk{c[4]}-s{c[5]}" for c in CASES])
@pytest.mark.parametrize("config", [(192, 64, 4, 12), (192, 128, 2, 12)], ids=["keys64", "keys128"])
def test_three_consumer_pingpong_matches_sdpa(dtype, causal, case, config):
    """The ping-pong variant with three consumer warp groups of 64 rows (12 warps: FlashAttention-3's tile
    at D 64, taking turns in a ring), as the other variants."""
    _check_forward(64, dtype, causal, case, pingpong=True, config=config)


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("D, prefetch_q", [(64, True), (64, False), (128, False)],
                         ids=["D64-prefetch", "D64", "D128"])  # (D 128 in 16 bits: no room for it)
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("Lq", [1200, 1300])
def test_persistent_programs_run_many_row_blocks_each(D, prefetch_q, causal, programs, Lq, monkeypatch):
    """Persistent programs (``_gluon_attn_fwd_pp``'s PERSISTENT) on a grid of 1, 3 or 7 (a GPU of that many
    SMs, as far as the launch knows): each program runs tens of row blocks of changing key counts (causal;
    bottom-right with more queries than keys: row blocks that see no key), its K/V ring, Q barriers and
    turns carried from one to the next, and every row matches float32 attention. Causal programs run row
    blocks in pairs (``_pp_item``): 1200 queries make 10 row blocks of 128 a head, 1300 eleven (a pair of one).
    ``prefetch_q``: each row block loads the next one's Q while it finishes (PREFETCH_Q)."""
    from impl_triton import gluon_attention as ga

    monkeypatch.setattr(ga, "_sm_count", lambda device: programs)
    _check_forward(D, torch.bfloat16, causal, (2, 6, 2, Lq, 900, 0.2), pingpong=True, persistent=True,
                   prefetch_q=prefetch_q)


def _check_forward(D, dtype, causal, case, **variant):
    """``gluon_attention.forward`` (``variant``: its keywords) against float32 attention: every row written
    (poisoned), the output and the log-sum-exp within the dtype's tolerance, -inf exactly where no key."""
    from impl_triton import gluon_attention as ga

    B, H, H_kv, Lq, Lk, scale = case
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H_kv, Lk, D, device="cuda", dtype=dtype) for _ in range(2))
    out = torch.full((B, H, Lq, D), float("nan"), device="cuda", dtype=dtype)  # poisoned: every row is written
    lse = torch.full((B, H, Lq), float("nan"), device="cuda")
    shift = None if causal is None else (Lk - Lq if causal == "bottom_right" else 0)
    ga.forward(q, k, v, scale, shift, True, out=out, lse=lse, **variant)
    qf, kf, vf = (t.float().repeat_interleave(H // t.shape[1], 1) if t is not q else t.float() for t in (q, k, v))
    s = qf @ kf.transpose(-1, -2) * scale
    if causal is not None:
        keep = torch.arange(Lk, device="cuda")[None, :] <= torch.arange(Lq, device="cuda")[:, None] + shift
        s = s.masked_fill(~keep, float("-inf"))
    expected_lse = torch.logsumexp(s, -1)
    expected = (torch.softmax(s, -1).nan_to_num(0.0) @ vf)
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)  # -inf exactly for the rows with no key
    torch.testing.assert_close(lse[seen], expected_lse[seen], rtol=1e-3, atol=1e-3)


FP8_CASES = [  # (B, H, H_kv, Lq, Lk, scale): keys in multiples of 16 (TMA's rows of column-major FP8 values)
    (2, 4, 2, 300, 512, 0.3),  # grouped heads, queries off the tiles
    (1, 4, 4, 640, 128, -0.2),  # a negative scale, more queries than keys (causal top-left: rows with no key)
    (2, 2, 1, 128, 1008, 0.125),  # keys off the tiles
]


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("case", FP8_CASES, ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-Lq{c[3]}-Lk{c[4]}-s{c[5]}"
                                                 for c in FP8_CASES])
@pytest.mark.parametrize("signs", ["positive", "mixed"])
@pytest.mark.parametrize("persistent", [False, True], ids=["a-program-a-block", "persistent"])
def test_gluon_fp8_pingpong_as_close_to_float64_as_the_tl_kernel(D, causal, case, signs, persistent, monkeypatch):
    """FP8 q, k, v (FlashAttention-3's descales, the values column-major) through the ping-pong variant:
    every output row written (poisoned), within twice the tl kernel's error against float64 attention of
    the dequantized inputs (both round P to e4m3 for P V), and the log-sum-exp likewise. ``mixed``: the
    descales of either sign, the query's and keys' product negative for some (batch, K/V head) and
    positive for others (a negative one moves onto Q in shared memory). ``persistent``: the same through
    two persistent programs (each row block reads its own descales)."""
    from common import attention, quantize_fp8
    from common.fp8 import dequantize_fp8
    from impl_triton import gluon_attention as ga

    B, H, H_kv, Lq, Lk, scale = case
    q8, qd = quantize_fp8(torch.randn(B, H, Lq, D, device="cuda") * 2, heads=H_kv)
    k8, kd = quantize_fp8(torch.randn(B, H_kv, Lk, D, device="cuda") * 3)
    v8, vd = quantize_fp8(torch.randn(B, H_kv, Lk, D, device="cuda"))
    v8 = v8.transpose(2, 3).contiguous().transpose(2, 3)  # (column-major: the layout the plan copies FP8 values to)
    if signs == "mixed":  # (every case has pairs whose q·k descale is negative and pairs where it is positive)
        pair = torch.arange(B * H_kv, device="cuda").view(B, H_kv)
        qd = qd * torch.where(pair % 2 == 0, -1.0, 1.0)
        kd = kd * torch.where(pair % 4 < 2, 1.0, -1.0)
        vd = vd * torch.where(pair % 3 == 0, -1.0, 1.0)
    qf = dequantize_fp8(q8, qd, torch.float64)  # (qd per K/V head: each repeated over its group's heads)
    kf, vf = (dequantize_fp8(t, d, torch.float64).repeat_interleave(H // H_kv, 1) for t, d in ((k8, kd), (v8, vd)))
    shift = None if causal is None else (Lk - Lq if causal == "bottom_right" else 0)
    s = qf @ kf.transpose(-1, -2) * scale
    if shift is not None:
        keep = torch.arange(Lk, device="cuda")[None, :] <= torch.arange(Lq, device="cuda")[:, None] + shift
        s = s.masked_fill(~keep, float("-inf"))
    expected, expected_lse = torch.softmax(s, -1).nan_to_num(0.0) @ vf, torch.logsumexp(s, -1)
    out = torch.full((B, H, Lq, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((B, H, Lq), float("nan"), device="cuda")
    monkeypatch.setattr(ga, "_sm_count", lambda device: 2)  # (persistent: two programs, many row blocks each)
    ga.forward(q8, k8, v8, scale, shift, True, out=out, lse=lse, pingpong=True, descales=(qd, kd, vd),
               persistent=persistent)
    tl_out, tl_lse = attention(q8, k8, v8, is_causal=shift is not None, scale=scale, enable_gqa=True,
                               return_lse=True, q_descale=qd, k_descale=kd, v_descale=vd, backend="triton",
                               alignment="bottom_right" if causal == "bottom_right" else "top_left")
    assert_as_close_as_tl(("out", ), (out, ), (tl_out, ), (expected, ))
    seen = expected_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)  # -inf exactly for the rows with no key
    lse_error, tl_lse_error = ((x[seen].double() - expected_lse[seen]).abs().max().item() for x in (lse, tl_lse))
    assert lse_error <= 2 * tl_lse_error + 1e-3, (lse_error, tl_lse_error)


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_output_written_by_tma_into_a_strided_view(variant):
    """The output's TMA store follows the output's own strides: a (B, Lq, H, D) buffer seen as (B, H, Lq, D),
    its rows padded past D, gets every row of every head and nothing past D or past Lq (poisoned)."""
    from impl_triton import gluon_attention as ga

    B, H, Lq, Lk, D = 2, 4, 333, 300, 128
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, Lk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    buffer = torch.full((B, Lq + 7, H, D + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buffer[:, :Lq, :, :D].transpose(1, 2)
    ga.forward(q, k, v, D ** -0.5, 0, False, out=out, **VARIANTS[variant])
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2)
    assert buffer[:, Lq:].isnan().all() and buffer[..., D:].isnan().all()


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
def test_attention_takes_the_gluon_path_when_switched_on(monkeypatch):
    """With ATTENTION_GLUON=1, attention() on the triton backend runs the plans the Gluon kernel
    serves through it and the rest through the tl kernel. A layout's first two calls launch through
    the plan, the second binds the Gluon launch (``BoundGluon``), later calls run it on their own
    tensors (fresh ones each call: the descriptors follow them) through the compiled kernel; a later
    call whose query does not start at a 16-byte multiple (same layout) runs the tl kernel's bound launch."""
    from common import attention
    from common.reuse import PLANS
    from impl_triton import gluon_attention as ga

    monkeypatch.setenv("ATTENTION_GLUON", "1")
    PLANS.clear()
    taken, bound = [], []
    run, call = ga.forward_plan, ga.BoundGluon.__call__
    monkeypatch.setattr(ga, "forward_plan", lambda plan, chosen: taken.append("plan") or run(plan, chosen))
    monkeypatch.setattr(ga.BoundGluon, "__call__",
                        lambda self, tensors: taken.append("bound") or bound.append(self) or call(self, tensors))

    def inputs():
        q = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
        return q, *(torch.randn(2, 2, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def check(q, k, v):
        out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton", return_lse=True)
        expected, expected_lse = reference_with_lse(q, k, v)
        torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2)
        torch.testing.assert_close(lse, expected_lse, rtol=1e-3, atol=1e-3)

    for _ in range(4):
        check(*inputs())
    assert taken == ["plan", "plan", "bound", "bound"]
    assert len(bound[-1].kernels) == 1  # (the fourth call launched the compiled kernel directly)
    fallback = []
    tl = bound[-1].fallback
    monkeypatch.setattr(bound[-1], "fallback", lambda tensors: fallback.append(1) or tl(tensors))
    q, k, v = inputs()
    unaligned = torch.empty(q.numel() + 8, device="cuda", dtype=q.dtype)[1:q.numel() + 1].view(q.shape).copy_(q)
    check(unaligned, k, v)
    assert taken[-1] == "bound" and fallback == [1]
    mask = torch.rand(1024, 1024, device="cuda") > 0.1
    attention(q, k, v, attn_mask=mask, enable_gqa=True, backend="triton")  # (a mask: the tl kernel)
    assert taken.count("plan") == 2


def reference_with_lse(q, k, v):
    """Causal grouped-query attention of 16-bit inputs in float32, and its log-sum-exp (B, H, Lq)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
    scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    Lq, Lk = scores.shape[-2:]
    scores = scores.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v, scores.logsumexp(-1)


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
def test_fp8_prefill_takes_the_pingpong_variant_when_switched_on(monkeypatch):
    """ATTENTION_GLUON=1: an FP8 prefill whose plan copies the values column-major runs the ping-pong
    variant (FP8 decode, whose values stay row-major, the tl kernel), each call (the third bound), within
    the tl kernel's FP8 output's reach; unset, the config table decides (behind the size guard: a prefill
    above it runs the variant the table names for its FP8 key, within the same reach)."""
    from common import attention, quantize_fp8
    from common.backends import get_backend
    from common.reuse import PLANS
    from impl_triton import gluon_attention as ga

    taken = []
    run, call = ga.forward_plan, ga.BoundGluon.__call__
    monkeypatch.setattr(ga, "forward_plan", lambda plan, chosen: taken.append(chosen) or run(plan, chosen))
    monkeypatch.setattr(ga.BoundGluon, "__call__", lambda self, tensors: taken.append("bound") or call(self, tensors))
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(torch.randn(2, 4, 1024, 128, device="cuda")) for _ in range(3))
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    monkeypatch.setenv("ATTENTION_GLUON", "0")
    expected = attention(q8, k8, v8, is_causal=True, backend="triton", **fp8)
    monkeypatch.setenv("ATTENTION_GLUON", "1")
    PLANS.clear()
    for _ in range(3):
        out = attention(q8, k8, v8, is_causal=True, backend="triton", **fp8)
    assert taken == ["pingpong", "pingpong", "bound"]  # (the second call bound the ping-pong launch)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.05, atol=0.05)
    q16 = torch.randn(2, 4, 1, 128, device="cuda", dtype=torch.bfloat16)
    attention(q16, k8, v8, backend="triton", k_descale=kd, v_descale=vd)  # (decode: the tl kernel)
    assert len(taken) == 3
    monkeypatch.setenv("ATTENTION_GLUON", "")
    PLANS.clear()
    attention(q8, k8, v8, is_causal=True, backend="triton", **fp8)
    chosen = get_backend("triton").configs.lookup_gluon(128, torch.float8_e4m3fn, True, 1024)
    by_default = chosen != "tl" and ga.large_enough(2, 4, 1024, 1024, 128, True)
    assert taken == ["pingpong", "pingpong", "bound"] + ([chosen] if by_default else [])
    (q8, qd), (k8, kd), (v8, vd) = (quantize_fp8(torch.randn(2, 16, 4096, 128, device="cuda")) for _ in range(3))
    fp8 = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    assert ga.large_enough(2, 16, 4096, 4096, 128, True)
    monkeypatch.setenv("ATTENTION_GLUON", "0")
    expected = attention(q8, k8, v8, is_causal=True, backend="triton", **fp8)
    monkeypatch.setenv("ATTENTION_GLUON", "")
    PLANS.clear()
    taken.clear()
    out = attention(q8, k8, v8, is_causal=True, backend="triton", **fp8)
    chosen = get_backend("triton").configs.lookup_gluon(128, torch.float8_e4m3fn, True, 4096)
    assert taken == ([] if chosen == "tl" else [chosen])
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.05, atol=0.05)


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("switch", ["", "0", "1"], ids=["default", "forced-off", "forced-on"])
def test_default_path_on_hopper_by_head_dim(monkeypatch, switch):
    """Unset, the switch sends each shape to the kernel the Triton backend's config table names for it
    (its gluon section, written by ``tune --passes gluon``: the tl kernel or a Gluon variant), but a
    call smaller than ``MIN_FLOPS`` to the tl kernel; ATTENTION_GLUON=0 sends none to the Gluon kernel,
    =1 every shape (through its head dim's variant, ``FORCED``). Every answer matches SDPA."""
    from common import attention
    from common.backends import get_backend
    from common.reuse import PLANS
    from impl_triton import gluon_attention as ga

    monkeypatch.setenv("ATTENTION_GLUON", switch)
    PLANS.clear()
    taken = []
    run = ga.forward
    monkeypatch.setattr(ga, "forward", lambda q, *args, specialized=False, pingpong=False, persistent=False, **kw:
                        taken.append((q.shape[2], q.shape[-1], "persistent" if persistent else "pingpong" if pingpong
                                      else "producer" if specialized else "one"))
                        or run(q, *args, specialized=specialized, pingpong=pingpong, persistent=persistent, **kw))
    shapes = ((8, 16, 1024, 256), (8, 16, 1024, 128), (1, 8, 1024, 128), (2, 8, 200, 128), (1, 8, 8192, 64),
              (2, 8, 4096, 64), (4, 4, 1024, 64))
    table = get_backend("triton").configs
    for B, H, L, D in shapes:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = attention(q, k, v, is_causal=True, backend="triton")
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1.6e-2)
    named = [(L, D, table.lookup_gluon(D, torch.bfloat16, True, L), ga.large_enough(B, H, L, L, D, True))
             for B, H, L, D in shapes]
    default = [(L, D, chosen) for L, D, chosen, large in named if chosen != "tl" and large]
    forced = [(L, D, ga.FORCED[D]) for B, H, L, D in shapes]
    assert taken == {"": default, "0": [], "1": forced}[switch]
    # (the committed table sends some of these shapes to Gluon, and the size guard alone keeps one off it)
    assert switch != "" or (len(default) >= 2 and any(chosen != "tl" and not large for *_, chosen, large in named))


class _StandInKernel:
    """A Gluon kernel stood in (the CPU tests of its bound launches): ``kernel[grid](*args, **meta)`` calls
    ``on_jit(grid, args, meta)`` and returns a compiled kernel's stand-in, whose direct launch the tests
    stand in too."""

    def __init__(self, on_jit):
        self.on_jit = on_jit

    def __getitem__(self, grid):
        def jit(*args, **meta):
            self.on_jit(grid, args, meta)
            return types.SimpleNamespace(metadata=types.SimpleNamespace(), run=lambda *args: None)

        return jit


@pytest.mark.parametrize("variant", ["one", "producer", "pingpong", "persistent"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_bound_gluon_launch_passes_each_calls_tensors(monkeypatch, variant, with_lse):
    """BoundGluon (CPU, the kernel and Triton's launcher stood in): the binding call's tensors are not
    kept; a later call's first launch goes through the kernel's JIT with that call's tensors at their
    places (descriptors rebased on q, k, v and the output, the log-sum-exp or the output in its slot,
    ping-pong's never-read descale slots the output), the next launches the compiled kernel with their
    addresses and the constexprs in signature order; a query off 16 bytes runs the fallback."""
    from common import compat
    from impl_triton import gluon_attention as ga

    B, H, H_kv, L, D = 2, 4, 2, 256, 128
    monkeypatch.setattr(ga, "_sm_count", lambda device: 132)  # (persistent: a CPU has no SMs to count)

    def tensors():
        q = torch.randn(B, H, L, D, dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, L, D, dtype=torch.bfloat16) for _ in range(2))
        lse = torch.empty(B, H, L) if with_lse else None
        return q, k, v, torch.empty_like(q), lse

    q, k, v, out, lse = tensors()
    plan = types.SimpleNamespace(query=q, key=k, value=v, out=out, lse=lse, scale=0.1, band=(1 - L, 0),
                                 with_lse=with_lse, descales=None, widen_v=0)
    fallback = []
    bound = ga.BoundGluon(plan, variant, lambda t: fallback.append(t))
    params = compat.jit_parameters(bound.kernel)
    kept = [*bound.args, *(t.base for t in bound.templates)]
    assert all(not isinstance(a, torch.Tensor) for a in kept)  # (the binding call's tensors are not kept)
    calls = []
    bound.kernel = _StandInKernel(lambda grid, args, meta: calls.append(("jit", grid, args, meta)))
    monkeypatch.setattr(ga, "launch_compiled", lambda kernel, grid, args: calls.append(("compiled", grid, args)))
    q, k, v, out, lse = tensors()
    roles = (q, k, v, out, lse, None, None, None, None, None)
    bound(roles)
    bound(roles)
    (_, grid, args, meta), (_, grid3, direct) = calls
    assert [d.base for d in args[:4]] == [q, k, v, out] and args[0].shape == list(q.shape)
    assert args[4] is (lse if with_lse else out) and meta["IS_CAUSAL"] and meta["WITH_LSE"] == with_lse
    if variant in ("pingpong", "persistent"):
        assert all(a is out for a in args[5:8])
    # (persistent: a program a pair of causal row blocks here)
    assert grid == ((B * H, 1) if variant == "persistent" else (2, B * H))
    assert len(direct) == len(params) and grid3 == (*grid, 1)
    assert direct[4] == (lse if with_lse else out).data_ptr() and direct[len(args):] == tuple(
        meta[name] for name, _, constexpr, _ in params if constexpr)
    assert [d.base for d in direct[:4]] == [q, k, v, out]
    unaligned = torch.empty(q.numel() + 8, dtype=q.dtype)[1:q.numel() + 1].view(q.shape)
    bound((unaligned, *roles[1:]))
    assert len(calls) == 2 and len(fallback) == 1 and fallback[0][0] is unaligned


@pytest.mark.parametrize("with_dlse", [False, True])
def test_bound_one_pass_passes_each_calls_tensors(monkeypatch, device, with_dlse):
    """BoundOnePass (any device: the launches before and after the one pass are tl kernels, which the
    interpreter runs on a CPU; the Gluon kernel and Triton's launcher stood in): the binding call's tensors are
    not kept; a later call's delta = rowsum(grad_out * out) - grad_lse lands in its delta, its dQ sum starts at
    zero, the one pass gets its descriptors rebased on that call's q, k, v, grad_out, dk, dv and sum, its
    log-sum-exp and delta, first through the kernel's JIT, then the compiled kernel with their addresses and the
    constexprs in signature order, and its dQ is the sum times the scale; a tensor the copy engine takes off 16
    bytes runs the fallback."""
    from common import compat
    from common import plan as planning
    from common.backends import get_backend
    from common.validation import check_call
    from impl_triton import gluon_attention as ga
    from impl_triton import gluon_backward as gb

    B, H, H_kv, L, D, scale = 1, 2, 1, 64, 64, 0.3

    def tensors():
        q = torch.randn(B, H, L, D, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(B, H_kv, L, D, device=device, dtype=torch.bfloat16) for _ in range(2))
        out, grad_out = torch.randn_like(q), torch.randn_like(q)
        lse = torch.randn(B, H, L, device=device)
        grad_lse = torch.randn(B, H, L, device=device) if with_dlse else None
        return q, k, v, out, grad_out, lse, grad_lse

    q, k, v, out, grad_out, lse, grad_lse = tensors()
    call = check_call(get_backend("triton"), q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=scale,
                      enable_gqa=True, return_lse=False)
    plan = planning.make_backward(call, get_backend("triton"), out, lse, grad_out, grad_lse)
    fallback = []
    bound = gb.BoundOnePass(plan, lambda t: fallback.append(t))
    kept = [*bound.args, *(t.base for t in bound.templates), *bound.prologue.args, *bound.epilogue.args]
    assert not any(isinstance(a, torch.Tensor) for a in kept)  # (the binding call's tensors are not kept)
    # (a compiled kernel's direct launch takes (x, y, z): common.compat.direct_launcher)
    assert bound.grid == (1, B * H_kv, 1) and bound.prologue.grid == bound.epilogue.grid == (B * H, 1, 1)
    params = compat.jit_parameters(gb._gluon_bwd_ws)
    calls = []

    def one_pass(kind, args):
        """The stand-in kernel: records its arguments, adds 2 to every element of dQ's sum (its descriptor's base)."""
        calls.append((kind, args))
        args[6].base.add_(2.0)

    def jit(grid, args, meta):
        assert grid == bound.grid[:2] == (1, B * H_kv)
        one_pass("jit", args)

    monkeypatch.setattr(gb, "_gluon_bwd_ws", _StandInKernel(jit))
    # (the bound launch's own, gluon_attention.launch_kept)
    monkeypatch.setattr(ga, "launch_compiled", lambda kernel, grid, args: one_pass("compiled", args))
    for _ in range(2):
        q, k, v, out, grad_out, lse, grad_lse = tensors()
        delta, dq, dk, dv = (torch.full_like(t, float("nan")) for t in planning.backward_buffers(q, k, v))
        roles = (q, k, v, out, grad_out, lse, grad_lse, delta, dq, dk, dv)
        bound(roles)
        kind, args = calls[-1]
        assert [d.base for d in args[:6]] == [q, k, v, grad_out, dk, dv] and args[6].base.dtype == torch.float32
        expected = (out.float() * grad_out.float()).sum(-1) - (grad_lse if with_dlse else 0)
        torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(dq, torch.full_like(dq, 2.0 * scale))  # (the sum from zeros, plus the stand-in's 2)
        if kind == "jit":
            assert args[7] is lse and args[8] is delta
        else:
            assert args[7:9] == (lse.data_ptr(), delta.data_ptr()) and len(args) == len(params)
            assert args[9:18] == tuple(bound.args[9:18]) and list(args[18:]) == bound.constexprs
    assert [kind for kind, _ in calls] == ["jit", "compiled"] and not fallback
    unaligned = torch.empty(q.numel() + 8, device=device, dtype=q.dtype)[1:q.numel() + 1].view(q.shape)
    bound((unaligned, *roles[1:]))
    assert len(calls) == 2 and len(fallback) == 1 and fallback[0][0] is unaligned and len(fallback[0]) == 11


def test_switch_takes_0_1_or_nothing(monkeypatch, device):
    """A misspelt switch is a clear error before any launch, not a silent default."""
    from common import attention

    monkeypatch.setenv("ATTENTION_GLUON", "yes")
    q = torch.randn(1, 2, 8, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="ATTENTION_GLUON"):
        attention(q, q, q, backend="triton")


def test_plans_are_kept_per_switch_setting(monkeypatch, device):
    """attention()'s kept plans are keyed by ATTENTION_GLUON too: a layout bound under one setting (the
    Gluon kernel's launch on sm_90, the tl kernel's elsewhere) is planned again under another, not reused."""
    from common import attention
    from common.reuse import PLANS

    q, k, v = (torch.randn(1, 2, 40, 64, device=device, dtype=torch.float16) for _ in range(3))
    PLANS.clear()
    for switch in ("", "0", "", "1"):
        monkeypatch.setenv("ATTENTION_GLUON", switch)
        for _ in range(2):
            out = attention(q, k, v, is_causal=True, backend="triton")
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    assert len(PLANS) == 3  # (unset, 0 and 1: three keys; the second unset found its plan)


def test_switched_on_without_hopper_runs_the_tl_kernel(monkeypatch, device):
    """ATTENTION_GLUON=1 where the Gluon kernel cannot run (no sm_90 GPU, the interpreter): the tl
    kernel, the same answer."""
    if ON_HOPPER:
        pytest.skip("on an sm_90 GPU the switch takes the Gluon kernel (the test above)")
    from common import attention
    from impl_triton import gluon_attention as ga

    monkeypatch.setenv("ATTENTION_GLUON", "1")
    monkeypatch.setattr(ga, "forward_plan", lambda plan, chosen: pytest.fail("the Gluon kernel ran off sm_90"))
    q, k, v = (torch.randn(1, 2, 33, 64, device=device, dtype=torch.float16) for _ in range(3))
    out = attention(q, k, v, is_causal=True, backend="triton")
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_backward_compiles_for_sm90_with_the_overlap(tmp_path):
    """The Gluon backward's two passes and its one-pass scheme build for sm_90 with the installed Triton (at
    D 64, causal): warp-group MMAs, TMA copies in and out (dQ once; dK and dV), no spills, and each loop
    waiting for its first product while the next is in flight; where the installed Triton has the bulk
    reduce-add, the one pass adding dQ by it too (one such copy, no per-element atomics in its place), also
    with a loader warp and a dQ warp of their own (its row tiles' stats in registers or read from shared
    memory); the one pass's waits without a barrier after them."""
    from impl_triton import gluon_backward as gb

    command = [sys.executable, str(ROOT / "tools" / "gluon_sass.py"), "--backward", "--dims", "64", "--causal",
               "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {m.group(1): m.group(0) for m in re.finditer(r"pass=(\w+) D=64 .*", result.stdout)}
    fused = ("fused", "fused_tma") if gb.bulk_reduce_add() else ("fused", )
    specialized = ("fused_ws", "fused_ws_stats") if gb.bulk_reduce_add() else ()
    assert set(lines) == {"dq", "dkdv", *fused, *(f"{name}_first" for name in fused), *specialized}, result.stdout
    for name, line in lines.items():
        fields = dict(item.split("=") for item in line.split())
        assert int(fields["STACK"]) == 0 and int(fields["HGMMA"]) > 0 and int(fields["UTMALDG"]) > 0, line
        assert int(fields["UTMASTG"]) == (1 if name == "dq" else 2) and fields["OVERLAP"] == "1", line
        if name.startswith("fused_ws"):  # (its dQ warp's loop: the bulk reduce-add, unrolled or not)
            assert int(fields["UTMAREDG"]) >= 1, line
        else:
            assert int(fields["UTMAREDG"]) == (1 if name.startswith("fused_tma") else 0), line
    for name in ("fused_tma", "fused_tma_first", *specialized) if gb.bulk_reduce_add() else ():
        assert "REDG" not in (tmp_path / f"gluon_bwd_{name}_d64.sass").read_text().replace("UTMAREDG", "")
    assert "REDG" in (tmp_path / "gluon_bwd_fused_d64.sass").read_text().replace("UTMAREDG", "")
    # the one pass's waits are each warp group's own: no barrier of both groups right after one (which triton
    # 3.9 puts after a wait in a partition of two warp groups unless it is marked so)
    for name in lines:
        if name.startswith("fused"):
            assert not WAIT_THEN_BARRIER.search((tmp_path / f"gluon_bwd_{name}_d64.ptx").read_text()), name


@pytest.mark.parametrize("D", [64, 24])
@pytest.mark.parametrize("with_dlse", [False, True])
def test_one_pass_sums_and_dq(D, with_dlse, monkeypatch):
    """The one pass's launches before and after it (tl kernels, so the interpreter runs them too): delta =
    rowsum(grad_out * out) - grad_lse from (B, L, H, D) views, dQ's float32 sum all zeros, then dQ = sum *
    scale rounded once; every element written (the buffers they allocate come poisoned)."""
    from impl_triton import gluon_backward as gb

    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, Lq = 2, 3, 100  # (rows off the 64-row blocks)
    out, grad_out = (torch.randn(B, Lq, H, D, device=device, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    grad_lse = torch.randn(B, H, Lq, device=device) if with_dlse else None
    empty = torch.empty

    def poisoned(*shape, **kw):
        made = empty(*shape, **kw)
        return made.fill_(float("nan")) if made.is_floating_point() else made

    monkeypatch.setattr(torch, "empty", poisoned)
    delta, dq_sum = gb.one_pass_sums(out, grad_out, grad_lse)
    expected = (out.float() * grad_out.float()).sum(-1) - (grad_lse if with_dlse else 0)
    torch.testing.assert_close(delta, expected.reshape(B * H, Lq), rtol=1e-5, atol=1e-5)
    assert dq_sum.shape == (B, H, Lq, D) and dq_sum.is_contiguous() and (dq_sum == 0).all()
    dq_sum.normal_()
    dq = gb.one_pass_dq(dq_sum, 0.3, torch.bfloat16)
    assert dq.dtype == torch.bfloat16 and dq.is_contiguous()
    assert torch.equal(dq, (dq_sum * 0.3).to(torch.bfloat16))


@pytest.mark.parametrize("causal", [False, True])
def test_dispatched_one_pass_compiles_for_sm90_as_measured(causal, tmp_path):
    """The one pass the triton backend runs (warp-specialised, D 64 and 128 at ``ws_tile``, its row tiles' stats
    read from shared memory: STATS_SMEM) builds for sm_90 with the installed Triton where it has the bulk
    reduce-add: dQ added by the copy engine (no per-element atomics), its waits without a barrier after them, and
    no more stack than the build timed on the GPU (none at D 64, 8 bytes at D 128: a few loop-invariant scalars,
    none of the accumulators); so does its variant with the stats held in registers, and the dispatched form
    takes no more stack than it."""
    from impl_triton import gluon_backward as gb

    if not gb.bulk_reduce_add():
        import triton

        pytest.skip(f"the one pass adds dQ by Gluon's bulk reduce-add (triton 3.9); this is {triton.__version__}")
    command = [sys.executable, str(ROOT / "tools" / "gluon_sass.py"), "--backward", "--dims", "64", "128",
               "--out", str(tmp_path), *(["--causal"] if causal else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for D, allowed in ((64, 0), (128, 8)):
        stacks = {}
        for name in ("fused_ws", "fused_ws_stats"):  # (_stats: its row tiles' stats read from shared memory)
            line = re.search(rf"pass={name} D={D} .*", result.stdout).group(0)
            fields = dict(item.split("=") for item in line.split())
            stacks[name] = int(fields["STACK"])
            assert int(fields["UTMAREDG"]) >= 1 and int(fields["UTMASTG"]) == 2 and int(fields["HGMMA"]) > 0, line
            assert "REDG" not in (tmp_path / f"gluon_bwd_{name}_d{D}.sass").read_text().replace("UTMAREDG", "")
            assert not WAIT_THEN_BARRIER.search((tmp_path / f"gluon_bwd_{name}_d{D}.ptx").read_text())
        # (this build, four query heads a K/V head: reading the stats from shared memory takes no more stack)
        assert stacks["fused_ws_stats"] <= min(allowed, stacks["fused_ws"]), (D, stacks)


def test_one_pass_runs_where_measured_and_never_when_deterministic(monkeypatch):
    """gluon_backward.one_pass (the tensors' sm_90 and TMA checks stood in, so any machine runs it): with the
    bulk reduce-add and nothing asking for a deterministic backward, D 64 and 128 from 1024 rows and keys, causal
    or not, at least the Gluon forward's FLOPs (large_enough), takes the warp-specialised one pass; D 256, shorter
    rows or keys, a smaller call (its bound tl launches cost a loop less), ATTENTION_GLUON=0, deterministic=True
    or torch.use_deterministic_algorithms keep the tl backward; ATTENTION_GLUON=1 takes every plan it serves,
    never a mask, a window with a left edge or a head dim it has no kernel for (256); without the bulk
    reduce-add, none. The Triton backend binds the one pass's launches (BoundOnePass) for a plan it runs."""
    import dataclasses

    import impl_triton.attention as triton_attention
    from common import plan as planning
    from common.backends import get_backend
    from common.validation import check_call
    from impl_triton import gluon_backward as gb
    from tests.conftest import DEVICE

    backend = get_backend("triton")
    monkeypatch.setattr(gb, "serves", lambda q, *tensors: q.shape[-1] in gb.HEAD_DIMS)  # (the tensors' checks)
    monkeypatch.setattr(gb, "bulk_reduce_add", lambda: True)
    monkeypatch.setattr(gb, "builds_one_pass", lambda: True)
    monkeypatch.delenv("ATTENTION_GLUON", raising=False)

    def plan(L=4096, D=128, Lk=None, is_causal=True, B=512, **kw):
        """A plan of one (batch, head), its query and keys then seen as B batches (stride 0) for the size guard."""
        q = torch.randn(1, 1, L, D, dtype=torch.bfloat16, device=DEVICE)
        k = torch.randn(1, 1, Lk or L, D, dtype=torch.bfloat16, device=DEVICE)
        call = check_call(backend, q, k, k, dropout_p=0.0, is_causal=is_causal, scale=None, enable_gqa=False,
                          return_lse=False, **{"attn_mask": None, **kw})
        made = planning.make_backward(call, backend, torch.randn_like(q), torch.randn(1, 1, L, device=DEVICE),
                                      torch.randn_like(q))
        return dataclasses.replace(made, query=made.query.expand(B, -1, -1, -1), key=made.key.expand(B, -1, -1, -1))

    mask = torch.ones(4096, 4096, dtype=torch.bool, device=DEVICE)
    assert gb.one_pass(plan()) and gb.one_pass(plan(is_causal=False)) and gb.one_pass(plan(L=8192, Lk=4096))
    assert gb.one_pass(plan(D=64))
    assert gb.one_pass(plan(L=1024)) and gb.one_pass(plan(L=1024, D=64, is_causal=False))
    # (the guard: 4·B·L²·D, half causal, against 3e10; 14 batches of D 64 at 4096 causal pass, 13 do not)
    assert gb.one_pass(plan(D=64, B=14)) and not gb.one_pass(plan(D=64, B=13))
    kept_tl = (plan(deterministic=True), plan(D=256), plan(L=512), plan(Lk=512),
               plan(attn_mask=mask, is_causal=False), plan(window=(256, 0)), plan(B=1))
    assert not any(gb.one_pass(p) for p in kept_tl)
    assert triton_attention.bind_backward(plan(L=512, B=1)) is not None
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not gb.one_pass(plan())
    finally:
        torch.use_deterministic_algorithms(was)
    wide = torch.empty(1, 1, 1, 128, device=DEVICE).expand(65536, 1, 4096, 128)
    many = dataclasses.replace(plan(), query=wide, key=wide)
    assert not gb.one_pass(many)  # (B·H_kv programs past a grid axis)
    monkeypatch.setenv("ATTENTION_GLUON", "1")
    assert [gb.one_pass(p) for p in kept_tl] == [False, False, True, True, False, False, True]
    assert isinstance(triton_attention.bind_backward(plan(L=512, B=1)), gb.BoundOnePass)
    monkeypatch.setenv("ATTENTION_GLUON", "0")
    assert not gb.one_pass(plan())
    monkeypatch.setenv("ATTENTION_GLUON", "yes")
    with pytest.raises(ValueError, match="ATTENTION_GLUON must be 0, 1 or unset"):
        gb.one_pass(plan())
    monkeypatch.delenv("ATTENTION_GLUON")
    monkeypatch.setattr(gb, "builds_one_pass", lambda: False)
    assert not gb.one_pass(plan())
    monkeypatch.setattr(gb, "builds_one_pass", lambda: True)
    monkeypatch.setattr(gb, "bulk_reduce_add", lambda: False)
    assert not gb.one_pass(plan())


@pytest.mark.parametrize("version, builds", [("12.9", False), ("13.0", True), ("13.4", True), (None, False)])
def test_one_pass_needs_a_cuda13_ptxas(version, builds, monkeypatch):
    """builds_one_pass reads the version of the ptxas Triton builds sm_90 with: CUDA 12.9's crashed on the
    one pass's causal grouped build, triton 3.9 ships 13.4's; none found, no one pass."""
    import triton.backends.nvidia.compiler as nvidia

    from impl_triton import gluon_backward as gb

    def get_ptxas(arch):
        assert arch == 90
        if version is None:
            raise RuntimeError("Cannot find ptxas-blackwell")
        return types.SimpleNamespace(path="ptxas", version=version)

    monkeypatch.setattr(nvidia, "get_ptxas", get_ptxas)
    gb.builds_one_pass.cache_clear()
    try:
        assert gb.builds_one_pass() is builds
    finally:
        gb.builds_one_pass.cache_clear()


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("L", [1024, 4096])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backward_takes_the_one_pass_where_dispatched(causal, D, L, monkeypatch):
    """attention's backward on the Triton backend at the benchmark's head dims and lengths (D 64 and 128, 1024 and
    4096, grouped heads, bf16; heads enough to pass the size guard) runs the warp-specialised one pass, its
    gradients within twice the tl backward's error of float32 autograd through SDPA (plus a hair), from its first
    call (planned), its second (planned, then bound), its third and fourth (the bound launches, BoundOnePass:
    through the JIT, then the compiled kernels directly), and a
    query off 16 bytes (the bound launches hand it to the tl backward's); with
    deterministic=True the tl backward runs instead, bit for bit the same twice."""
    from common import attention
    from common.reuse import BACKWARDS
    from impl_triton import gluon_backward as gb

    if not gb.bulk_reduce_add():
        import triton

        pytest.skip(f"the one pass adds dQ by Gluon's bulk reduce-add (triton 3.9); this is {triton.__version__}")
    monkeypatch.delenv("ATTENTION_GLUON", raising=False)
    taken, run = [], gb.backward_plan
    monkeypatch.setattr(gb, "backward_plan", lambda plan: taken.append(plan.query.shape) or run(plan))
    H = 16 * (4096 // L) ** 2  # (4·H·L²·D, half causal, at least gluon_attention.MIN_FLOPS at D 64)
    q = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, H // 2, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16)
    BACKWARDS.clear()

    def grads(query=q, **kw):
        out = attention(query, k, v, is_causal=causal, enable_gqa=True, backend="triton", **kw)
        return torch.autograd.grad(out, (query, k, v), grad_out)

    bound_calls, call = [], gb.BoundOnePass.__call__
    monkeypatch.setattr(gb.BoundOnePass, "__call__",
                        lambda self, tensors: bound_calls.append(tensors[0].shape) or call(self, tensors))
    # (the layout's second call binds, its third runs the bound launches and keeps their compiled kernels, its
    # fourth launches those directly)
    one_pass, binding, bound, direct = grads(), grads(), grads(), grads()
    assert taken == [q.shape, q.shape] and bound_calls == [q.shape, q.shape]
    tl, again = grads(deterministic=True), grads(deterministic=True)
    assert taken == [q.shape, q.shape] and all(torch.equal(a, b) for a, b in zip(tl, again))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=True)
    expected = torch.autograd.grad(out, (qf, kf, vf), grad_out.float())
    # (a query off 16 bytes, the same layout: the bound launches hand it to the tl backward's)
    unaligned = torch.empty(q.numel() + 8, device="cuda", dtype=q.dtype)[1:q.numel() + 1].view(q.shape)
    off = grads(unaligned.copy_(q.detach()).requires_grad_())
    assert bound_calls == [q.shape] * 3 and taken == [q.shape, q.shape]
    for got in (one_pass, binding, bound, direct, off):
        assert_as_close_as_tl(("dq", "dk", "dv"), got, tl, expected)


BACKWARD_CASES = [  # (B, H, H_kv, Lq, Lk, scale, with a gradient of the log-sum-exp)
    (2, 4, 2, 300, 517, 0.3, False),  # grouped heads, lengths off the tiles
    (1, 4, 4, 700, 129, -0.2, True),  # more queries than keys (causal top-left: rows with no key), dlse
    (2, 2, 1, 128, 1000, 0.125, False),  # whole query tiles, keys off the tiles
]


@pytest.mark.skipif(not ON_HOPPER, reason="Gluon's Hopper kernel runs on sm_90 GPUs only (not under the interpreter)")
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("case", BACKWARD_CASES,
                         ids=[f"B{c[0]}-H{c[1]}-Hkv{c[2]}-Lq{c[3]}-Lk{c[4]}-s{c[5]}-dlse{int(c[6])}"
                              for c in BACKWARD_CASES])
@pytest.mark.parametrize("scheme", ["two-pass", "two-pass-overlap-32", "one-pass", "one-pass-tma", "one-pass-first",
                                    "one-pass-tma-first", "one-pass-ws", "one-pass-ws-stats"])
def test_gluon_backward_as_close_to_float64_as_the_tl_backward(D, dtype, causal, case, scheme):
    """dq, dk, dv of the Gluon backward (every element written: poisoned buffers; the one-pass scheme's
    dq is summed from zeros, by atomics or, -tma, by the copy engine's bulk reduce-add; -first: dK's product
    issued after dQ's; -ws: with a loader warp and a dQ warp, -stats: each row tile's m2 and delta read from
    shared memory where used) against float64
    autograd of the same attention, each within twice the tl backward's own error (plus a hair) on the
    same inputs."""
    from common import attention_backward
    from impl_triton import gluon_backward as gb

    if ("tma" in scheme or "-ws" in scheme) and not gb.bulk_reduce_add():
        import triton

        pytest.skip(f"the bulk reduce-add is Gluon's from triton 3.9; this is triton {triton.__version__}")

    B, H, H_kv, Lq, Lk, scale, with_dlse = case
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, H_kv, Lk, D, device="cuda", dtype=dtype) for _ in range(2))
    grad_out = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype)
    shift = None if causal is None else (Lk - Lq if causal == "bottom_right" else 0)
    qf, kf, vf = (t.double().requires_grad_() for t in (q, k, v))
    s = qf @ kf.repeat_interleave(H // H_kv, 1).transpose(-1, -2) * scale
    if shift is not None:
        keep = torch.arange(Lk, device="cuda")[None, :] <= torch.arange(Lq, device="cuda")[:, None] + shift
        s = s.masked_fill(~keep, float("-inf"))
    lse64 = torch.logsumexp(s, -1)
    out64 = torch.softmax(s, -1).nan_to_num(0.0) @ vf.repeat_interleave(H // H_kv, 1)
    grad_lse = torch.randn(B, H, Lq, device="cuda") if with_dlse else None
    loss = (out64 * grad_out.double()).sum()
    if with_dlse:
        loss = loss + (lse64.nan_to_num(0.0, neginf=0.0) * grad_lse.double()).sum()
    expected = torch.autograd.grad(loss, (qf, kf, vf))
    out, lse = out64.detach().to(dtype), lse64.detach().float()
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    if scheme.startswith("two-pass"):  # (-overlap-32: the dK/dV pass's overlap at row tiles of 32)
        dkdv = (32, 128, 4, 8, True) if scheme.endswith("32") else None
        gb.backward(q, k, v, out, grad_out, lse, scale, shift, grad_lse=grad_lse, dq=dq, dk=dk, dv=dv, dkdv=dkdv)
    else:
        dq = gb.backward_fused(q, k, v, out, grad_out, lse, scale, shift, grad_lse=grad_lse, dq=dq, dk=dk, dv=dv,
                               dq_tma="tma" in scheme, dq_first=scheme.endswith("first"),
                               specialized="-ws" in scheme, stats_smem=scheme.endswith("stats"))[0]
    tl_grads = attention_backward(grad_out, q, k, v, out, lse, is_causal=shift is not None, scale=scale,
                                  enable_gqa=True, backend="triton", grad_lse=grad_lse,
                                  alignment="bottom_right" if causal == "bottom_right" else "top_left")
    assert not any(got.isnan().any() for got in (dq, dk, dv))
    assert_as_close_as_tl(("dq", "dk", "dv"), (dq, dk, dv), tl_grads, expected)
