"""The tree's base node and the repository paths its defaults point at."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
BUNDLED_TASKS = REPO_ROOT / "tasks"
RECIPES = REPO_ROOT / "recipes"


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
