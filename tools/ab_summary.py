"""The A/B of tools/h200.sh's ab-bench stage side by side: one line per throughput (or FP8) shape, each tree's
Triton time and its ratio to SDPA's default in the same run (and its result's largest error), where the row has
them (the FP8 section's rows have neither).

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
            if (r.get("section") not in ("throughput", "fp8") or r.get("backend") != "triton"
                    or r.get("status") != "ok"):
                continue
            key = (r["mode"], r["dtype"], r["D"], r["Lq"], r["Lk"], r["causal"])
            shapes.setdefault(key, {})[name] = r
    print("| mode | dtype | D | Lq | Lk | causal | " + " | ".join(f"{n}: ms (/ SDPA), error" for n in runs) + " |")
    print("|---" * (6 + len(runs)) + "|")
    for key in sorted(shapes):
        cells = []
        for name in runs:
            r = shapes[key].get(name)
            cells.append("-" if r is None else f"{r['ms']:.3f}" + (f" ({r['vs_sdpa']:.3f}x)" if "vs_sdpa" in r else "")
                         + (f", {r['max_error']:.1e}" if "max_error" in r else ""))
        print("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
