"""Rollouts in groups: n episodes of the same task (a GRPO group), many groups per step, at bounded
sandbox concurrency while the engine batches every episode's generation requests."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Callable

from furlong.agent.episode import AgentParams, Episode, run_episode
from furlong.engine.base import Engine, SamplingParams
from furlong.sandbox.images import ImageStore
from furlong.seeding import mix_seed
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


class Rollouts:
    def __init__(self, engine: Engine, tokenizer, backend, store: ImageStore, params: AgentParams,
                 concurrency: int):
        self.engine, self.tokenizer, self.backend, self.store = engine, tokenizer, backend, store
        self.params = params
        self._slots = asyncio.Semaphore(concurrency)

    async def _one(self, task: Task, sampling: SamplingParams, group_id: int, sample_id: int) -> Episode:
        image = await self.store.image(task.dockerfile, self.backend)
        async with self._slots:
            return await run_episode(task, self.engine, self.tokenizer, self.backend, image, self.params,
                                     sampling, group_id=group_id, sample_id=sample_id)

    async def run_plan(self, plan: RolloutPlan, temperature: float) -> list[Episode]:
        jobs = []
        for g, task in enumerate(plan.tasks):
            for s in range(plan.group_size):
                sampling = SamplingParams(temperature=temperature, seed=plan.episode_seed(g, s))
                jobs.append(self._one(task, sampling, group_id=plan.step * 100_000 + g, sample_id=s))
        return list(await asyncio.gather(*jobs))

    async def evaluate(self, tasks: list[Task], temperature: float, seed: int,
                       on_done: Callable[[], None] = lambda: None) -> list[Episode]:
        """pass@1: one sampled episode per task, with fixed seeds."""
        async def one(i: int, task: Task) -> Episode:
            episode = await self._one(task, SamplingParams(temperature=temperature, seed=mix_seed(seed, -1, i)), i, 0)
            on_done()
            return episode

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))


def pass_rate(episodes: list[Episode]) -> float:
    scored = [e for e in episodes if e.reward is not None]
    return sum(e.reward >= 1.0 for e in scored) / len(scored) if scored else 0.0
