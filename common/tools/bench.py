"""``bench``: the two kernels side by side with SDPA, on a GPU.

Three sections, each timed with ``triton.testing.do_bench`` (median) on fresh
random inputs, each result checked against SDPA before it is timed:

- throughput: fp16 and bf16, head dims 64 and 128 (optionally 32, 256),
  L = 512..16384 with B·L = 16k tokens and H·D = 2048, causal and not;
  TFLOP/s = 4·B·H·L²·D (halved when causal);
- homework: the homework's four shapes, in µs per call: GPU time and the wall
  time of a plain Python loop of calls (host work included);
- decode: Lq in {1, 16}, Lk from 4k to 64k, B = 8, 32 query heads sharing 8
  K/V heads (grouped-query);
- fp8: FP8 (e4m3) inputs with descales, forward: the throughput shapes at L 4k
  and 16k with query, keys and values in FP8, and decoding (Lq 1, the decode
  section's heads) with a bfloat16 query over FP8 keys and values; SDPA's rows
  there run the same shapes in bfloat16 (it takes no FP8), and each FP8 row is
  also set against our own 16-bit row of the same shape where the run has one.

Backends: "triton", "ninetoothed", "torch" (SDPA's default, called directly; cuDNN on an H200)
and "sdpa-flash" (SDPA forced onto its FlashAttention-2 kernel). Writes
results.json / results.csv / one PNG per dtype into ``--out`` (by default bench-results/ in the
current directory) and the Markdown report (with the hand-written analysis in benchmarks/NOTES.md)
to stdout or ``--markdown PATH``; only ``--write`` rewrites the committed benchmarks/ and BENCHMARKS.md.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import pathlib
import platform
import sys

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (common/tools/ is two levels down)
ALL_BACKENDS = ("triton", "ninetoothed", "torch", "sdpa-flash")
OUT_DEFAULT = "bench-results"  # relative to the current directory: a plain run rewrites no committed file
BASELINE = "torch"
TOKENS, WIDTH = 16384, 2048  # B·L and H·D of the throughput sweep
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
HOMEWORK_SHAPES = [(2, 4, 16, 32), (4, 8, 64, 64), (1, 16, 128, 128), (2, 4, 1024, 64)]
DECODE = dict(B=8, H=32, H_kv=8, D=128, q_lens=(1, 16), k_lens=(4096, 16384, 65536))
FP8_LENGTHS, FP8_DECODE_K_LENS = (4096, 16384), (16384, 65536)
FP8, FP8_KV = "float8_e4m3fn", "bfloat16-fp8kv"  # the fp8 section's dtypes: all FP8; a bf16 query on FP8 K/V
# FLOPs of a mode, in forwards: the backward does 2.5 forwards' worth of matrix
# products (as FlashAttention and Triton's tutorial count it).
MODE_FLOPS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def _caller(backend, q, k, v, is_causal, enable_gqa=False):
    from common import attention

    if backend == "sdpa-flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)

        return call
    if backend == "torch":
        # SDPA itself, not through our "torch" backend: the baseline's wall time must not
        # carry our validation and planning (10-25 µs a call on the H200's host).
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    return lambda: attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa, backend=backend)


def _inputs(B, H, H_kv, Lq, Lk, D, dtype):
    q = torch.randn(B, H, Lq, D, dtype=dtype, device="cuda")
    k = torch.randn(B, H_kv, Lk, D, dtype=dtype, device="cuda")
    v = torch.randn(B, H_kv, Lk, D, dtype=dtype, device="cuda")
    return q, k, v


def _fp8_inputs(B, H, H_kv, Lq, Lk, D, dtype: str):
    """(q, k, v, descales, real q, k, v): FP8 keys and values with descales per batch and K/V head,
    the query FP8 too (FP8) or bfloat16 (FP8_KV); the real values in float32."""
    from common import quantize_fp8
    from common.fp8 import dequantize_fp8

    q = torch.randn(B, H, Lq, D, device="cuda")
    (k, kd), (v, vd) = (quantize_fp8(torch.randn(B, H_kv, Lk, D, device="cuda")) for _ in range(2))
    q, qd = quantize_fp8(q, heads=H_kv) if dtype == FP8 else (q.bfloat16(), None)
    real = [dequantize_fp8(x, d) if d is not None else x.float() for x, d in ((q, qd), (k, kd), (v, vd))]
    return q, k, v, dict(q_descale=qd, k_descale=kd, v_descale=vd), real


def _fp8_bound(out, q_real, k_real, v_real, is_causal, fp8_query: bool) -> bool:
    """Whether the FP8 output is within ``common.reference.fp8_error_bound`` (the tests' bound) on a
    slice: batch 0's first two query heads, their last 128 rows (the rows that see the most keys);
    an FP8 query's scores moved by Hopper's FP8 sums, probabilities rounded to e4m3 for P·V (with a
    16-bit query, the values widened to float16 and the probabilities with them)."""
    from common.reference import E4M3_ROUNDING, HALF_UNITS, fp8_error_bound, fp8_score_error, reference_probs

    H, H_kv, Lq, Lk, D = q_real.shape[1], k_real.shape[1], q_real.shape[2], k_real.shape[2], q_real.shape[3]
    heads, rows = min(2, H), min(128, Lq)
    group = H // H_kv
    q = q_real[:1, :heads, Lq - rows:].double()
    k = k_real[:1].repeat_interleave(group, 1)[:, :heads].double()
    v = v_real[:1].repeat_interleave(group, 1)[:, :heads].double()
    mask = (torch.ones(rows, Lk, dtype=torch.bool, device=q.device).tril(Lk - rows) if is_causal else None)
    probs = reference_probs(q, k, attn_mask=mask)
    expected = probs @ v
    score_error = fp8_score_error(q, k, D**-0.5) if fp8_query else 0.0
    pv_rounding = E4M3_ROUNDING if fp8_query else HALF_UNITS[torch.float16]
    bound = fp8_error_bound(probs, v, expected, out.dtype, pv_rounding, score_error)
    got = out[:1, :heads, Lq - rows:].double()
    return bool(((got - expected).abs() <= bound).all())


def _measure_fp8(backend, B, H, H_kv, Lq, Lk, D, dtype: str, is_causal) -> dict:
    """An fp8 section row: our FP8 forward checked against float64 attention of the dequantized
    inputs (``_fp8_bound``) and timed; for SDPA ("torch", "sdpa-flash"), the same shape in bfloat16."""
    from common import attention
    from common.tools.timing import attention_flops, gpu_time_ms

    row = dict(section="fp8", mode="fwd", backend=backend, dtype=dtype, B=B, H=H, H_kv=H_kv, Lq=Lq, Lk=Lk, D=D,
               causal=is_causal)
    q, k, v, descales, real = _fp8_inputs(B, H, H_kv, Lq, Lk, D, dtype)
    gqa = H != H_kv
    if backend in ("torch", "sdpa-flash"):
        fn = _caller(backend, *(x.bfloat16() for x in real), is_causal, gqa)
        row["status"] = "ok"  # (bfloat16: SDPA takes no FP8; nothing of ours to check)
    else:
        def fn():
            return attention(q, k, v, is_causal=is_causal, enable_gqa=gqa, backend=backend, **descales)
        try:
            out = fn()
        except Exception as error:  # noqa: BLE001 - a backend that cannot run a shape says so in the table
            row.update(status=f"error: {type(error).__name__}: {error}"[:200])
            return row
        row["status"] = "ok" if _fp8_bound(out, *real, is_causal, dtype == FP8) else "WRONG (error above the bound)"
        del out
    row["ms"] = gpu_time_ms(fn)
    row["tflops"] = attention_flops(B, H, Lq, Lk, D, causal=is_causal) / (row["ms"] * 1e-3) / 1e12
    return row


def measure(section, backend, B, H, H_kv, Lq, Lk, D, dtype, is_causal, wall=False, mode="fwd") -> dict:
    """Check one backend on one shape against SDPA (output, and gradients unless
    ``mode`` is "fwd"), then time the forward, the backward or both (the fp8 section:
    :func:`_measure_fp8`)."""
    from common.reference import error_bound, grad_error_bound, reference
    from common.tools.timing import attention_flops, gpu_time_ms, wall_time_us

    if section == "fp8":
        return _measure_fp8(backend, B, H, H_kv, Lq, Lk, D, dtype, is_causal)
    q, k, v = _inputs(B, H, H_kv, Lq, Lk, D, dtype)
    gqa = H != H_kv
    fn = _caller(backend, q, k, v, is_causal, gqa)
    row = dict(section=section, mode=mode, backend=backend, dtype=str(dtype).removeprefix("torch."), B=B, H=H,
               H_kv=H_kv, Lq=Lq, Lk=Lk, D=D, causal=is_causal)
    if mode != "fwd":
        for t in (q, k, v):
            t.requires_grad_()
    try:
        out = fn()
        if mode != "fwd":
            grad_out = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    except Exception as error:  # noqa: BLE001 - a backend that cannot run a shape says so in the table
        row.update(status=f"error: {type(error).__name__}: {error}"[:200])
        return row
    ref_inputs = [t.detach().float().requires_grad_(mode != "fwd") for t in (q, k, v)]
    expected = reference(*ref_inputs, is_causal=is_causal, enable_gqa=gqa, dtype=torch.float32)
    bound, _ = error_bound(expected, dtype)
    row["max_error"] = (out.float() - expected).abs().max().item()
    wrong = row["max_error"] > bound
    if mode != "fwd":
        expected_grads = torch.autograd.grad(expected, ref_inputs, grad_out.float())
        errors = [(g.float() - e).abs().max().item() / grad_error_bound(e, dtype)[0]
                  for g, e in zip(grads, expected_grads)]
        row["grad_error_vs_bound"] = max(errors)  # <= 1: within the tests' bound
        wrong = wrong or row["grad_error_vs_bound"] > 1
        del expected_grads, grads
    del expected, ref_inputs
    row["status"] = "ok" if not wrong else "WRONG (error above the tests' bound)"
    if mode == "bwd":
        timed = lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)  # noqa: E731
    elif mode == "fwd+bwd":
        timed = lambda: torch.autograd.grad(fn(), (q, k, v), grad_out)  # noqa: E731
    else:
        timed = fn
    row["ms"] = gpu_time_ms(timed)
    flops = attention_flops(B, H, Lq, Lk, D, causal=is_causal) * MODE_FLOPS[mode]
    row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
    if wall:
        row["wall_us"] = wall_time_us(fn)
    return row


def _throughput_jobs(args, dtypes) -> list[tuple]:
    """The throughput sweep: B·L = 16k tokens, H·D = 2048, every dtype, head dim, masking, length and mode."""
    jobs = []
    for dtype in dtypes:
        for D in args.head_dims:
            for is_causal in [mode == "causal" for mode in args.masking]:
                for L in args.lengths:
                    B, H = max(1, TOKENS // L), WIDTH // D
                    jobs += [("throughput", B, H, H, L, L, D, dtype, is_causal, False, mode) for mode in args.modes]
    return jobs


def _homework_jobs() -> list[tuple]:
    """The homework's four shapes, fp16, causal and not, with wall times."""
    return [("homework", B, H, H, L, L, D, torch.float16, is_causal, True, "fwd")
            for B, H, L, D in HOMEWORK_SHAPES for is_causal in (False, True)]


def _decode_jobs(dtypes) -> list[tuple]:
    """Short queries against long grouped-query keys, with wall times, in the given dtypes."""
    return [("decode", DECODE["B"], DECODE["H"], DECODE["H_kv"], Lq, Lk, DECODE["D"], dtype, False, True, "fwd")
            for dtype in dtypes for Lq in DECODE["q_lens"] for Lk in DECODE["k_lens"]]


def _fp8_jobs(args) -> list[tuple]:
    """FP8 prefill at the throughput shapes of L 4k and 16k (every head dim and masking asked), then
    decoding from FP8 keys and values at the decode section's heads."""
    jobs = []
    for D in args.head_dims:
        for is_causal in [mode == "causal" for mode in args.masking]:
            for L in FP8_LENGTHS:
                jobs.append(("fp8", max(1, TOKENS // L), WIDTH // D, WIDTH // D, L, L, D, FP8, is_causal, False,
                             "fwd"))
    return jobs + [("fp8", DECODE["B"], DECODE["H"], DECODE["H_kv"], 1, Lk, DECODE["D"], FP8_KV, False, False, "fwd")
                   for Lk in FP8_DECODE_K_LENS]


def plan(args):
    """Every (section, shape) to measure, in order: tuples (section, B, H, H_kv, Lq, Lk, D, dtype,
    is_causal, wall, mode)."""
    dtypes = [getattr(torch, name) for name in args.dtypes]
    jobs = []
    if "throughput" in args.sections:
        jobs += _throughput_jobs(args, dtypes)
    if "homework" in args.sections:
        jobs += _homework_jobs()
    if "decode" in args.sections:
        jobs += _decode_jobs(dtypes[:1])
    if "fp8" in args.sections:
        jobs += _fp8_jobs(args)
    return jobs


def environment() -> dict:
    import triton

    try:
        import ninetoothed
        nt_version = getattr(ninetoothed, "__version__", None)
        if nt_version is None:
            from importlib.metadata import version
            nt_version = version("ninetoothed")
    except Exception:  # noqa: BLE001 - only for the record
        nt_version = "unknown"
    return dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        ninetoothed=nt_version, cuda=torch.version.cuda, python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )


def _add_ratios(rows):
    base = {}
    for r in rows:
        if r["backend"] == BASELINE and "ms" in r:
            base[_shape_key(r)] = r["ms"]
    triton_ms = {_shape_key(r): r["ms"] for r in rows if r["backend"] == "triton" and "ms" in r}
    # an FP8 row's 16-bit twin: our same backend on the same shape, bf16 (throughput) or the decode
    # section's dtype
    sixteen = {(r["backend"], r["B"], r["H"], r["H_kv"], r["Lq"], r["Lk"], r["D"], r["causal"]): r["ms"]
               for r in rows if r["section"] in ("throughput", "decode") and r.get("mode", "fwd") == "fwd"
               and r["dtype"] in ("bfloat16", "float16") and "ms" in r
               and not (r["section"] == "throughput" and r["dtype"] != "bfloat16")}
    for r in rows:
        if "ms" in r and _shape_key(r) in base:
            r["vs_sdpa"] = base[_shape_key(r)] / r["ms"]
        if r["backend"] == "ninetoothed" and "ms" in r and _shape_key(r) in triton_ms:
            r["vs_triton"] = triton_ms[_shape_key(r)] / r["ms"]
        twin = (r["backend"], r["B"], r["H"], r["H_kv"], r["Lq"], r["Lk"], r["D"], r["causal"])
        if r["section"] == "fp8" and r["backend"] in ("triton", "ninetoothed") and "ms" in r and twin in sixteen:
            r["vs_16bit"] = sixteen[twin] / r["ms"]


def _shape_key(r):
    return (r["section"], r.get("mode", "fwd"), r["dtype"], r["B"], r["H"], r["H_kv"], r["Lq"], r["Lk"], r["D"],
            r["causal"])


def _print_row(r):
    shape = f"({r['B']},{r['H']}{'/' + str(r['H_kv']) if r['H_kv'] != r['H'] else ''},{r['Lq']}"
    shape += f"x{r['Lk']},{r['D']})" if r["Lq"] != r["Lk"] else f",{r['D']})"
    text = (f"{r['section']:<10} {r.get('mode', 'fwd'):<7} {r['dtype']:<8} {shape:<26} "
            f"{'causal' if r['causal'] else 'full':<6} {r['backend']:<12}")
    if "ms" in r:
        text += f" {r['ms'] * 1e3:10.1f} µs {r['tflops']:7.1f} TFLOP/s"
        if "vs_sdpa" in r:
            text += f" {r['vs_sdpa']:5.2f}x SDPA"
        if "wall_us" in r:
            text += f"  wall {r['wall_us']:.1f} µs"
    text += f"  {r['status']}"
    print(text, flush=True)


def write_results(rows, env, out_dir: pathlib.Path) -> None:
    """results.json in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1) + "\n")


def write_outputs(rows, env, out_dir: pathlib.Path):
    write_results(rows, env, out_dir)
    # the first row's columns in its order, then the others by name (a set's order changes between runs)
    first = list(rows[0])
    fields = sorted({key for r in rows for key in r}, key=lambda f: (first.index(f), "") if f in first else (99, f))
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return plot(rows, env, out_dir)


def _plot_panel(ax, subset, D, causal) -> None:
    """One panel: TFLOP/s against L of every backend, at one head dim and causal mode."""
    for backend in ALL_BACKENDS:
        points = sorted((r["Lq"], r["tflops"]) for r in subset
                        if r["D"] == D and r["causal"] == causal and r["backend"] == backend)
        if points:
            ax.plot(*zip(*points), marker="o", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_title(f"D={D}, {'causal' if causal else 'not causal'}")
    ax.set_xlabel("sequence length L (B·L = 16k)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _plot_figure(plt, subset, dtype, mode, env, out_dir: pathlib.Path) -> pathlib.Path:
    """One PNG: a panel per (head dim, causal mode) of one dtype and mode."""
    head_dims = sorted({r["D"] for r in subset})
    fig, axes = plt.subplots(2, len(head_dims), figsize=(4.5 * len(head_dims), 7), squeeze=False)
    for col, D in enumerate(head_dims):
        for row_index, causal in enumerate((False, True)):
            _plot_panel(axes[row_index][col], subset, D, causal)
    title = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward + backward"}[mode]
    fig.suptitle(f"attention {title}, {dtype}, {env['gpu']} (torch {env['torch']}, triton {env['triton']})")
    fig.tight_layout()
    path = out_dir / (f"throughput_{dtype}.png" if mode == "fwd" else f"throughput_{dtype}_{mode.replace('+', '_')}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows, env, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """TFLOP/s against L, one panel per (head dim, causal mode), one PNG per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = [r for r in rows if r["section"] == "throughput" and "tflops" in r]
    paths = []
    for dtype, mode in sorted({(r["dtype"], r.get("mode", "fwd")) for r in throughput}):
        subset = [r for r in throughput if r["dtype"] == dtype and r.get("mode", "fwd") == mode]
        paths.append(_plot_figure(plt, subset, dtype, mode, env, out_dir))
    return paths


def _table(rows, columns):
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r) for _, fmt in columns) + " |")
    return "\n".join(lines)


