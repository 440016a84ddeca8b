"""Does on-policy distillation from a stronger teacher reach GRPO's end point in fewer steps? (docs/distill.md;
issue 47's first measurement.) Two RL arms forked from one run's SFT checkpoint and pre-RL eval (--source),
the same RL settings, task stream and seed:

  1. opd: train.distill.mode=opd, teacher.path = --teacher (a checkpoint RL trained further: by default the
     self-distillation bench's GRPO-alone control after its 10 steps);
  2. grpo: GRPO alone (the recipe's RL, zero-variance groups filtered).

Each arm saves a checkpoint every --every steps (train.rl.checkpoint_every); a run keeps only its newest, so
this script copies each one's policy as it appears and, once the run ends, evaluates it on the run's held-out
instances with the run's sampling seeds (the same code as the run's own eval phases, in a scratch run
directory beside the arm). Reported per arm and evaluated step: held-out pass@1 and its paired gain over the
pre-RL eval with 90% bootstrap intervals, cumulative RL wall seconds; per step: wall and teacher seconds,
teacher tokens; the first evaluated step at which OPD's pass@1 reaches GRPO's final one. The last checkpoint
is evaluated too, beside the run's own eval_after of the same weights: how far a re-evaluation moves.

    python bench/distill_teacher_bench.py --source /tmp/dbench/runs/seed0-distill \
      --teacher /tmp/dbench/runs/seed0-grpo/checkpoints/rl-9/hf --keep /tmp/dteach
    python bench/distill_teacher_bench.py --source /tmp/dbench/runs/seed0-distill --teacher-steps 30 \
      --keep /tmp/dteach30 --out bench/results/distill_teacher_30.json   # a teacher from a 30-step GRPO run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import threading
from pathlib import Path

import torch
import yaml
from distill_bench import compare, heldout, teacher_cost
from provenance import finish, provenance
from rich.console import Console
from runs import ROOT, ci, fork_before_rl, summary, train

from furlong.build import training as build
from furlong.config import Config
from furlong.metrics.episodes import read_jsonl
from furlong.metrics.run import RunDir
from furlong.metrics.stats import bootstrap_mean
from furlong.run.phases import eval_phase

RESULTS = ROOT / "bench" / "results" / "distill_teacher.json"
DISTILL_OFF = {"mode": "off", "weight": 1.0, "teacher": {"path": None, "system_prompt": None}}


def copy_checkpoints(run: Path, into: Path, done: threading.Event) -> None:
    """Copies each checkpoint's policy (rl-N/hf) while the run is going: the run deletes the older one
    once the next is recorded, so the newest recorded one is always complete and still there."""
    seen: set[str] = set()
    while True:
        finished = done.is_set()  # read first: one more look after the run ends catches the last one
        try:
            last = json.loads((run / "state.json").read_text())["last_checkpoint"]
        except (OSError, ValueError):
            last = None
        if last and last["name"] not in seen:
            shutil.copytree(run / "checkpoints" / last["name"] / "hf", into / last["name"])
            seen.add(last["name"])
        if finished:
            return
        done.wait(0.5)


def run_arm(source: Path, work: Path, distill: dict, rl: dict) -> None:
    """One RL arm from `source`'s SFT checkpoint and pre-RL eval (train.rl keys `rl` changed), its checkpoints
    copied to work/policies."""
    fork_before_rl(source, work, {**rl, "filter_zero_variance": distill["mode"] == "off"})
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["train"]["distill"] = distill
    for node in (config["train"], config["eval"]):  # the source's worktree may be gone: the bundled tasks here
        if not Path(node["tasks"]).exists():
            node["tasks"] = str(ROOT / "tasks")
    (work / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.copytree(source / "checkpoints" / "sft", work / "checkpoints" / "sft")
    policies = work / "policies"
    policies.mkdir()
    done = threading.Event()
    watcher = threading.Thread(target=copy_checkpoints, args=(work, policies, done))
    watcher.start()
    try:
        train(["--resume", str(work)], f"({work.name})")
    finally:
        done.set()
        watcher.join()


def evaluate_policies(work: Path) -> None:
    """Held-out eval of each copied policy, as the run's own eval phases do (its config, instances and
    seeds), in work/curve: a scratch run whose phases are named after the checkpoints."""
    tree = yaml.safe_load((work / "config.yaml").read_text())
    tree["train"]["distill"] = DISTILL_OFF  # the eval needs no teacher: skip its tokenizer check
    cfg = Config.model_validate(tree)
    curve = work / "curve"
    run = RunDir.open(curve) if (curve / "state.json").exists() else RunDir.create(curve, cfg.model_dump(mode="json"))
    torch.set_num_threads(cfg.train.torch_threads)
    p = build.pieces(cfg)
    try:
        for policy in sorted((work / "policies").iterdir(), key=lambda d: int(d.name.split("-")[1])):
            asyncio.run(eval_phase(f"eval_{policy.name}", policy, cfg, p, run, Console(quiet=True)))
    finally:
        p.close()


def point(steps: int, phase: str, wall: float, after: dict[str, dict], before: dict[str, dict]) -> dict:
    """One evaluated step: compare()'s figures and each family's pass@1 [value, 90% low, high]."""
    families = sorted({e["family"] for e in after.values()})
    by_family = {
        f: ci(bootstrap_mean([float(e["reward"] >= 1) for e in after.values() if e["family"] == f])) for f in families
    }
    return {
        "steps": steps,
        "eval": phase,
        "wall_seconds": wall,
        **compare(after, before),
        "family_pass_at_1": by_family,
    }


def curve(work: Path, before: dict[str, dict]) -> list[dict]:
    """Held-out pass@1 at step 0 (the shared pre-RL eval), each copied checkpoint and the run's eval_after."""
    rows = [r for r in read_jsonl(work / "metrics.jsonl") if r["phase"] == "rl"]
    walls = [round(sum(r["step_seconds"] for r in rows[: k + 1]), 1) for k in range(len(rows))]
    points = [point(0, "eval_before", 0.0, before, before)]
    phases = sorted({r["phase"] for r in read_jsonl(work / "curve" / "episodes.jsonl")}, key=lambda n: int(n[8:]))
    for phase in phases:  # eval_rl-N: after step N, so N + 1 steps trained
        n = int(phase[8:])
        points.append(point(n + 1, phase, walls[n], heldout(work / "curve", phase), before))
    points.append(point(len(rows), "eval_after", walls[-1], heldout(work, "eval_after"), before))
    return points


