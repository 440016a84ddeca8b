"""Episodes for evaluation: a fresh sandbox per task, the agent phase, then the verifier phase."""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import asdict, dataclass, field

from furlong.eval.agents import Agent, TimedSandbox
from furlong.sandbox.base import ImageRef, SandboxDied, SandboxError, SandboxSpec
from furlong.tasks.model import Task
from furlong.tasks.verifier import verify

STATUSES = ("ok", "timeout", "infra_error")


@dataclass(frozen=True)
class Timing:
    sandbox_start: float = 0.0
    agent_commands: float = 0.0
    verifier: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.sandbox_start + self.agent_commands + self.verifier + self.other


@dataclass(frozen=True)
class EpisodeResult:
    task: str
    agent: str
    reward: float | None  # None for infra_error: an infrastructure failure is not a score
    status: str  # ok | timeout | infra_error
    timing: Timing
    error: str | None = None
    agent_timed_out: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    family: str | None = None
    seed: int | None = None
    split: str | None = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["timing"] = {k: round(v, 6) for k, v in out["timing"].items()}
        return out


class _Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: dict[str, float] = {}

    def lap(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.marks[name] = self.marks.get(name, 0.0) + now - since
        return now


async def run_episode(task: Task, agent: Agent, backend, image: ImageRef) -> EpisodeResult:
    """Never raises for a task's or the sandbox's fault: a failure becomes the episode's status."""
    clock, sandbox = _Clock(), None
    base = dict(task=task.id, agent=agent.name, family=task.family, seed=task.seed, split=task.split)
    try:
        t = time.perf_counter()
        sandbox = await backend.create(SandboxSpec(image=image, network=task.network, limits=task.limits))
        await sandbox.exec("true", timeout_s=30)  # ready for commands: that is what "started" means
        t = clock.lap("sandbox_start", t)
        timed = TimedSandbox(sandbox)
        agent_timed_out = await _agent_phase(task, agent, timed)
        t = clock.lap("agent_phase", t)
        verdict = await verify(task, sandbox, image.workdir)
        clock.lap("verifier", t)
    except (SandboxDied, SandboxError) as exc:
        return EpisodeResult(**base, reward=None, status="infra_error", timing=_timing(clock, None),
                             error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug in an agent must not take the run down with it
        return EpisodeResult(**base, reward=None, status="infra_error", timing=_timing(clock, None),
                             error="".join(traceback.format_exception_only(exc)).strip())
    finally:
        if sandbox is not None:
            await sandbox.close()
    timing = _timing(clock, timed.seconds)
    if verdict.reward is None:
        return EpisodeResult(**base, reward=None, status="infra_error", timing=timing, error=verdict.problem,
                             agent_timed_out=agent_timed_out)
    status = "timeout" if verdict.timed_out or agent_timed_out else "ok"
    return EpisodeResult(**base, reward=verdict.reward, status=status, timing=timing, error=verdict.problem,
                         agent_timed_out=agent_timed_out, rewards=verdict.rewards)


async def _agent_phase(task: Task, agent: Agent, sandbox: TimedSandbox) -> bool:
    """True when the agent ran out of time. Its background processes keep running for the verifier."""
    try:
        run = await asyncio.wait_for(agent.run(task, sandbox, task.agent_timeout_s), task.agent_timeout_s + 5)
        return run.timed_out
    except asyncio.TimeoutError:
        return True


def _timing(clock: _Clock, command_s: float | None) -> Timing:
    total = time.perf_counter() - clock.start
    m = clock.marks
    commands = command_s if command_s is not None else 0.0
    known = m.get("sandbox_start", 0.0) + commands + m.get("verifier", 0.0)
    return Timing(sandbox_start=m.get("sandbox_start", 0.0), agent_commands=commands,
                  verifier=m.get("verifier", 0.0), other=max(total - known, 0.0))
