"""Loads Harbor and Terminal-Bench 1.0 task directories into `Task`s (furlong.tasks.suite loads a directory of them).

A Harbor task's shape is resolved here as Harbor resolves it (harbor's models/task/verifier_mode.py and
paths.py): where each step's tests run (its own sandbox or the agent's), which image that sandbox has,
which tests and solution each step uses. The schema is furlong.tasks.harbor_toml.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from furlong.sandbox.base import Limits, SyscallPolicy
from furlong.sandbox.runtime import seccomp
from furlong.tasks import harbor_toml as ht
from furlong.tasks.artifacts import unsafe_source
from furlong.tasks.model import (
    Artifact,
    CollectHook,
    Step,
    Task,
    TaskError,
    TaskNetwork,
    VerifierEnvironment,
    step_task,
)
from furlong.tasks.network import TableNetwork, baseline, explicit, resolve


class _TerminalBenchYaml(BaseModel):
    model_config = ConfigDict(extra="ignore")  # task.yaml carries many keys for TB1's own harness

    instruction: str
    max_agent_timeout_sec: float = Field(180.0, gt=0)
    max_test_timeout_sec: float = Field(30.0, gt=0)


def _validated(model: type[BaseModel], data: Any, task: str, file: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            known = ", ".join(_model_at(model, err["loc"][:-1]).model_fields)
            raise TaskError(task, file, f"unknown key {field!r} (known here: {known})") from None
        raise TaskError(task, file, f"field {field!r}: {err['msg']} (got {err.get('input')!r})") from None


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The table at `loc` (list indices skipped, `X | None` and `list[X]` looked through)."""
    for key in loc:
        if isinstance(key, int):
            continue
        model = _inner_model(model.model_fields[str(key)].annotation)
    return model


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (typing.Union, list):
        for arg in typing.get_args(annotation):
            if (found := _inner_model(arg)) is not None:
                return found
    return None


