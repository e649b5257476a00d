"""``demo``: both kernels and SDPA on the homework's shapes, in one table.

The homework is the original assignment: ``attention(query, key, value, is_causal=False, scale=None)``
in Triton, matching SDPA in float16 within rtol = atol = 1e-2 on the four shapes below; its test is
tests/test_seed.py.
"""

from __future__ import annotations

import time

import torch

HOMEWORK_SHAPES = [(2, 4, 16, 32), (4, 8, 64, 64), (1, 16, 128, 128), (2, 4, 1024, 64)]
BACKENDS = ("triton", "ninetoothed", "torch")


def run(device: str, scales=(1.0, None), seed: int = 0) -> list[dict]:
    from common import attention
    from common.reference import reference
    from common.tools.timing import gpu_time_ms, wall_time_us

    rows = []
    torch.manual_seed(seed)
    for B, H, L, D in HOMEWORK_SHAPES:
        q, k, v = (torch.randn(B, H, L, D, dtype=torch.float16, device=device) for _ in range(3))
        for is_causal in (False, True):
            for scale in scales:
                expected = reference(q, k, v, is_causal=is_causal, scale=scale, dtype=torch.float32)
                for backend in BACKENDS:
                    start = time.perf_counter()
                    out = attention(q, k, v, is_causal=is_causal, scale=scale, backend=backend)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    first_s = time.perf_counter() - start
                    error = (out.float() - expected).abs().max().item()
                    row = dict(
                        shape=f"({B},{H},{L},{D})", causal=is_causal, scale=scale, backend=backend,
                        error=error, ok=bool(torch.allclose(out.float(), expected, rtol=1e-2, atol=1e-2)),
                        first_call_s=first_s,
                    )
                    if device == "cuda":
                        fn = lambda: attention(q, k, v, is_causal=is_causal, scale=scale, backend=backend)  # noqa: E731
                        row["gpu_us"] = gpu_time_ms(fn) * 1e3
                        row["wall_us"] = wall_time_us(fn)
                    rows.append(row)
                    print(_format_row(row), flush=True)
    return rows


HEADER = f"{'shape':<16} {'causal':<6} {'scale':<5} {'backend':<12} {'max|err|':>9} {'ok':<4} {'first call':>10}"


def _format_row(row) -> str:
    scale = "None" if row["scale"] is None else f"{row['scale']:g}"
    text = (
        f"{row['shape']:<16} {str(row['causal']):<6} {scale:<5} {row['backend']:<12} "
        f"{row['error']:9.2e} {'PASS' if row['ok'] else 'FAIL':<4} {row['first_call_s']:9.2f}s"
    )
    if "gpu_us" in row:
        text += f" {row['gpu_us']:9.1f} {row['wall_us']:9.1f}"
    return text


DESCRIPTION = """\
The homework (the original assignment): implement attention(query, key, value,
is_causal=False, scale=None) in Triton so that it matches torch's SDPA in float16 within
rtol = atol = 1e-2 on four shapes (B, H, L, D): (2, 4, 16, 32), (4, 8, 64, 64),
(1, 16, 128, 128), (2, 4, 1024, 64). Its test is tests/test_seed.py.

The demo runs both kernels (Triton, NineToothed) and SDPA itself on those shapes (fp16;
causal or not; scale 1.0 or the default) and prints, per call: the error against SDPA
computed in float32, PASS/FAIL by that criterion (allclose, rtol = atol = 1e-2), the first
call's time (compilation included) and, on a GPU, the time per call. Without a GPU it runs
on the CPU under Triton's interpreter.
"""


def add_arguments(parser):
    """The demo takes no options."""


def main(args) -> int:
    from common.interpret import use_interpreter_if_no_gpu

    interpreted = use_interpreter_if_no_gpu()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if interpreted:
        print(
            "No CUDA device: running on the CPU under Triton's interpreter (TRITON_INTERPRET=1).\n"
            "Times are the interpreter's, not a GPU's; to stay near a minute the demo runs\n"
            "scale=None only here (the test suite covers scale=1.0 on the CPU too).\n"
        )
    print(
        "The homework: attention(query, key, value, is_causal=False, scale=None) matching torch's SDPA\n"
        "in float16 within rtol = atol = 1e-2 on four shapes (its test: tests/test_seed.py). Each row is\n"
        "one call of one backend on one of those shapes; 'torch' is SDPA itself.\n"
    )
    header = HEADER + (f" {'GPU µs':>9} {'wall µs':>9}" if device == "cuda" else "")
    print(header)
    print("-" * len(header))
    rows = run(device, scales=(None,) if interpreted else (1.0, None))
    failed = [r for r in rows if not r["ok"]]
    print(
        "\nmax|err|: against SDPA computed in float32 on the same inputs; ok: allclose(rtol=atol=1e-2), "
        "the homework's criterion. first call: includes compiling."
        + ("\nGPU µs: do_bench median; wall µs: per call in a Python loop, host work included." if device == "cuda" else "")
    )
    print(f"{len(rows) - len(failed)}/{len(rows)} passed")
    return 1 if failed else 0
