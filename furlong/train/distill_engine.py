"""A distillation teacher served by an engine (train.distill.teacher.engine: hf | vllm; docs/distill.md): the
trainer-held Teacher's prompt rendering and records, each episode scored by `Engine.score` (prefill only, the
teacher's ids, the sampled tokens' logprobs) instead of a forward beside the policy.

An episode whose scoring raises (the engine down, refused, or slower than `timeout_s`) loses the term, recorded
as teacher_failed, as a failing forward does in the trainer: never a crashed step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from furlong.agent.episode import Episode
from furlong.engine.base import Engine
from furlong.train.distill import Item, Teacher, TeacherPass, failed_episode, scored_episode, teacher_tokenizer
from furlong.train.grpo_config import GRPOConfig


class EngineTeacher:
    """`teacher` renders, `engine` (loaded with the teacher's checkpoint) scores; at most `concurrency`
    episodes are in the engine at once, each given `timeout_s`."""

    where = "in the driver process"  # where the engine runs, for the run's log (train.cluster=ray: an actor)

    def __init__(self, teacher: Teacher, engine: Engine, *, timeout_s: float = 300.0, concurrency: int = 16) -> None:
        self.teacher, self.engine, self.timeout_s = teacher, engine, timeout_s
        self._slots = asyncio.Semaphore(concurrency)

    async def score(self, episodes: Sequence[Episode]) -> TeacherPass:
        """Every scored episode (reward not None) with teacher logprobs or the reason it has none."""
        start = time.perf_counter()
        out, todo = self.teacher.prepare(episodes)
        done = await asyncio.gather(*(self._one(episodes[item[0]], item) for item in todo))
        for (i, _, _), e in zip(todo, done, strict=True):
            out[i] = e
        return TeacherPass(tuple(out), time.perf_counter() - start, sum(len(ids) for _, ids, _ in todo))

    async def _one(self, e: Episode, item: Item) -> Episode:
        _, ids, shift = item
        sampled = [p + shift for p, m in enumerate(e.loss_mask) if m]
        if not sampled:
            return scored_episode(e, [0.0] * len(e.loss_mask))
        first = sampled[0]
        try:
            async with self._slots:
                got = await asyncio.wait_for(self.engine.score(ids, first, self.teacher.temperature), self.timeout_s)
        except Exception as err:  # noqa: BLE001 -- any engine failure fails this episode's term, not the step
            if isinstance(err, asyncio.TimeoutError):
                err = TimeoutError(f"the teacher's engine did not score in {self.timeout_s:g} s")
            return failed_episode(e, err)
        if len(got) != len(ids) - first:
            return failed_episode(
                e, ValueError(f"the engine returned {len(got)} logprobs for {len(ids) - first} tokens")
            )
        return scored_episode(e, [got[p + shift - first] if m else 0.0 for p, m in enumerate(e.loss_mask)])


@dataclass(frozen=True)
class ServedTeacher:
    """What a run's engine teacher is made of: the checkpoint its engine loads (`path`: the teacher's, or the
    SFT checkpoint for a frozen self-teacher), its engine kind, and the Teacher's rendering settings."""

    kind: str
    path: Path
    system_prompt: str | None
    hints: tuple[tuple[str, str], ...]

    def renderer(self, tokenizer_dir: Path, config: GRPOConfig) -> Teacher:
        """The Teacher that renders prompts (the checkpoint's template, else the student's), at the rollout
        temperature."""
        return Teacher(
            teacher_tokenizer(tokenizer_dir, self.path),
            system_prompt=self.system_prompt,
            hints=dict(self.hints),
            temperature=config.temperature,
            served=True,
        )
