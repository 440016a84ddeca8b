"""Asynchronous vs synchronous RL on the same recipe, in one run, at EQUAL RL WALL TIME: `furlong train` in
sync mode, then the RL phase and final eval again in async mode from the SAME SFT model and pre-RL eval
(the sync run's directory is copied up to its RL phase and resumed with train.rl.mode=async). Each mode
trains for the same budget of RL wall-clock seconds (train.rl.time_budget_s: it stops after the step that
crosses it), so the modes differ only in how rollouts and training overlap.

Recipe: recipes/async-bench.yaml (families slow-echo, whose commands sleep 0.1-4 s and verifier 0.1-1 s,
and transform-text; the default's SFT, 32 instances per family x 9 epochs). Reported per mode, from the
runs' metrics.jsonl, state.json and episodes.jsonl: RL steps and seconds, episodes settled (trained,
filtered, dropped stale, infra errors) per minute, trainer idle fraction (share of RL time not in
train_step) and the share it waited for a batch, engine idle fraction, the machine's busy cores over the
RL phase and which processes used them (bench/cpuload.py: overlap pays only while cores are spare), mean and max staleness of the
trained episodes, held-out pass@1 before and after RL with 90% bootstrap intervals; then async vs sync:
the ratio of episodes per minute and the paired difference of held-out pass@1 after RL (bootstrap over
the held-out tasks, both modes evaluated on the same tasks and seeds). Writes bench/results/async_vs_sync.json.

    python bench/async_vs_sync.py                  # 300 s of RL per mode: 13-16 min on 2 shared cores
    python bench/async_vs_sync.py --recipe recipes/async-bench-server-kl.yaml --seed 0   # the README's figures:
        # the engine in its own process, the default's KL and demonstration anchor (async drifts without them)
    python bench/async_vs_sync.py --budget-s 120   # shorter
    python bench/async_vs_sync.py --seed 1 --out bench/results/async_vs_sync_seed1.json   # a seed check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from furlong.metrics.episodes import read_jsonl  # noqa: E402
from cpuload import CpuMeter  # noqa: E402
from provenance import finish, provenance  # noqa: E402
from runs import ci, fork_before_rl, train  # noqa: E402
from furlong.metrics.stats import bootstrap_mean  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "async_vs_sync.json"
RECIPE = "recipes/async-bench.yaml"
# cores_by_process: furlong train's main thread is the event loop that drives the episodes, its other
# threads the trainer (and the engine, when it is in-process); the engine server is its own process
PROCESSES = {"furlong train": "furlong.cli train", "engine server": "furlong.engine.server"}


def _rewards(run: Path, phase: str) -> dict[str, float]:
    """Held-out reward per task (an unscored episode counts 0, as a failure)."""
    return {r["task"]: float(r["reward"] or 0.0) for r in read_jsonl(run / "episodes.jsonl") if r["phase"] == phase}


def measure(run: Path, meter: CpuMeter) -> dict:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    rl_window = (rows[0]["time"] - rows[0]["step_seconds"], rows[-1]["time"])  # a row is logged as its step ends
    phases = json.loads((run / "state.json").read_text())["phases"]
    rl_s, eps = phases["rl"]["seconds"], phases["rl"]["episodes"]
    train_s = sum(r["seconds"] for r in rows)  # in train_step
    settled = sum(eps[k] for k in ("trained", "dropped_stale", "filtered", "infra_error"))
    batch = [(r["staleness_mean"], r["episodes_trained"] + r["episodes_filtered"]) for r in rows]
    before, after = _rewards(run, "eval_before"), _rewards(run, "eval_after")
    gain = bootstrap_mean([after[t] - before[t] for t in after])
    return {"rl_steps": len(rows), "rl_seconds": round(rl_s, 1), "episodes": eps,
            "episodes_per_minute": round(60 * settled / rl_s, 1),
            "trained_episodes_per_minute": round(60 * eps["trained"] / rl_s, 1),
            "steps_per_minute": round(60 * len(rows) / rl_s, 2),
            "trainer_idle_fraction": round(1 - train_s / rl_s, 3),
            "trainer_wait_fraction": round(sum(r["trainer_wait_s"] for r in rows) / rl_s, 3),
            # async's steps are bound by it: a train step beside generation is slower than one alone
            "train_step_seconds_mean": round(train_s / len(rows), 2),
            "engine_idle_fraction": round(sum(r["engine_idle_frac"] * r["step_seconds"] for r in rows) / rl_s, 3),
            "cores_busy": meter.cores_busy(*rl_window), "cores_by_process": meter.cores_by_process(*rl_window),
            "staleness_mean": round(sum(s * n for s, n in batch) / max(sum(n for _, n in batch), 1), 3),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "episodes_multi_version": sum(r["episodes_multi_version"] for r in rows),
            "steps_updated": sum(bool(r["updated"]) for r in rows),
            "pass_at_1_before": ci(bootstrap_mean(list(before.values()))),
            "pass_at_1_after": ci(bootstrap_mean(list(after.values()))),
            "pass_at_1_gain": ci(gain),
            "pass_at_1_after_per_family": {f: v["pass_at_1"] for f, v in phases["eval_after"]["per_family"].items()},
            "pass_at_1_points_per_rl_minute": round(100 * gain.value / (rl_s / 60), 2)}


def compare(sync_dir: Path, async_dir: Path, sync: dict, asyn: dict) -> dict:
    s_after, a_after = _rewards(sync_dir, "eval_after"), _rewards(async_dir, "eval_after")
    diff = bootstrap_mean([a_after[t] - s_after[t] for t in s_after])  # paired: same tasks and eval seeds
    return {"episodes_per_minute": round(asyn["episodes_per_minute"] / sync["episodes_per_minute"], 3),
            "trained_episodes_per_minute": round(asyn["trained_episodes_per_minute"]
                                                 / max(sync["trained_episodes_per_minute"], 1e-9), 3),
            "steps_per_minute": round(asyn["steps_per_minute"] / sync["steps_per_minute"], 3),
            "pass_at_1_after_async_minus_sync": ci(diff)}


def run_both(work: Path, recipe: str, budget_s: float, max_staleness: int, seed: int) -> tuple[Path, Path]:
    sync_dir, async_dir = work / "sync", work / "async"
    print(f"sync: SFT, eval, {budget_s:g} s of RL, eval ...", flush=True)
    train(["--config", recipe, f"train.run_dir={sync_dir}", f"train.seed={seed}",
            f"train.rl.time_budget_s={budget_s}"])
    fork_before_rl(sync_dir, async_dir, {"mode": "async", "max_staleness": max_staleness})
    print(f"async: {budget_s:g} s of RL, eval (same SFT model and pre-RL eval) ...", flush=True)
    train(["--resume", str(async_dir)])
    return sync_dir, async_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=300.0, help="RL wall-clock seconds per mode")
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="train.seed (SFT data order, RL task stream)")
    ap.add_argument("--recipe", default=RECIPE, help="a check of this script: recipes/smoke.yaml")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the result JSON")
    ap.add_argument("--keep", type=Path, help="keep both run directories here (default: deleted)")
    args = ap.parse_args()
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-async-bench-"))
    try:
        with CpuMeter(PROCESSES) as meter:
            sync_dir, async_dir = run_both(work, args.recipe, args.budget_s, args.max_staleness, args.seed)
        sync, asyn = measure(sync_dir, meter), measure(async_dir, meter)
        ratios = compare(sync_dir, async_dir, sync, asyn)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {"provenance": finish(prov), "recipe": args.recipe,
              "rl_budget_s": args.budget_s, "max_staleness": args.max_staleness, "seed": args.seed,
              "cores": os.cpu_count(), "intervals": "[value, 90% bootstrap low, high]", "sync": sync, "async": asyn, "async_vs_sync": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for key in sync:
        print(f"{key:34} sync {json.dumps(sync[key]):>40}   async {json.dumps(asyn[key])}")
    print(json.dumps(ratios), f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
