"""The one task model that Harbor and Terminal-Bench 1.0 directories load into."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from furlong.sandbox.base import Limits, SyscallPolicy
from furlong.sandbox.network import NO_NETWORK, NetworkPolicy

TESTS_DIR = "/tests"  # where the task's tests are copied, after the agent finishes
VERIFIER_LOG_DIR = "/logs/verifier"  # where tests write reward.txt / reward.json


class TaskError(ValueError):
    """A task directory is malformed; the message names the task, file and field."""

    def __init__(self, task: str, file: str, problem: str):
        super().__init__(f"task {task!r}: {file}: {problem}")
        self.task, self.file, self.problem = task, file, problem


@dataclass(frozen=True)
class TaskNetwork:
    """The network of each phase (furlong.tasks.network resolves it from task.toml): the agent's, and the
    tests'. Both None: task.toml names no mode, so furlong's default applies (`sandbox.network`; offline
    where it has not been applied)."""

    agent: NetworkPolicy | None = None
    verifier: NetworkPolicy | None = None

    @property
    def named(self) -> bool:
        return self.agent is not None or self.verifier is not None


@dataclass(frozen=True)
class Task:
    id: str
    path: Path
    instruction: str
    dockerfile: Path | None  # None: the plain default base image
    agent_timeout_s: float
    verifier_timeout_s: float
    tests_dir: Path | None  # copied to /tests after the agent finishes
    test_script: Path  # the verifier's entry point, run as /tests/<name>
    solution: Path | None  # a shell script the oracle agent runs
    network: TaskNetwork = field(default_factory=TaskNetwork)
    limits: Limits = field(default_factory=Limits)
    syscalls: SyscallPolicy = field(default_factory=SyscallPolicy)  # task.toml [environment] seccomp*
    verifier_env: tuple[tuple[str, str], ...] = ()
    solution_env: tuple[tuple[str, str], ...] = ()  # task.toml [solution] env: the oracle's solve.sh runs with it
    verifier_toolchain: bool = False  # task.toml [furlong] verifier_toolchain: uv/uvx/pytest stacked on the image
    trust_agent_tools: bool = False  # task.toml [verifier] trust_agent_tools: tampering is recorded, not scored 0
    format: str = "harbor"  # harbor | terminal-bench
    family: str | None = None  # set for instances generated from a task family
    seed: int | None = None
    split: str | None = None  # train | heldout, for family instances

    @property
    def agent_network(self) -> NetworkPolicy:
        return self.network.agent or NO_NETWORK

    @property
    def verifier_network(self) -> NetworkPolicy:
        return self.network.verifier or NO_NETWORK

    @property
    def online(self) -> bool:
        """Whether either phase has any network."""
        return self.agent_network.online or self.verifier_network.online
