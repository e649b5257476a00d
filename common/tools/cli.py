"""The command line: ``python -m common`` or ``twin-attention``.

Never imported by the library: ``import common`` loads none of the commands. The commands are
declared in a table of names; a command's module (and torch with it) is imported only when that
command runs or shows its own help, so ``twin-attention --help`` imports none of them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

DESCRIPTION = """\
Scaled-dot-product attention written twice (Triton and NineToothed): the commands.

"The homework" below is the original assignment: implement attention(query, key, value,
is_causal=False, scale=None) in Triton so that it matches torch's scaled_dot_product_attention
in float16 within rtol = atol = 1e-2 on four shapes, (B, H, L, D) = (2, 4, 16, 32),
(4, 8, 64, 64), (1, 16, 128, 128) and (2, 4, 1024, 64); its test is tests/test_seed.py.

  demo     both kernels and SDPA on the homework's four shapes: error, pass/fail, time
           (without a GPU: on the CPU, under Triton's interpreter)
  bench    the benchmark against SDPA on a GPU; results into --out, the report with --write
  tune     times candidate block sizes on a GPU; writes impl_*/configs.json
  compare  the two programming models side by side; the report on stdout, or --write

'python -m common COMMAND' is the same as 'twin-attention COMMAND';
'twin-attention COMMAND --help' describes a command and its options.
"""

# name: (module, one-line summary). Only the module of the command that runs is imported.
COMMANDS = {
    "demo": ("common.tools.demo", "both kernels and SDPA on the homework's four shapes"),
    "bench": ("common.tools.bench", "benchmark against SDPA (GPU)"),
    "tune": ("common.tools.tune", "tune the config tables (GPU)"),
    "compare": ("common.tools.compare", "Triton vs NineToothed: code, build cost, speed"),
}


class CommandError(Exception):
    """A command cannot run as asked; the message is one line for the user."""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written, and every option's default after its help."""


def require(module: str, extra: str, command: str) -> None:
    """Raise a one-line CommandError unless ``module`` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise CommandError(f"{command} needs the package {module!r}: pip install -e '.[{extra}]'")


def parser(load=tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The command line; the commands named in ``load`` get their description and options, which
    imports their modules (every command by default; ``main`` loads only the one it runs)."""
    top = argparse.ArgumentParser(prog="twin-attention", description=DESCRIPTION, formatter_class=_Formatter)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        if name not in load:
            commands.add_parser(name, help=summary)
            continue
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=summary, description=module.DESCRIPTION, formatter_class=_Formatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)
    return top


def _command_in(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top level has no
    option that takes a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    args = parser(load=[command] if command in COMMANDS else []).parse_args(argv)
    try:
        return args.run(args)
    except CommandError as error:
        print(f"twin-attention {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
