"""The root node, and loading it: defaults, then a YAML recipe, then `key=value` overrides."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from furlong.config.base import _Node, mapped_class, section_class
from furlong.config.sandbox import (
    EvalConfig,
    ImagesConfig,
    OpenEnvConfig,
    SandboxConfig,
)
from furlong.config.train import TrainConfig


class Config(_Node):
    sandbox: SandboxConfig = Field(SandboxConfig(), description="sandboxes, for every command")
    images: ImagesConfig = Field(ImagesConfig(), description="base images from registries")
    eval: EvalConfig = Field(EvalConfig(), description="`furlong eval`")
    openenv: OpenEnvConfig = Field(
        OpenEnvConfig(), description="the OpenEnv server of train.env.openenv and eval.env=openenv"
    )
    train: TrainConfig = Field(TrainConfig(), description="`furlong train` and `furlong sft`")

    @model_validator(mode="after")
    def _sandbox_hosts_on_ray(self) -> Config:
        if self.train.ray.sandbox_hosts and self.train.cluster != "ray":
            raise ValueError(
                "train.ray.sandbox_hosts: sandbox host actors need train.cluster=ray (local mode: "
                "start hosts with `furlong sandbox serve` and set sandbox.backend=remote)"
            )
        if self.train.ray.sandbox_hosts and self.sandbox.backend == "remote":
            raise ValueError(
                "train.ray.sandbox_hosts: the run's sandboxes go to its own host actors; drop "
                "sandbox.backend=remote (and sandbox.hosts), or set train.ray.sandbox_hosts=0"
            )
        return self


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


def _value(key: str, raw: str) -> Any:
    """An override's value, read as YAML (4, true, [a, b], null); empty is null."""
    if not raw.strip():
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"override {key}={raw}: {problem} (values are YAML: 4, true, [a, b], null)") from None


def load_config(recipe: Path | None = None, overrides: Sequence[str] = ()) -> Config:
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
        _set(tree, key.strip(), _value(key.strip(), raw))
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']} (got {e.get('input')!r}){_nearest(e)}"
            for e in exc.errors()
        ]
        where = f" in {recipe}" if recipe else ""
        sep = " " if len(problems) == 1 else "\n  "  # one problem, one line
        raise ConfigError(f"invalid config{where}:{sep}" + "\n  ".join(problems)) from None


def _nearest(error: Any) -> str:
    """For an unknown key, the valid key of its section nearest to it (a typo's likely meaning), else ""."""
    if error.get("type") != "extra_forbidden":
        return ""
    *parents, leaf = (str(p) for p in error["loc"])
    node: type[BaseModel] = Config
    i = 0
    while i < len(parents):
        field = node.model_fields.get(parents[i])
        if field is None:
            return ""
        child = section_class(field.annotation)
        if child is None and (child := mapped_class(field.annotation)) is not None:
            i += 1  # the next part is an entry's name in the mapping (train.env.rewards.NAME)
        if child is None:
            return ""
        node, i = child, i + 1
    close = difflib.get_close_matches(leaf, list(node.model_fields), n=1, cutoff=0.6)
    return f"; did you mean {'.'.join([*parents, close[0]])}?" if close else ""
