"""Pass rates and status counts over episodes, one rule for every report.

pass@1 and the per-family rates share one denominator: the scored episodes (reward not None, i.e.
every status but infra_error, agent_broke_sandbox included as a failure). Unscored infra_error
episodes are counted beside the rate, never silently folded into it as zeros.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from furlong.agent.runner import STATUSES


@dataclass(frozen=True)
class Scored:
    """What a report needs from one episode, eval's EpisodeResult and RL's Episode alike."""

    family: str | None
    reward: float | None
    status: str


def passed(reward: float | None) -> bool:
    return reward is not None and reward >= 1.0


def status_counts(statuses: Iterable[str]) -> dict[str, int]:
    """Every status, zeros included, so a report always shows all of them."""
    counts = dict.fromkeys(STATUSES, 0)
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return counts


def rates(episodes: list[Scored]) -> dict:
    """pass@1 over scored episodes, with the episodes, scored and infra_error counts beside it."""
    scored = [e.reward for e in episodes if e.reward is not None]
    return {
        "pass_at_1": sum(map(passed, scored)) / len(scored) if scored else 0.0,
        "mean_reward": sum(scored) / len(scored) if scored else 0.0,
        "episodes": len(episodes),
        "scored": len(scored),
        "infra_errors": sum(e.status == "infra_error" for e in episodes),
    }


def outcome_summary(episodes: list[Scored]) -> dict:
    """Overall rates, every status counted, and the same rates per task family (family instances only)."""
    families: dict[str, list[Scored]] = {}
    for e in episodes:
        if e.family is not None:
            families.setdefault(e.family, []).append(e)
    return {
        **rates(episodes),
        "status": status_counts(e.status for e in episodes),
        "per_family": {name: rates(group) for name, group in sorted(families.items())},
    }
