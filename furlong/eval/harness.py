"""Episodes for evaluation: the one episode runner (furlong.agent.runner) with a scripted agent,
recorded as an EpisodeResult."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from furlong.agent.runner import STATUSES, Agent, Outcome, SandboxSource, run_outcome
from furlong.metrics.timing import EpisodeTiming
from furlong.sandbox.base import ImageRef
from furlong.sandbox.pool import FreshSandboxes, fixed_image
from furlong.tasks.model import Task

__all__ = ["STATUSES", "EpisodeResult", "run_episode", "run_agent"]


@dataclass(frozen=True)
class EpisodeResult:
    task: str
    agent: str
    reward: float | None  # None for infra_error: an infrastructure failure is not a score
    status: str  # ok | truncated | timeout | agent_broke_sandbox | infra_error
    timing: EpisodeTiming
    error: str | None = None
    agent_timed_out: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    family: str | None = None
    seed: int | None = None
    split: str | None = None

    @classmethod
    def of(cls, task: Task, agent: str, outcome: Outcome) -> EpisodeResult:
        return cls(task=task.id, agent=agent, reward=outcome.reward, status=outcome.status, timing=outcome.timing,
                   error=outcome.error, agent_timed_out=outcome.agent_timed_out, rewards=outcome.rewards,
                   family=task.family, seed=task.seed, split=task.split)

    def to_json(self) -> dict:
        out = asdict(self)
        out["timing"] = {k: round(v, 6) for k, v in out["timing"].items()}
        return out


async def run_agent(task: Task, agent: Agent, sandboxes: SandboxSource) -> EpisodeResult:
    """Never raises for an agent's, a task's or the sandbox's fault: a failure becomes the status."""
    return EpisodeResult.of(task, agent.name, await run_outcome(task, agent, sandboxes))


async def run_episode(task: Task, agent: Agent, backend, image: ImageRef) -> EpisodeResult:
    """One episode in a fresh sandbox of `image`."""
    return await run_agent(task, agent, FreshSandboxes(backend, fixed_image(image)))
