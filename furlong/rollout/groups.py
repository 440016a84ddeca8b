"""Rollouts in groups: n episodes of the same task (a GRPO group), many groups per step, at bounded
sandbox concurrency while the engine batches every episode's generation requests."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Sequence

from furlong.agent.episode import AgentParams, Episode, run_episode
from furlong.agent.runner import SandboxSource
from furlong.engine.base import Engine, SamplingParams
from furlong.metrics.outcomes import Scored, rates
from furlong.seeding import eval_seed, mix_seed
from furlong.tasks.model import Task


@dataclass(frozen=True)
class RolloutPlan:
    """Which tasks a step uses, and the sampling seed of each episode: a pure function of the step."""

    step: int
    tasks: tuple[Task, ...]
    group_size: int
    seed: int

    def episode_seed(self, group: int, sample: int) -> int:
        return mix_seed(self.seed, self.step, group, sample)


def plan_step(tasks: list[Task], step: int, tasks_per_step: int, group_size: int, seed: int) -> RolloutPlan:
    """Deterministic in (seed, step), so a resumed run draws exactly the samples the killed one would have."""
    order = list(range(len(tasks)))
    epoch, offset = divmod(step * tasks_per_step, len(tasks))
    random.Random(seed * 7919 + epoch).shuffle(order)
    picked = [tasks[order[(offset + i) % len(order)]] for i in range(tasks_per_step)]
    return RolloutPlan(step=step, tasks=tuple(picked), group_size=group_size, seed=seed)


GROUP_STRIDE = 100_000  # an RL episode's group_id is step * GROUP_STRIDE + its group in the step


def step_of(episode: Episode) -> int:
    return episode.group_id // GROUP_STRIDE


@dataclass(frozen=True)
class _Job:
    task: Task
    sampling: SamplingParams
    group_id: int
    sample_id: int


@dataclass(eq=False)
class _Waiting:
    task: Task
    reserved: bool = False


class Rollouts:
    """Episodes at bounded concurrency. Every episode goes through the one runner, so a plan always
    returns one Episode per sample: a sandbox failure is an episode's status, never a step's exception.

    Sandboxes are reserved a window ahead (as wide as the concurrency): the first window of a step by
    `prepare`, called while the previous step trains, then one more each time an episode starts.
    """

    def __init__(self, engine: Engine, tokenizer, sandboxes: SandboxSource, params: AgentParams, concurrency: int,
                 on_episode: Callable[[Episode], None] = lambda e: None):
        self.engine, self.tokenizer, self.sandboxes = engine, tokenizer, sandboxes
        self.params, self.concurrency = params, concurrency
        self.on_episode = on_episode  # called as each episode finishes (the run's episode records)
        self._slots = asyncio.Semaphore(concurrency)
        self._prepared: set[int] = set()
        self._ahead = 0  # episodes waiting for a slot whose sandbox is already starting
        self._credit: Counter[str] = Counter()  # task ids with a sandbox reserved before their episode began
        self._waiting: deque[_Waiting] = deque()  # episodes waiting for a slot with no sandbox started yet

    @staticmethod
    def _plan_jobs(plan: RolloutPlan, temperature: float) -> list[_Job]:
        return [_Job(task, SamplingParams(temperature=temperature, seed=plan.episode_seed(g, s)),
                     plan.step * GROUP_STRIDE + g, s)
                for g, task in enumerate(plan.tasks) for s in range(plan.group_size)]

    def prepare(self, plan: RolloutPlan) -> None:
        """Starts the sandboxes of the plan's first episodes in the background (once per step)."""
        if plan.step not in self._prepared:
            self._prepared.add(plan.step)
            episodes = [task for task in plan.tasks for _ in range(plan.group_size)]
            for task in episodes[: self.concurrency]:
                self.sandboxes.reserve(task)

    async def run_plan(self, plan: RolloutPlan, temperature: float) -> list[Episode]:
        self.prepare(plan)
        return await self._run(self._plan_jobs(plan, temperature))

    def _reserve_waiting(self) -> None:
        """Keeps up to `concurrency` waiting episodes' sandboxes starting, oldest waiter first (the
        semaphore hands out slots in that order)."""
        while self._ahead < self.concurrency and self._waiting:
            entry = self._waiting.popleft()
            entry.reserved, self._ahead = True, self._ahead + 1
            self.sandboxes.reserve(entry.task)

    def reserve_ahead(self, tasks: Sequence[Task]) -> None:
        """Starts the sandboxes of the first `concurrency` episodes about to run (e.g. the next step's,
        while this one trains); the episodes then take them instead of reserving their own."""
        for task in tasks[: self.concurrency]:
            self._credit[task.id] += 1
            self.sandboxes.reserve(task)

    async def run_group(self, task: Task, group_id: int, seeds: Sequence[int], temperature: float) -> list[Episode]:
        """One GRPO group, one episode per seed (furlong.rollout.scheduler's unit of work). While an
        episode waits for one of the `concurrency` slots its sandbox starts ahead in the warm pool, for
        at most `concurrency` waiting episodes at a time, so a slot never waits on a sandbox start."""

        async def one(sample: int, seed: int) -> Episode:
            entry = _Waiting(task)
            if self._credit[task.id] > 0:  # its sandbox was reserved by reserve_ahead already
                self._credit[task.id] -= 1
                entry.reserved, self._ahead = True, self._ahead + 1
            else:
                self._waiting.append(entry)
                self._reserve_waiting()
            async with self._slots:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                self._ahead -= entry.reserved
                self._reserve_waiting()  # a reservation slot is free: the next waiting episode gets it
                episode = await run_episode(task, self.engine, self.tokenizer, self.sandboxes, self.params,
                                            SamplingParams(temperature=temperature, seed=seed),
                                            group_id=group_id, sample_id=sample)
            self.on_episode(episode)
            return episode

        return list(await asyncio.gather(*(one(s, seed) for s, seed in enumerate(seeds))))

    async def evaluate(self, tasks: list[Task], temperature: float, seed: int,
                       on_done: Callable[[], None] = lambda: None) -> list[Episode]:
        """pass@1: one sampled episode per task, seeded as `furlong eval` seeds sample 0 (eval_seed)."""
        for task in tasks[: self.concurrency]:
            self.sandboxes.reserve(task)
        jobs = [_Job(t, SamplingParams(temperature=temperature, seed=eval_seed(seed, t.id, 0)), i, 0)
                for i, t in enumerate(tasks)]
        return await self._run(jobs, on_done)

    async def _run(self, jobs: list[_Job], on_done: Callable[[], None] = lambda: None) -> list[Episode]:
        """The first `concurrency` jobs' sandboxes are already reserved; each job that starts reserves
        the one `concurrency` places behind it."""

        async def one(k: int, job: _Job) -> Episode:
            async with self._slots:
                if k + self.concurrency < len(jobs):  # keep the window full
                    self.sandboxes.reserve(jobs[k + self.concurrency].task)
                episode = await run_episode(job.task, self.engine, self.tokenizer, self.sandboxes, self.params,
                                            job.sampling, group_id=job.group_id, sample_id=job.sample_id)
            self.on_episode(episode)
            on_done()
            return episode

        return list(await asyncio.gather(*(one(k, job) for k, job in enumerate(jobs))))


def pass_rate(episodes: list[Episode]) -> float:
    """pass@1 over the scored episodes (the denominator of the per-family rates too)."""
    return rates([Scored(e.family, e.reward, e.status) for e in episodes])["pass_at_1"]
