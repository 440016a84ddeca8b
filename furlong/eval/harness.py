"""Episodes for evaluation: the one episode runner (furlong.agent.runner) with a scripted agent,
recorded as an EpisodeResult."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from furlong.agent.runner import STATUSES, Agent, Outcome, SandboxSource, run_retrying
from furlong.envs.base import Environment, StepScore
from furlong.gateway.trajectory import GatewayStats
from furlong.sandbox.base import ImageRef
from furlong.sandbox.pool import FreshSandboxes, fixed_image
from furlong.tasks.model import Task
from furlong.tasks.receipt import Receipt
from furlong.tasks.suite import BrokenTask
from furlong.timing import EpisodeTiming

__all__ = ["STATUSES", "EpisodeResult", "run_agent", "run_task_episode"]


@dataclass(frozen=True)
class EpisodeResult:
    task: str
    agent: str
    reward: float | None  # None for infra_error: an infrastructure failure is not a score
    status: str  # one of furlong.agent.runner.STATUSES
    timing: EpisodeTiming
    error: str | None = None
    agent_timed_out: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    family: str | None = None
    seed: int | None = None
    split: str | None = None
    # Why the tests scored what they did: their exit code and output tail (null if they never ran), and
    # a scripted agent's last command's (null for agents that do not report one, e.g. noop).
    verifier_exit_code: int | None = None
    verifier_output: str | None = None
    agent_exit_code: int | None = None
    agent_output: str | None = None
    image_note: str | None = None  # what served the task's FROM when it is not the image asked for
    sample: int = 0  # which of the task's --samples episodes this is (0-based)
    turns: int | None = None  # model turns taken (null for the scripted agents)
    tokens_response: int | None = None  # tokens the model sampled (null for the scripted agents)
    response_sha: str | None = None  # their digest, as in the run's episodes.jsonl (same digest: same tokens)
    tampered_paths: tuple[str, ...] = ()  # what the agent changed that the tests execute (furlong.tasks.integrity)
    integrity_checked: bool | None = None  # false: the reward was not checked against tampering (docs/sandboxes.md)
    steps: tuple[StepScore, ...] = ()  # a multi-step task's steps that ran: name, reward, rewards, error
    traceback: str | None = None  # where an exception decided the outcome (furlong.agent.runner.Outcome)
    gateway: GatewayStats | None = None  # a harness's requests, tito mismatch, history rewrites (docs/gateway.md)
    receipts: tuple[Receipt, ...] = ()  # what the reward was computed from (furlong.tasks.receipt), one per test run

    @classmethod
    def of(
        cls,
        task: Task,
        agent: str,
        outcome: Outcome,
        sample: int = 0,
        turns: int | None = None,
        tokens_response: int | None = None,
        response_sha: str | None = None,
        gateway: GatewayStats | None = None,
    ) -> EpisodeResult:
        return cls(
            task=task.id,
            agent=agent,
            reward=outcome.reward,
            status=outcome.status,
            timing=outcome.timing,
            error=outcome.error,
            agent_timed_out=outcome.agent_timed_out,
            rewards=outcome.rewards,
            family=task.family,
            seed=task.seed,
            split=task.split,
            verifier_exit_code=outcome.verifier_exit_code,
            verifier_output=outcome.verifier_output,
            agent_exit_code=outcome.agent_exit_code,
            agent_output=outcome.agent_output,
            image_note=outcome.image_note,
            sample=sample,
            turns=turns,
            tokens_response=tokens_response,
            response_sha=response_sha,
            tampered_paths=outcome.tampered_paths,
            integrity_checked=outcome.integrity_checked,
            steps=outcome.steps,
            traceback=outcome.traceback,
            gateway=gateway,
            receipts=outcome.receipts,
        )

    @classmethod
    def unloadable(cls, broken: BrokenTask, agent: str) -> EpisodeResult:
        """A task (or family) that could not be loaded: an infra_error episode that never started."""
        return cls(
            task=broken.id,
            agent=agent,
            reward=None,
            status="infra_error",
            timing=EpisodeTiming(),
            error=broken.error,
            family=broken.family,
        )

    def to_json(self) -> dict:
        out = asdict(self)
        out["timing"] = {k: round(v, 6) for k, v in out["timing"].items()}
        return out


async def run_agent(
    task: Task, new_agent: Callable[[], Agent], sandboxes: Environment | SandboxSource, sample: int = 0
) -> EpisodeResult:
    """Never raises for an agent's, a task's or the sandbox's fault: a failure becomes the status. An
    episode whose sandbox host was lost runs again with `new_agent()` (furlong.agent.runner.run_retrying)."""
    agent, outcome = await run_retrying(task, new_agent, sandboxes)
    stats = getattr(agent, "gateway_stats", None)  # a harness's (furlong.agent.harness)
    return EpisodeResult.of(
        task,
        agent.name,
        outcome,
        sample,
        getattr(agent, "turns", None),
        getattr(agent, "response_len", None),
        getattr(agent, "response_sha", None),
        stats() if callable(stats) else None,
    )


async def run_task_episode(task: Task, agent: Agent, backend, image: ImageRef) -> EpisodeResult:
    """One episode in a fresh sandbox of `image`."""
    return await run_agent(task, lambda: agent, FreshSandboxes(backend, fixed_image(image)))
