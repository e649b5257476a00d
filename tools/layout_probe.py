"""Memory layouts against head dims, each case in a process of its own (an illegal access ends the
process's CUDA context, not the probe): forward and backward checked against float64 SDPA.

    python tools/layout_probe.py [--sanitize] [--jobs 6] [--backends triton ninetoothed] [CASE ...]

A case names its head dims, lengths, causal flag and each tensor's layout: ``c`` contiguous,
``t`` a view of a (B, L, H, D) buffer, ``m`` contiguous but one element off 16-byte alignment,
``tm`` both. The layouts of query, key, value and the output's gradient are given in that
order. ``paged_`` cases run paged_attention over caches whose rows are off 16-element units
(PAGED_CASES). Small head dims (16-wide tiles) are where the compiled code differs most between these
layouts: a row-by-row load into registers and a 32-byte-swizzled shared tile instead of
asynchronous copies. ``--sanitize``: each case under compute-sanitizer's memcheck too.
Prints one line a case and backend: ok, refused (the backend does not take the head dim),
wrong (the check's message) or died (the exit code and the last lines).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys

import torch

sys.path.insert(0, ".")

# name: (D, Dv, Lq, Lk, causal, layouts of q, k, v, grad_out[, dtype]); float16 unless named
CASES = {
    "d16_contiguous": (16, 16, 148, 148, True, "c c c c"),
    "d16_misaligned_values": (16, 16, 40, 40, False, "c c m c"),
    "d16_misaligned_values_causal": (16, 16, 148, 148, True, "c c m c"),
    "d64_dv16_misaligned_values": (64, 16, 40, 40, False, "c c m c"),
    "d16_misaligned_all": (16, 16, 40, 40, False, "m m m m"),
    "d16_misaligned_all_causal": (16, 16, 148, 148, True, "m m m m"),
    "d16_transposed": (16, 16, 40, 40, False, "t t t t"),
    "d16_transposed_misaligned": (16, 16, 148, 148, True, "tm tm tm tm"),
    "d24_dv16_transposed_misaligned": (24, 16, 40, 40, False, "tm tm tm tm"),
    "d32_misaligned_all": (32, 32, 148, 148, True, "m m m m"),
    "d64_misaligned_all": (64, 64, 148, 148, False, "m m m m"),
    "d24_misaligned_all": (24, 24, 40, 40, False, "m m m m"),
    # value head dims under the query's (a narrower value tile) in each layout
    "d24_dv16_contiguous": (24, 16, 40, 40, False, "c c c c"),
    "d24_dv16_misaligned_all": (24, 16, 40, 40, False, "m m m m"),
    "d24_dv16_misaligned_values": (24, 16, 40, 40, False, "c c m c"),
    "d24_dv16_misaligned_qk": (24, 16, 40, 40, False, "m m c c"),
    "d24_dv16_transposed": (24, 16, 40, 40, False, "t t t t"),
    "d128_dv32_misaligned_all": (128, 32, 235, 238, True, "m m m m", "bfloat16"),
    "d128_dv32_misaligned_values": (128, 32, 235, 238, True, "c c m c", "bfloat16"),
    "d128_dv32_misaligned_qk": (128, 32, 235, 238, True, "m m c c", "bfloat16"),
    "d128_dv32_contiguous": (128, 32, 235, 238, True, "c c c c", "bfloat16"),
    "d40_dv24_contiguous": (40, 24, 300, 300, False, "c c c c", "bfloat16"),
    "d40_dv24_transposed": (40, 24, 300, 300, False, "t t t t", "bfloat16"),
    "d64_dv32_misaligned_all": (64, 32, 148, 148, False, "m m m m"),
    "d32_dv64_misaligned_all": (32, 64, 148, 148, False, "m m m m"),
    # head dims under 16 (refused where the backend takes 16 and up)
    "dv1_transposed": (24, 1, 40, 40, False, "t t t t"),
    "dv8_transposed_causal": (24, 8, 148, 14, True, "t t t t"),
    "d8_misaligned_all": (8, 8, 40, 40, False, "m m m m"),
}

# paged_attention (forward only): name: (D, Dv, page, H_kv, the query's layout, value pages "rows" or
# "columns"); float16, caches (num_pages, page, H_kv, D | Dv) with rows of D * H_kv elements (off
# 16-element units where that product is)
PAGED_CASES = {
    "paged_d40_dv24_rows": (40, 24, 16, 1, "c", "rows"),
    "paged_d40_dv24_misaligned_query": (40, 24, 16, 1, "m", "rows"),
    "paged_d24_dv16_misaligned_query": (24, 16, 32, 1, "m", "rows"),
    "paged_d64_dv32_misaligned_query": (64, 32, 16, 2, "m", "rows"),
    "paged_d64_dv32_columns": (64, 32, 16, 2, "c", "columns"),
    "paged_d40_dv24_columns_page3": (40, 24, 3, 1, "m", "columns"),
}
CASES.update(PAGED_CASES)


def _tensor(layout, shape, dtype, device):
    """A (B, H, L, D) tensor in ``layout`` (see the module's docstring), standard normal."""
    B, H, L, D = shape
    transposed = "t" in layout
    full = (B, L, H, D) if transposed else shape
    n = B * H * L * D
    offset = 1 if "m" in layout else 0
    t = torch.randn(n + offset, dtype=dtype, device=device)[offset:].view(full)
    if offset:
        assert t.data_ptr() % 16 != 0
    return t.transpose(1, 2) if transposed else t


def run_paged(name, backend):
    """A PAGED_CASES case in this process, against float64 attention of each sequence's keys."""
    from common import paged_attention
    from tests.conftest import DEVICE
    from tests.test_paged import _cache, _reference

    D, Dv, page, H_kv, layout, values = PAGED_CASES[name]
    torch.manual_seed(0)
    lens, H = [300, 77, 0, 161], 4 * H_kv
    key_cache, value_cache, table, seqlens, keys, vals = _cache(lens, H_kv, D, Dv, page, torch.float16)
    if values == "columns":  # each value page stored (H_kv, Dv, page)
        value_cache = value_cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    query = _tensor(layout, (len(lens), H, 2, D), torch.float16, DEVICE)
    try:
        out = paged_attention(query, key_cache, value_cache, table, seqlens, True, enable_gqa=True,
                              backend=backend)
    except ValueError as error:
        print(f"refused: {error}")
        return 0
    try:
        torch.testing.assert_close(out.double(), _reference(query, keys, vals, True), rtol=1e-2, atol=1e-2)
    except AssertionError as error:
        print(f"wrong: {' '.join(str(error).split())[:300]}")
        return 1
    print("ok")
    return 0


def run_one(name, backend):
    """The case in this process: prints ok, refused or wrong; an illegal access ends it."""
    if name in PAGED_CASES:
        return run_paged(name, backend)
    from common import attention
    from tests.cases import check_grads, check_output
    from tests.conftest import DEVICE  # (and the interpreter, without a GPU)

    D, Dv, Lq, Lk, causal, layouts, *dtype = CASES[name]
    lq, lk, lv, lg = layouts.split()
    torch.manual_seed(0)
    B, H, dtype, device = 2, 2, getattr(torch, dtype[0] if dtype else "float16"), DEVICE
    q = _tensor(lq, (B, H, Lq, D), dtype, device).requires_grad_()
    k = _tensor(lk, (B, H, Lk, D), dtype, device).requires_grad_()
    v = _tensor(lv, (B, H, Lk, Dv), dtype, device).requires_grad_()
    try:
        out = attention(q, k, v, is_causal=causal, backend=backend)
    except ValueError as error:
        print(f"refused: {error}")
        return 0
    try:
        check_output(out, q, k, v, is_causal=causal)
        grad_out = _tensor(lg, tuple(out.shape), dtype, device)
        out.backward(grad_out)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        check_grads((q.grad, k.grad, v.grad), q, k, v, grad_out, out=out, is_causal=causal)
    except AssertionError as error:
        print(f"wrong: {str(error).splitlines()[0]}")
        return 1
    print("ok")
    return 0


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--backends", nargs="+", default=["triton", "ninetoothed"])
    parser.add_argument("--sanitize", action="store_true")
    parser.add_argument("--jobs", type=int, default=6, help="cases run at once")
    parser.add_argument("--one", nargs=2, metavar=("CASE", "BACKEND"))
    args = parser.parse_args(argv)
    if args.one:
        return run_one(*args.one)
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")

    def run(name, backend):
        command = [sys.executable, __file__, "--one", name, backend]
        if args.sanitize:
            command = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", *command]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        verdict = next((line for line in lines if line.startswith(("ok", "refused", "wrong"))), None)
        if done.returncode != 0 or verdict is None:
            verdict = f"died (rc {done.returncode}): " + " | ".join(lines[-4:])
        return f"{name:32s} {backend:12s} {CASES[name]} {verdict[:400]}", verdict.startswith(("ok", "refused"))

    failures = 0
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(run, name, backend) for name in args.cases for backend in args.backends]
        for future in runs:  # (in the cases' order)
            line, passed = future.result()
            failures += not passed
            print(line, flush=True)
    print(f"layout probe: {failures} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
