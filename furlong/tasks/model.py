"""The one task model that Harbor and Terminal-Bench 1.0 directories load into."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from furlong.sandbox.base import ImageSource, Limits, Prebuilt, SyscallPolicy
from furlong.sandbox.network import NO_NETWORK, NetworkPolicy

TESTS_DIR = "/tests"  # where the task's tests are copied, after the agent finishes
VERIFIER_LOG_DIR = "/logs/verifier"  # where tests write reward.txt / reward.json
ARTIFACTS_DIR = "/logs/artifacts"  # Harbor's convention dir: what the agent leaves there reaches a separate verifier
REWARD_STRATEGIES = ("mean", "final")  # task.toml multi_step_reward_strategy


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
class Artifact:
    """One path of the agent's sandbox that a separate verifier receives, at the same path (Harbor's
    `artifacts` entry; its `destination` only places Harbor's host copy, so furlong has no use for it)."""

    source: str  # absolute (a relative one is taken from /, as `docker cp` does)
    exclude: tuple[str, ...] = ()  # tar --exclude patterns, for a directory


@dataclass(frozen=True)
class CollectHook:
    """A `[[verifier.collect]]` command: run in the agent's sandbox, as the agent, once the agent phase ends
    and before the artifacts are collected (best effort: its failure changes nothing)."""

    command: str
    timeout_s: float = 60.0


@dataclass(frozen=True)
class VerifierEnvironment:
    """Where a separate verifier runs (Harbor's environment_mode = "separate"): a sandbox of its own."""

    dockerfile: Path | None  # its image (tests/Dockerfile, or the task's environment/Dockerfile); None: the base
    bundled_tests: bool  # the image holds the tests at /tests (built from the tests directory): none copied in
    limits: Limits = field(default_factory=Limits)
    syscalls: SyscallPolicy = field(default_factory=SyscallPolicy)


@dataclass(frozen=True)
class Step:
    """One of a multi-step task's `[[steps]]`, resolved as Harbor resolves it. Its fields of Task's names
    replace the task's for the step (`step_task`)."""

    name: str
    instruction: str  # steps/<name>/instruction.md
    agent_timeout_s: float
    verifier_timeout_s: float
    test_script: Path  # steps/<name>/tests/test.sh, else tests/test.sh
    tests_overlay: Path | None  # steps/<name>/tests: copied into /tests over the task's tests/
    solution: Path | None  # steps/<name>/solution/solve.sh, else the task's
    verifier_env: tuple[tuple[str, str], ...]  # the task's [verifier] env, then the step's
    separate: VerifierEnvironment | None
    artifacts: tuple[Artifact, ...]  # the task's, then the step's
    collect: tuple[CollectHook, ...]
    workdir: Path | None = None  # steps/<name>/workdir: copied into the working directory before the step
    min_reward: tuple[tuple[str, float], ...] | None = None  # below any: the steps after this one do not run
    network: TaskNetwork = TaskNetwork()  # each phase's, the step's own tables first (furlong.tasks.network)


STEP_FIELDS = (
    "instruction",
    "agent_timeout_s",
    "verifier_timeout_s",
    "test_script",
    "tests_overlay",
    "solution",
    "verifier_env",
    "separate",
    "artifacts",
    "collect",
    "network",
)


@dataclass(frozen=True)
class Task:
    id: str
    path: Path
    instruction: str  # a multi-step task's: its first step's
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
    separate: VerifierEnvironment | None = None  # None: the tests run in the agent's sandbox (Harbor's "shared")
    artifacts: tuple[Artifact, ...] = ()  # declared entries; the convention dir is always collected too
    collect: tuple[CollectHook, ...] = ()
    tests_overlay: Path | None = None  # a step's own tests/, copied over tests_dir
    steps: tuple[Step, ...] = ()  # Harbor's [[steps]], run in order in one sandbox
    reward_strategy: str = "mean"  # multi_step_reward_strategy: mean | final
    docker_image: str | None = None  # task.toml [environment] docker_image: Harbor's prebuilt image
    agent_user: str | None = None  # task.toml [agent] user (a name or uid): the agent's identity, not the image's USER

    @property
    def image_source(self) -> ImageSource:
        """What the task's image is made from: the prebuilt image where it names one (with its Dockerfile, for
        where no registry serves it: furlong.sandbox.images.prebuilt), else its Dockerfile, else None (the base)."""
        if self.docker_image:
            return Prebuilt(
                self.docker_image, self.dockerfile, f"task {self.id!r}: task.toml: environment.docker_image"
            )
        return self.dockerfile

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

    def network_policies(self) -> tuple[NetworkPolicy, ...]:
        """Every policy the episode's phases use, in order, once each (a sandbox is set up to switch among
        them: furlong.sandbox.pool.sandbox_spec)."""
        found = [self.agent_network, self.verifier_network]
        for step in self.steps:
            found += [step.network.agent or self.agent_network, step.network.verifier or self.verifier_network]
        return tuple(dict.fromkeys(found))


def step_task(task: Task, step: Step) -> Task:
    """The task as one step of it runs: the step's instruction, timeouts, tests, solution and verifier."""
    return dataclasses.replace(task, steps=(), **{name: getattr(step, name) for name in STEP_FIELDS})


def phases(task: Task) -> tuple[Task, ...]:
    """What an episode runs, in order: each step of a multi-step task, or the task itself."""
    return tuple(step_task(task, s) for s in task.steps) if task.steps else (task,)


def verifier_dockerfiles(task: Task) -> tuple[Path | None, ...]:
    """The images a task's separate verifiers run in (none for a task whose tests share its sandbox)."""
    return tuple(dict.fromkeys(p.separate.dockerfile for p in phases(task) if p.separate is not None))
