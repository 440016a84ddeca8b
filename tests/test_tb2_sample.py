"""The bundled Terminal-Bench-2-style sample (tasks-tb2/): the oracle scores 100%, the no-op agent 0%.

Tasks whose Dockerfiles need more than furlong's native subset (multi-stage, ARG, LABEL, USER, heredoc
RUN) build only with the buildah builder (furlong.sandbox.images.buildah), which install.sh always installs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from furlong.config import REPO_ROOT

SAMPLE = REPO_ROOT / "tasks-tb2"

pytestmark = pytest.mark.slow


def _eval(tasks: Path, agent: str, out: Path) -> dict[str, dict]:
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(tasks), "--agent", agent,
                          "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return {r["task"]: r for r in map(json.loads, out.read_text().splitlines())}


def _check(tasks: Path, tmp_path: Path, expected: set[str]) -> None:
    oracle = _eval(tasks, "oracle", tmp_path / "oracle.jsonl")
    assert set(oracle) == expected
    assert {t: (r["reward"], r["status"]) for t, r in oracle.items()} == {t: (1.0, "ok") for t in expected}, oracle
    note = oracle["pip-local-package"]["image_note"]  # python:3.10-slim: the record says what served it
    assert "stand-in" in note and "Python 3.11" in note and "asks for Python 3.10" in note, note
    noop = _eval(tasks, "noop", tmp_path / "noop.jsonl")
    assert {t: (r["reward"], r["status"]) for t, r in noop.items()} == {t: (0.0, "ok") for t in expected}, noop


def test_whole_sample(tmp_path: Path):
    _check(SAMPLE, tmp_path, {p.name for p in SAMPLE.iterdir() if p.is_dir()})
