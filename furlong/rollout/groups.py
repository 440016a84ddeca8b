"""Rollouts in groups: n episodes of the same task (a GRPO group), many groups per step, at bounded
sandbox concurrency while the engine batches every episode's generation requests."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from furlong.agent.episode import AgentParams, Episode, run_episode
from furlong.agent.harness import HarnessAgents, run_harness_episode
from furlong.agent.runner import SandboxSource
from furlong.engine.base import Engine, SamplingParams
from furlong.envs.base import Environment, EnvSpec
from furlong.metrics.outcomes import Scored, rates
from furlong.seeding import eval_seed, mix_seed


@dataclass(frozen=True)
class PlannedEpisode:
    """One episode to run: its task, its sampling seed and who it is (the fields its Episode gets)."""

    task: EnvSpec
    seed: int
    group_id: int
    step: int | None
    attempt: int
    sample_id: int

    @property
    def key(self) -> tuple[int | None, int, int, int]:
        return self.step, self.group_id, self.attempt, self.sample_id


@dataclass(frozen=True)
class RolloutPlan:
    """Which tasks a step uses, and the sampling seed of each episode: a pure function of the step."""

    step: int
    tasks: tuple[EnvSpec, ...]
    group_size: int
    seed: int

    def episode_seed(self, group: int, sample: int) -> int:
        return mix_seed(self.seed, self.step, group, sample)

    def episodes(self) -> list[PlannedEpisode]:
        """Group g of the step is group step * len(tasks) + g of the stream (GroupStream's numbering)."""
        first = self.step * len(self.tasks)
        return [
            PlannedEpisode(task, self.episode_seed(g, s), first + g, self.step, 0, s)
            for g, task in enumerate(self.tasks)
            for s in range(self.group_size)
        ]


def plan_step(tasks: Sequence[EnvSpec], step: int, tasks_per_step: int, group_size: int, seed: int) -> RolloutPlan:
    """Deterministic in (seed, step), so a resumed run draws exactly the samples the killed one would have."""
    order = list(range(len(tasks)))
    epoch, offset = divmod(step * tasks_per_step, len(tasks))
    random.Random(seed * 7919 + epoch).shuffle(order)
    picked = [tasks[order[(offset + i) % len(order)]] for i in range(tasks_per_step)]
    return RolloutPlan(step=step, tasks=tuple(picked), group_size=group_size, seed=seed)


@dataclass(eq=False)
class _Place:
    task: EnvSpec
    reserved: bool = False  # its sandbox is starting (or started) in the warm pool


class Rollouts:
    """Episodes at bounded concurrency. Every episode goes through the one runner, so a run always
    returns one Episode per planned episode: a sandbox failure is an episode's status, never an exception.

    Sandboxes start ahead through one line: the episodes about to take one of the `concurrency` slots,
    in the order they will. The first `concurrency` places in the line have their sandbox reserved. An
    episode joins the line when it is expected (`expect`: e.g. the next step's groups, while this one
    trains) or, if nobody expected it, when it starts waiting for a slot; it leaves the line when it takes
    a slot, and the first place without a sandbox gets one. So a slot never waits on a sandbox start, and
    no more than `concurrency` sandboxes wait idle for their episodes.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        sandboxes: Environment | SandboxSource,
        params: AgentParams,
        concurrency: int,
        on_episode: Callable[[Episode], None] = lambda e: None,
        harness: Sequence[str] | None = None,
    ):
        self.engine, self.tokenizer, self.sandboxes = engine, tokenizer, sandboxes
        self.params, self.concurrency = params, concurrency
        # train.agent.harness.command: that program is each episode's agent, through a gateway on `engine`
        self.harness = None if harness is None else HarnessAgents(engine, tokenizer, params, harness)
        self.on_episode = on_episode  # called as each episode finishes (the run's episode records)
        self._slots = asyncio.Semaphore(concurrency)
        self._line: dict[tuple, _Place] = {}  # PlannedEpisode.key -> place, in line order
        self._reserved = 0  # places in the line whose sandbox is reserved: always its first ones

    def expect(self, episodes: Sequence[PlannedEpisode]) -> None:
        """These episodes will start soon, in this order: they join the line (once, however often they
        are expected), and the first `concurrency` places get their sandboxes started now."""
        for planned in episodes:
            self._line.setdefault(planned.key, _Place(planned.task))
        self._reserve_front()

    def _reserve_front(self) -> None:
        for place in self._line.values():
            if self._reserved >= self.concurrency:
                return
            if not place.reserved:
                place.reserved, self._reserved = True, self._reserved + 1
                self.sandboxes.reserve(place.task)

    def _leave_line(self, planned: PlannedEpisode) -> None:
        place = self._line.pop(planned.key, None)
        if place is not None and place.reserved:
            self._reserved -= 1
        self._reserve_front()

    async def run(
        self, episodes: Sequence[PlannedEpisode], temperature: float, on_done: Callable[[], None] = lambda: None
    ) -> list[Episode]:
        """Every episode, `concurrency` at a time, in order; `on_done` after each one finishes. A harness
        episode is one sample per trajectory segment (furlong.agent.harness), so it may give several."""
        self.expect(episodes)

        async def one(planned: PlannedEpisode) -> list[Episode]:
            async with self._slots:
                self._leave_line(planned)
                samples = await self._episode(planned, temperature)
            for sample in samples:
                self.on_episode(sample)
            on_done()
            return samples

        return [e for samples in await asyncio.gather(*(one(p) for p in episodes)) for e in samples]

    async def _episode(self, planned: PlannedEpisode, temperature: float) -> list[Episode]:
        who: dict[str, Any] = {
            "group_id": planned.group_id,
            "step": planned.step,
            "attempt": planned.attempt,
            "sample_id": planned.sample_id,
        }
        if self.harness is not None:  # the harness's requests pick their own sampling
            return await run_harness_episode(planned.task, self.harness, self.sandboxes, **who)
        sampling = SamplingParams(temperature=temperature, seed=planned.seed)
        return [
            await run_episode(planned.task, self.engine, self.tokenizer, self.sandboxes, self.params, sampling, **who)
        ]

    async def close(self) -> None:
        """The harness's gateway, where there is one."""
        if self.harness is not None:
            await self.harness.close()

    async def evaluate(
        self, tasks: Sequence[EnvSpec], temperature: float, seed: int, on_done: Callable[[], None] = lambda: None
    ) -> list[Episode]:
        """pass@1: one sampled episode per task (group i is task i, in no step), seeded as `furlong eval` seeds
        its sample 0 (eval_seed), so both report the same episodes for the same checkpoint."""
        episodes = [PlannedEpisode(t, eval_seed(seed, t.id, 0), i, None, 0, 0) for i, t in enumerate(tasks)]
        return await self.run(episodes, temperature, on_done)


def pass_rate(episodes: list[Episode]) -> float:
    """pass@1 over the scored episodes (the denominator of the per-family rates too)."""
    return rates([Scored(e.family, e.reward, e.status) for e in episodes])["pass_at_1"]
