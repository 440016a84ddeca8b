"""Loads Harbor and Terminal-Bench 1.0 task directories into `Task`s (furlong.tasks.suite loads a directory of them)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from furlong.sandbox import seccomp
from furlong.sandbox.base import Limits, SyscallPolicy
from furlong.tasks.model import Task, TaskError


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Harbor ignores keys it does not know; so do we


class _Agent(_Section):
    timeout_sec: float = Field(600.0, gt=0)


class _Verifier(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = {}


class _Environment(_Section):
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    allow_internet: bool = False
    network: bool = False
    seccomp: bool = True  # furlong's own keys: the syscall filter, and names taken off its deny list
    seccomp_allow: list[str] = []


class _Furlong(_Section):
    """furlong's own task.toml table, named so that no Harbor field can clash with it."""

    verifier_toolchain: bool = False  # furlong.sandbox.toolchain: uv, uvx and pytest for the tests, offline too


class _HarborToml(_Section):
    agent: _Agent = _Agent()
    verifier: _Verifier = _Verifier()
    environment: _Environment = _Environment()
    furlong: _Furlong = _Furlong()


class _TerminalBenchYaml(_Section):
    instruction: str
    max_agent_timeout_sec: float = Field(180.0, gt=0)
    max_test_timeout_sec: float = Field(30.0, gt=0)


def _validated(model: type[BaseModel], data: Any, task: str, file: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise TaskError(task, file, f"field {field!r}: {err['msg']} (got {err.get('input')!r})") from None


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
    conf: _HarborToml = _validated(_HarborToml, raw, tid, "task.toml")
    instruction = _read(path / "instruction.md", tid)
    test_script = path / "tests" / "test.sh"
    if not test_script.is_file():
        raise TaskError(tid, "tests/test.sh", "missing: a Harbor task needs tests/test.sh")
    env = conf.environment
    dockerfile = path / "environment" / "Dockerfile"
    solution = path / "solution" / "solve.sh"
    return Task(
        id=tid, path=path, instruction=instruction,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        agent_timeout_s=conf.agent.timeout_sec, verifier_timeout_s=conf.verifier.timeout_sec,
        tests_dir=path / "tests", test_script=test_script,
        solution=solution if solution.is_file() else None,
        network=env.allow_internet or env.network,
        limits=Limits(cpus=env.cpus, memory_mb=env.memory_mb), syscalls=_syscalls(env, tid),
        verifier_env=tuple(sorted(conf.verifier.env.items())), format="harbor",
        verifier_toolchain=conf.furlong.verifier_toolchain,
    )


def _syscalls(env: _Environment, task: str) -> SyscallPolicy:
    try:
        seccomp.check(env.seccomp_allow)
    except seccomp.SeccompError as exc:
        raise TaskError(task, "task.toml", f"field 'environment.seccomp_allow': {exc}") from None
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
        id=tid, path=path, instruction=conf.instruction,
        dockerfile=dockerfile if dockerfile.is_file() else None,
        agent_timeout_s=conf.max_agent_timeout_sec, verifier_timeout_s=conf.max_test_timeout_sec,
        tests_dir=tests if tests.is_dir() else None, test_script=test_script,
        solution=solution if solution.is_file() else None, format="terminal-bench",
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
