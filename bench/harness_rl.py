"""Does RL through an unmodified harness learn? (docs/gateway.md; issue 43.) Per seed, two runs of the default
recipe from one SFT checkpoint:

  - own: `furlong train` with furlong's own agent loop (SFT, held-out eval, RL, held-out eval);
  - harness: forked from own's SFT checkpoint, every episode (RL and both held-out evals) run by
    examples/harness_agent.py, an ordinary `openai` SDK agent, through the run's gateway
    (examples/harness.yaml's train.agent.harness).

Reported per seed and pooled over seeds: held-out pass@1 before and after RL, the gain in points (90% bootstrap
intervals, paired on the same instances and sampling seeds), harness minus own, each family's gain; the
gateway's totals over every harness episode (requests, tito_mismatch_tokens, history rewrites, malformed calls);
RL seconds and statuses.

    python bench/harness_rl.py --keep DIR                    # 3 seeds of the default recipe
    python bench/harness_rl.py --keep DIR --seeds 0 train.rl.steps=10 train.eval.heldout_per_family=32
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import yaml
from provenance import finish, provenance
from runs import ROOT, ci, fork_with_own_eval, heldout, summary, train

from furlong.metrics.episodes import read_jsonl
from furlong.metrics.stats import bootstrap_mean, bootstrap_paired_diff

RESULTS = ROOT / "bench" / "results" / "harness_rl.json"
HARNESS = yaml.safe_load((ROOT / "examples" / "harness.yaml").read_text())["train"]["agent"]["harness"]


def gain(run: Path) -> dict:
    """Held-out pass@1 before and after RL and the paired gain, overall and per family."""
    before, after = heldout(run, "eval_before"), heldout(run, "eval_after")
    tasks = sorted(set(before) & set(after))

    def one(keep: list[str]) -> dict:
        b = [float(before[t]["reward"] >= 1) for t in keep]
        a = [float(after[t]["reward"] >= 1) for t in keep]
        return {"instances": len(keep), "before": ci(bootstrap_mean(b)), "after": ci(bootstrap_mean(a)),
                "gain_points": ci(bootstrap_paired_diff(a, b), 100)}

    families = sorted({before[t]["family"] for t in tasks})
    return {**one(tasks), "per_family": {f: one([t for t in tasks if before[t]["family"] == f]) for f in families}}


def gateway_totals(run: Path) -> dict:
    """Sums of every harness episode's gateway record (RL and evals), and the episodes that had none."""
    total: Counter = Counter()
    missing = 0
    for r in read_jsonl(run / "episodes.jsonl"):
        if r.get("gateway") is None:
            missing += 1
            continue
        total["episodes"] += 1
        for key in ("requests", "tito_mismatch_tokens", "gateway_history_rewrites", "malformed_calls"):
            total[key] += r["gateway"].get(key, 0)
    return {**total, "episodes_without_gateway_record": missing}


def harness_arm(own: Path, work: Path) -> None:
    """own's config and SFT checkpoint, with the harness as the agent of RL and both held-out evals."""
    fork_with_own_eval(own, work, own / "checkpoints" / "sft", {})  # own's pre-RL eval was furlong's agent
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["train"]["agent"]["harness"] = HARNESS
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    train(["--resume", str(work)], "(harness)")


def arm(run: Path) -> dict:
    s = summary(run)
    return {"heldout": gain(run), "status": s["status"], "rl_episodes": s["rl_episodes"],
            "phase_seconds": s["phase_seconds"]}


def one_seed(work: Path, seed: int, overrides: list[str], reused: list[str]) -> dict:
    own, har = work / f"seed{seed}-own", work / f"seed{seed}-harness"
    reused += [str(r) for r in (own, har) if (r / "summary.json").exists()]
    if not (own / "summary.json").exists():
        print(f"seed {seed}: furlong train (own agent) ...", flush=True)
        shutil.rmtree(own, ignore_errors=True)
        train([f"train.seed={seed}", f"train.run_dir={own}", *overrides], f"(seed {seed}, own)")
    if not (har / "summary.json").exists():
        print(f"seed {seed}: the harness, from the same SFT checkpoint ...", flush=True)
        shutil.rmtree(har, ignore_errors=True)
        harness_arm(own, har)
    a_own, a_har = arm(own), arm(har)
    a_har["gateway"] = gateway_totals(har)
    after_o, after_h = heldout(own, "eval_after"), heldout(har, "eval_after")
    tasks = sorted(set(after_o) & set(after_h))
    h = [float(after_h[t]["reward"] >= 1) for t in tasks]
    o = [float(after_o[t]["reward"] >= 1) for t in tasks]
    return {"seed": seed, "own": a_own, "harness": a_har,
            "harness_minus_own_after": ci(bootstrap_paired_diff(h, o), 100)}


def pooled(seeds: list[dict]) -> dict:
    """The mean over seeds of each arm's gain (points), with the seeds' range."""
    out = {}
    for name in ("own", "harness"):
        gains = [s[name]["heldout"]["gain_points"][0] for s in seeds]
        out[name] = {"gain_points_mean": round(sum(gains) / len(gains), 2), "min": min(gains), "max": max(gains)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", type=Path, help="keep the runs here (default: deleted); finished runs there are reused")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args()
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-harness-"))
    work.mkdir(parents=True, exist_ok=True)
    seeds: list[dict] = []
    reused: list[str] = []  # runs an earlier invocation finished (--keep): this one only read them
    try:
        for seed in args.seeds:
            seeds.append(one_seed(work, seed, args.overrides, reused))
            print(json.dumps({k: seeds[-1][k] for k in ("seed", "harness_minus_own_after")}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "question": "does RL through an unmodified openai-SDK harness (examples/harness_agent.py) learn, beside "
        "furlong's own agent from the same SFT checkpoint?",
        "harness": HARNESS,
        "overrides": args.overrides,
        "values": "[value, 90% bootstrap low, high]; gains in points, paired on the same held-out instances and "
        "sampling seeds",
        "seeds": seeds,
        "pooled": pooled(seeds),
        "reused_runs": reused,
        "provenance": finish(prov),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
