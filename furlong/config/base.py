"""The tree's base node, the repository paths its defaults point at, and how a field holds a section."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
BUNDLED_TASKS = REPO_ROOT / "tasks"
RECIPES = REPO_ROOT / "recipes"


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def section_class(annotation: Any) -> type[BaseModel] | None:
    """The section a field's annotation is (`train.rl`), else None."""
    return annotation if inspect.isclass(annotation) and issubclass(annotation, BaseModel) else None


def mapped_class(annotation: Any) -> type[BaseModel] | None:
    """The section class of a mapping of names to sections (`train.env.rewards.NAME`), else None."""
    args = typing.get_args(annotation)
    if (
        typing.get_origin(annotation) is dict
        and len(args) == 2
        and inspect.isclass(args[1])
        and issubclass(args[1], BaseModel)
    ):
        return args[1]
    return None
