"""Loads Harbor and Terminal-Bench 1.0 task directories into `Task`s (furlong.tasks.suite loads a directory of them)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from furlong.sandbox import seccomp
from furlong.sandbox.base import Limits, SyscallPolicy
from furlong.tasks.model import Task, TaskError, TaskNetwork
from furlong.tasks.network import TableNetwork, resolve


class _Section(BaseModel):
    """A task.toml table. A key that neither Harbor nor furlong defines is an error naming it: a typo such
    as `timeout_secs` must not leave the task on a default. Harbor's keys that furlong does not act on are
    declared `Any` so that Harbor's tasks keep loading."""

    model_config = ConfigDict(extra="forbid")


NetworkMode = Literal["no-network", "public", "allowlist"]


class _Agent(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    user: Any = None  # Harbor's; the agent runs as the sandbox's user
    network_mode: NetworkMode | None = None  # Harbor's phase override: see furlong.tasks.network
    allowed_hosts: list[str] | None = None

    def table(self, where: str) -> TableNetwork:
        return TableNetwork(where, self.network_mode, self.allowed_hosts)


class _Verifier(_Section):
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = {}
    # furlong's: the agent may replace what the tests execute (the task is about a tool); see
    # furlong.tasks.integrity. Tampering is still recorded in the episode, but not scored 0.
    trust_agent_tools: bool = False
    user: Any = None  # Harbor's keys for a separate verifier user or sandbox: furlong verifies in the agent's
    environment: Any = None
    environment_mode: Literal["shared", "separate"] | None = None
    collect: Any = None
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] | None = None

    def table(self, where: str) -> TableNetwork:
        return TableNetwork(where, self.network_mode, self.allowed_hosts)


class _Environment(_Section):
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    network_mode: NetworkMode | None = None  # Harbor >= 0.2's; wins over the older allow_internet
    allowed_hosts: list[str] | None = None
    allow_internet: bool | None = None
    network: bool | None = None  # furlong's older spelling of allow_internet
    os: Literal["linux", "windows"] = "linux"
    seccomp: bool = True  # furlong's own keys: the syscall filter, and names taken off its deny list
    seccomp_allow: list[str] = []
    # Harbor's keys furlong does not act on: the image comes from environment/Dockerfile, and there are
    # no GPUs, storage quotas, MCP servers or skills in a sandbox
    build_timeout_sec: Any = None
    docker_image: Any = None
    storage_mb: Any = None
    gpus: Any = None
    gpu_types: Any = None
    tpu: Any = None
    mcp_servers: Any = None
    env: Any = None
    skills_dir: Any = None
    healthcheck: Any = None
    workdir: Any = None
    memory: str | None = None  # Harbor's deprecated spelling of memory_mb ("4G", "512M")
    storage: Any = None

    @field_validator("memory")
    @classmethod
    def _size(cls, size: str | None) -> str | None:
        if size is not None:
            _megabytes(size)
        return size

    @model_validator(mode="after")
    def _memory_spelling(self) -> _Environment:
        if self.memory is not None and "memory_mb" not in self.model_fields_set:
            self.memory_mb = _megabytes(self.memory)
        return self


def _megabytes(size: str) -> int:
    units = {"G": 1024, "M": 1, "K": 1 / 1024}
    number, unit = size.strip()[:-1], size.strip()[-1:].upper()
    try:
        mb = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise ValueError("expected a size like '4G' or '512M'") from None
    if mb <= 0:
        raise ValueError("under a megabyte")
    return mb


class _Furlong(_Section):
    """furlong's own task.toml table, named so that no Harbor field can clash with it."""

    verifier_toolchain: bool = False  # furlong.sandbox.toolchain: uv, uvx and pytest for the tests, offline too


class _Solution(_Section):
    env: dict[str, str] = {}  # the oracle's solve.sh runs with these


class _HarborToml(_Section):
    agent: _Agent = _Agent()
    verifier: _Verifier = _Verifier()
    environment: _Environment = _Environment()
    solution: _Solution = _Solution()
    furlong: _Furlong = _Furlong()
    metadata: dict[str, Any] = {}  # free-form: author, difficulty, tags...
    steps: list[Any] = []  # Harbor's multi-step tasks: refused in _unsupported
    # Harbor's top-level keys furlong does not read
    version: Any = None
    schema_version: Any = None
    task: Any = None
    source: Any = None
    artifacts: Any = None
    multi_step_reward_strategy: Any = None


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
            known = _known(model, err["loc"][:-1])
            raise TaskError(task, file, f"unknown key {field!r} (known here: {known})") from None
        raise TaskError(task, file, f"field {field!r}: {err['msg']} (got {err.get('input')!r})") from None


def _known(model: type[BaseModel], loc: tuple) -> str:
    """The keys the table at `loc` takes, for an unknown-key error."""
    for key in loc:
        model = model.model_fields[str(key)].annotation
    return ", ".join(model.model_fields)


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
    _unsupported(conf, tid)
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
        network=_network(conf, tid),
        limits=Limits(cpus=env.cpus, memory_mb=env.memory_mb), syscalls=_syscalls(env, tid),
        verifier_env=tuple(sorted(conf.verifier.env.items())), format="harbor",
        solution_env=tuple(sorted(conf.solution.env.items())),
        verifier_toolchain=conf.furlong.verifier_toolchain, trust_agent_tools=conf.verifier.trust_agent_tools,
    )


def _unsupported(conf: _HarborToml, task: str) -> None:
    """Harbor task shapes furlong cannot run as written: refused by name, never run differently."""
    if conf.steps:
        raise TaskError(task, "task.toml", "field 'steps': multi-step tasks are not supported (one instruction, "
                                           "one tests/test.sh per task)")
    if conf.environment.os != "linux":
        raise TaskError(task, "task.toml", f"field 'environment.os': {conf.environment.os!r}: furlong's sandboxes "
                                           "are Linux")
    v = conf.verifier
    if v.environment_mode == "separate" or (v.environment_mode is None and v.environment is not None):
        raise TaskError(task, "task.toml", "field 'verifier.environment_mode': 'separate' is not supported: furlong "
                                           "runs the tests in the agent's sandbox once the agent stops (set it "
                                           "to 'shared' and drop tests/Dockerfile and [verifier.environment])")


def _network(conf: _HarborToml, task: str) -> TaskNetwork:
    """Each phase's network, as Harbor resolves it (furlong.tasks.network)."""
    env = conf.environment
    legacy = env.allow_internet if env.allow_internet is not None else env.network
    environment = TableNetwork("environment", env.network_mode, env.allowed_hosts)
    return resolve(environment, legacy, conf.agent.table("agent"), conf.verifier.table("verifier"), task)


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
