"""A crude model of one warp running a key loop's softmax, read from SASS (a lead for an A/B, not a timing).

    python tools/sass_model.py SASS... [--loops 2]

For each SASS file (``tools/gluon_sass.py --out`` writes them), the key loops (loops holding both products, S and
P V, shortest first: ``cpu_sass.mma_loops``) with their instructions and local (spill) accesses, and the cycles from
the wait for S (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) to the loop's end for one warp issuing in order: an
instruction issues a cycle after the one before, once its source registers are ready and its pipe is free. Forward
branches inside the loop are taken as skipped (a masked tile's code, the last tile's prefetch). Latencies and
issue intervals by pipe (sm_90, approximate): FMA 4 / 1, ALU 5 / 2 (half rate), the special-function unit
(MUFU) 18 / 8 (16 results a clock an SM), shuffles 26 / 2, conversions 5 / 2. The warp is alone: the other
consumer warp group's issue and the tensor cores' time are not modelled, so two builds' cycles compare how long
one warp's softmax holds its issue slots and its special-function unit, nothing more.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpu_sass import mma_loops  # noqa: E402

LATENCY = dict(fma=4, alu=5, mufu=18, shfl=26, cvt=5, other=2)
INTERVAL = dict(fma=1, alu=2, mufu=8, shfl=2, cvt=2, other=1)
PIPES = {"fma": ("FFMA", "FADD", "FMUL", "IMAD"), "mufu": ("MUFU",), "shfl": ("SHFL",),
         "cvt": ("F2FP", "F2F", "I2F", "F2I"),
         "alu": ("FMNMX", "FSEL", "FSETP", "LOP3", "ISETP", "IADD3", "VIADD", "SEL", "PLOP3", "SHF", "PRMT", "LEA",
                 "MOV")}
PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}


def _instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """The SASS's instructions in order, each label as a line "name:" of its own, and the labels' positions."""
    lines, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(lines)
            lines.append(label.group(1) + ":")
            continue
        instruction = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if instruction:
            lines.append(instruction.group(1).strip())
    return lines, labels


def _straight(body: list[str]) -> list[str]:
    """The loop's body with each forward branch's skipped code left out (the branch taken)."""
    where = {x[:-1]: i for i, x in enumerate(body) if x.endswith(":")}
    out, skipping = [], None
    for i, x in enumerate(body):
        if skipping:
            if x == skipping + ":":
                skipping = None
            continue
        target = re.search(r"BRA `\((\.L_x_\d+)\)", x)
        if target and where.get(target.group(1), -1) > i:
            skipping = target.group(1)
            continue
        out.append(x)
    return out


def cycles(instructions: list[str]) -> int:
    """The in-order issue model's cycles for ``instructions`` (one warp, alone)."""
    ready, free, t = {}, {}, 0
    for x in instructions:
        if not x or x.endswith(":"):
            continue
        body = re.sub(r"^@!?U?P\w+\s+", "", x)
        op = body.split()[0].split(".")[0]
        if op in ("BRA", "NOP", "BSYNC", "BSSY"):
            continue
        registers = re.findall(r"\bR(\d+)\b", body.split(None, 1)[1] if " " in body else "")
        pipe = PIPE_OF.get(op, "other")
        writes = registers[0] if registers and op not in ("SYNCS", "STG", "STS", "STL", "HGMMA", "QGMMA") else None
        reads = [] if op in ("HGMMA", "QGMMA") else registers[1:] if writes else registers  # (MMAs read async)
        t = max([t + 1, free.get(pipe, 0)] + [ready.get(r, 0) for r in reads])
        free[pipe] = t + INTERVAL[pipe]
        if writes:
            ready[writes] = t + LATENCY[pipe]
    return t


def key_loops(sass: str) -> list[tuple[int, int, int]]:
    """(instructions, local accesses, modelled cycles of the softmax) of each key loop, shortest first."""
    lines, labels = _instructions(sass)
    loops = []
    for label, steps, opcodes in mma_loops(sass, top=None, both_operands=True):
        opcodes = dict(opcodes)
        start = labels[label]
        end = max(i for i, x in enumerate(lines) if re.search(r"\bBRA\b.*" + re.escape(label) + r"\)", x))
        body = _straight(lines[start:end + 1])
        waits = [i for i, x in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in x]
        loops.append((steps, opcodes.get("LDL", 0) + opcodes.get("STL", 0), cycles(body[waits[0] if waits else 0:])))
    return sorted(loops)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sass", nargs="+")
    parser.add_argument("--loops", type=int, default=2, help="how many key loops a file, shortest first")
    args = parser.parse_args(argv)
    for path in args.sass:
        loops = key_loops(pathlib.Path(path).read_text())[:args.loops]
        print(path, "  ".join(f"{steps} instructions, {local} local, {c} cycles" for steps, local, c in loops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
