"""Does RL on a prompt dataset learn from its reward? The bundled example (recipes/prompts-arith.yaml,
docs/prompts.md): SFT shows the answers of "What is a + b?"; "What is a plus b?" has none, and the held-out
rows are the "plus" rows of 40 pairs RL never draws. Per seed (train.seed: SFT order, RL stream, sampling):

  1. `furlong train --config recipes/prompts-arith.yaml`: SFT, held-out pass@1, 40 GRPO steps, held-out again;
  2. the control: the same RL phase from the same SFT checkpoint, with a reward that is 0 for everything
     (bench/prompts_no_signal.py, zero-variance groups kept): every advantage is 0, so only the KL penalty and
     the demonstration anchor (more "a + b" answers) train. Its final model is scored with the real reward
     by `furlong eval --agent model` on the same held-out rows with the same sampling seeds.

Reported per seed and pooled over the seeds: held-out pass@1 before RL, after RL and after the control, the
paired gains with 90% bootstrap intervals (RL minus control: what the reward itself taught), RL's train
reward on the "plus" and "+" rows in its first and last quarter of steps, every status, wall seconds.
Writes bench/results/prompts_rl.json.

    python bench/prompts_rl.py                   # 3 seeds: about 21 min on 2 shared cores
    python bench/prompts_rl.py --seeds 0 --keep /tmp/prompts-rl train.rl.steps=2 train.sft.epochs=1  # a check
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
from provenance import finish, provenance
from runs import ROOT, fork_before_rl, summary, train

from furlong.build.environment import prompt_source
from furlong.config import load_config
from furlong.metrics.episodes import read_jsonl
from furlong.metrics.stats import bootstrap_mean, bootstrap_paired_diff

RECIPE = "recipes/prompts-arith.yaml"
RESULTS = ROOT / "bench" / "results" / "prompts_rl.json"
NO_SIGNAL = "bench/prompts_no_signal.py:no_signal"


def control(main: Path, work: Path, recipe: dict) -> dict[str, float]:
    """The control arm from `main`'s SFT: task -> held-out reward of its final model, under the real reward."""
    fork_before_rl(main, work, {"filter_zero_variance": False})
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["train"]["env"]["prompts"]["reward"] = NO_SIGNAL
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.copytree(main / "checkpoints" / "sft", work / "checkpoints" / "sft")
    train(["--resume", str(work)], "(control)")
    final, t = summary(work)["hf_model"], recipe["train"]
    out = work / "eval_real_reward.jsonl"
    subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--config", str(work / "config.yaml"),
                    "--agent", "model", "--model", final, "--split", "heldout",
                    "--per-family", str(t["eval"]["heldout_per_family"]), "--out", str(out),
                    f"train.env.prompts.reward={t['env']['prompts']['reward']}",
                    f"eval.seed={t['eval']['seed']}", f"eval.temperature={t['eval']['temperature']}",
                    f"eval.concurrency={t['eval']['concurrency']}"],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return {r["task"]: r["reward"] for r in read_jsonl(out) if r["reward"] is not None}


def heldout(run: Path, phase: str) -> dict[str, float]:
    return {r["task"]: r["reward"] for r in read_jsonl(run / "episodes.jsonl")
            if r["phase"] == phase and r["reward"] is not None}


def pass_at_1(rewards: dict[str, float]) -> float:
    return round(bootstrap_mean([float(r >= 1) for r in rewards.values()]).value, 4)


def gain(after: dict[str, float], before: dict[str, float]) -> dict:
    """Pass@1 after and the paired gain over `before`, in points, on the tasks both scored."""
    tasks = sorted(set(after) & set(before))
    a, b = [float(after[t] >= 1) for t in tasks], [float(before[t] >= 1) for t in tasks]
    d, m = bootstrap_paired_diff(a, b), bootstrap_mean(a)
    return {"instances": len(tasks), "pass_at_1": round(m.value, 4),
            "gain_points": round(100 * d.value, 2), "gain_ci90": [round(100 * d.lo, 2), round(100 * d.hi, 2)]}


