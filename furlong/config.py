"""One typed config tree: defaults here, a YAML recipe sets what differs, `key=value` overrides last.

An unknown key or a value of the wrong type is an error that names the key and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_TASKS = REPO_ROOT / "tasks"
RECIPES = REPO_ROOT / "recipes"


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SandboxConfig(_Node):
    backend: Literal["bwrap"] = "bwrap"
    host_uid: int = Field(61000, gt=0, description="unprivileged uid sandboxes run as when furlong runs as root")
    output_cap_bytes: int = Field(1 << 20, gt=0)
    debian_mirror: str = "http://deb.debian.org/debian"


class EvalConfig(_Node):
    tasks: Path = BUNDLED_TASKS
    agent: Literal["oracle", "noop"] = "oracle"
    concurrency: int = Field(2, ge=1)
    out: Path | None = None
    split: Literal["train", "heldout", "all"] = "heldout"
    per_family: int | None = Field(2, ge=1, description="instances of each task family; null for all")


class Config(_Node):
    sandbox: SandboxConfig = SandboxConfig()
    eval: EvalConfig = EvalConfig()


class ConfigError(ValueError):
    pass


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
    node[leaf] = value


def load_config(recipe: Path | None = None, overrides: list[str] = ()) -> Config:
    tree: dict = {}
    if recipe is not None:
        try:
            tree = yaml.safe_load(Path(recipe).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"recipe {recipe}: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe {recipe}: expected a mapping at the top level")
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. eval.concurrency=4")
        _set(tree, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()]
        where = f" in {recipe}" if recipe else ""
        raise ConfigError(f"invalid config{where}:\n  " + "\n  ".join(problems)) from None
