"""The A/B of tools/h200.sh's ab-bench stage side by side: one line per throughput shape, each tree's Triton
time and its ratio to SDPA's default in the same run (and its result's largest error).

    python tools/ab_summary.py results_main.json results_<tree>.json ...
"""

from __future__ import annotations

import json
import pathlib
import sys


def main(paths: list[str]) -> int:
    runs = {pathlib.Path(p).stem.removeprefix("results_"): json.loads(pathlib.Path(p).read_text())["rows"]
            for p in paths}
    shapes = {}
    for name, rows in runs.items():
        for r in rows:
            if r.get("section") != "throughput" or r.get("backend") != "triton" or r.get("status") != "ok":
                continue
            key = (r["mode"], r["dtype"], r["D"], r["Lk"], r["causal"])
            shapes.setdefault(key, {})[name] = r
    print("| mode | dtype | D | L | causal | " + " | ".join(f"{n}: ms (/ SDPA), error" for n in runs) + " |")
    print("|---" * (5 + len(runs)) + "|")
    for key in sorted(shapes):
        cells = []
        for name in runs:
            r = shapes[key].get(name)
            cells.append(f"{r['ms']:.3f} ({r['vs_sdpa']:.3f}x), {r['max_error']:.1e}" if r else "-")
        print("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
