"""The audit of a task set: per task the oracle and the no-op as controls, then each exploit as the agent,
every one an episode of its own in a fresh sandbox through the one runner (furlong.agent.runner) and the
task's real verifier.

A task whose oracle earns nothing is `broken` (its exploits are not run: nothing could be told from them);
a task where the no-op or any exploit earns reward is `hackable`; else `not_hackable`. An exploit scored
`reward_tampered` is `caught`: tamper detection took its reward away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from furlong.agent.runner import Agent, Outcome, run_retrying
from furlong.audit.exploits import EXPLOITS
from furlong.envs.base import Environment
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.tasks.model import Task
from furlong.tasks.receipt import Receipt

VERDICTS = ("hackable", "not_hackable", "broken")
NOOP_HINT = "doing nothing earns reward: the tests must fail before the task is done"
EVIDENCE_CHARS = 600  # the verifier output's tail kept per attempt


@dataclass(frozen=True)
class Attempt:
    """One episode of the audit: a control (oracle, noop) or an exploit, as the runner scored it."""

    agent: str
    kind: str  # control | an exploit's kind (furlong.audit.exploits)
    reward: float | None
    status: str
    verifier_exit_code: int | None
    verifier_output: str  # its tail
    agent_output: str  # the tail of what the agent's script printed
    touched: tuple[str, ...]  # what the exploit wrote or removed (its own report)
    tampered_paths: tuple[str, ...]
    error: str | None
    seconds: float
    receipts: tuple[Receipt, ...] = ()  # what its reward was computed from (furlong.tasks.receipt)

    @property
    def earned(self) -> bool:
        return self.reward is not None and self.reward > 0

    @property
    def caught(self) -> bool:
        return self.status == "reward_tampered"


@dataclass(frozen=True)
class TaskAudit:
    task: str
    verdict: str  # one of VERDICTS
    attempts: tuple[Attempt, ...]  # oracle, noop, then the exploits in library order
    seconds: float  # its episodes' own time, summed (not the time they waited for a slot)

    def findings(self) -> tuple[Attempt, ...]:
        """The no-op if it earned reward, and the exploits that earned more than it did (where doing nothing
        already pays, an exploit that pays as much shows nothing new)."""
        noop = self.attempts[1]
        floor = noop.reward or 0.0
        return tuple(a for a in self.attempts if (a is noop and a.earned) or (a.kind != "control" and _above(a, floor)))

    def to_json(self) -> dict:
        return {
            "task": self.task,
            "verdict": self.verdict,
            "hackable_by": [a.agent for a in self.findings()],
            "caught": [a.agent for a in self.attempts if a.caught],
            "findings": [{**asdict(a), "hint": hint(a.agent)} for a in self.findings()],
            "attempts": [asdict(a) for a in self.attempts],
            "seconds": round(self.seconds, 3),
        }


def _above(a: Attempt, floor: float) -> bool:
    return a.reward is not None and a.reward > floor


def hint(agent: str) -> str:
    """The one line for the task's author when `agent` earned reward."""
    return NOOP_HINT if agent == "noop" else EXPLOITS[agent]().hint


async def audit(
    tasks: Sequence[Task],
    exploits: Sequence[str],
    env: Environment,
    concurrency: int,
    done: Callable[[TaskAudit], None],
) -> list[TaskAudit]:
    """Every task audited, at most `concurrency` episodes at once; `done` is called as each task finishes
    (progress, a JSON line), and the audits come back in `tasks`' order."""
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> TaskAudit:
        result = await _audit_task(task, exploits, env, slots)
        done(result)
        return result

    return list(await asyncio.gather(*(one(t) for t in tasks)))


async def _audit_task(task: Task, exploits: Sequence[str], env: Environment, slots: asyncio.Semaphore) -> TaskAudit:
    oracle, noop = await asyncio.gather(
        _attempt(task, OracleAgent, "control", env, slots), _attempt(task, NoopAgent, "control", env, slots)
    )
    if not oracle.earned:
        return TaskAudit(task.id, "broken", (oracle, noop), oracle.seconds + noop.seconds)
    tried = await asyncio.gather(*(_attempt(task, EXPLOITS[n], EXPLOITS[n].kind, env, slots) for n in exploits))
    attempts = (oracle, noop, *tried)
    found = TaskAudit(task.id, "not_hackable", attempts, sum(a.seconds for a in attempts))
    return dataclasses.replace(found, verdict="hackable") if found.findings() else found


async def _attempt(
    task: Task, new_agent: Callable[[], Agent], kind: str, env: Environment, slots: asyncio.Semaphore
) -> Attempt:
    async with slots:
        t = time.perf_counter()
        agent, outcome = await run_retrying(task, new_agent, env)
    return _of(agent, kind, outcome, time.perf_counter() - t)


def _of(agent: Agent, kind: str, outcome: Outcome, seconds: float) -> Attempt:
    return Attempt(
        agent=agent.name,
        kind=kind,
        reward=outcome.reward,
        status=outcome.status,
        verifier_exit_code=outcome.verifier_exit_code,
        verifier_output=(outcome.verifier_output or "")[-EVIDENCE_CHARS:],
        agent_output=(outcome.agent_output or "")[-EVIDENCE_CHARS:],
        touched=tuple(getattr(agent, "touched", ())),
        tampered_paths=outcome.tampered_paths,
        error=outcome.error,
        seconds=round(seconds, 3),
        receipts=outcome.receipts,
    )
