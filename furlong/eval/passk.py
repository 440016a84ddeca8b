"""pass@k from K sampled episodes per task: the unbiased estimator of Chen et al. 2021 (Codex paper).

With n scored samples of a task of which c passed, pass@k = 1 - C(n-c, k) / C(n, k): the chance that k
samples drawn without replacement from those n include at least one pass. Averaging it over tasks
estimates the probability that k fresh samples solve a task. Unscored (infra_error) samples are left out
of n, as everywhere else in furlong; a task with fewer than k scored samples has no pass@k (null) and
is left out of the averages for that k.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import comb

from furlong.metrics.outcomes import Scored, passed


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), exactly (integer binomials), for 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(samples: int) -> tuple[int, ...]:
    """The k reported for K samples per task: the powers of two up to K, and K itself."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    return tuple(sorted({1 << i for i in range(samples.bit_length()) if 1 << i <= samples} | {samples}))


def task_pass_at_k(episodes: Sequence[Scored], ks: Iterable[int]) -> dict:
    """One task's samples -> {"n", "c", "pass_at_k": {"1": ..., "2": ...}} (null where n < k)."""
    rewards = [e.reward for e in episodes if e.reward is not None]
    n, c = len(rewards), sum(map(passed, rewards))
    return {"n": n, "c": c, "pass_at_k": {str(k): pass_at_k(n, c, k) if n >= k else None for k in ks}}


def mean_pass_at_k(per_task: Iterable[dict], ks: Iterable[int]) -> dict[str, float | None]:
    """The mean over tasks of each pass@k, over the tasks that have it (null when none does)."""
    rows = list(per_task)
    out: dict[str, float | None] = {}
    for k in map(str, ks):
        values = [r["pass_at_k"][k] for r in rows if r["pass_at_k"][k] is not None]
        out[k] = sum(values) / len(values) if values else None
    return out


def pass_at_k_summary(tasks: Sequence[tuple[str, str | None, Sequence[Scored]]], samples: int) -> dict:
    """(task id, family, its episodes) for every task -> pass@k overall, per family and per task."""
    ks = ks_for(samples)
    per_task = {task: {"family": family, **task_pass_at_k(episodes, ks)} for task, family, episodes in tasks}
    families = sorted({row["family"] for row in per_task.values() if row["family"] is not None})
    return {
        "samples": samples,
        "ks": list(ks),
        "pass_at_k": mean_pass_at_k(per_task.values(), ks),
        "per_family": {f: mean_pass_at_k((r for r in per_task.values() if r["family"] == f), ks) for f in families},
        "per_task": per_task,
    }
