"""What an RL step's batch leaves in the run directory: its metrics row's rollout keys and its
episodes.jsonl lines. Each function writes keys no other writes, so a row merges them without loss."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from furlong.agent.episode import Episode
from furlong.metrics.episodes import episode_record
from furlong.metrics.outcomes import status_counts
from furlong.rollout.group_filter import filter_zero_variance_groups
from furlong.rollout.scheduler import OUTCOMES, Batch, Group

TIME_PARTS = ("sandbox_start", "model_wait", "agent_commands", "verifier", "other")


def rollout_metrics(episodes: Sequence[Episode]) -> dict:
    """Per-episode means and counts of the trained batch: where the time went, turns, statuses."""
    n = max(len(episodes), 1)
    out = {f"time_{k}": sum(getattr(e.timing, k) for e in episodes) / n for k in TIME_PARTS}
    out.update(
        {
            "episodes": len(episodes),
            "turns_mean": sum(e.turns for e in episodes) / n,
            "tool_errors": sum(e.tool_errors for e in episodes),
            **{f"status_{k}": v for k, v in status_counts(e.status for e in episodes).items()},
        }
    )
    return out


def samples_sha(groups: Sequence[Group]) -> str:
    """A fingerprint of which samples a batch drew: two runs that drew the same ones have the same.
    Its key format is that of the runs recorded before episodes carried step and attempt (a group was
    then numbered step * 100000 + attempt * 1000 + slot), so fingerprints stay comparable with theirs."""
    keys = ",".join(
        f"{e.task_id}#{g.spec.step * 100_000 + g.spec.attempt * 1_000 + g.spec.slot}.{e.sample_id}"
        for g in groups
        for e in g.episodes
    )
    return hashlib.sha256(keys.encode()).hexdigest()[:16]


def settled_episodes(batch: Batch, filter_zero_variance: bool) -> list[tuple[Group, Episode, str]]:
    """Every episode settled by this batch with how it ended: exactly one of OUTCOMES (the trainer's own
    rules: no reward is an infra error, then a zero-variance group is filtered)."""
    scored = [e for e in batch.episodes if e.reward is not None]
    kept = {id(e) for e in (filter_zero_variance_groups(scored).episodes if filter_zero_variance else scored)}
    out = [
        (g, e, "infra_error" if e.reward is None else "trained" if id(e) in kept else "filtered")
        for g in batch.groups
        for e in g.episodes
    ]
    return out + [
        (g, e, "infra_error" if e.reward is None else "dropped_stale") for g in batch.stale for e in g.episodes
    ]


def outcome_counts(batch: Batch, filter_zero_variance: bool) -> dict[str, int]:
    outcomes = [o for _, _, o in settled_episodes(batch, filter_zero_variance)]
    return {k: outcomes.count(k) for k in OUTCOMES}


def staleness_stats(groups: Sequence[Group], version: int) -> dict[str, float]:
    """Per trained episode: versions from its oldest sampled token to the version trained, and how many
    episodes kept generating across a weight update (tokens of more than one version)."""
    sampled = [e for g in groups for e in g.episodes if e.oldest_version is not None]
    lags = [version - e.oldest_version for e in sampled if e.oldest_version is not None]  # (all are: narrows for mypy)
    multi = sum(len({v for v, m in zip(e.token_weight_versions, e.loss_mask) if m}) > 1 for e in sampled)
    return {
        "staleness_mean": sum(lags) / max(len(lags), 1),
        "staleness_max": max(lags, default=0),
        "episodes_multi_version": multi,
    }


def batch_metrics(batch: Batch, filter_zero_variance: bool) -> dict:
    """Where every episode went: started this step, and how those settled by this batch ended."""
    counts = outcome_counts(batch, filter_zero_variance)
    return {
        "episodes_started": batch.started,
        **{f"episodes_{k}": v for k, v in counts.items()},
        "episodes_in_flight": batch.in_flight,
        "groups_stale": len(batch.stale),
        "trainer_wait_s": batch.wait_s,
        "samples_sha": samples_sha(batch.groups),
        **staleness_stats(batch.groups, batch.version),
    }


def settled_records(batch: Batch, step: int, filter_zero_variance: bool) -> list[dict]:
    """episodes.jsonl lines for the episodes this step settled: `step` is the step that trained (or
    dropped) them, `plan_step` the step the group was planned for (later in async mode)."""
    return [
        {
            **episode_record(e, "rl", step),
            "plan_step": g.spec.step,
            "slot": g.spec.slot,
            "in_batch": any(g is b for b in batch.groups),
            "outcome": outcome,
        }
        for g, e, outcome in settled_episodes(batch, filter_zero_variance)
    ]
