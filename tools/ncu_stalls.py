"""Where a kernel's warps stall, from Nsight Compute's per-SASS-line samples.

    python tools/ncu_stalls.py REPORT.sass.csv [--top N]

The input is what ``ncu --import REPORT --page source --csv --print-source sass`` writes (``tools/h200.sh ncu``
writes one per case). For each kernel in it, this prints:
- the share of all warp-state samples by stall reason;
- the share by opcode, with how many warp instructions of that opcode ran;
- the ``--top`` SASS lines with the most samples, each with its three main reasons.

A warp that idles for the whole kernel (the unused warps of a producer's warp group) shows as one line with many
``barrier`` samples and few executions; it costs the kernel nothing.
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(rows: list[list[str]]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, SASS lines) for each kernel section of the CSV's rows."""
    sections = []
    for row in rows:
        if row and row[0] == "Kernel Name":
            sections.append((row[1], None, []))
        elif row and row[0] == "Address" and sections:
            sections[-1] = (sections[-1][0], row, sections[-1][2])
        elif sections and sections[-1][1] is not None and len(row) >= len(sections[-1][1]) - 1:
            sections[-1][2].append(row)
    return [section for section in sections if section[1] is not None]


def opcode(source: str) -> str:
    """A SASS line's opcode without its predicate and modifiers (``@!P0 BRA ...`` -> ``BRA``)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summary(header: list[str], lines: list[list[str]], top: int = 20) -> dict:
    """The samples of one kernel: ``total``, ``reasons`` and ``opcodes`` (name -> share of the samples; opcodes
    also with their warp instructions executed), and ``top``, the lines with the most samples, each as
    (address, source, share, [(reason, samples)] of its three main reasons)."""
    at = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]

    def count(line, name):
        value = line[at[name]].replace(",", "") if at[name] < len(line) else ""
        return int(float(value)) if value else 0

    total = sum(count(line, SAMPLES) for line in lines) or 1
    by_reason = {name[len("stall_"):]: sum(count(line, name) for line in lines) / total for name in reasons}
    by_opcode = collections.defaultdict(lambda: [0.0, 0])
    for line in lines:
        entry = by_opcode[opcode(line[at["Source"]])]
        entry[0] += count(line, SAMPLES) / total
        entry[1] += count(line, EXECUTED)
    ranked = sorted(lines, key=lambda line: -count(line, SAMPLES))[:top]
    top_lines = [(line[at["Address"]], line[at["Source"]].strip(), count(line, SAMPLES) / total,
                  sorted(((name[len("stall_"):], count(line, name)) for name in reasons), key=lambda x: -x[1])[:3])
                 for line in ranked]
    return {"total": total, "reasons": dict(sorted(by_reason.items(), key=lambda x: -x[1])),
            "opcodes": dict(sorted(by_opcode.items(), key=lambda x: -x[1][0])), "top": top_lines}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu's source page, SASS, as CSV")
    parser.add_argument("--top", type=int, default=20, help="how many SASS lines to list")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    for name, header, lines in kernels(rows):
        result = summary(header, lines, args.top)
        print(f"=== {name}: {len(lines)} SASS lines, {result['total']} samples")
        print("  by reason: " + ", ".join(f"{r} {100 * v:.1f}%" for r, v in result["reasons"].items() if v >= 0.01))
        print("  by opcode (samples, warp instructions): " + ", ".join(
            f"{o} {100 * v[0]:.1f}% {v[1]}" for o, v in list(result["opcodes"].items())[:16]))
        for address, source, share, main_reasons in result["top"]:
            print(f"  {address[-6:]} {100 * share:5.1f}% {source[:64]:64s} {main_reasons}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
