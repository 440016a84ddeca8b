"""Lint and types are part of the test command, so CI runs them: `ruff check`, `ruff format --check` and
`mypy` over furlong/, each configured in pyproject.toml ([tool.ruff], [tool.mypy])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["ruff", "check", "furlong"], ["ruff", "format", "--check", "furlong"],
                                     ["mypy"]], ids=["ruff-check", "ruff-format", "mypy"])
def test_furlong_is_clean(command):
    r = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"`{' '.join(command)}` found problems:\n{r.stdout[-6000:]}\n{r.stderr[-2000:]}"
