"""Scripted agents for `furlong eval`: the oracle (the task's own solution, a prompt row's answer) and a
do-nothing agent.

A model-driven agent implements the same `Agent` protocol (furlong.agent.runner); the runner times
the agent's sandbox calls and decides the outcome.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from furlong.agent.runner import Agent, AgentRun
from furlong.agent.tools import ToolRunner
from furlong.envs.base import Toolbox
from furlong.envs.prompts import PromptRow
from furlong.envs.toolset import ToolSet
from furlong.tasks.model import Task
from furlong.tasks.verifier import output_tail

__all__ = ["Agent", "AgentRun", "AnswerAgent", "EpisodeAgents", "NoopAgent", "OracleAgent", "agent_for", "make_agent"]

SOLUTION_DIR = "/solution"


@runtime_checkable
class EpisodeAgents(Protocol):
    """Makes a fresh agent for each episode: a model agent holds one conversation's state
    (furlong.eval.model). The scripted agents hold none, so one serves every episode."""

    name: str

    def for_episode(self, task: Task, sample: int) -> Agent: ...


def agent_for(agents: Agent | EpisodeAgents, task: Task, sample: int) -> Agent:
    """The agent that runs episode `sample` of `task`."""
    return agents.for_episode(task, sample) if isinstance(agents, EpisodeAgents) else agents


class NoopAgent:
    name = "noop"

    async def run(self, task: Task, tools: ToolSet, timeout_s: float) -> AgentRun:
        return AgentRun()


class OracleAgent:
    """Runs the task's solution script, as Harbor's oracle does (a Harbor episode's agent: it needs the sandbox)."""

    name = "oracle"

    async def run(self, task: Task, tools: ToolSet, timeout_s: float) -> AgentRun:
        sandbox = tools.sandbox
        if task.solution is None:
            raise ValueError(f"task {task.id!r} has no solution for the oracle agent")
        # Harbor copies the solution in as root; an image's USER could not create /solution itself
        as_root = getattr(sandbox, "agent_uid", 0) != 0
        if as_root:
            await sandbox.exec(f"mkdir -p {SOLUTION_DIR}", timeout_s=30, cwd="/", as_verifier=True)
        if task.solution.parent == task.path:  # Terminal-Bench: a lone solution.sh beside task.yaml
            await sandbox.write_file(
                f"{SOLUTION_DIR}/{task.solution.name}", task.solution.read_bytes(), 0o755, as_verifier=as_root
            )
        else:
            await sandbox.put_dir(task.solution.parent, SOLUTION_DIR, as_verifier=as_root)
        res = await sandbox.exec(
            f"bash {SOLUTION_DIR}/{task.solution.name}", timeout_s=timeout_s, env=dict(task.solution_env) or None
        )
        # Recorded so a 0 reward can be traced to a solution that failed, not only to the tests.
        return AgentRun(
            commands=1,
            timed_out=res.timed_out,
            last_exit_code=res.exit_code,
            last_output=output_tail(res.stdout, res.stderr),
        )


class AnswerAgent:
    """A prompt dataset's oracle: the row's reference answer as the model's one turn."""

    name = "oracle"

    async def run(self, row: PromptRow, tools: Toolbox, timeout_s: float) -> AgentRun:
        if row.answer is None:
            raise ValueError(f"{row.where} has no answer for the oracle agent (train.env.prompts.answer_field)")
        await ToolRunner(tools, timeout_s, observation_chars=4000).reply(row.answer)  # as a model turn goes
        return AgentRun()


AGENTS: dict[str, Callable[[], Agent]] = {"oracle": OracleAgent, "noop": NoopAgent}


def make_agent(name: str) -> Agent:
    try:
        return AGENTS[name]()
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; known: {', '.join(AGENTS)}") from None
