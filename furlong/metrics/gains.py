"""What RL changed on held-out instances, per family, with 90% intervals (summary.json, the benches).

Each held-out instance is scored once before RL and once after, with the same sampling seed, so the
gain is a paired difference: pairs are resampled together. Only instances scored in both evals count
(an infra_error has no reward to compare).
"""

from __future__ import annotations

from pathlib import Path

from furlong.metrics.episodes import FILENAME, read_jsonl
from furlong.metrics.outcomes import passed
from furlong.metrics.stats import bootstrap_mean, bootstrap_paired_diff


def eval_passes(run_path: Path, phase: str) -> dict[str, tuple[str, bool]]:
    """task -> (family, passed) for every scored episode of an eval phase."""
    return {
        r["task"]: (r.get("family") or "", passed(r["reward"]))
        for r in read_jsonl(Path(run_path) / FILENAME)
        if r.get("phase") == phase and r.get("reward") is not None
    }


def _gain(pairs: list[tuple[bool, bool]]) -> dict:
    before, after = [float(b) for b, _ in pairs], [float(a) for _, a in pairs]
    gain = bootstrap_paired_diff(after, before)
    b, a = bootstrap_mean(before), bootstrap_mean(after)
    return {
        "instances": len(pairs),
        "before": round(b.value, 4),
        "after": round(a.value, 4),
        "after_ci90": [round(a.lo, 4), round(a.hi, 4)],
        "gain_points": round(100 * gain.value, 2),
        "gain_ci90": [round(100 * gain.lo, 2), round(100 * gain.hi, 2)],
    }


def heldout_gains(run_path: Path, groups: dict[str, tuple[str, ...]]) -> dict:
    """Per family, and per named group of families (e.g. reward_only, demonstrated): held-out pass@1
    before and after RL and the paired gain in points, each with its 90% bootstrap interval."""
    before, after = eval_passes(run_path, "eval_before"), eval_passes(run_path, "eval_after")
    pairs: dict[str, list[tuple[bool, bool]]] = {}
    for task, (family, ok) in before.items():
        if task in after:
            pairs.setdefault(family, []).append((ok, after[task][1]))
    out: dict[str, dict | None] = {"per_family": {f: _gain(p) for f, p in sorted(pairs.items())}}
    for name, families in groups.items():
        joined = [pair for f in families for pair in pairs.get(f, [])]
        out[name] = _gain(joined) if joined else None
    return out