def per_step(work: Path) -> dict:
    rows = [r for r in read_jsonl(work / "metrics.jsonl") if r["phase"] == "rl"]
    out = {k: [round(r[k], 4) for r in rows] for k in ("step_seconds", "reward_mean", "grad_norm", "ref_kl")}
    out["cumulative_seconds"] = [round(sum(out["step_seconds"][: k + 1]), 1) for k in range(len(rows))]
    for k in ("teacher_seconds", "teacher_tokens", "distill_reverse_kl"):
        if rows and k in rows[0]:
            out[k] = [round(r[k], 5) for r in rows]
    return out


def arm(work: Path, before: dict[str, dict]) -> dict:
    s = summary(work)
    points = curve(work, before)
    rerun = next(p for p in points if p["eval"] == f"eval_rl-{points[-1]['steps'] - 1}")
    return {
        "curve": points,
        "last_checkpoint_reevaluated_minus_eval_after": round(rerun["pass_at_1"][0] - points[-1]["pass_at_1"][0], 4),
        "per_step": per_step(work),
        **({"teacher": t} if (t := teacher_cost(work)) else {}),
        "status": s["status"],
        "phase_seconds": s["phase_seconds"],
    }


def first_reach(opd: list[dict], target: float) -> dict:
    """The first evaluated step at which OPD's held-out pass@1 (the point estimate) is at least `target`."""
    for p in opd[1:]:
        if p["pass_at_1"][0] >= target:
            return {"reached": True, "steps": p["steps"], "wall_seconds": p["wall_seconds"], "eval": p["eval"]}
    return {"reached": False}