def train_reward_by_kind(run: Path, kinds: dict[str, str], steps: int) -> dict:
    """RL's mean train reward on each kind of row, in the first and the last quarter of the steps."""
    quarter, out = max(steps // 4, 1), {}
    for kind in sorted(set(kinds.values())):
        for part, keep in (("first_quarter", lambda s: s < quarter), ("last_quarter", lambda s: s >= steps - quarter)):
            rewards = [r["reward"] for r in read_jsonl(run / "episodes.jsonl") if r["phase"] == "rl"
                       and r["reward"] is not None and kinds.get(r["task"]) == kind and keep(r["step"])]
            out[f"{kind}_{part}"] = round(sum(rewards) / len(rewards), 4) if rewards else None
    return out


def one_seed(work: Path, seed: int, overrides: list[str], kinds: dict[str, str]) -> tuple[dict, dict]:
    main = work / f"seed{seed}"
    if not (main / "summary.json").exists():  # --keep DIR of an earlier invocation: its finished runs count
        print(f"seed {seed}: furlong train ...", flush=True)
        train(["--config", RECIPE, f"train.seed={seed}", f"train.run_dir={main}", *overrides], f"(seed {seed})")
    recipe = yaml.safe_load((main / "config.yaml").read_text())
    print(f"seed {seed}: control ...", flush=True)
    shutil.rmtree(work / f"seed{seed}-control", ignore_errors=True)
    ctrl = control(main, work / f"seed{seed}-control", recipe)
    before, after = heldout(main, "eval_before"), heldout(main, "eval_after")
    s = summary(main)
    result = {"seed": seed, "pass_at_1_before": pass_at_1(before), "rl": gain(after, before),
              "control": gain(ctrl, before), "rl_minus_control": gain(after, ctrl),
              "train_reward": train_reward_by_kind(main, kinds, recipe["train"]["rl"]["steps"]),
              "status": s["status"], "eval_infra_errors": s["eval_infra_errors"],
              "rl_episodes": s["rl_episodes"], "phase_seconds": s["phase_seconds"],
              "wall_seconds": s["wall_seconds_this_invocation"]}
    keyed = {f"{seed}/{t}": v for t, v in before.items()}
    return result, {"before": keyed, "after": {f"{seed}/{t}": v for t, v in after.items()},
                    "control": {f"{seed}/{t}": v for t, v in ctrl.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", type=Path, help="keep the runs here (default: deleted); a seed whose run there has "
                    "finished (DIR/seedN/summary.json) is reused, its control run again")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args()
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-prompts-rl-"))
    work.mkdir(parents=True, exist_ok=True)
    env = load_config(ROOT / RECIPE).train.env
    kinds = {r.id: r.values["kind"] for split in ("train", "heldout")
             for r in prompt_source(env, {}).instances(split)}
    seeds, pooled = [], {"before": {}, "after": {}, "control": {}}
    try:
        for seed in args.seeds:
            result, pairs = one_seed(work, seed, args.overrides, kinds)
            seeds.append(result)
            for k, rewards in pooled.items():
                rewards.update(pairs[k])
            print(json.dumps({k: result[k] for k in ("seed", "pass_at_1_before", "rl", "control")}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    before = pooled["before"]
    out = {"question": "does RL on a prompt dataset learn from its reward, beyond what its KL and anchor do?",
           "recipe": RECIPE, "overrides": args.overrides,
           "heldout": "the 'a plus b' rows of 40 pairs: a wording SFT never shows an answer for, pairs RL never draws",
           "gain": "held-out pass@1 after minus before, points, [paired 90% bootstrap interval]",
           "seeds": seeds,
           "pooled": {"pass_at_1_before": pass_at_1(before), "rl": gain(pooled["after"], before),
                      "control": gain(pooled["control"], before),
                      "rl_minus_control": gain(pooled["after"], pooled["control"])},
           "provenance": finish(prov)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["pooled"]), f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
