"""The README's Python snippets run as written (on a GPU, or on the CPU under Triton's interpreter) and
print what they computed."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[f"snippet{i}" for i in range(len(SNIPPETS))])
def test_snippet_runs(index, tmp_path):
    if "transformers" in SNIPPETS[index]:
        pytest.importorskip("transformers")
    env = dict(os.environ)
    env.setdefault("TRITON_INTERPRET", "1" if not _has_gpu() else "0")
    result = subprocess.run([sys.executable, "-c", SNIPPETS[index]], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "a snippet prints what it computed, so that its reader sees it worked"


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