def teacher_heldout(teacher: Path) -> dict | None:
    """The teacher's held-out pass@1, overall and per family, when it is a run's last checkpoint
    (RUN/checkpoints/rl-N/hf): that run's eval_after."""
    state = teacher.resolve().parents[2] / "state.json"
    if not state.exists():
        return None
    after = json.loads(state.read_text())["phases"].get("eval_after", {})
    families = {f: round(v["pass_at_1"], 4) for f, v in after.get("per_family", {}).items()}
    return {"pass_at_1": round(after["pass_at_1"], 4), "family_pass_at_1": families} if after else None


def teacher_run(source: Path, work: Path, steps: int) -> Path:
    """GRPO alone for `steps` steps from `source`'s SFT checkpoint (reused when finished): its last policy."""
    if not (work / "summary.json").exists():
        print(f"teacher: GRPO alone, {steps} steps ...", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        run_arm(source, work, DISTILL_OFF, {"steps": steps, "checkpoint_every": steps})
    return work / "checkpoints" / f"rl-{steps - 1}" / "hf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--source", type=Path, required=True, help="a run whose SFT checkpoint and pre-RL eval both arms fork from"
    )
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--teacher", type=Path, help="the OPD teacher: a checkpoint directory")
    who.add_argument("--teacher-steps", type=int, help="the teacher: a GRPO run of this many steps from --source")
    ap.add_argument("--keep", type=Path, required=True, help="the arms' runs go here; finished ones are reused")
    ap.add_argument("--every", type=int, default=2, help="steps between the checkpoints evaluated")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    args.keep.mkdir(parents=True, exist_ok=True)
    if args.teacher_steps:  # a longer GRPO run from the same start, in KEEP/teacher-run; its last checkpoint
        args.teacher = teacher_run(args.source, args.keep / "teacher-run", args.teacher_steps)
    teacher = args.keep / "teacher"
    if not teacher.exists():  # a copy: the source run may be pruned later
        shutil.copytree(args.teacher, teacher)
    opd = {"mode": "opd", "weight": 1.0, "teacher": {"path": str(teacher), "system_prompt": None}}
    reused = []
    for name, distill in (("grpo", DISTILL_OFF), ("opd", opd)):
        work = args.keep / name
        if (work / "summary.json").exists():
            reused.append(str(work))
        else:
            print(f"arm {name} ...", flush=True)
            shutil.rmtree(work, ignore_errors=True)
            run_arm(args.source, work, distill, {"checkpoint_every": args.every})
        evaluate_policies(work)
    before = heldout(args.source, "eval_before")
    arms = {name: arm(args.keep / name, before) for name in ("grpo", "opd")}
    target = arms["grpo"]["curve"][-1]["pass_at_1"][0]
    out = {
        "question": "does OPD from a stronger teacher reach GRPO's end point in fewer steps, from the same start?",
        "source_run": str(args.source),
        "teacher": str(args.teacher),
        "teacher_steps": args.teacher_steps,
        "teacher_heldout": teacher_heldout(args.teacher),
        "every": args.every,
        "values": "[value, 90% bootstrap low, high]; pass gains in points over the pre-RL eval, paired on the same "
        "held-out instances and sampling seeds; wall_seconds: RL step time summed to that step",
        "before": {
            "pass_at_1": ci(bootstrap_mean([float(e["reward"] >= 1) for e in before.values()])),
            "instances": len(before),
        },
        "arms": arms,
        "grpo_final_pass_at_1": target,
        "opd_first_reaches_grpo_final": first_reach(arms["opd"]["curve"], target),
        "opd_minus_grpo_final": compare(
            heldout(args.keep / "opd", "eval_after"), heldout(args.keep / "grpo", "eval_after")
        ),
        "reused_runs": reused,
        "provenance": finish(prov),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
