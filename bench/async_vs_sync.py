"""Asynchronous vs synchronous RL on the same recipe, in one run: `furlong train` in sync mode, then the
RL phase and final eval again in async mode from the SAME SFT model and pre-RL eval (the sync run's
directory is copied up to its RL phase and resumed with train.rl.mode=async), so the modes differ only in
how rollouts and training overlap.

Families: slow-echo (commands and verifier sleep 0.2-3 s / 0.1-1 s by seed: variable episode durations)
and count-in-file (fast). Reported per mode, from the runs' metrics.jsonl and state.json:
episodes per minute of RL wall time (episodes started), trainer idle fraction (time the trainer waited
for a batch / RL time), mean and max staleness of trained episodes, held-out pass@1 before and after RL,
and pass@1 points gained per RL minute; then async/sync ratios. Writes bench/results/async_vs_sync.json.

    python bench/async_vs_sync.py                 # a few minutes per mode on 2 shared cores
    python bench/async_vs_sync.py --steps 4       # shorter
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "async_vs_sync.json"


def recipe(steps: int) -> list[str]:
    return ["train.families=[slow-echo, count-in-file]", "train.agent.max_turns=2", "train.agent.max_new_tokens=32",
            "train.sft.instances_per_family=16", "train.sft.epochs=6",
            f"train.rl.steps={steps}", "train.rl.tasks_per_step=4", "train.rl.group_size=4",
            "train.rl.concurrency=16", "train.rl.checkpoint_every=100", "train.eval.heldout_per_family=16"]


def _train(args: list[str]) -> None:
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", *args], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if res.returncode != 0:
        sys.exit(f"furlong train failed:\n{res.stderr[-3000:]}")


def fork_before_rl(src: Path, dst: Path, overrides: dict) -> None:
    """A copy of run `src` that has done SFT and the pre-RL eval, with RL settings changed."""
    dst.mkdir(parents=True)
    config = yaml.safe_load((src / "config.yaml").read_text())
    config["train"]["rl"].update(overrides)
    config["train"]["run_dir"] = str(dst)
    (dst / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    state = json.loads((src / "state.json").read_text())
    state["phases"] = {k: v for k, v in state["phases"].items() if k in ("sft", "eval_before")}
    state["last_checkpoint"] = None
    (dst / "state.json").write_text(json.dumps(state))
    rows = [r for r in map(json.loads, (src / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "sft"]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def measure(run: Path) -> dict:
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    phases = json.loads((run / "state.json").read_text())["phases"]
    rl_s = phases["rl"]["seconds"]
    trained = [r for r in rows if r["episodes_trained"] + r["episodes_filtered"]]
    weight = sum(r["episodes_trained"] + r["episodes_filtered"] for r in trained) or 1
    before, after = phases["eval_before"]["pass_at_1"], phases["eval_after"]["pass_at_1"]
    return {"rl_seconds": round(rl_s, 1), "episodes": phases["rl"]["episodes"],
            "episodes_per_minute": round(60 * phases["rl"]["episodes"]["started"] / rl_s, 2),
            "trainer_idle_fraction": round(sum(r["trainer_wait_s"] for r in rows) / rl_s, 3),
            "staleness_mean": round(sum(r["staleness_mean"] * (r["episodes_trained"] + r["episodes_filtered"])
                                        for r in trained) / weight, 3),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "episodes_multi_version": sum(r["episodes_multi_version"] for r in rows),
            "pass_at_1_before": before, "pass_at_1_after": after,
            "pass_at_1_points_per_rl_minute": round(100 * (after - before) / (rl_s / 60), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-staleness", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="furlong-async-bench-"))
    try:
        sync_dir, async_dir = work / "sync", work / "async"
        print("sync: SFT, eval, RL, eval ...", flush=True)
        _train([f"train.run_dir={sync_dir}", *recipe(args.steps)])
        fork_before_rl(sync_dir, async_dir, {"mode": "async", "max_staleness": args.max_staleness})
        print("async: RL, eval (same SFT model) ...", flush=True)
        _train(["--resume", str(async_dir)])
        sync, asyn = measure(sync_dir), measure(async_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = {"episodes_per_minute": round(asyn["episodes_per_minute"] / sync["episodes_per_minute"], 3),
              "rl_seconds": round(asyn["rl_seconds"] / sync["rl_seconds"], 3),
              "pass_at_1_after_minus_sync": round(asyn["pass_at_1_after"] - sync["pass_at_1_after"], 4)}
    result = {"command": "python bench/async_vs_sync.py " + " ".join(sys.argv[1:]), "recipe": recipe(args.steps),
              "max_staleness": args.max_staleness, "sync": sync, "async": asyn, "async_over_sync": ratios}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    for key in sync:
        print(f"{key:34} sync {sync[key]!s:>12}   async {asyn[key]!s:>12}")
    print(f"async/sync episodes per minute: {ratios['episodes_per_minute']}x; written to {RESULTS}")


if __name__ == "__main__":
    main()
