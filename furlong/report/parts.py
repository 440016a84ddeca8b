"""The report's sections. Each reads a RunData and returns its blocks, noting in `missing` what the
run's files could not support (an older run has no episodes.jsonl; a run in progress has few steps)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from furlong.metrics.stats import Estimate, bootstrap_mean, point
from furlong.report import plots
from furlong.report.data import RunData
from furlong.report.document import Block, Heading, Image, Para, Table

FRACTIONS = ("group_wait_frac", "kv_held_tool_wait_frac", "engine_idle_frac", "trainer_idle_frac")
NO_RECORDS = "no episodes.jsonl (a run from before per-episode records)"
MAX_PATHS = 10  # of the tampered paths listed


@dataclass
class Section:
    blocks: list[Block] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def passed(e: dict) -> float:
    return float(e.get("reward") is not None and e["reward"] >= 1.0)


def scored(episodes: list[dict]) -> list[dict]:
    return [e for e in episodes if e.get("reward") is not None]


def by_step(episodes: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in episodes:
        if isinstance(e.get("step"), int):
            out.setdefault(e["step"], []).append(e)
    return dict(sorted(out.items()))


def overview(run: RunData) -> Section:
    s = Section([Heading(f"furlong report: {run.name}", 1)])
    steps = run.config.get("train", {}).get("rl", {}).get("steps", "?")
    state = "finished" if run.summary else "in progress, or stopped before it finished (no summary.json)"
    s.blocks.append(
        Para(
            f"Run {run.path}: {state}. RL steps logged: {len(run.rl_rows)} of {steps}. "
            f"Phases done: {', '.join(run.state.get('phases', {})) or 'none'}. "
            "Every interval is a 90% percentile bootstrap (2000 resamples, seed 0)."
        )
    )
    order = ("eval_before", "rl", "eval_after")
    phases = sorted(
        {e.get("phase", "?") for e in run.episodes},
        key=lambda p: (p not in order, order.index(p) if p in order else 0, p),
    )
    rows = []
    for phase in phases:
        eps = run.phase_episodes(phase)
        statuses: dict[str, int] = {}
        for e in eps:
            statuses[e.get("status", "?")] = statuses.get(e.get("status", "?"), 0) + 1
        rows.append(
            (
                phase,
                str(len(eps)),
                ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())),
                bootstrap_mean([passed(e) for e in scored(eps)]).text(),
            )
        )
    if rows:
        s.blocks.append(Table(("phase", "episodes", "statuses", "pass@1 [90% CI]"), tuple(rows)))
    else:
        s.missing.append(f"episode counts and statuses per phase: {NO_RECORDS}")
    if run.summary:
        b, a = run.summary.get("heldout_pass_at_1_before_rl"), run.summary.get("heldout_pass_at_1_after_rl")
        s.blocks.append(Para(f"Held-out pass@1 (summary.json): {b:.3f} after SFT, {a:.3f} after RL."))
    return s


def receipts(run: RunData) -> Section:
    """Per phase: how many scored episodes carry receipts (furlong.tasks.receipt), how many of those had no
    tamper check, and the tampered paths the receipts name, most frequent first."""
    s = Section([Heading("Receipts")])
    if not run.episodes:
        s.missing.append(f"receipts: {NO_RECORDS}")
        return s
    rows, paths = [], dict[str, int]()
    for phase in dict.fromkeys(e.get("phase", "?") for e in run.episodes):
        eps = scored(run.phase_episodes(phase))
        with_receipts = [e for e in eps if e.get("receipts")]
        found = [r for e in with_receipts for r in e["receipts"]]
        for r in found:
            for p in r.get("tampered_paths") or []:
                paths[p] = paths.get(p, 0) + 1
        rows.append(
            (
                phase,
                str(len(eps)),
                str(len(with_receipts)),
                str(len(eps) - len(with_receipts)),
                str(sum(not r.get("tamper_checked", True) for r in found)),
                str(sum(bool(r.get("tampered_paths")) for r in found)),
            )
        )
    header = ("phase", "scored", "with receipts", "without", "no tamper check", "tampered")
    s.blocks.append(Table(header, tuple(rows)))
    top = sorted(paths.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_PATHS]
    listed = ", ".join(f"{p} ({n})" for p, n in top) if top else "none"
    s.blocks.append(
        Para(
            f"Tampered paths the receipts name (episodes): {listed}. A scored episode without a receipt was "
            "scored by an environment that gives none (a Python environment's), or recorded before receipts; "
            "`furlong eval --verify-receipts RUN_DIR/episodes.jsonl --tasks DIR` rechecks them against the tasks."
        )
    )
    return s


def reward_per_step(run: RunData) -> Section:
    s = Section([Heading("Reward and pass rate per step")])
    steps = by_step(run.batch_episodes())
    if steps:
        reward = {k: bootstrap_mean([e["reward"] for e in scored(v)]) for k, v in steps.items()}
        rate = {k: bootstrap_mean([passed(e) for e in scored(v)]) for k, v in steps.items()}
        n = {k: len(v) for k, v in steps.items()}
    elif run.rl_rows:
        rows = run.rows_by_step()
        reward = {k: point(r["reward_mean"]) for k, r in rows.items()}
        rate = {k: point(r["pass_rate"]) for k, r in rows.items()}
        n = {k: r.get("episodes", 0) for k, r in rows.items()}
        s.missing.append(f"intervals on per-step reward and pass rate: {NO_RECORDS}; logged step means shown")
    else:
        s.missing.append("reward and pass rate per step: no RL step logged yet")
        return s
    x = list(reward)
    s.blocks.append(
        Image(
            "reward_per_step.png",
            plots.lines(
                x,
                {"mean reward": list(reward.values()), "pass rate": list(rate.values())},
                "RL reward and pass rate",
                "per episode",
            ),
            "Mean reward and pass rate per RL step (scored episodes), 90% bootstrap band",
        )
    )
    s.blocks.append(
        Table(
            ("step", "episodes", "mean reward [90% CI]", "pass rate [90% CI]"),
            tuple((str(k), str(n[k]), reward[k].text(), rate[k].text()) for k in x),
        )
    )
    return s


def _halves(steps: list[int]) -> tuple[set[int], set[int]]:
    cut = (len(steps) + 1) // 2
    return set(steps[:cut]), set(steps[cut:])


def family_halves(run: RunData) -> Section:
    s = Section([Heading("Per-family pass rate, first and second half of training")])
    rl = run.phase_episodes("rl")
    series: dict[str, dict[str, Estimate]] = {}
    if rl:
        first, second = _halves(sorted(by_step(rl)))
        for label, keep in (("RL first half", first), ("RL second half", second)):
            series[label] = _per_family([e for e in rl if e.get("step") in keep])
        for phase, label in (("eval_before", "held-out before RL"), ("eval_after", "held-out after RL")):
            if run.phase_episodes(phase):
                series[label] = _per_family(run.phase_episodes(phase))
    elif any(k.startswith("pass_rate/") for r in run.rl_rows for k in r):
        first, second = _halves([int(r["step"]) for r in run.rl_rows])
        for label, keep in (("RL first half (step means)", first), ("RL second half (step means)", second)):
            rows = [r for r in run.rl_rows if r["step"] in keep]
            fams = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("pass_rate/")})
            series[label] = {
                f: bootstrap_mean([r[f"pass_rate/{f}"] for r in rows if f"pass_rate/{f}" in r]) for f in fams
            }
    elif run.summary:
        for key, label in (("per_family_before", "held-out before RL"), ("per_family_after", "held-out after RL")):
            series[label] = {f: point(v["pass_at_1"]) for f, v in run.summary.get(key, {}).items()}
        s.missing.append(
            f"per-family pass rate during RL: {NO_RECORDS}, no per-family step metrics; "
            "held-out rates from summary.json shown"
        )
    if not any(series.values()):
        s.missing.append("per-family pass rates: no episodes recorded yet")
        return s
    fams = sorted({f for v in series.values() for f in v})
    filled = {k: [v.get(f, Estimate(np.nan, np.nan, np.nan, 0)) for f in fams] for k, v in series.items()}
    s.blocks.append(
        Image(
            "family_pass_rate.png",
            plots.grouped_bars(fams, filled, "Pass rate per family", "pass rate"),
            "Pass rate per family: RL steps split in halves, and held-out evals; 90% bootstrap whiskers",
        )
    )
    s.blocks.append(
        Table(("family", *series), tuple((f, *(v[i].text() for v in filled.values())) for i, f in enumerate(fams)))
    )
    return s


def _per_family(episodes: list[dict]) -> dict[str, Estimate]:
    fams: dict[str, list[float]] = {}
    for e in scored(episodes):
        fams.setdefault(e.get("family") or "?", []).append(passed(e))
    return {f: bootstrap_mean(v) for f, v in sorted(fams.items())}
