"""Builders for the run's environment (`train.env`): Harbor tasks or the user's Python environment, the
user's extra tools and reward functions, each named "module:attribute" and imported here, the one
place furlong imports user code (docs/environments.md)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from furlong.config import ConfigError, EnvConfig, TrainConfig
from furlong.envs.base import Environment
from furlong.envs.harbor import HarborEnv, HarborSource
from furlong.envs.rewards import TESTS_ONLY, RewardFn, Scorer
from furlong.envs.toolset import Tool
from furlong.envs.user import PythonEnv, PythonSource
from furlong.sandbox.base import SandboxBackend
from furlong.sandbox.pool import ImageLookup, WarmPools
from furlong.tasks.family import load_family


def load_object(spec: str, key: str) -> Any:
    """The object "module:attribute" names, from the Python path or the directory furlong runs in (as
    `python -m` would find it); ConfigError naming `key` when it is not there."""
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {exc}") from None
    try:
        obj = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigError(f"{key}: module {module_name!r} has no {attribute!r}") from None
    return obj


def extra_tools(env: EnvConfig) -> tuple[Tool, ...]:
    tools: list[Tool] = []
    for spec in env.tools:
        found = load_object(spec, "train.env.tools")
        found = list(found) if isinstance(found, (list, tuple)) else [found]
        if not all(isinstance(t, Tool) for t in found):
            raise ConfigError(f"train.env.tools: {spec!r} is not a furlong.envs.toolset.Tool (or a list of them)")
        tools += found
    return tuple(tools)


def scorer(env: EnvConfig) -> Scorer:
    """The reward functions and weights; the own reward's key is `tests` (Harbor) or `steps` (python)."""
    fns = [RewardFn(name=name, weight=r.weight, timeout_s=r.timeout_s, command=r.command,
                    python=load_object(r.python, f"train.env.rewards.{name}.python") if r.python else None)
           for name, r in env.rewards.items()]
    if env.python is not None and (commands := [f.name for f in fns if f.command is not None]):
        raise ConfigError(f"train.env.rewards: {commands} are commands, which run in a sandbox; a Python "
                          "environment has none (use python: module:function)")
    return Scorer(fns, own_weight=env.tests_weight, own="steps" if env.python else "tests")


def env_source(t: TrainConfig, backend: SandboxBackend) -> HarborSource | PythonSource:
    """The run's instances: a Python environment's (train.env.python), or the task families' (their
    generators run on `backend`): all their train instances, and train.eval.heldout_per_family held-out
    ones each."""
    if t.env.python is not None:
        return python_source(t.env, {"train": t.env.train_instances, "heldout": t.eval.heldout_per_family})
    families = [load_family(t.tasks / name, backend) for name in t.families]
    for f in families:
        if len(f.seeds["heldout"]) < t.eval.heldout_per_family:
            raise ConfigError(f"train.eval.heldout_per_family: {t.eval.heldout_per_family} requested, but family "
                              f"{f.name!r} has {len(f.seeds['heldout'])} held-out instances")
    return HarborSource(families, {"heldout": t.eval.heldout_per_family})


def python_source(env: EnvConfig, counts: dict[str, int]) -> PythonSource:
    """A Python environment's instances, `counts[split]` of each split."""
    factory = load_object(env.python or "", "train.env.python")
    return PythonSource(factory, env.family() or "", counts, env.agent_timeout_s, extra_tools(env))


@dataclass(frozen=True)
class RunEnv:
    """The environment every phase of a run opens its episodes in: Harbor tasks in warm-pooled sandboxes
    (`factory` None), or the user's Python environment; with the same tools and reward functions."""

    backend: SandboxBackend
    images: ImageLookup
    tools: tuple[Tool, ...] = ()
    scorer: Scorer = TESTS_ONLY
    factory: Any = None  # a Python environment's factory
    sessions: Callable[[], AbstractAsyncContextManager[Environment]] | None = None  # an OpenEnv server's

    @asynccontextmanager
    async def open(self) -> AsyncIterator[Environment]:
        """A phase's environment; its unclaimed sandboxes are closed when the phase ends."""
        if self.sessions is not None:
            async with self.sessions() as env:
                yield env
            return
        if self.factory is not None:
            yield PythonEnv(self.factory, self.tools, self.scorer)
            return
        async with WarmPools(self.backend, self.images) as pools:
            yield HarborEnv(pools, self.tools, self.scorer)


def run_env(env: EnvConfig, backend: SandboxBackend, images: ImageLookup,
            sessions: Callable[[], AbstractAsyncContextManager[Environment]] | None = None) -> RunEnv:
    """The run's environment; `sessions`: an OpenEnv server's (train.env.openenv), which brings its own
    tools and rewards."""
    if sessions is not None:
        if env.tools or env.rewards:
            raise ConfigError("train.env.tools and train.env.rewards: an OpenEnv server (train.env.openenv) "
                              "brings its own tools and rewards")
        return RunEnv(backend, images, sessions=sessions)
    tools, scoring = extra_tools(env), scorer(env)
    factory = load_object(env.python, "train.env.python") if env.python else None
    if factory is None:
        try:
            HarborEnv(None, tools, scoring)  # type: ignore[arg-type]  # checks the tools beside bash
        except ValueError as exc:
            raise ConfigError(f"train.env.tools: {exc}") from None
    return RunEnv(backend, images, tools, scoring, factory)
