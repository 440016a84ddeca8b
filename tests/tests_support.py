"""Small builders shared by tests."""

from __future__ import annotations

from pathlib import Path

from furlong.tasks.loader import load_task
from furlong.tasks.model import Task


def make_task(root: Path, name: str, instruction: str, test: str, solve: str = "true",
              agent_timeout: float = 60, verifier_timeout: float = 30) -> Task:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text(f"[agent]\ntimeout_sec = {agent_timeout}\n[verifier]\ntimeout_sec = {verifier_timeout}\n")
    (d / "instruction.md").write_text(instruction)
    (d / "tests" / "test.sh").write_text(test + "\n")
    (d / "solution" / "solve.sh").write_text(solve + "\n")
    return load_task(d)
