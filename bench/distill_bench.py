"""Does self-distillation with a brevity prompt shorten the policy's replies while its pass rate holds?
(docs/distill.md; issue 47's second measurement.) Per seed (train.seed: SFT order, RL stream, sampling):

  1. distill: `furlong train` with the default recipe and train.distill.mode=grpo+opd, the teacher being the
     policy itself under the default system prompt plus a brevity instruction (BRIEF);
  2. control: the same RL phase from the same SFT checkpoint and pre-RL eval with GRPO alone (the default:
     no teacher, zero-variance groups filtered), so what the teacher adds is distill minus control.

Reported per seed: held-out mean generated tokens per episode (all turns, the sampled tokens only) before RL
and after each arm, overall and per family, with 90% bootstrap intervals and the after/before ratio; held-out
pass@1 before and after each arm with paired 90% intervals; the RL episodes' mean generated tokens in the
first and last quarter of the steps; the teacher's seconds and tokens per step and their share of the step
time; every status; wall seconds. Writes bench/results/distill_self.json.

A teacher variant (--variant NAME --distill KEY=VALUE ..., keys under train.distill) is a third RL arm forked
from the distill run's SFT checkpoint and pre-RL eval (as the control is), with the distillation settings
changed; it reuses both finished runs in --keep and is written, as "distill", to distill_self_NAME.json.

    python bench/distill_bench.py                          # 3 seeds of the default recipe
    python bench/distill_bench.py --seeds 0 train.rl.steps=10 train.eval.heldout_per_family=32  # one small seed
    python bench/distill_bench.py --seeds 0 --keep DIR --variant frozen-w0.1 \
      --distill teacher.frozen=true weight=0.1 -- train.rl.steps=10 train.eval.heldout_per_family=32
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import yaml
from provenance import finish, provenance
from runs import ROOT, ci, fork_before_rl, heldout, summary, train

from furlong.config import DEFAULT_SYSTEM_PROMPT
from furlong.metrics.episodes import read_jsonl
from furlong.metrics.stats import bootstrap_mean, bootstrap_paired_diff

RESULTS = ROOT / "bench" / "results" / "distill_self.json"
BRIEF = f"{DEFAULT_SYSTEM_PROMPT} Be brief, and use as few commands and as few words as you can."
DISTILL = ["train.distill.mode=grpo+opd", "train.distill.weight=1.0", f"train.distill.teacher.system_prompt={BRIEF}"]


def lengths(eps: dict[str, dict]) -> dict:
    """Mean generated tokens per episode, overall and per family, [value, 90% low, high]."""
    families = sorted({e["family"] for e in eps.values()})
    return {
        "all": ci(bootstrap_mean([e["tokens_response"] for e in eps.values()])),
        **{f: ci(bootstrap_mean([e["tokens_response"] for e in eps.values() if e["family"] == f])) for f in families},
    }


def compare(after: dict[str, dict], before: dict[str, dict]) -> dict:
    """Pass@1 and length after against before, paired on the instances both scored."""
    tasks = sorted(set(after) & set(before))
    a = [float(after[t]["reward"] >= 1) for t in tasks]
    b = [float(before[t]["reward"] >= 1) for t in tasks]
    la = [after[t]["tokens_response"] for t in tasks]
    lb = [before[t]["tokens_response"] for t in tasks]
    return {
        "instances": len(tasks),
        "pass_at_1": ci(bootstrap_mean(a)),
        "pass_gain_points": ci(bootstrap_paired_diff(a, b), 100),
        "tokens_per_episode": lengths({t: after[t] for t in tasks}),
        "tokens_change": ci(bootstrap_paired_diff(la, lb)),
        "tokens_ratio": round(sum(la) / max(sum(lb), 1), 4),
    }


def rl_lengths(run: Path, steps: int) -> dict:
    """The trained RL episodes' mean generated tokens in the first and the last quarter of the steps."""
    quarter = max(steps // 4, 1)
    eps = [r for r in read_jsonl(run / "episodes.jsonl") if r["phase"] == "rl" and r.get("outcome") == "trained"]
    first = [r["tokens_response"] for r in eps if r["step"] < quarter]
    last = [r["tokens_response"] for r in eps if r["step"] >= steps - quarter]
    return {"first_quarter": ci(bootstrap_mean(first)), "last_quarter": ci(bootstrap_mean(last))}


def teacher_cost(run: Path) -> dict:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl" and "teacher_seconds" in r]
    if not rows:
        return {}
    return {
        "teacher_seconds_per_step": ci(bootstrap_mean([r["teacher_seconds"] for r in rows])),
        "teacher_tokens_per_step": ci(bootstrap_mean([r["teacher_tokens"] for r in rows])),
        "teacher_share_of_step": ci(bootstrap_mean([r["teacher_seconds"] / r["step_seconds"] for r in rows])),
        "step_seconds": ci(bootstrap_mean([r["step_seconds"] for r in rows])),
        "reverse_kl_first_last": [round(rows[0]["distill_reverse_kl"], 5), round(rows[-1]["distill_reverse_kl"], 5)],
        "teacher_failed": sum(r["distill_failed"] for r in rows),
    }


STEP_KEYS = ("reward_mean", "response_len_mean", "grad_norm", "ref_kl", "entropy", "distill_reverse_kl")


def per_step(run: Path) -> dict:
    """The RL steps' own rows, key by key (those the run logged), and each step's truncated episodes."""
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    out = {k: [round(r[k], 5) for r in rows] for k in STEP_KEYS if rows and k in rows[0]}
    out["status_truncated"] = [r.get("status_truncated", 0) for r in rows]
    return out


def control_arm(main: Path, work: Path) -> None:
    """GRPO alone from `main`'s SFT checkpoint and pre-RL eval: the recipe's default RL, no teacher."""
    fork_before_rl(main, work, {"filter_zero_variance": True})
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["train"]["distill"] = {"mode": "off", "weight": 1.0, "teacher": {"path": None, "system_prompt": None}}
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.copytree(main / "checkpoints" / "sft", work / "checkpoints" / "sft")
    train(["--resume", str(work)], "(control)")


def variant_arm(main: Path, work: Path, distill: list[str]) -> None:
    """`main`'s distillation RL from its SFT checkpoint and pre-RL eval, with train.distill keys changed."""
    fork_before_rl(main, work, {})
    config = yaml.safe_load((work / "config.yaml").read_text())
    for key, value in distill_overrides(distill).items():
        *parents, leaf = key.split(".")
        node = config["train"]["distill"]
        for p in parents:
            node = node[p]
        node[leaf] = value
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.copytree(main / "checkpoints" / "sft", work / "checkpoints" / "sft")
    train(["--resume", str(work)], f"(variant {work.name})")


def distill_overrides(items: list[str]) -> dict:
    """--distill KEY=VALUE (keys under train.distill), each value read as YAML as furlong's overrides are."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--distill {item!r}: expected KEY=VALUE with KEY under train.distill (weight=0.1)")
        out[key.removeprefix("train.distill.")] = yaml.safe_load(value)
    return out


def arm(run: Path, before: dict[str, dict], steps: int) -> dict:
    s = summary(run)
    return {
        "heldout": compare(heldout(run, "eval_after"), before),
        "rl_tokens_per_episode": rl_lengths(run, steps),
        "per_step": per_step(run),
        **({"teacher": t} if (t := teacher_cost(run)) else {}),
        "status": s["status"],
        "rl_episodes": s["rl_episodes"],
        "phase_seconds": s["phase_seconds"],
    }


def one_seed(work: Path, seed: int, overrides: list[str], reused: list[str], variant: tuple[str, list[str]]) -> dict:
    main, ctrl = work / f"seed{seed}-distill", work / f"seed{seed}-grpo"
    reused += [str(r) for r in (main, ctrl) if (r / "summary.json").exists()]
    if not (main / "summary.json").exists():
        print(f"seed {seed}: furlong train (distill) ...", flush=True)
        train([f"train.seed={seed}", f"train.run_dir={main}", *DISTILL, *overrides], f"(seed {seed})")
    if not (ctrl / "summary.json").exists():
        print(f"seed {seed}: control (GRPO alone) ...", flush=True)
        shutil.rmtree(ctrl, ignore_errors=True)
        control_arm(main, ctrl)
    name, distill_keys = variant
    if name:  # the teacher variant is this seed's distill arm; the weight-1 run only lends its SFT checkpoint
        var = work / f"seed{seed}-{name}"
        if (var / "summary.json").exists():
            reused.append(str(var))
        else:
            print(f"seed {seed}: variant {name} ...", flush=True)
            shutil.rmtree(var, ignore_errors=True)
            variant_arm(main, var, distill_keys)
        main = var
    steps = yaml.safe_load((main / "config.yaml").read_text())["train"]["rl"]["steps"]
    before = heldout(main, "eval_before")
    distill, grpo = arm(main, before, steps), arm(ctrl, before, steps)
    distill["settings"] = yaml.safe_load((main / "config.yaml").read_text())["train"]["distill"]
    after_d, after_g = heldout(main, "eval_after"), heldout(ctrl, "eval_after")
    return {
        "seed": seed,
        "before": {
            "pass_at_1": ci(bootstrap_mean([float(e["reward"] >= 1) for e in before.values()])),
            "tokens_per_episode": lengths(before),
            "instances": len(before),
        },
        "distill": distill,
        "grpo": grpo,
        "distill_minus_grpo": compare(after_d, after_g),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", type=Path, help="keep the runs here (default: deleted); finished runs there are reused")
    ap.add_argument("--variant", default="", help="a teacher variant's name: a third arm, run seedN-NAME")
    ap.add_argument("--distill", nargs="*", default=[], help="the variant's KEY=VALUE keys under train.distill")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args()
    if bool(args.variant) != bool(args.distill):
        ap.error("--variant NAME and --distill KEY=VALUE ... go together")
    distill_overrides(args.distill)  # a malformed key fails before any run
    if args.variant and args.out == RESULTS:
        args.out = RESULTS.with_name(f"distill_self_{args.variant}.json")  # the weight-1 result stays
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-distill-"))
    work.mkdir(parents=True, exist_ok=True)
    seeds: list[dict] = []
    reused: list[str] = []  # runs an earlier invocation finished (--keep): this one only read them
    try:
        for seed in args.seeds:
            seeds.append(one_seed(work, seed, args.overrides, reused, (args.variant, args.distill)))
            print(json.dumps({k: seeds[-1][k] for k in ("seed", "before")}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "question": "does self-distillation with a brevity prompt shorten replies while held-out pass@1 holds?",
        "teacher_system_prompt": BRIEF,
        "distill": DISTILL,
        **({"variant": args.variant, "variant_distill": args.distill} if args.variant else {}),
        "overrides": args.overrides,
        "values": "[value, 90% bootstrap low, high]; pass gains in points, paired on the same held-out instances "
        "and sampling seeds; tokens: generated (sampled) tokens per episode, all turns",
        "seeds": seeds,
        "reused_runs": reused,
        "provenance": finish(prov),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