def _pivot(rows, section):
    """One line per shape, one column group per backend."""
    shapes = {}
    for r in rows:
        if r["section"] == section:
            shapes.setdefault(_shape_key(r), {})[r["backend"]] = r
    return shapes


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def _header(env, notes: str) -> list[str]:
    """The report's title, environment, timing method and the hand-written notes."""
    out = [
        "# Benchmarks",
        "",
        "Regenerated by `python -m common bench --write` (do not edit by hand; the analysis comes from "
        "`benchmarks/NOTES.md`).",
        "",
        f"- GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
        f"ninetoothed {env['ninetoothed']}, Python {env['python']}; measured {env['date']}"
        + (f" (backward rows: {env['date_backward']}, a separate run)" if "date_backward" in env else "")
        + "".join(f"; the {', '.join(run['sections'])} rows it measured again: {run['date']}, a later run "
                  "(its rows replace the first run's of the same shape)" for run in env.get("later_runs", ())) + ".",
        "- Timing: `triton.testing.do_bench`, median; random normal inputs; every result checked against SDPA "
        "(float32; gradients too for the backward) before timing. TFLOP/s = 4·B·H·Lq·Lk·D, halved when causal, "
        "times 2.5 for the backward (`bwd`: `torch.autograd.grad` after one forward) and 3.5 for both. `torch` "
        "is SDPA's default (cuDNN here), `sdpa-flash` SDPA's FlashAttention-2 backend. Ratios are against "
        "`torch` in the same run.",
        "",
    ]
    if notes:
        out += [notes.strip(), ""]
    return out


