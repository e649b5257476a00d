"""Compile a call's kernels for a GPU on a machine without one, and say what they became.

Triton compiles for a named target with no GPU present (its ptxas and disassembler ship in
its package), so registers, spills, shared memory and the instructions of the code a call
would launch on an H200 (sm_90) can be read on a CPU: where the lent GPU's time is short,
this finds what differs between two kernels, or what a change did to one, before timing it
(registers and spills, programs an SM, whether ptxas serialised the warpgroup MMAs, and the
instructions of one step of each loop of tensor-core products).

    python tools/cpu_sass.py BACKEND B H H_KV LQ LK D [--dtype bfloat16] [--splits N]
        [--causal] [--backward] [--tile N ...] [--fp8 {all,kv}] [--paged PAGE [--value-columns] [--paged-join]]
        [--varlen] [--mask {bool,float}] [--dv DV] [--misaligned {q,k,v,all}] [--capability 90] [--out DIR]
    (from the repository's root, the package installed)

The call (its forward, or with --backward its backward) is planned by the project's own host plan (as on a GPU with that many SMs: give
--splits for a split decode launch, since a CPU has none), then each launch compiles
instead of running (``triton.JITFunction.warmup``); nothing is launched. Prints, per kernel:
registers, spills, shared memory, counts of the tensor-core, copy and global-memory
instructions, and each tensor-core loop's instructions a step; writes its TTGIR, PTX and SASS
to --out. Uses the installed Triton, which may be newer than the GPU machine's: for the GPU's
own, install that version into a folder
(``pip install --no-deps --target DIR triton==3.6.0``) and put DIR first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pathlib
import re
import subprocess
import sys

if __name__ == "__main__":  # (imported, e.g. by a test, it changes nothing of its importer's)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

# (this checkout's packages, not another one installed: the call compiles the kernels beside this file)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from common.interpret import _StandInDriver  # noqa: E402

INSTRUCTIONS = r"HGMMA[.\w]*|QGMMA[.\w]*|HMMA[.\w]*|LDGSTS[.\w]*|UTMALDG[.\w]*|LDG[.\w]*|STG[.\w]*|ATOMG[.\w]*|RED[.\w]*|BAR[.\w]*"


NVIDIA_TOOLS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # ptxas, nvdisasm, cuobjdump


def disassemble(kernel, out: pathlib.Path, name: str) -> tuple[str, str]:
    """``(sass, usage)`` of a compiled kernel: its cubin, TTGIR, PTX and SASS written to ``out`` as
    ``name``.*, and cuobjdump's resource usage (``REG:``, ``STACK:``, ...)."""
    out.mkdir(parents=True, exist_ok=True)
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    for form in ("ttgir", "ptx"):
        (out / f"{name}.{form}").write_text(kernel.asm[form])
    sass = subprocess.run([str(NVIDIA_TOOLS / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    (out / f"{name}.sass").write_text(sass)
    usage = subprocess.run([str(NVIDIA_TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                           capture_output=True, text=True).stdout
    return sass, usage


def _varlen(args, backend, q, k, v, fp8, compiled) -> int:
    """varlen_attention's launches over the B sequences packed (their descales per sequence)."""
    from common import varlen_attention
    from common.plan import force_splits

    B, _, _, Lq, Lk, _ = args.shape
    packed = [t.transpose(1, 2).flatten(0, 1) for t in (q, k, v)]  # (B * L, heads, D)
    cu_q, cu_k = (torch.arange(B + 1, dtype=torch.int32) * n for n in (Lq, Lk))
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), fp8[:3])) if fp8 else {}
    with force_splits(args.splits):
        varlen_attention(*packed, cu_q, cu_k, Lq, Lk, is_causal=args.causal, enable_gqa=q.shape[1] != k.shape[1],
                         backend=backend.name, **descales)
    return _report(args, compiled)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backend", choices=["triton", "ninetoothed"])
    parser.add_argument("shape", nargs=6, type=int, metavar="B H H_KV LQ LK D")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--splits", type=int, default=1, help="key splits (a split decode launch)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--tile", nargs="+", type=int, metavar="N",
                        help="the tile instead of the table's: BLOCK_M BLOCK_N WARPS STAGES [MAXNREG] (forward), "
                             "BLOCK_M1 BLOCK_N1 BLOCK_M2 BLOCK_N2 WARPS STAGES (--backward)")
    parser.add_argument("--backward", action="store_true", help="the backward's kernels instead of the forward's")
    parser.add_argument("--fp8", choices=["all", "kv"], help="float8_e4m3fn query, keys and values (all), or keys "
                        "and values under a --dtype query (kv); with descales")
    parser.add_argument("--value-columns", action="store_true", help="the values column-major (keys contiguous for "
                        "a head and column); with --paged, the value pages")
    parser.add_argument("--paged", type=int, metavar="PAGE", help="paged_attention and append_kv over caches of "
                        "pages of PAGE keys holding the keys and values (with --fp8 kv: FP8 caches)")
    parser.add_argument("--varlen", action="store_true", help="varlen_attention over B packed sequences of LQ "
                        "queries and LK keys each (with --fp8: descales per sequence)")
    parser.add_argument("--dv", type=int, help="the values' head dim (default D)")
    parser.add_argument("--misaligned", choices=["q", "k", "v", "all"], help="that input (all: the output's "
                        "gradient too) one element past a 16-byte boundary")
    parser.add_argument("--capability", type=int, default=90, help="compute capability to compile for")
    parser.add_argument("--paged-join", action="store_true", help="with --paged, NineToothed's kernel with a step's "
                        "tiles one softmax update (impl_ninetoothed.attention.PAGED_JOIN)")
    parser.add_argument("--paged-join-tiles", action="store_true", help="with --paged and FP8 caches, NineToothed's "
                        "kernel with a step's 16-key tiles joined before one product each "
                        "(impl_ninetoothed.attention.PAGED_FP8_JOIN_TILES)")
    parser.add_argument("--mask", choices=["bool", "float"], help="a (B, 1, LQ, LK) attention mask broadcast over "
                        "the heads, boolean or additive (transformers' static-cache decoding passes one)")
    parser.add_argument("--out", default="/tmp/cpu_sass", help="where the TTGIR, PTX and SASS go")
    args = parser.parse_args(argv)

    class TargetDriver(_StandInDriver):
        """The stand-in driver (see common.interpret) that names a CUDA target."""

        backend = "cuda"

        def get_current_target(self):
            return GPUTarget("cuda", args.capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    triton.runtime.driver.set_active(TargetDriver())

    import common.launch as launch
    import common.validation as validation
    from common.backends import resolve
    from common.plan import force_splits, make_forward

    compiled = {}

    def compile_only(self, grid, arguments, num_warps, num_stages, maxnreg=None):
        grid = grid({}) if callable(grid) else grid
        capped = {} if maxnreg is None else {"maxnreg": maxnreg}
        compiled[self.fn.__name__] = self.fn.warmup(*arguments, grid=grid, num_warps=num_warps,
                                                    num_stages=num_stages, **capped, **launch.COMPILE_OPTIONS)

    launch.CachedLauncher.launch = compile_only
    validation._check_kernel_device = lambda *a: None  # CPU tensors, planned as if on the GPU
    import common.paged as paged

    paged._check_kernel_device = validation._check_kernel_device

    B, H, H_kv, Lq, Lk, D = args.shape
    dtype = getattr(torch, args.dtype)
    Dv = args.dv or D

    def tensor(*shape, misaligned=False):  # (misaligned: one element past a 16-byte boundary)
        flat = torch.randn(torch.Size(shape).numel() + misaligned, dtype=dtype)
        return flat[int(misaligned):].view(shape)

    off = {"q": args.misaligned in ("q", "all"), "k": args.misaligned in ("k", "all"),
           "v": args.misaligned in ("v", "all")}
    q = tensor(B, H, Lq, D, misaligned=off["q"])
    k, v = tensor(B, H_kv, Lk, D, misaligned=off["k"]), tensor(B, H_kv, Lk, Dv, misaligned=off["v"])
    fp8 = None
    if args.fp8:
        e4m3 = torch.float8_e4m3fn
        k, v = k.to(e4m3), v.to(e4m3)
        q = q.to(e4m3) if args.fp8 == "all" else q
        ones = torch.ones(B, H_kv)
        fp8 = (ones if args.fp8 == "all" else None, ones, ones, None)
    backend = resolve(args.backend)
    if args.paged:
        if args.paged_join or args.paged_join_tiles:
            import impl_ninetoothed.attention as nt

            nt.PAGED_JOIN = True
            nt.PAGED_FP8_JOIN_TILES = args.paged_join_tiles
        return _paged(args, backend, q, k, v, fp8, compiled)
    if args.value_columns:  # (as a decode's FP8 values are best given: keys contiguous)
        v = v.transpose(2, 3).contiguous().transpose(2, 3)
    if args.varlen:
        return _varlen(args, backend, q, k, v, fp8, compiled)
    mask = None
    if args.mask:  # (the values do not matter: nothing runs)
        mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        mask = mask if args.mask == "bool" else torch.zeros(B, 1, Lq, Lk, dtype=dtype)
    call = validation.check_call(backend, q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=args.causal,
                                 scale=None, enable_gqa=H_kv != H, return_lse=False, fp8=fp8)
    from common.configs import BackwardConfig, Config, override
    from common.plan import make_backward

    tile = (BackwardConfig if args.backward else Config)(*args.tile) if args.tile else None
    with force_splits(args.splits), override(tile) if tile else contextlib.nullcontext():
        if args.backward:  # (the values do not matter: nothing runs)
            out, grad_out = tensor(B, H, Lq, Dv), tensor(B, H, Lq, Dv, misaligned=args.misaligned == "all")
            plan = make_backward(call, backend, out, torch.zeros(B, H, Lq), grad_out)
            print(f"plan: {plan.config}")
            backend.load().backward(plan)
        else:
            plan = make_forward(call, backend, with_lse=False)
            print(f"plan: {plan.config}, {plan.num_splits} split(s) of {plan.blocks_per_split} key blocks, "
                  f"kernels' query {tuple(plan.query.shape)}")
            backend.load().forward(plan)

    return _report(args, compiled)


def _paged(args, backend, q, k, v, fp8, compiled) -> int:
    """--paged: the call's keys and values as caches of pages (in order), a decode or chunk of
    new tokens over them by paged_attention, then append_kv of the query's rows' worth of new
    keys and values (16-bit ones, quantized, into FP8 caches)."""
    from common.paged import append_kv, paged_attention
    from common.plan import force_splits

    B, H_kv, Lk, D = k.shape
    page = args.paged
    pages = -(-Lk // page)
    caches = []
    for x in (k, v):
        width = x.shape[3]  # (D, then the values' Dv)
        padded = torch.zeros(B, H_kv, pages * page, width).to(x.dtype)
        padded[:, :, :Lk] = x
        caches.append(padded.view(B, H_kv, pages, page, width).permute(0, 2, 3, 1, 4)
                      .reshape(B * pages, page, H_kv, width))
    if args.value_columns:  # each value page column-major: (pages, H_kv, D, page) in memory
        caches[1] = caches[1].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    table = torch.arange(B * pages, dtype=torch.int32).view(B, pages)
    lengths = torch.full((B,), Lk, dtype=torch.int32)
    descales = {} if fp8 is None else dict(k_descale=fp8[1], v_descale=fp8[2])
    with force_splits(args.splits):
        paged_attention(q, *caches, table, lengths, is_causal=args.causal, enable_gqa=q.shape[1] != H_kv,
                        backend=backend.name, **descales)
    new_k, new_v = (torch.randn(B, H_kv, q.shape[2], x.shape[3], dtype=q.dtype) for x in (k, v))
    append_kv(*caches, table, lengths - q.shape[2], new_k, new_v, backend=backend.name, **descales)
    return _report(args, compiled)


def _report(args, compiled) -> int:
    """Each compiled kernel's registers, spills, shared memory and instructions (see the module)."""
    out = pathlib.Path(args.out)
    for name, kernel in compiled.items():
        sass, usage = disassemble(kernel, out, name)
        regs = re.search(r"REG:(\d+)", usage)
        # ptxas spills to the stack frame (STACK), not to LOCAL (which stays 0 for our kernels)
        stack = re.search(r"STACK:(\d+)", usage)
        counts = collections.Counter(re.findall(INSTRUCTIONS, sass))
        resident = programs_per_sm(int(regs.group(1)), kernel.metadata.shared, kernel.metadata.num_warps) if (
            regs and args.capability == 90) else "?"
        print(f"{name}: {regs.group(1) if regs else '?'} registers, {stack.group(1) if stack else '?'} bytes "
              f"of stack (spills), {kernel.metadata.shared} bytes of shared memory, "
              f"{kernel.metadata.num_warps} warps, {kernel.metadata.num_stages} stages, "
              f"{resident} programs an SM (sm_90), {serialized(out / f'{name}.ptx', kernel)}")
        print("  " + ", ".join(f"{count} {op}" for op, count in sorted(counts.items())))
        for label, size, mix in mma_loops(sass):
            print(f"  loop {label}: {size} instructions a step ({', '.join(f'{n} {op}' for op, n in mix)})")
    print(f"TTGIR, PTX and SASS in {out}")
    return 0


def mma_loops(sass: str, top: int | None = 8, both_operands: bool = False) -> list:
    """The loops of a kernel's SASS that hold tensor-core products (a key or query loop's
    steps): ``(label, instructions a step, the ``top`` commonest opcodes (None: all))`` each, in
    address order. A loop is the code from a label to the last branch back to it. ``both_operands``:
    only loops holding a warp-group MMA whose A operand is in shared memory (an attention step's S)
    and one whose A is in registers (its P V), so that a barrier's wait loop around one product's
    instructions does not count as a step."""
    labels, instructions = {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        instruction = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if instruction:
            instructions.append(instruction.group(1).strip())
    ends = {}
    for i, instruction in enumerate(instructions):
        target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", instruction)
        if target and target.group(1) in labels and labels[target.group(1)] <= i:
            ends[target.group(1)] = i
    loops = []
    for label, end in ends.items():
        body = instructions[labels[label]:end + 1]
        opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in body)
        if both_operands:
            products = [x for x in body if re.search(r"\b[HQ]GMMA\.", x)]
            if not (any(re.search(r"GMMA\.\S+ R\d+, gdesc", x) for x in products)
                    and any(re.search(r"GMMA\.\S+ R\d+, R\d+, gdesc", x) for x in products)):
                continue
        if opcodes["HGMMA"] or opcodes["QGMMA"] or opcodes["HMMA"]:  # (QGMMA: FP8 operands)
            loops.append((labels[label], label, len(body), opcodes.most_common(top)))
    return [loop[1:] for loop in sorted(loops)]


def serialized(ptx: pathlib.Path, kernel) -> str:
    """Whether ptxas serialises the kernel's warpgroup MMAs (a performance note such as C7515 or
    C7511: each ``wgmma`` then waits for the one before; a NineToothed split forward did, 2026-12-01,
    benchmarks/NOTES.md "Split sizes in symbols timed"), from ptxas run again on the PTX with
    ``-v`` for the kernel's own architecture, by the ptxas Triton builds that architecture with (triton 3.9
    builds sm_90 with its CUDA 13 ``ptxas-blackwell``; a copy of it may carry no other)."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"\.target\s+(sm_(\d+)\w*)", kernel.asm["ptx"])
    if arch is None:
        return "MMA serialisation unknown"
    notes = subprocess.run([get_ptxas(int(arch.group(2))).path, f"-arch={arch.group(1)}", "-v", str(ptx), "-o",
                            os.devnull], capture_output=True, text=True).stderr
    # (C7515: accumulator registers defined between a wgmma's start and end; C7511: too few
    # registers for the wgmma pipeline; other codes may name other causes)
    note = re.search(r"\((C\d+)\)[^\n]*wgmma[^\n]*serialized", notes)
    return f"MMAs serialized (ptxas {note.group(1)})" if note else "MMAs not serialized"


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """How many programs of a kernel an sm_90 SM (H100, H200) holds at once: the fewest that its
    registers (65536 a SM, allocated per warp in units of 256: a thread's count rounded up to 8),
    its shared memory (227 KB a program at most, 228 KB a SM, 1 KB of it reserved per program)
    and its warps (64 a SM) allow, at most 32."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = 228 * 1024 // (shared + 1024)
    return min(by_registers, by_shared, 64 // warps, 32)


if __name__ == "__main__":
    sys.exit(main())
