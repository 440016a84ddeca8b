"""Where an episode's time went: sandbox start, model wait, agent commands, verifier, the rest."""

from __future__ import annotations

import time
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
