"""Report sections on time: the episode-time breakdown, sample lag, and the per-step fractions."""

from __future__ import annotations

import numpy as np

from furlong.metrics.episodes import COMPONENTS
from furlong.metrics.stats import Estimate, bootstrap_mean
from furlong.report import plots
from furlong.report.data import RunData
from furlong.report.document import Heading, Image, Table
from furlong.report.parts import FRACTIONS, NO_RECORDS, Section

PHASE_ORDER = ("rl", "eval_before", "eval_after")


def component_samples(run: RunData, phase: str | None = None) -> dict[str, list[float]]:
    """Seconds per component (and `total`) per episode, from the records; or, for a run without them,
    the per-step means the metrics logged (then each sample is a step, not an episode)."""
    eps = run.phase_episodes(phase)
    if eps:
        out = {k: [float(e["time"].get(k, 0.0)) for e in eps] for k in COMPONENTS}
        out["total"] = [float(e["seconds"]) for e in eps]
        return out
    if phase in (None, "rl") and run.rl_rows and f"time_{COMPONENTS[0]}" in run.rl_rows[0]:
        out = {k: [float(r.get(f"time_{k}", 0.0)) for r in run.rl_rows] for k in COMPONENTS}
        out["total"] = [sum(vals) for vals in zip(*(out[k] for k in COMPONENTS))]
        return out
    return {}


def time_breakdown(run: RunData) -> Section:
    s = Section([Heading("Episode time breakdown")])
    groups = {"all": component_samples(run)}
    groups.update({p: component_samples(run, p) for p in PHASE_ORDER if run.phase_episodes(p)})
    groups = {k: v for k, v in groups.items() if v}
    if not groups:
        s.missing.append("episode time breakdown: no episodes recorded and no timing in the step metrics")
        return s
    if not run.episodes:
        s.missing.append(f"per-episode timing and the breakdown by phase: {NO_RECORDS}; RL per-step means shown")
    est = {g: {k: bootstrap_mean(v) for k, v in samples.items()} for g, samples in groups.items()}
    labels = list(est)
    s.blocks.append(
        Image(
            "time_breakdown.png",
            plots.stacked_bars(
                labels,
                {k: [est[g][k].value for g in labels] for k in COMPONENTS},
                [est[g]["total"] for g in labels],
                "Where an episode's time goes",
            ),
            "Mean seconds per episode by component, overall and by phase; whisker: 90% bootstrap interval of the total",
        )
    )
    s.blocks.append(
        Table(
            ("phase", "n", *COMPONENTS, "total"),
            tuple((g, str(est[g]["total"].n), *(est[g][k].text() for k in (*COMPONENTS, "total"))) for g in labels),
        )
    )
    return s


def episode_lags(run: RunData) -> tuple[list[float], list[float]]:
    """(lag, seconds) per trained RL episode with sampled tokens: the version it was trained at (that of
    the step that settled it, not the step it was planned for) minus its oldest token's version."""
    lags, seconds = [], []
    for e in run.batch_episodes():
        trained = run.trained_version(e["step"]) if isinstance(e.get("step"), int) else None
        if trained is not None and e.get("version_first") is not None:
            lags.append(float(trained - e["version_first"]))
            seconds.append(float(e["seconds"]))
    return lags, seconds


