"""Episodes for evaluation: a fresh sandbox per task, the agent phase, then the verifier phase."""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import asdict, dataclass, field

from furlong.eval.agents import Agent, TimedSandbox
from furlong.metrics.timing import Clock, EpisodeTiming
from furlong.sandbox.base import ImageRef, SandboxDied, SandboxError, SandboxSpec
from furlong.tasks.model import Task
from furlong.tasks.verifier import verify

STATUSES = ("ok", "timeout", "infra_error")


@dataclass(frozen=True)
class EpisodeResult:
    task: str
    agent: str
    reward: float | None  # None for infra_error: an infrastructure failure is not a score
    status: str  # ok | timeout | infra_error
    timing: EpisodeTiming
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


async def run_episode(task: Task, agent: Agent, backend, image: ImageRef) -> EpisodeResult:
    """Never raises for a task's or the sandbox's fault: a failure becomes the episode's status."""
    clock, sandbox, timed = Clock(), None, None
    base = dict(task=task.id, agent=agent.name, family=task.family, seed=task.seed, split=task.split)
    try:
        t = time.perf_counter()
        sandbox = await backend.create(SandboxSpec(image=image, network=task.network, limits=task.limits))
        await sandbox.exec("true", timeout_s=30)  # ready for commands: that is what "started" means
        t = clock.add("sandbox_start", t)
        timed = TimedSandbox(sandbox)
        agent_timed_out = await _agent_phase(task, agent, timed)
        t = time.perf_counter()
        verdict = await verify(task, sandbox, image.workdir)
        clock.add("verifier", t)
    except (SandboxDied, SandboxError) as exc:
        return EpisodeResult(**base, reward=None, status="infra_error", timing=_timing(clock, timed),
                             error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug in an agent must not take the run down with it
        return EpisodeResult(**base, reward=None, status="infra_error", timing=_timing(clock, timed),
                             error="".join(traceback.format_exception_only(exc)).strip())
    finally:
        if sandbox is not None:
            await sandbox.close()
    timing = _timing(clock, timed)
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


def _timing(clock: Clock, timed: TimedSandbox | None) -> EpisodeTiming:
    if timed is not None:
        clock.spent["agent_commands"] = timed.seconds
    return clock.timing()