def _read(path: Path, task: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise TaskError(task, path.name, "missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(task, path.name, f"unreadable: {exc}") from None


def load_harbor(path: Path, task_id: str | None = None) -> Task:
    tid = task_id or path.name
    try:
        raw = tomllib.loads(_read(path / "task.toml", tid))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(tid, "task.toml", f"invalid TOML: {exc}") from None
    conf: ht.HarborToml = _validated(ht.HarborToml, raw, tid, "task.toml")
    _unsupported(conf, tid)
    env = conf.environment
    dockerfile = path / "environment" / "Dockerfile"
    solution = path / "solution" / "solve.sh"
    separate = _separate(conf, None, path, tid)
    test_script = path / "tests" / "test.sh"
    if not conf.steps and not (separate and separate.bundled_tests) and not test_script.is_file():
        raise TaskError(
            tid,
            "tests/test.sh",
            "missing: a Harbor task needs tests/test.sh (or tests/Dockerfile "
            "for a separate verifier whose image holds its tests)",
        )
    task = Task(
        id=tid,
        path=path,
        instruction="" if conf.steps else _read(path / "instruction.md", tid),
        dockerfile=dockerfile if dockerfile.is_file() else None,
        agent_timeout_s=conf.agent.timeout_sec,
        verifier_timeout_s=conf.verifier.timeout_sec,
        tests_dir=path / "tests" if (path / "tests").is_dir() else None,
        test_script=test_script,
        solution=solution if solution.is_file() else None,
        network=_phase_network(conf, None, tid),
        limits=Limits(cpus=env.cpus, memory_mb=env.memory_mb),
        syscalls=_syscalls(env, tid, "environment"),
        verifier_env=tuple(sorted(conf.verifier.env.items())),
        format="harbor",
        solution_env=tuple(sorted(conf.solution.env.items())),
        verifier_toolchain=conf.furlong.verifier_toolchain,
        trust_agent_tools=conf.verifier.trust_agent_tools,
        separate=separate,
        artifacts=_artifacts(conf.artifacts),
        collect=_hooks(conf.verifier.collect),
        reward_strategy=conf.multi_step_reward_strategy or "mean",
        docker_image=conf.environment.docker_image,
        agent_user=_agent_user(conf, tid),
    )
    if not conf.steps:
        return task
    steps = tuple(_step(conf, s, task, tid) for s in conf.steps)
    return dataclasses.replace(step_task(task, steps[0]), steps=steps)


def _step(conf: ht.HarborToml, step: ht.Step, task: Task, tid: str) -> Step:
    """One [[steps]] entry, resolved: what it inherits from the task, and its own files under steps/<name>/."""
    where = f"steps/{step.name}"
    home = task.path / "steps" / step.name
    if not home.is_dir():
        raise TaskError(tid, where, "missing: every [[steps]] entry needs its directory")
    separate = _separate(conf, step, task.path, tid)
    own_tests = home / "tests"
    script = own_tests / "test.sh" if (own_tests / "test.sh").is_file() else task.path / "tests" / "test.sh"
    if not (separate and separate.bundled_tests) and not script.is_file():
        raise TaskError(tid, f"{where}/tests/test.sh", "missing, and so is tests/test.sh: the step has no tests")
    solution = home / "solution" / "solve.sh" if (home / "solution").is_dir() else task.solution
    if step.min_reward is None:
        gate = None
    else:
        gate = (
            (("reward", step.min_reward),)
            if isinstance(step.min_reward, float)
            else tuple(sorted(step.min_reward.items()))
        )
    workdir = home / "workdir"
    return Step(
        name=step.name,
        instruction=_read(home / "instruction.md", tid),
        agent_timeout_s=step.agent.timeout_sec or conf.agent.timeout_sec,
        # as Harbor's: a step's own [verifier] timeout_sec (600 unless given), never the task's
        verifier_timeout_s=step.verifier.timeout_sec,
        test_script=script,
        tests_overlay=own_tests if own_tests.is_dir() else None,
        solution=solution if solution is None or solution.is_file() else None,
        verifier_env=tuple(sorted({**conf.verifier.env, **step.verifier.env}.items())),
        separate=separate,
        artifacts=task.artifacts + _artifacts(step.artifacts),
        collect=task.collect + _hooks(step.verifier.collect),
        workdir=workdir if workdir.is_dir() else None,
        min_reward=gate,
        network=_phase_network(conf, step, tid),
    )


def _separate(conf: ht.HarborToml, step: ht.Step | None, path: Path, tid: str) -> VerifierEnvironment | None:
    """Where the tests run when they do not share the agent's sandbox (Harbor's resolution): None for
    "shared". The image: a tests/Dockerfile (the step's own first, then the task's) builds one that holds
    its tests; else a fresh sandbox of the task's own image. Its limits: [verifier.environment] (the step's,
    then the task's), else the task's [environment]; its network is the tests' phase's (_phase_network)."""
    mode = (step.verifier.mode if step else None) or conf.verifier.mode or "shared"
    if mode == "shared":
        return None
    own = step.verifier.environment if step else None
    env = own or conf.verifier.environment or conf.environment
    where = f"steps.{step.name}.verifier" if step else "verifier"
    dirs = ([(own, path / "steps" / step.name / "tests")] if step else []) + [
        (conf.verifier.environment, path / "tests")
    ]
    dockerfile, bundled = path / "environment" / "Dockerfile", False
    for declared, directory in dirs:
        if declared is not None and declared.docker_image:
            raise TaskError(
                tid,
                "task.toml",
                f"field '{where}.environment.docker_image': a prebuilt verifier "
                "image is not supported (give tests/Dockerfile)",
            )
        if (directory / "docker-compose.yaml").is_file():
            raise TaskError(
                tid,
                str(directory.relative_to(path) / "docker-compose.yaml"),
                "a docker-compose verifier environment is not supported (one Dockerfile)",
            )
        if (directory / "Dockerfile").is_file():
            dockerfile, bundled = directory / "Dockerfile", True
            break
    table = "environment" if env is conf.environment else f"{where}.environment"
    return VerifierEnvironment(
        dockerfile=dockerfile if dockerfile.is_file() else None,
        bundled_tests=bundled,
        limits=Limits(cpus=env.cpus, memory_mb=env.memory_mb),
        syscalls=_syscalls(env, tid, table),
    )


def _artifacts(entries: Sequence[ht.Artifact]) -> tuple[Artifact, ...]:
    return tuple(Artifact(source=str(PurePosixPath("/", e.source)), exclude=tuple(e.exclude)) for e in entries)


def _hooks(hooks: Sequence[ht.Collect]) -> tuple[CollectHook, ...]:
    return tuple(CollectHook(command=h.command, timeout_s=h.timeout_sec) for h in hooks)


def _unsupported(conf: ht.HarborToml, task: str) -> None:
    """Harbor task shapes furlong cannot run as written: refused by name, never run differently."""
    envs = [("environment", conf.environment), ("verifier.environment", conf.verifier.environment)]
    envs += [(f"steps.{s.name}.verifier.environment", s.verifier.environment) for s in conf.steps]
    for where, env in envs:
        if env is not None and env.os != "linux":
            raise TaskError(task, "task.toml", f"field '{where}.os': {env.os!r}: furlong's sandboxes are Linux")
    artifacts = [("artifacts", a) for a in conf.artifacts]
    artifacts += [(f"steps.{s.name}.artifacts", a) for s in conf.steps for a in s.artifacts]
    for where, artifact in artifacts:
        if unsafe_source(artifact.source):
            raise TaskError(
                task,
                "task.toml",
                f"field '{where}': {artifact.source!r} is the verifier's own "
                "(/tests, /logs/verifier), never the agent's to hand over",
            )
        if artifact.service not in (None, ht.MAIN_SERVICE):
            raise TaskError(
                task,
                "task.toml",
                f"field '{where}': service {artifact.service!r}: docker-compose "
                "sidecar services are not supported (one sandbox per phase)",
            )
    hooks = [("verifier.collect", h) for h in conf.verifier.collect]
    hooks += [(f"steps.{s.name}.verifier.collect", h) for s in conf.steps for h in s.verifier.collect]
    for where, hook in hooks:
        if hook.service != ht.MAIN_SERVICE:
            raise TaskError(
                task,
                "task.toml",
                f"field '{where}': service {hook.service!r}: docker-compose "
                "sidecar services are not supported (hooks run in the agent's sandbox)",
            )


def _agent_user(conf: ht.HarborToml, tid: str) -> str | None:
    """[agent] user, as the image's USER is written. One sandbox serves every step, and its agent's identity is
    fixed when it starts, so a step may not name another."""
    user = None if conf.agent.user is None else str(conf.agent.user)
    for step in conf.steps:
        if step.agent.user is not None and str(step.agent.user) != user:
            raise TaskError(
                tid,
                "task.toml",
                f"field 'steps.{step.name}.agent.user': {step.agent.user!r} differs from "
                f"[agent] user {user!r}: every step's agent runs in one sandbox, as one user",
            )
    return user


def _phase_network(conf: ht.HarborToml, step: ht.Step | None, tid: str) -> TaskNetwork:
    """Each phase's network, as Harbor resolves it (furlong.tasks.network): a step's own [agent] and [verifier]
    tables first; for tests in a separate verifier's sandbox, that environment's own `network_mode` (a
    [verifier.environment] that names one) is the tests' baseline, as Harbor's separate environment's is."""
    env = conf.environment
    steps = (
        (_table(f"steps.{step.name}.agent", step.agent), _table(f"steps.{step.name}.verifier", step.verifier))
        if step is not None
        else (None, None)
    )
    network = resolve(
        _table("environment", env),
        _legacy(env),
        _table("agent", conf.agent),
        _table("verifier", conf.verifier),
        tid,
        *steps,
    )
    own = _separate_environment(conf, step)
    if own is None:
        return network
    where, sep_env = own
    named = (explicit(steps[1], tid) if steps[1] is not None else None) or explicit(
        _table("verifier", conf.verifier), tid
    )
    tests = named or baseline(_table(f"{where}.environment", sep_env), _legacy(sep_env), tid)
    return dataclasses.replace(network, verifier=tests) if tests is not None else network


def _table(where: str, table: ht.Agent | ht.Verifier | ht.Environment) -> TableNetwork:
    return TableNetwork(where, table.network_mode, table.allowed_hosts)


def _legacy(env: ht.Environment) -> bool | None:
    """The older spellings of `network_mode`: Harbor's allow_internet, furlong's network (None: neither)."""
    return env.allow_internet if env.allow_internet is not None else env.network


def _separate_environment(conf: ht.HarborToml, step: ht.Step | None) -> tuple[str, ht.Environment] | None:
    """A separate verifier's own [verifier.environment] table (a step's first), where the tests run in one."""
    mode = (step.verifier.mode if step else None) or conf.verifier.mode or "shared"
    if mode == "shared":
        return None
    if step is not None and step.verifier.environment is not None:
        return f"steps.{step.name}.verifier", step.verifier.environment
    if conf.verifier.environment is not None:
        return "verifier", conf.verifier.environment
    return None


def _syscalls(env: ht.Environment, task: str, where: str) -> SyscallPolicy:
    try:
        seccomp.check(env.seccomp_allow)
    except seccomp.SeccompError as exc:
        raise TaskError(task, "task.toml", f"field '{where}.seccomp_allow': {exc}") from None
    return SyscallPolicy(enabled=env.seccomp, allow=tuple(env.seccomp_allow))


def load_terminal_bench(path: Path, task_id: str | None = None) -> Task:
    tid = task_id or path.name
    try:
        raw = yaml.safe_load(_read(path / "task.yaml", tid))
    except yaml.YAMLError as exc:
        raise TaskError(tid, "task.yaml", f"invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise TaskError(tid, "task.yaml", f"expected a mapping at the top level, got {type(raw).__name__}")
    conf: _TerminalBenchYaml = _validated(_TerminalBenchYaml, raw, tid, "task.yaml")
    test_script = path / "run-tests.sh"
    if not test_script.is_file():
        raise TaskError(tid, "run-tests.sh", "missing: a Terminal-Bench task needs run-tests.sh")
    tests = path / "tests"
    dockerfile, solution = path / "Dockerfile", path / "solution.sh"
    return Task(
        id=tid,
        path=path,
        instruction=conf.instruction,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        agent_timeout_s=conf.max_agent_timeout_sec,
        verifier_timeout_s=conf.max_test_timeout_sec,
        tests_dir=tests if tests.is_dir() else None,
        test_script=test_script,
        solution=solution if solution.is_file() else None,
        format="terminal-bench",
    )


def load_task(path: Path) -> Task:
    path = Path(path)
    if (path / "task.toml").exists():
        return load_harbor(path)
    if (path / "task.yaml").exists():
        return load_terminal_bench(path)
    raise TaskError(path.name, str(path), "not a task directory (no task.toml or task.yaml)")


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").exists() or (path / "task.yaml").exists()