def _tflops_cell(s, b) -> str:
    """A backend's TFLOP/s on a shape, or the start of its status where it did not run cleanly."""
    if s["by"].get(b, {}).get("status", "ok") != "ok":
        return s["by"][b]["status"][:30]
    return _num(s["by"].get(b, {}).get("tflops"), ".0f")


def _throughput_columns(section, backends) -> list[tuple]:
    """The columns of a throughput or decode table: the shape, TFLOP/s and ratios per backend
    (and, for decode, the wall time a decoding loop pays)."""
    columns = [("pass", lambda s: s.get("mode", "fwd")), ("dtype", lambda s: s["dtype"]), ("B,H,Lq,Lk,D", lambda s: f"{s['B']},{s['H']},{s['Lq']},{s['Lk']},{s['D']}"),
               ("causal", lambda s: "yes" if s["causal"] else "no")]
    columns += [(f"{b} TFLOP/s", lambda s, b=b: _tflops_cell(s, b)) for b in backends]
    columns += [(f"{b} / SDPA", lambda s, b=b: _num(s["by"].get(b, {}).get("vs_sdpa"), ".2f"))
                for b in ("triton", "ninetoothed") if b in backends]
    if "ninetoothed" in backends:
        columns.append(("NT / triton", lambda s: _num(s["by"].get("ninetoothed", {}).get("vs_triton"), ".2f")))
    if section == "fp8":  # against our own 16-bit forward of the same shape
        columns += [(f"{b} / our 16-bit", lambda s, b=b: _num(s["by"].get(b, {}).get("vs_16bit"), ".2f"))
                    for b in ("triton", "ninetoothed") if b in backends]
    if section == "decode":  # a decoding loop pays the host work of every call too
        columns += [(f"{b} wall µs", lambda s, b=b: _num(s["by"].get(b, {}).get("wall_us"), ".0f")) for b in backends]
    return columns


