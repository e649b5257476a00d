"""Compile the Gluon Hopper forward for sm_90 on a machine without a GPU, and say what it became.

    python tools/gluon_sass.py [--dims 64 128 256] [--dtype bfloat16] [--causal] [--specialized | --pingpong
        [--persistent]] [--pv-order] [--config BLOCK_M BLOCK_N STAGES WARPS] [--out DIR]

Gluon kernels do not run under Triton's interpreter; compiling them for a named target needs no
GPU (Triton ships ptxas and the disassembler), so on a CPU this checks that the kernel builds with
the installed Triton and reads what the H200 would run: registers, stack (spills), shared memory,
and the tensor-core, TMA (loads, and the output's store) and wait instructions
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``: the loop waits for S of a tile while P V of the one before is
still in flight, FlashAttention-3's overlap). One
line per head dim: ``D=<d> REG=<n> STACK=<n> SMEM=<n> HGMMA=<n> QGMMA=<n> UTMALDG=<n> UTMASTG=<n>
OVERLAP=<0|1> KEY_LOOP_LOCAL=<n> KEY_LOOP=<n> KEY_LOOP_SHFL=<n>`` (QGMMA: the FP8 warp-group MMAs;
KEY_LOOP_LOCAL: the spill loads and stores inside the key loop; KEY_LOOP: its instructions a step,
KEY_LOOP_SHFL the shuffles among them).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpu_sass import disassemble, mma_loops  # noqa: E402

from common.interpret import _StandInDriver  # noqa: E402
from common.launch import COMPILE_OPTIONS  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float8_e4m3fn"],
                        help="the inputs' dtype (float8_e4m3fn: ping-pong only, the values column-major, bf16 out)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--specialized", action="store_true", help="the variant with a producer warp")
    parser.add_argument("--pingpong", action="store_true",
                        help="the variant with two consumer warp groups in ping-pong and a producer warp")
    parser.add_argument("--persistent", action="store_true",
                        help="with --pingpong: persistent programs, one an SM (an H200's 132)")
    parser.add_argument("--pv-order", action="store_true",
                        help="with --dtype float8_e4m3fn: values in the P·V order (common.plan.Widen.PV_ORDER)")
    parser.add_argument("--backward", action="store_true",
                        help="the Gluon backward's two passes (impl_triton.gluon_backward) instead of the forward")
    parser.add_argument("--dkdv-overlap", type=int, choices=[0, 1],
                        help="with --backward: the dK/dV pass with the overlap (row tiles of 32, four stages) or without "
                        "(row tiles of 64, two stages) instead of gluon_backward.tiles'")
    parser.add_argument("--config", nargs=4, type=int, metavar=("BLOCK_M", "BLOCK_N", "STAGES", "WARPS"),
                        help="a tile instead of gluon_attention.tile's")
    parser.add_argument("--out", default="/tmp/gluon_sass", help="where the TTGIR, PTX and SASS go")
    args = parser.parse_args(argv)

    class TargetDriver(_StandInDriver):
        backend = "cuda"

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(TargetDriver())
    import impl_triton.gluon_attention as ga

    out_dir = pathlib.Path(args.out)
    dtype = getattr(torch, args.dtype)
    if args.backward:
        return _backward(args, out_dir, dtype)
    fp8 = dtype == torch.float8_e4m3fn
    if fp8 and not args.pingpong:
        parser.error("--dtype float8_e4m3fn takes --pingpong (the Gluon forward's FP8 variant)")
    if args.pv_order and not fp8:
        parser.error("--pv-order takes --dtype float8_e4m3fn (an order of FP8 values)")
    if args.persistent and not args.pingpong:
        parser.error("--persistent takes --pingpong (the ping-pong variant's persistent programs)")
    for D in args.dims:
        if fp8 and D not in ga.FP8_HEAD_DIMS:
            continue
        L = 1024 if fp8 else 1000  # (FP8 column-major values: TMA asks 16-byte rows of keys)
        q = torch.randn(2, 8, L, D).to(dtype)
        k = torch.randn(2, 2, L, D).to(dtype)
        v = torch.randn(2, 2, D, L).to(dtype).transpose(2, 3) if fp8 else torch.randn(2, 2, L, D, dtype=dtype)
        out, lse = torch.empty(2, 8, L, D, dtype=torch.bfloat16 if fp8 else dtype), torch.empty(2, 8, L)
        descales = (torch.ones(2, 2),) * 3 if fp8 else None
        variant = dict(pingpong=True) if args.pingpong else dict(specialized=True) if args.specialized else {}
        if args.persistent:
            variant["persistent"] = True
            ga._sm_count = lambda device: 132  # (an H200's; a CPU has none to ask)
        fn, _, launch_args, meta = ga._launch(q, k, v, out, lse, 0.125, 0 if args.causal else None, True,
                                              config=tuple(args.config) if args.config else None, descales=descales,
                                              pv_order=args.pv_order, **variant)
        kernel = fn.warmup(*launch_args, grid=(1,), **meta)
        sass, usage = disassemble(kernel, out_dir, f"gluon_fwd_d{D}")
        regs, stack = (int(re.search(rf"{name}:(\d+)", usage).group(1)) for name in ("REG", "STACK"))
        overlap = int(bool(re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)))
        # the key loop: the shortest loop holding both products, S (A in shared memory) and P V (A in
        # registers): a persistent program's row-block loop holds it, and a wait loop may span one product
        _, steps, opcodes = min(mma_loops(sass, top=None, both_operands=True), key=lambda loop: loop[1])
        key_loop = dict(opcodes)
        print(f"D={D} REG={regs} STACK={stack} SMEM={kernel.metadata.shared} "
              f"HGMMA={len(re.findall(r'HGMMA', sass))} QGMMA={len(re.findall(r'QGMMA', sass))} "
              f"UTMALDG={len(re.findall(r'UTMALDG', sass))} UTMASTG={len(re.findall(r'UTMASTG', sass))} "
              f"OVERLAP={overlap} KEY_LOOP_LOCAL={key_loop.get('LDL', 0) + key_loop.get('STL', 0)} "
              f"KEY_LOOP={steps} KEY_LOOP_SHFL={key_loop.get('SHFL', 0)}", flush=True)
    return 0


def _backward(args, out_dir, dtype) -> int:
    """The backward's dQ and dK/dV passes and its one pass at each head dim it takes: one line a kernel,
    ``pass=<dq|dkdv|fused|fused_tma>[_first] D=<d> REG= STACK= SMEM= HGMMA= UTMALDG= UTMASTG= UTMAREDG=
    OVERLAP=`` (fused_tma: dQ by the bulk reduce-add, UTMAREDG, where the installed Triton has it; _first: dK's
    product issued after dQ's, DQ_FIRST; fused_ws, there too: the one pass with a loader warp and a dQ warp;
    fused_ws_stats: that one with its row tiles' stats read from shared memory, STATS_SMEM)."""
    import impl_triton.gluon_backward as gb
    from impl_triton.gluon_attention import descriptor

    for D in (d for d in args.dims if d in gb.HEAD_DIMS):
        q, o, do = (torch.randn(2, 8, 1000, D, dtype=dtype) for _ in range(3))
        k, v = (torch.randn(2, 2, 1000, D, dtype=dtype) for _ in range(2))
        lse, delta = torch.empty(2, 8, 1000), torch.empty(16, 1000)
        (bm1, bn1, s1, w1), (bm2, bn2, s2, w2, overlap) = gb.tiles(D)
        if args.dkdv_overlap is not None:  # (the overlap's own tile: row tiles of 32, four stages)
            bm2, s2, overlap = (32, 4, True) if args.dkdv_overlap else (64, 2, False)
        dq_kernel = gb._gluon_bwd_dq.warmup(
            descriptor(q, bm1), descriptor(k, bn1), descriptor(v, bn1), descriptor(do, bm1), descriptor(q, bm1),
            o, lse, lse, delta, *o.stride()[:3], *lse.stride(), *lse.stride(), 0.125, 8, 4, 1000, 1000, 0,
            BLOCK_M=bm1, BLOCK_N=bn1, HEAD_DIM=D, STAGES=s1, IS_CAUSAL=args.causal, WITH_DLSE=False,
            num_warps=w1, grid=(1,), **COMPILE_OPTIONS)
        dkdv_kernel = gb._gluon_bwd_dkdv.warmup(
            descriptor(q, bm2), descriptor(k, bn2), descriptor(v, bn2), descriptor(do, bm2), descriptor(k, bn2),
            descriptor(v, bn2), lse, delta, *lse.stride(), 0.125, 2, 4, 1000, 1000, 0,
            BLOCK_M=bm2, BLOCK_N=bn2, HEAD_DIM=D, STAGES=s2, IS_CAUSAL=args.causal, OVERLAP=overlap, num_warps=w2,
            grid=(1,), **COMPILE_OPTIONS)
        bm3, bn3, s3, w3, dq_t = gb.fused_tile(D)
        dq_sum = lse.new_empty(2, 8, 1000, D)
        # (dQ added by atomics; and, where the installed Triton has it, by the bulk reduce-add; each with dK's
        # product issued before dQ's and after it, _first)
        fused = []
        for dq_tma, dq_first in [(tma, first) for tma in ((False, True) if gb.bulk_reduce_add() else (False,))
                                 for first in (False, True)]:
            name = "fused" + ("_tma" if dq_tma else "") + ("_first" if dq_first else "")
            fused.append((name, gb._gluon_bwd_fused.warmup(
                descriptor(q, bm3), descriptor(k, bn3), descriptor(v, bn3), descriptor(do, bm3), descriptor(k, bn3),
                descriptor(v, bn3), dq_sum, descriptor(dq_sum if dq_tma else q, bm3), lse, delta, *q.stride()[:3],
                *lse.stride(), 0.125, 2, 4, 1000, 1000, 0, BLOCK_M=bm3, BLOCK_N=bn3, HEAD_DIM=D, STAGES=s3,
                IS_CAUSAL=args.causal, DQ_T=dq_t, DQ_TMA=dq_tma, DQ_FIRST=dq_first, num_warps=w3, grid=(1,), **COMPILE_OPTIONS)))
        if gb.bulk_reduce_add():  # (FlashAttention-3's warp roles: a loader warp, a dQ warp, the consumers; its tile;
            # _stats: each row tile's m2 and delta read from shared memory where used)
            bm4, bn4, s4, w4, dq_t4 = gb.ws_tile(D)
            for suffix, stats_smem in (("", False), ("_stats", True)):
                fused.append(("fused_ws" + suffix, gb._gluon_bwd_ws.warmup(
                    descriptor(q, bm4), descriptor(k, bn4), descriptor(v, bn4), descriptor(do, bm4), descriptor(k, bn4),
                    descriptor(v, bn4), descriptor(dq_sum, bm4), lse, delta, *lse.stride(), 0.125, 2, 4, 1000, 1000, 0,
                    BLOCK_M=bm4, BLOCK_N=bn4, HEAD_DIM=D, STAGES=s4, IS_CAUSAL=args.causal, DQ_T=dq_t4, num_warps=w4,
                    STATS_SMEM=stats_smem, grid=(1,), **COMPILE_OPTIONS)))
        for name, kernel in (("dq", dq_kernel), ("dkdv", dkdv_kernel), *fused):
            sass, usage = disassemble(kernel, out_dir, f"gluon_bwd_{name}_d{D}")
            regs, stack = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "STACK"))
            overlap = int(bool(re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)))
            print(f"pass={name} D={D} REG={regs} STACK={stack} SMEM={kernel.metadata.shared} "
                  f"HGMMA={len(re.findall(r'HGMMA', sass))} UTMALDG={len(re.findall(r'UTMALDG', sass))} "
                  f"UTMASTG={len(re.findall(r'UTMASTG', sass))} UTMAREDG={len(re.findall(r'UTMAREDG', sass))} "
                  f"OVERLAP={overlap}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
