"""A small kernel for the two-width fault (benchmarks/NOTES.md, "Query/key and value tiles of two widths
loaded element by element go wrong on sm_90"): ``acc = sum over key blocks of (q k^T) v``, with no softmax,
its query/key tiles BD wide and its value tiles BDV wide, every input read through its strides with masks
past the head dims, in a pipelined loop as the attention kernels' (``common.plan.tile_widths`` keeps those
kernels off the failing case; this kernel has no such rule).

    python tools/two_widths.py                 # on a GPU: each case against torch, ok or wrong
    python tools/two_widths.py --compile-only  # on a CPU: each case compiled for sm_90 (the installed
                                               # Triton), its shared and register layouts printed
    TRITON_INTERPRET=1 python tools/two_widths.py  # on a CPU: the kernel itself checked (all ok)

A case: (D, Dv, layout, BLOCK_M, BLOCK_N), layout "aligned" (contiguous: rows of D or Dv elements, read in
16-byte pieces only where that is a multiple of 8) or "misaligned" (every input one element past a 16-byte
boundary: its rows read element by element). Where the attention kernels went wrong (D 24 / Dv 16 and
D 128 / Dv 32 misaligned, triton 3.6 on an H100), the compiled kernel kept the two tiles in two register
layouts and two shared swizzles; with one width, or aligned inputs, one of each.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

if "--compile-only" in sys.argv:  # (compile for the GPU, never interpret)
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (D, Dv, layout, BLOCK_M, BLOCK_N): rows of 64 take the warp-group MMA on sm_90 (the dense forward's
# failing D 24 / Dv 16 tile was 64 x 128), rows of 16 the older MMA (the paged decode's)
CASES = [(24, 16, "aligned", 64, 128), (24, 16, "misaligned", 64, 128), (32, 32, "misaligned", 64, 128),
         (128, 32, "aligned", 64, 64), (128, 32, "misaligned", 64, 64), (128, 128, "misaligned", 64, 64),
         (64, 16, "misaligned", 64, 128), (40, 24, "aligned", 16, 64), (40, 24, "misaligned", 16, 64),
         (32, 32, "misaligned", 16, 64)]


@triton.jit
def _two_widths(Q, K, V, OUT, stride_qm, stride_kn, stride_vn, stride_om, Lq, Lk,
                D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D), other=0.0)
    acc = tl.zeros([BLOCK_M, BDV], dtype=tl.float32)
    for start_n in tl.range(0, Lk, BLOCK_N, num_stages=3):
        keys = start_n + offs_n
        k = tl.load(K + keys[:, None] * stride_kn + offs_d[None, :],
                    mask=(keys[:, None] < Lk) & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + keys[:, None] * stride_vn + offs_dv[None, :],
                    mask=(keys[:, None] < Lk) & (offs_dv[None, :] < DV), other=0.0)
        qk = tl.dot(q, tl.trans(k))
        acc = tl.dot(qk.to(v.dtype), v, acc)
    tl.store(OUT + offs_m[:, None] * stride_om + offs_dv[None, :], acc,
             mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < DV))


def _inputs(D, Dv, layout, device, L=300):
    """q (L, D), k (L, D), v (L, Dv) float16, small values (the scores stay in float16's range)."""
    offset = 1 if layout == "misaligned" else 0

    def tensor(width):
        t = (torch.randn(L * width + offset, device=device) * 0.25).to(torch.float16)
        return t[offset:].view(L, width)

    return tensor(D), tensor(D), tensor(Dv)


def _launch(q, k, v, out, D, Dv, block_m, block_n, warmup=False):
    BD, BDV = max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(Dv))
    arguments = (q, k, v, out, q.stride(0), k.stride(0), v.stride(0), out.stride(0), q.shape[0], k.shape[0])
    constants = dict(D=D, DV=Dv, BD=BD, BDV=BDV, BLOCK_M=block_m, BLOCK_N=block_n)
    grid = (triton.cdiv(q.shape[0], block_m),)
    if warmup:
        return _two_widths.warmup(*arguments, **constants, grid=grid, num_warps=4, num_stages=3)
    _two_widths[grid](*arguments, **constants, num_warps=4, num_stages=3)
    return None


def compile_only(capability: int) -> int:
    """Compile each case for ``capability`` with a stand-in driver (no GPU) and print its layouts."""
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common.interpret import _StandInDriver

    class TargetDriver(_StandInDriver):
        backend = "cuda"

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(TargetDriver())
    for D, Dv, layout, block_m, block_n in CASES:
        q, k, v = _inputs(D, Dv, layout, "cpu")
        out = torch.empty(q.shape[0], Dv, dtype=torch.float32)
        kernel = _launch(q, k, v, out, D, Dv, block_m, block_n, warmup=True)
        ttgir = kernel.asm["ttgir"]
        shared = sorted(set(re.findall(r"#ttg\.swizzled_shared<\{[^}]*\}>|#ttg\.nvmma_shared<\{[^}]*\}>", ttgir)))
        blocked = sorted(set(re.findall(r"#ttg\.blocked<\{[^}]*\}>", ttgir)))
        mma = sorted(set(re.findall(r"versionMajor = (\d)", ttgir)))
        print(f"D {D:3d} Dv {Dv:3d} {layout:10s} {block_m:3d} x {block_n:3d}: MMA v{'/'.join(mma)}, {len(shared)} "
              f"shared layout(s), {len(blocked)} blocked; async copies {ttgir.count('async_copy_global_to_local')}")
        for text in shared:
            print("    ", text)
    return 0


def run_case(index: int) -> int:
    """CASES[index] on the GPU against torch: prints ok or WRONG (an illegal access ends the process).
    Without a GPU, under Triton's interpreter (TRITON_INTERPRET=1), on the CPU: the kernel's own check."""
    D, Dv, layout, block_m, block_n = CASES[index]
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = _inputs(D, Dv, layout, device)
    out = torch.full((q.shape[0], Dv), float("nan"), dtype=torch.float32, device=device)
    _launch(q, k, v, out, D, Dv, block_m, block_n)
    expected = (q.float() @ k.float().T).half().float() @ v.float()
    error = (out - expected).abs().max().item()
    bound = 2e-2 * max(1.0, expected.abs().max().item())
    print(f"{'ok' if error <= bound else 'WRONG'} (error {error:.3g}, bound {bound:.3g})", flush=True)
    return 0 if error <= bound else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--capability", type=int, default=90)
    parser.add_argument("--one", type=int, metavar="INDEX", help="run CASES[INDEX] in this process")
    args = parser.parse_args(argv)
    if args.compile_only:
        return compile_only(args.capability)
    if args.one is not None:
        return run_case(args.one)
    failures = 0
    for index, (D, Dv, layout, block_m, block_n) in enumerate(CASES):  # (a process each: see run_case)
        done = subprocess.run([sys.executable, __file__, "--one", str(index)], capture_output=True, text=True,
                              env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        verdict = next((line for line in lines if line.startswith(("ok", "WRONG"))), None)
        if verdict is None or done.returncode not in (0, 1):
            verdict = f"died (rc {done.returncode}): " + " | ".join(lines[-3:])
        failures += not verdict.startswith("ok")
        print(f"D {D:3d} Dv {Dv:3d} {layout:10s} {block_m:3d} x {block_n:3d}: {verdict[:300]}", flush=True)
    print(f"two widths: {failures} wrong or died")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