def _homework_table(rows, backends) -> list[str]:
    """The homework's shapes: GPU and wall µs per call of every backend."""
    shapes = _pivot(rows, "homework")
    if not shapes:
        return []
    out = ["## The homework's shapes (fp16), µs per call", "",
           "GPU: do_bench median. Wall: a plain Python loop of calls, host work included (what a user's loop pays).", ""]
    columns = [("B,H,L,D", lambda s: f"{s['B']},{s['H']},{s['Lq']},{s['D']}"), ("causal", lambda s: "yes" if s["causal"] else "no")]
    for b in backends:
        columns.append((f"{b} GPU", lambda s, b=b: _num(_us(s["by"].get(b)), ".1f")))
        columns.append((f"{b} wall", lambda s, b=b: _num(s["by"].get(b, {}).get("wall_us"), ".1f")))
    table_rows = [dict(next(iter(by.values())), by=by) for by in shapes.values()]
    return out + [_table(table_rows, columns), ""]


def markdown(rows, env, plots, notes: str, base: pathlib.Path = ROOT) -> str:
    """The report; ``base`` is the folder the plots' links are relative to (the report's own)."""
    backends = [b for b in ALL_BACKENDS if any(r["backend"] == b for r in rows)]
    out = _header(env, notes)
    sections = [
        ("throughput", "Throughput (B·L = 16384, H·D = 2048)"),
        ("decode", "Decode-like shapes (B = 8, 32 query heads over 8 K/V heads, D = 128)"),
        ("fp8", "FP8 (e4m3) inputs, forward: prefill at B·L = 16384, H·D = 2048 (query, keys, values in FP8, "
                "row-major values as given); decoding with a bfloat16 query over FP8 keys and values "
                "(bfloat16-fp8kv); SDPA's rows run the same shapes in bfloat16"),
    ]
    for section, title in sections:
        shapes = _pivot(rows, section)
        if not shapes:
            continue
        table_rows = [dict(next(iter(by.values())), by=by) for by in shapes.values()]
        out += [f"## {title}", "", _table(table_rows, _throughput_columns(section, backends)), ""]
    out += _homework_table(rows, backends)
    if plots:
        out += ["## Plots", ""] + [f"![{p.stem}]({pathlib.Path(os.path.relpath(p, base)).as_posix()})"
                                   for p in plots] + [""]
    return "\n".join(out)


