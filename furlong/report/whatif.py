"""Two runs side by side (`--compare`), and what faster inference would buy (`--project-inference-speedup`)."""

from __future__ import annotations

import numpy as np

from furlong.metrics.episodes import COMPONENTS
from furlong.metrics.stats import bootstrap_diff, bootstrap_mean, bootstrap_ratio
from furlong.report.data import RunData
from furlong.report.document import Heading, Para, Table
from furlong.report.parts import Section, by_step
from furlong.report.timing import component_samples

ASSUMPTION = (
    "Assumption: only model_wait (time an episode waits on generation) shrinks, by k; sandbox start, "
    "agent commands, verifier and other time per episode stay as measured, and so do each step's "
    "training and weight-sync seconds. A step's rollout wall time (step seconds - train - sync) is "
    "scaled by the step's projected/measured mean episode time. Queueing effects (e.g. more "
    "episodes in flight at once) are not modelled."
)


def _episode_samples(run: RunData) -> dict[str, list[float]]:
    """The RL episodes if any are recorded, else every recorded episode, else the logged step means."""
    return component_samples(run, "rl") or component_samples(run)


def compare(a: RunData, b: RunData) -> Section:
    s = Section([Heading(f"Compare: {a.name} (A) vs {b.name} (B)")])
    sa, sb = _episode_samples(a), _episode_samples(b)
    if not sa or not sb:
        s.missing.append(f"comparison: no episode timing in {(b if sa else a).path}")
        return s
    ratio = bootstrap_ratio(sa["total"], sb["total"])
    unit = lambda r: "episodes" if r.episodes else "per-step means (no episodes.jsonl)"  # noqa: E731
    s.blocks.append(
        Para(
            f"Mean episode time A / B: {ratio.text()} (90% bootstrap interval, each run resampled "
            f"independently; A: {len(sa['total'])} {unit(a)}, B: {len(sb['total'])} {unit(b)})."
        )
    )
    rows = tuple(
        (k, bootstrap_mean(sa[k]).text(), bootstrap_mean(sb[k]).text(), bootstrap_diff(sa[k], sb[k]).text())
        for k in (*COMPONENTS, "total")
    )
    s.blocks.append(Table(("component (s)", "A mean [90% CI]", "B mean [90% CI]", "A - B [90% CI]"), rows))
    return s


def _projected(total: np.ndarray, model_wait: np.ndarray, k: float) -> np.ndarray:
    return total - model_wait + model_wait / k


def _step_projection(run: RunData, k: float) -> list[float]:
    """Projected seconds per logged RL step (see ASSUMPTION)."""
    records = by_step(run.phase_episodes("rl"))
    out = []
    for row in run.rl_rows:
        if not row.get("step_seconds"):
            continue
        eps = records.get(int(row["step"]))
        if eps:
            total = np.array([e["seconds"] for e in eps])
            mw = np.array([e["time"].get("model_wait", 0.0) for e in eps])
        else:
            mw = np.array([row.get("time_model_wait", 0.0)])
            total = np.array([sum(row.get(f"time_{c}", 0.0) for c in COMPONENTS)])
        factor = _projected(total, mw, k).mean() / total.mean() if total.mean() > 0 else 1.0
        fixed = row.get("seconds", 0.0) + row.get("sync_seconds", 0.0)
        out.append(max(row["step_seconds"] - fixed, 0.0) * factor + fixed)
    return out


def projection(run: RunData, speedups: list[float]) -> Section:
    s = Section([Heading("Projection: faster inference")])
    samples = _episode_samples(run)
    if not samples:
        s.missing.append("inference-speedup projection: no episode timing recorded")
        return s
    total, mw = np.array(samples["total"]), np.array(samples["model_wait"])
    base_ep, base_step = bootstrap_mean(total), bootstrap_mean(_step_projection(run, 1.0))
    rows = [("1 (measured)", base_ep.text(), "1", base_step.text(), "1")]
    for k in speedups:
        ep, step = bootstrap_mean(_projected(total, mw, k)), bootstrap_mean(_step_projection(run, k))
        rows.append(
            (
                f"{k:g}",
                ep.text(),
                f"{base_ep.value / ep.value:.2f}x",
                step.text(),
                f"{base_step.value / step.value:.2f}x" if step.n else "n/a",
            )
        )
    s.blocks.append(Para(ASSUMPTION))
    s.blocks.append(
        Table(
            ("inference k x faster", "episode s [90% CI]", "episode speedup", "step s [90% CI]", "step speedup"),
            tuple(rows),
        )
    )
    return s
