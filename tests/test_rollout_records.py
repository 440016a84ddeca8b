"""What an RL step records about its rollouts (furlong.rollout.records), on hand-built batches: each metrics
key has one writer, and a re-queued copy of a group is a group of its own in the trainer and the records."""

from __future__ import annotations

from pathlib import Path

import pytest

from furlong.agent.episode import Episode
from furlong.metrics.diagnostics import StepWindow
from furlong.metrics.run import metrics_row
from furlong.timing import EpisodeTiming
from furlong.rollout.records import batch_metrics, rollout_metrics, settled_records
from furlong.rollout.scheduler import Batch, Group, GroupSpec, GroupStream
from furlong.rollout.group_filter import filter_zero_variance_groups
from tests_support import make_task


def _group(spec: GroupSpec, rewards: list[float], version: int) -> Group:
    """The spec's episodes, each with two sampled tokens of `version` after a one-token prompt."""
    return Group(spec, tuple(
        Episode(task_id=spec.task.id, group_id=spec.index, step=spec.step, attempt=spec.attempt, sample_id=s,
                prompt_len=1, tokens=(1, 2, 3), loss_mask=(0, 1, 1), rollout_logprobs=(0.0, -1.0, -1.0),
                token_weight_versions=(-1, version, version), reward=r, status="ok",
                timing=EpisodeTiming(other=1.0 + s, started_at=0.0, ended_at=1.0 + s), turns=1, family="f")
        for s, r in enumerate(rewards)))


def _stream(tmp_path: Path) -> GroupStream:
    tasks = [make_task(tmp_path / "tasks", f"t{i}", "Create /tmp/done", "true") for i in range(3)]
    return GroupStream(tasks, tasks_per_step=2, group_size=2, seed=0)


def test_a_steps_rollout_metrics_write_each_key_once(tmp_path):
    stream = _stream(tmp_path)
    batch = Batch(version=3, groups=(_group(stream.spec(2), [0.0, 1.0], 1), _group(stream.spec(3), [1.0, 1.0], 2)),
                  stale=(), started=4, in_flight=0, wait_s=0.5)
    parts = [rollout_metrics(batch.episodes), batch_metrics(batch, filter_zero_variance=True),
             StepWindow(None).diagnostics(batch.episodes, batch.version, train_seconds=0.0)]
    keys = [k for part in parts for k in part]
    assert sorted(keys) == sorted(set(keys)), [k for k in set(keys) if keys.count(k) > 1]
    merged = {k: v for part in parts for k, v in part.items()}
    assert merged["sample_lag_mean"] == merged["staleness_mean"] == 1.5 and merged["staleness_max"] == 2
    assert (merged["episodes_trained"], merged["episodes_filtered"]) == (2, 2)


def test_a_requeued_copy_of_a_group_is_a_group_of_its_own(tmp_path):
    """Attempt 0 of group 1 (step 0, slot 1), dropped as stale, and its re-queued attempt 1, settled in one
    step: two GRPO groups (each copy's all-equal rewards are filtered on their own, not pooled into one
    group that varies), and records told apart by attempt that keep the plan step and slot."""
    stream = _stream(tmp_path)
    first, copy = stream.spec(1), stream.spec(1, attempt=1)
    assert (first.step, first.slot, copy.step, copy.slot) == (0, 1, 0, 1) and first.seeds != copy.seeds
    stale, trained = _group(first, [0.0, 0.0], 0), _group(copy, [1.0, 1.0], 2)
    kept = filter_zero_variance_groups([*stale.episodes, *trained.episodes])  # pooled, they would vary
    assert (kept.groups_kept, kept.groups_dropped) == (0, 2)
    batch = Batch(version=2, groups=(trained,), stale=(stale,), started=2, in_flight=0, wait_s=0.0)
    records = settled_records(batch, step=1, filter_zero_variance=True)
    assert sorted((r["group"], r["attempt"], r["sample"], r["outcome"]) for r in records) == [
        (1, 0, 0, "dropped_stale"), (1, 0, 1, "dropped_stale"), (1, 1, 0, "filtered"), (1, 1, 1, "filtered")]
    assert all((r["step"], r["plan_step"], r["slot"]) == (1, 0, 1) for r in records)


def test_a_metrics_row_refuses_a_key_two_parts_write():
    assert metrics_row({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"\['a'\] written by two parts"):
        metrics_row({"a": 1, "c": 0}, {"a": 2})
