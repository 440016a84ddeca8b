"""What each RL step logs about its rollouts: the metrics row's rollout columns and the episodes.jsonl
lines of the episodes the step settled."""

from __future__ import annotations

import hashlib

from furlong.agent.episode import Episode
from furlong.metrics.episodes import episode_record
from furlong.metrics.outcomes import status_counts
from furlong.rollout.groups import step_of
from furlong.rollout.scheduler import ATTEMPT_STRIDE, Batch, outcome_counts, settled_episodes, staleness_stats


def rollout_metrics(episodes: list[Episode], version: int) -> dict:
    n = max(len(episodes), 1)
    keys = ",".join(f"{e.task_id}#{e.group_id}.{e.sample_id}" for e in episodes)
    lags = [version - min(v for v, m in zip(e.token_weight_versions, e.loss_mask) if m)
            for e in episodes if e.response_len]
    out = {f"time_{k}": sum(getattr(e.timing, k) for e in episodes) / n
           for k in ("sandbox_start", "model_wait", "agent_commands", "verifier", "other")}
    out.update({"episodes": len(episodes), "turns_mean": sum(e.turns for e in episodes) / n,
                "tool_errors": sum(e.tool_errors for e in episodes),
                **{f"status_{k}": v for k, v in status_counts(e.status for e in episodes).items()},
                "sample_lag_mean": sum(lags) / max(len(lags), 1),
                "samples_sha": hashlib.sha256(keys.encode()).hexdigest()[:16]})
    return out

def settled_records(batch: Batch, step: int, filter_zero_variance: bool) -> list[dict]:
    """episodes.jsonl lines for the episodes this step settled: `step` is the step that trained (or
    dropped) them, `plan_step` the step the group was planned for (later in async mode)."""
    return [{**episode_record(e, "rl", step), "plan_step": step_of(e), "attempt": g.spec.attempt,
             "slot": g.spec.group_id % ATTEMPT_STRIDE, "in_batch": any(g is b for b in batch.groups),
             "outcome": outcome}
            for g, e, outcome in settled_episodes(batch, filter_zero_variance)]

def batch_metrics(batch: Batch, filter_zero_variance: bool) -> dict:
    """Where every episode went: started this step, and how those settled by this batch ended."""
    counts = outcome_counts(batch, filter_zero_variance)
    return {"episodes_started": batch.started, **{f"episodes_{k}": v for k, v in counts.items()},
            "episodes_in_flight": batch.in_flight, "groups_stale": len(batch.stale),
            "trainer_wait_s": batch.wait_s, **staleness_stats(batch.groups, batch.version)}
