"""The command line: ``python -m common`` or ``twin-attention``.

Never imported by the library: ``import common`` loads none of the commands.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

DESCRIPTION = """\
Scaled-dot-product attention written twice (Triton and NineToothed): the commands.

  demo     both kernels and SDPA on the homework's shapes (without a GPU: on the CPU,
           under Triton's interpreter)
  bench    the benchmark against SDPA on a GPU; writes BENCHMARKS.md and benchmarks/
  tune     times candidate block sizes on a GPU; writes impl_*/configs.json
  compare  the two programming models side by side; writes COMPARISON.md and comparison/

'python -m common COMMAND' is the same as 'twin-attention COMMAND'.
"""


class CommandError(Exception):
    """A command cannot run as asked; the message is one line for the user."""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default after its help."""


def require(module: str, extra: str, command: str) -> None:
    """Raise a one-line CommandError unless ``module`` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise CommandError(f"{command} needs the package {module!r}: pip install -e '.[{extra}]'")


def parser() -> argparse.ArgumentParser:
    from common.tools import bench, compare, demo, tune

    top = argparse.ArgumentParser(prog="twin-attention", description=DESCRIPTION, formatter_class=_Formatter)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module, summary in (
        ("demo", demo, "both kernels and SDPA on the homework's shapes"),
        ("bench", bench, "benchmark against SDPA (GPU)"),
        ("tune", tune, "tune the config tables (GPU)"),
        ("compare", compare, "Triton vs NineToothed: code, build cost, speed"),
    ):
        sub = commands.add_parser(name, help=summary, description=module.DESCRIPTION, formatter_class=_Formatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except CommandError as error:
        print(f"twin-attention {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
