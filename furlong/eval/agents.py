"""Scripted agents for `furlong eval`: the oracle (the task's own solution) and a do-nothing agent.

A model-driven agent implements the same `Agent` protocol.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from furlong.sandbox.base import ExecResult, Sandbox
from furlong.tasks.model import Task

SOLUTION_DIR = "/solution"


@dataclass(frozen=True)
class AgentRun:
    commands: int = 0
    timed_out: bool = False


class Agent(Protocol):
    name: str

    async def run(self, task: Task, sandbox: Sandbox, timeout_s: float) -> AgentRun: ...


class TimedSandbox:
    """Wraps a sandbox to add up the wall time spent in its commands (the episode's agent_commands)."""

    def __init__(self, inner: Sandbox):
        self.inner = inner
        self.seconds = 0.0
        self.commands = 0

    async def exec(self, cmd: str, timeout_s: float = 60.0, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        start = time.perf_counter()
        try:
            return await self.inner.exec(cmd, timeout_s, cwd, env)
        finally:
            self.seconds += time.perf_counter() - start
            self.commands += 1

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class NoopAgent:
    name = "noop"

    async def run(self, task: Task, sandbox: Sandbox, timeout_s: float) -> AgentRun:
        return AgentRun()


class OracleAgent:
    """Runs the task's solution script, as Harbor's oracle does."""

    name = "oracle"

    async def run(self, task: Task, sandbox: Sandbox, timeout_s: float) -> AgentRun:
        if task.solution is None:
            raise ValueError(f"task {task.id!r} has no solution for the oracle agent")
        if task.solution.parent == task.path:  # Terminal-Bench: a lone solution.sh beside task.yaml
            await sandbox.write_file(f"{SOLUTION_DIR}/{task.solution.name}", task.solution.read_bytes(), 0o755)
        else:
            await sandbox.put_dir(task.solution.parent, SOLUTION_DIR)
        res = await sandbox.exec(f"bash {SOLUTION_DIR}/{task.solution.name}", timeout_s=timeout_s)
        return AgentRun(commands=1, timed_out=res.timed_out)


AGENTS = {"oracle": OracleAgent, "noop": NoopAgent}


def make_agent(name: str) -> Agent:
    try:
        return AGENTS[name]()
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; known: {', '.join(AGENTS)}") from None
