"""Which GRPO group an episode is in, and DAPO's dynamic-sampling filter over complete groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from furlong.agent.episode import Episode


def group_key(episode: Episode) -> tuple[str, int | None, int, int]:
    """Which GRPO group an episode belongs to (Episode.group_key: task, step, group, attempt)."""
    return episode.group_key


@dataclass(frozen=True)
class GroupFilter:
    episodes: tuple[Episode, ...]  # the survivors, in their original order
    groups_kept: int
    groups_dropped: int


def filter_zero_variance_groups(episodes: Sequence[Episode]) -> GroupFilter:
    """DAPO dynamic sampling: drop groups whose rewards are all equal. Their advantages are all 0, so they add
    no gradient, only tokens to the loss denominator that dilute the groups that do teach something."""
    rewards: dict[tuple, list[float]] = {}
    for e in episodes:
        if e.reward is None:
            raise ValueError(
                f"episode {e.task_id}/{e.group_id}/{e.sample_id} has no reward (infra error); "
                "drop those before filtering"
            )
        rewards.setdefault(group_key(e), []).append(e.reward)
    varied = {key for key, rs in rewards.items() if max(rs) > min(rs)}
    return GroupFilter(
        episodes=tuple(e for e in episodes if group_key(e) in varied),
        groups_kept=len(varied),
        groups_dropped=len(rewards) - len(varied),
    )
