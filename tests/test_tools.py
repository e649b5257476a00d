"""The commands' plumbing that runs without a GPU: where they read and write."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["bench", "compare"])
def test_commands_write_into_the_repository(module):
    """ROOT is the repository root (common/tools/ sits two levels below it), not common/."""
    import importlib

    root = importlib.import_module(f"common.tools.{module}").ROOT
    assert (root / "pyproject.toml").is_file() and (root / "common").is_dir()