def sample_lag(run: RunData) -> Section:
    s = Section([Heading("Sample lag")])
    lags, seconds = episode_lags(run)
    if not lags:
        logged = [r["sample_lag_mean"] for r in run.rl_rows if "sample_lag_mean" in r]
        if logged:
            s.blocks.append(Table(("sample lag, mean over steps [90% CI]",), ((bootstrap_mean(logged).text(),),)))
        why = NO_RECORDS if not run.episodes else "no RL episode recorded with its step's metrics yet"
        s.missing.append(f"sample-lag histogram and lag by episode length: {why}")
        return s
    s.blocks.append(
        Image(
            "sample_lag_hist.png",
            plots.histogram(lags, "Sample lag", "trained version - oldest token version"),
            "Sample lag of RL episodes (weight versions between sampling and training)",
        )
    )
    order = np.argsort(seconds, kind="stable")
    buckets = [
        (f"q{i}", [lags[j] for j in idx], [seconds[j] for j in idx])
        for i, idx in enumerate(np.array_split(order, 4), start=1)
        if len(idx)
    ]
    est = [bootstrap_mean(b[1]) for b in buckets]
    s.blocks.append(
        Image(
            "lag_by_length.png",
            plots.grouped_bars(
                [b[0] for b in buckets], {"sample lag": est}, "Sample lag by episode duration quartile", "lag"
            ),
            "Mean sample lag per quartile of episode duration (q1 shortest), 90% bootstrap whiskers",
        )
    )
    rows = [
        ("all", f"{min(seconds):.2f}-{max(seconds):.2f}", str(len(lags)), bootstrap_mean(lags).text(), f"{max(lags):g}")
    ]
    rows += [
        (name, f"{min(sec):.2f}-{max(sec):.2f}", str(len(lag)), e.text(), f"{max(lag):g}")
        for (name, lag, sec), e in zip(buckets, est)
    ]
    s.blocks.append(Table(("episodes", "duration s", "n", "mean lag [90% CI]", "max lag"), tuple(rows)))
    return s


def teacher_cost(run: RunData) -> Section:
    """train.distill: what the teacher's prefill cost each step (seconds, tokens, share of the step), and
    how many episodes it scored or failed. Nothing for a run without a teacher."""
    rows = [r for r in run.rl_rows if "teacher_seconds" in r]
    if not rows:
        return Section()
    seconds = [float(r["teacher_seconds"]) for r in rows]
    tokens = [float(r["teacher_tokens"]) for r in rows]
    share = [float(r["teacher_seconds"]) / r["step_seconds"] for r in rows if r.get("step_seconds")]
    head = ("steps", "teacher s/step [90% CI]", "teacher tokens/step [90% CI]", "share of step time [90% CI]")
    counts = ("episodes scored", "teacher failed", "reverse KL (mean over steps)")
    row = (
        str(len(rows)),
        bootstrap_mean(seconds).text(),
        bootstrap_mean(tokens).text(),
        bootstrap_mean(share).text() if share else "-",
        str(sum(int(r.get("distill_scored", 0)) for r in rows)),
        str(sum(int(r.get("distill_failed", 0)) for r in rows)),
        f"{np.mean([float(r.get('distill_reverse_kl', 0.0)) for r in rows]):.4g}",
    )
    return Section([Heading("Distillation teacher"), Table((*head, *counts), (row,))])


def fractions(run: RunData) -> Section:
    s = Section([Heading("Group wait, KV held during tool waits, idle fractions")])
    series = {k: [(int(r["step"]), float(r[k])) for r in run.rl_rows if k in r] for k in FRACTIONS}
    if not series["trainer_idle_frac"]:  # older runs: the trainer's share follows from the logged seconds
        series["trainer_idle_frac"] = [
            (int(r["step"]), 1.0 - r["seconds"] / r["step_seconds"])
            for r in run.rl_rows
            if r.get("step_seconds") and "seconds" in r
        ]
    absent = [k for k, v in series.items() if not v]
    if absent:
        s.missing.append(f"per-step {', '.join(absent)}: not in metrics.jsonl (a run from before these diagnostics)")
    series = {k: v for k, v in series.items() if v}
    if not series:
        return s
    steps = sorted({st for v in series.values() for st, _ in v})
    lines = {k: [Estimate(dict(v).get(st, np.nan), np.nan, np.nan, 1) for st in steps] for k, v in series.items()}
    s.blocks.append(
        Image(
            "fractions.png",
            plots.lines(steps, lines, "Fractions per RL step", "fraction"),
            "Group wait, KV held during tool waits, engine and trainer idle, per RL step",
        )
    )
    s.blocks.append(
        Table(
            ("fraction", "mean over steps [90% CI]", "min", "max"),
            tuple(
                (
                    k,
                    bootstrap_mean([x for _, x in v]).text(),
                    f"{min(x for _, x in v):.3g}",
                    f"{max(x for _, x in v):.3g}",
                )
                for k, v in series.items()
            ),
        )
    )
    return s
