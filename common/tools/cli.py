"""The command line: ``python -m common`` or ``twin-attention``.

Never imported by the library: ``import common`` loads none of the commands.

    demo     both kernels and SDPA on the homework's shapes (CPU: under the interpreter)
    bench    the benchmark against SDPA on a GPU; writes BENCHMARKS.md and benchmarks/
    tune     pick block sizes on a GPU; writes impl_*/configs.json
    compare  the two programming models side by side; writes COMPARISON.md and comparison/
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="twin-attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="both kernels and SDPA on the homework's shapes")
    from common.tools import bench, compare, tune

    bench.add_arguments(commands.add_parser("bench", help="benchmark against SDPA (GPU)"))
    tune.add_arguments(commands.add_parser("tune", help="tune the config tables (GPU)"))
    compare.add_arguments(commands.add_parser("compare", help="Triton vs NineToothed: code, build cost, speed"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        from common.tools import demo

        return demo.main(args)
    return {"bench": bench, "tune": tune, "compare": compare}[args.command].main(args)


if __name__ == "__main__":
    sys.exit(main())
