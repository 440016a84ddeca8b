"""Builders for the run's environment (`train.env`): Harbor tasks, the user's Python environment or a prompt
dataset, the user's extra tools and reward functions, each named "module:attribute" (a prompt dataset's
reward also as a file) and imported here, the one place furlong imports user code (docs/environments.md,
docs/prompts.md)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from furlong.config import ConfigError, EnvConfig, TrainConfig
from furlong.envs.base import Environment
from furlong.envs.harbor import HarborEnv, HarborSource
from furlong.envs.prompt_data import dataset_splits, file_splits
from furlong.envs.prompts import Fields, PromptEnv, PromptSource
from furlong.envs.rewards import TESTS_ONLY, RewardFn, Scorer
from furlong.envs.toolset import Tool
from furlong.envs.user import PythonEnv, PythonSource
from furlong.sandbox.base import LayerSource, SandboxBackend
from furlong.sandbox.pool import ImageLookup, WarmPools
from furlong.tasks.family import load_family
from furlong.tasks.model import TaskNetwork


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


def load_callable(spec: str, key: str) -> Callable:
    """The function "module:function" names, or "FILE.py[:function]" (default name `reward`) defines;
    ConfigError naming `key` when it is not there or not callable."""
    target, sep, name = spec.rpartition(":")
    if spec.endswith(".py") or target.endswith(".py"):
        path, name = (spec, "reward") if spec.endswith(".py") else (target, name)
        fn = getattr(_file_module(path, key), name, None)
        if fn is None:
            raise ConfigError(f"{key}: {path} defines no {name!r}")
    elif not sep:
        raise ConfigError(f'{key}: expected "module:function" or a FILE.py, got {spec!r}')
    else:
        fn = load_object(spec, key)
    if not callable(fn):
        raise ConfigError(f"{key}: {spec!r} is {type(fn).__name__}, not a function")
    return fn


def _file_module(path: str, key: str) -> Any:
    """The module the Python file at `path` (relative: to the directory furlong runs in) defines, run once."""
    file = os.path.abspath(path)
    if not os.path.isfile(file):
        raise ConfigError(f"{key}: no such file {path!r}")
    name = f"furlong_user_{hashlib.sha256(file.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look their module up there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 -- user code: whatever it raises, the config names it
        del sys.modules[name]
        raise ConfigError(f"{key}: importing {path} failed: {type(exc).__name__}: {exc}") from None
    return module


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
    fns = [
        RewardFn(
            name=name,
            weight=r.weight,
            timeout_s=r.timeout_s,
            command=r.command,
            params=r.params,
            python=load_object(r.python, f"train.env.rewards.{name}.python") if r.python else None,
        )
        for name, r in env.rewards.items()
    ]
    if env.python is not None and (commands := [f.name for f in fns if f.command is not None]):
        raise ConfigError(
            f"train.env.rewards: {commands} are commands, which run in a sandbox; a Python "
            "environment has none (use python: module:function)"
        )
    return Scorer(fns, own_weight=env.tests_weight, own="steps" if env.python else "tests")


def env_source(
    t: TrainConfig, backend: SandboxBackend, network: TaskNetwork | None = None
) -> HarborSource | PythonSource | PromptSource:
    """The run's instances: a Python environment's (train.env.python), a prompt dataset's rows
    (train.env.prompts), or the task families' (their generators run on `backend`): all their train
    instances, and train.eval.heldout_per_family held-out ones each (those that name no network mode with
    `network`'s phases)."""
    if t.env.python is not None:
        return python_source(t.env, {"train": t.env.train_instances, "heldout": t.eval.heldout_per_family})
    if t.env.prompts.active:
        return prompt_source(t.env, {"heldout": t.eval.heldout_per_family})
    families = [load_family(t.tasks / name, backend) for name in t.families]
    for f in families:
        if len(f.seeds["heldout"]) < t.eval.heldout_per_family:
            raise ConfigError(
                f"train.eval.heldout_per_family: {t.eval.heldout_per_family} requested, but family "
                f"{f.name!r} has {len(f.seeds['heldout'])} held-out instances"
            )
    return HarborSource(families, {"heldout": t.eval.heldout_per_family}, network)


def python_source(env: EnvConfig, counts: dict[str, int]) -> PythonSource:
    """A Python environment's instances, `counts[split]` of each split."""
    factory = load_object(env.python or "", "train.env.python")
    return PythonSource(factory, env.family() or "", counts, env.agent_timeout_s, extra_tools(env))


def prompt_source(env: EnvConfig, limits: dict[str, int]) -> PromptSource:
    """A prompt dataset's rows of each split, checked now (a bad row is an error before the run starts)."""
    p = env.prompts
    if p.path is not None:
        tables = dataset_splits(p.path, p.format, p.split_field, p.splits, p.heldout_fraction)
    else:
        assert p.train_path is not None and p.heldout_path is not None  # PromptsConfig checked it
        tables = file_splits(p.train_path, p.heldout_path, p.format)
    return PromptSource(
        tables, Fields(p.prompt_field, p.system_field, p.answer_field), p.family(), env.agent_timeout_s, limits
    )


@dataclass(frozen=True)
class RunEnv:
    """The environment every phase of a run opens its episodes in: Harbor tasks in warm-pooled sandboxes
    (`factory` None), or the user's Python environment; with the same tools and reward functions."""

    backend: SandboxBackend
    images: ImageLookup
    tools: tuple[Tool, ...] = ()
    scorer: Scorer = TESTS_ONLY
    factory: Any = None  # a Python environment's factory
    prompts: PromptEnv | None = None  # a prompt dataset's: nothing to start or close per phase
    sessions: Callable[[], AbstractAsyncContextManager[Environment]] | None = None  # an OpenEnv server's
    layers: LayerSource | None = None  # this host's image store: a separate verifier's image shows its tests

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
        if self.prompts is not None:
            yield self.prompts
            return
        async with WarmPools(self.backend, self.images) as pools:
            yield HarborEnv(pools, self.tools, self.scorer, self.layers)


def run_env(
    env: EnvConfig,
    backend: SandboxBackend,
    images: ImageLookup,
    sessions: Callable[[], AbstractAsyncContextManager[Environment]] | None = None,
    layers: LayerSource | None = None,
) -> RunEnv:
    """The run's environment; `sessions`: an OpenEnv server's (train.env.openenv), which brings its own
    tools and rewards; `layers`: the image store, where it is on this host."""
    if sessions is not None:
        if env.tools or env.rewards:
            raise ConfigError(
                "train.env.tools and train.env.rewards: an OpenEnv server (train.env.openenv) "
                "brings its own tools and rewards"
            )
        return RunEnv(backend, images, sessions=sessions)
    if env.prompts.active:
        reward = load_callable(env.prompts.reward or "", "train.env.prompts.reward")
        return RunEnv(backend, images, prompts=PromptEnv(reward, env.prompts.reward_timeout_s))
    tools, scoring = extra_tools(env), scorer(env)
    factory = load_object(env.python, "train.env.python") if env.python else None
    if env.demonstrations and isinstance(factory, type) and not callable(getattr(factory, "demonstrate", None)):
        raise ConfigError(
            f"train.env.demonstrations: {env.python} has no demonstrate() method returning the "
            "Actions that solve an instance (docs/environments.md)"
        )
    if factory is None:
        try:
            HarborEnv(None, tools, scoring)  # type: ignore[arg-type]  # checks the tools beside bash
        except ValueError as exc:
            raise ConfigError(f"train.env.tools: {exc}") from None
    return RunEnv(backend, images, tools, scoring, factory, layers=layers)
