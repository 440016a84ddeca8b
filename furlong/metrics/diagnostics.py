"""Where an RL step's time goes, logged with each step's metrics (docs/report.md, "Step diagnostics").

- sample lag: the trained version minus the version of an episode's oldest sampled token, overall and
  by quartile of the step's episode durations (do long episodes train more off-policy?);
- group wait: the share of time finished episodes sit waiting for the slowest episode of their GRPO
  group, sum(group end - episode end) / sum(group end - group start) over episodes;
- KV held during tool waits: context tokens x tool time over context tokens x episode time, with tool
  time = agent commands + verifier and the episode's token count as its context;
- engine idle: the share of the step's wall time with no generation in flight (a `BusyMeter` around
  the engine sees every request); trainer idle: the share not in `train_step`;
- per-family pass rate.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from furlong.metrics.outcomes import Scored, outcome_summary

if TYPE_CHECKING:
    from furlong.agent.episode import Episode


class BusyMeter:
    """An engine seen through its `generate` calls: adds up the wall time with at least one in flight.
    Everything else is the wrapped engine's."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._inflight = 0
        self._since = 0.0
        self._busy = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self._inflight == 0:
            self._since = time.perf_counter()
        self._inflight += 1
        try:
            return await self.engine.generate(*args, **kwargs)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._busy += time.perf_counter() - self._since

    def busy_seconds(self) -> float:
        """So far, the interval still open included."""
        open_part = time.perf_counter() - self._since if self._inflight else 0.0
        return self._busy + open_part


class StepWindow:
    """Opened at a step's start; `diagnostics` closes it with the step's episodes."""

    def __init__(self, engine: Any):
        self._meter = engine if isinstance(engine, BusyMeter) else None
        self._busy0 = self._meter.busy_seconds() if self._meter else 0.0
        self._t0 = time.perf_counter()

    def diagnostics(self, episodes: Sequence[Episode], trained_version: int, train_seconds: float) -> dict:
        wall = max(time.perf_counter() - self._t0, 1e-9)
        out = {
            **sample_lag(episodes, trained_version),
            "group_wait_frac": group_wait(episodes),
            "kv_held_tool_wait_frac": kv_held_tool_wait(episodes),
            "trainer_idle_frac": _clip01(1.0 - train_seconds / wall),
            **family_pass_rates(episodes),
        }
        if self._meter is not None:
            out["engine_idle_frac"] = _clip01(1.0 - (self._meter.busy_seconds() - self._busy0) / wall)
        return out


def _clip01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def sample_lag(episodes: Sequence[Episode], trained_version: int) -> dict[str, float]:
    """Mean and max lag, and the mean in each quartile of episode duration (q1 shortest)."""
    pairs = [(e.timing.total, trained_version - e.oldest_version) for e in episodes if e.oldest_version is not None]
    if not pairs:
        return {"sample_lag_mean": 0.0, "sample_lag_max": 0.0}
    seconds, lags = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs], dtype=float)
    out = {"sample_lag_mean": float(lags.mean()), "sample_lag_max": float(lags.max())}
    for q, idx in enumerate(np.array_split(np.argsort(seconds, kind="stable"), 4), start=1):
        if len(idx):
            out[f"sample_lag_mean_q{q}"] = float(lags[idx].mean())
    return out


def group_wait(episodes: Sequence[Episode]) -> float:
    groups: dict[tuple, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.group_key, []).append(e)
    waited = spanned = 0.0
    for members in groups.values():
        start = min(e.timing.started_at for e in members)
        end = max(e.timing.ended_at for e in members)
        waited += sum(end - e.timing.ended_at for e in members)
        spanned += (end - start) * len(members)
    return waited / spanned if spanned > 0 else 0.0


def kv_held_tool_wait(episodes: Sequence[Episode]) -> float:
    held = sum(len(e.tokens) * (e.timing.agent_commands + e.timing.verifier) for e in episodes)
    total = sum(len(e.tokens) * e.timing.total for e in episodes)
    return _clip01(held / total) if total > 0 else 0.0


def family_pass_rates(episodes: Sequence[Episode]) -> dict[str, float]:
    per = outcome_summary([Scored(e.family, e.reward, e.status) for e in episodes])["per_family"]
    return {f"pass_rate/{name}": r["pass_at_1"] for name, r in per.items()}
