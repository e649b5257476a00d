"""Run FlashAttention's own test module against ``common.flash_attn_interface``.

    python tools/fa_suite/run.py PATH/TO/flash-attention/tests/test_flash_attn.py [--cpu] [pytest args]

The module is copied into a scratch folder beside this folder's conftest and run by pytest with
``flash_attn`` resolving to the package here: FlashAttention's functions are ours, and the
helpers its tests build inputs and references with (``bert_padding``'s ``pad_input`` and
``unpad_input``, ``layers.rotary``'s ``apply_rotary_emb``) are written here in torch. The test
code itself runs as written. ``--cpu`` runs it under Triton's interpreter on CPU tensors: the
tests' "cuda" device strings become "cpu" in the copy, and conftest.py cuts the cases to small
ones (FA_MAX_SEQ, FA_DIMS, FA_PER_TEST; see there). The backend is ATTENTION_BACKEND's
("triton" when unset), as for any call without ``backend=``.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    source, rest = pathlib.Path(argv[0]), argv[1:]
    cpu = "--cpu" in rest
    rest = [arg for arg in rest if arg != "--cpu"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    if cpu:
        env.update(FA_CPU="1", TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory(prefix="fa_suite_") as scratch:
        text = source.read_text()
        if cpu:
            text = text.replace('device = "cuda"', 'device = "cpu"').replace('device="cuda"', 'device="cpu"')
        (pathlib.Path(scratch) / source.name).write_text(text)
        shutil.copy(HERE / "conftest.py", scratch)
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", source.name, *rest]
        return subprocess.call(command, cwd=scratch, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