def _us(r):
    return None if not r or "ms" not in r else r["ms"] * 1e3


def _load_results(path: str) -> dict:
    from common.tools.cli import CommandError

    try:
        data = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise CommandError(f"--from-json {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CommandError(f"--from-json {path}: not a readable results.json ({error})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or "environment" not in data:
        raise CommandError(f"--from-json {path}: not a results.json written by bench (no 'environment' and 'rows')")
    return data


def merge_results(parts: list[dict]) -> dict:
    """One results.json from several runs (e.g. one per GPU, or forward and backward apart):
    the rows of all, the first run's environment; a later run's date is kept as
    ``date_backward`` when all its rows are backward rows, else in ``later_runs`` with the
    sections it measured. A shape measured again keeps only the later run's rows, every
    backend's (a row's ratios compare it with rows of its own run)."""
    env = dict(parts[0]["environment"])
    rows = {}
    for part in parts:
        if part is not parts[0] and part["rows"]:
            if all(r.get("mode", "fwd") != "fwd" for r in part["rows"]):
                env["date_backward"] = part["environment"]["date"]
            else:
                sections = sorted({r["section"] for r in part["rows"]})
                env.setdefault("later_runs", []).append(dict(date=part["environment"]["date"], sections=sections))
        remeasured = {_shape_key(row) for row in part["rows"]}
        rows = {key: row for key, row in rows.items() if key[0] not in remeasured}
        for row in part["rows"]:
            rows[(_shape_key(row), row["backend"])] = row
    return dict(environment=env, rows=list(rows.values()))


def destinations(args) -> tuple[pathlib.Path, pathlib.Path | str | None]:
    """Where a run writes: (the folder of results and plots, the Markdown report: a path, "-" for
    stdout, None for none). Only --write names the committed benchmarks/ and BENCHMARKS.md."""
    from common.tools.cli import CommandError

    if args.write:
        if args.out != OUT_DEFAULT or args.markdown != "-":
            raise CommandError("--write names the committed benchmarks/ and BENCHMARKS.md: leave out --out and "
                               "--markdown")
        return ROOT / "benchmarks", ROOT / "BENCHMARKS.md"
    report = None if args.markdown == "" else "-" if args.markdown == "-" else pathlib.Path(args.markdown)
    return pathlib.Path(args.out), report


def _write_report(rows, env, plots, report: pathlib.Path | str | None) -> None:
    """The Markdown report (with benchmarks/NOTES.md) to ``report``: a file, "-" for stdout, None for none."""
    if report is None:
        return
    notes_path = ROOT / "benchmarks" / "NOTES.md"
    notes = notes_path.read_text() if notes_path.exists() else ""
    if report == "-":
        sys.stdout.write(markdown(rows, env, plots, notes, base=pathlib.Path.cwd()))
        return
    report.write_text(markdown(rows, env, plots, notes, base=report.resolve().parent))
    print(f"wrote {report}", file=sys.stderr)


def report(args) -> int:
    """Rebuild results.json/csv (merged), the plots and the report from one or more results.json, measuring
    nothing (no GPU needed)."""
    from common.tools.cli import require

    out_dir, report_to = destinations(args)
    data = merge_results([_load_results(path) for path in args.from_json])
    require("matplotlib", "bench", "bench")
    # results.json and results.csv again (the merged rows, when several runs were given), then the plots
    plots = write_outputs(data["rows"], data["environment"], out_dir)
    _write_report(data["rows"], data["environment"], plots, report_to)
    print(f"wrote {out_dir}/results.json, results.csv and {len(plots)} plots from {', '.join(args.from_json)}",
          file=sys.stderr)
    return 0


def main(args) -> int:
    if args.from_json:
        return report(args)
    from common.tools.cli import CommandError, require

    if not torch.cuda.is_available():
        raise CommandError("bench needs a CUDA GPU; this machine has none (the CPU interpreter measures nothing "
                           "useful; --from-json rebuilds a report without one)")
    require("matplotlib", "bench", "bench")
    out_dir, report_to = destinations(args)
    env = environment()
    print(f"{env['gpu']}: torch {env['torch']}, triton {env['triton']}, ninetoothed {env['ninetoothed']}", flush=True)
    jobs = plan(args)
    rows = []
    for i, job in enumerate(jobs):
        section, B, H, H_kv, Lq, Lk, D, dtype, is_causal, wall, mode = job
        for backend in args.backends:
            row = measure(section, backend, B, H, H_kv, Lq, Lk, D, dtype, is_causal, wall=wall, mode=mode)
            rows.append(row)
        _add_ratios(rows)
        for row in rows[-len(args.backends):]:
            _print_row(row)
        print(f"[{i + 1}/{len(jobs)}]", flush=True)
        # what is measured so far, should the run be cut short (write_outputs rewrites it whole)
        write_results(rows, env, out_dir)
    plots = write_outputs(rows, env, out_dir)
    wrong = [r for r in rows if r.get("status", "ok") != "ok"]
    print(f"wrote {out_dir}/results.json, results.csv and {len(plots)} plots; {len(wrong)} problem rows", flush=True)
    _write_report(rows, env, plots, report_to)
    return 1 if any(r["status"].startswith("WRONG") for r in wrong) else 0


DESCRIPTION = """\
The two kernels side by side with SDPA, on a GPU: throughput (forward, backward or both;
B*L = 16k tokens, H*D = 2048), the homework's four small fp16 shapes (those of the original
assignment's test, tests/test_seed.py; GPU and wall time per call), decode-like shapes and FP8
inputs (prefill and decoding, against SDPA in bfloat16 and our own 16-bit rows). Every result
is checked before it is timed (against SDPA; FP8 against float64 of the dequantized inputs). Writes
results.json, results.csv and plots into --out and prints the Markdown report (or writes it
to --markdown PATH); it rewrites the committed benchmarks/ and BENCHMARKS.md only with
--write. With --from-json it measures nothing and rebuilds the report from an earlier
results.json (no GPU needed; several files are merged). Plots need matplotlib:
pip install -e '.[bench]'.
"""


def add_arguments(parser):
    parser.add_argument("--sections", nargs="+", default=["throughput", "homework", "decode", "fp8"],
                        choices=["throughput", "homework", "decode", "fp8"], help="which parts of the benchmark to run")
    parser.add_argument("--backends", nargs="+", default=list(ALL_BACKENDS), choices=list(ALL_BACKENDS),
                        help="'torch' is SDPA's default, 'sdpa-flash' SDPA forced onto FlashAttention-2")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"],
                        help="input dtypes of the throughput section (the decode section uses the first)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], help="head dims of the throughput section")
    parser.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS),
                        help="sequence lengths L of the throughput section (B = 16384 / L)")
    parser.add_argument("--masking", nargs="+", default=["full", "causal"], choices=["full", "causal"],
                        help="the throughput section's shapes without a mask, causal, or both")
    parser.add_argument("--modes", nargs="+", default=["fwd"], choices=list(MODE_FLOPS),
                        help="what the throughput section times: forward, backward (autograd, after one "
                             "forward), or both; TFLOP/s counts 1, 2.5 and 3.5 forwards")
    parser.add_argument("--out", default=OUT_DEFAULT, help="folder for results.json/csv and plots")
    parser.add_argument("--markdown", default="-", metavar="PATH",
                        help="where the Markdown report goes: '-' for stdout, '' for none, or a file")
    parser.add_argument("--write", action="store_true",
                        help="regenerate the committed report: results and plots into the repository's benchmarks/, "
                             "the report into BENCHMARKS.md (without --out and --markdown)")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="RESULTS_JSON",
                        help="measure nothing: rebuild the report and plots from earlier results.json files "
                             "(several: their rows merged, e.g. runs on two GPUs)")
