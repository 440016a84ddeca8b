"""Where an episode's time went: sandbox start, model wait, agent commands, verifier, the rest; and, for
benchmarks, where one operation's time went (`phases`/`mark`: a sandbox start's phases)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

PARTS = ("sandbox_start", "model_wait", "agent_commands", "verifier")


@dataclass(frozen=True)
class EpisodeTiming:
    sandbox_start: float = 0.0
    model_wait: float = 0.0
    agent_commands: float = 0.0
    verifier: float = 0.0
    other: float = 0.0
    started_at: float = 0.0  # wall clock (unix seconds), for the run's per-episode records and report
    ended_at: float = 0.0

    @property
    def total(self) -> float:
        return self.sandbox_start + self.model_wait + self.agent_commands + self.verifier + self.other


class Clock:
    """Adds up named spans; whatever is not in a named span is `other`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.started_at = time.time()
        self.spent: dict[str, float] = {}

    def add(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.spent[name] = self.spent.get(name, 0.0) + now - since
        return now

    def timing(self) -> EpisodeTiming:
        parts = {k: self.spent.get(k, 0.0) for k in PARTS}
        return EpisodeTiming(
            **parts,
            other=max(time.perf_counter() - self.start - sum(parts.values()), 0.0),
            started_at=self.started_at,
            ended_at=time.time(),
        )


# The phases being recorded in this task's context (None: none are; a mark then costs a lookup and a clock read)
_PHASES: ContextVar[dict[str, float] | None] = ContextVar("furlong_phases", default=None)


@contextmanager
def phases() -> Iterator[dict[str, float]]:
    """Records the spans that code run inside it (this context, and the threads asyncio.to_thread starts
    from it) marks with `mark`: name -> seconds, in the dict it yields (bench/sandbox_cold_start.py)."""
    spent: dict[str, float] = {}
    token = _PHASES.set(spent)
    try:
        yield spent
    finally:
        _PHASES.reset(token)


def mark(name: str, since: float) -> float:
    """Ends span `name`, begun at `since` (a perf_counter reading), where phases are being recorded; returns
    now, the next span's beginning."""
    now = time.perf_counter()
    if (spent := _PHASES.get()) is not None:
        spent[name] = spent.get(name, 0.0) + now - since
    return now
