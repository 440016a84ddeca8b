"""Does RL earn its keep? Three arms from the same recipe (the embedded default unless --config), in one go:

  A  sft+rl         `furlong train`: SFT on the demonstrated families' demonstrations, then RL on
                    train.rl.families (the default: the reward-only family alone).
  B  sft-only       no RL: SFT alone spends A's SFT + RL wall time on more SFT: more demonstrations of the
                    demonstrated families (up to all of their train instances) and more epochs, sized from
                    A's measured cost per demonstration and per demonstration-epoch.
  C  strong-sft+rl  A's RL phase started from B's SFT model (no further SFT): does RL keep what the
                    strongest SFT knows while it learns the reward-only families? (--no-strong skips it)

Every arm is scored on the same held-out instances with the same sampling seeds, so A - B is a paired
difference. Reported: held-out pass@1 with 90% bootstrap intervals per arm on the reward-only families,
the demonstrated ones and all; A - B (paired); C's gain on each group (paired, before vs after its RL);
wall time per arm. Writes bench/results/rl_vs_sft.json.

    python bench/rl_vs_sft.py                  # about 20 min on 2 cores
    python bench/rl_vs_sft.py --from-run RUN   # arm A is an existing run of the same recipe
    python bench/rl_vs_sft.py --keep DIR       # arms finished in DIR (DIR/A, B, C) are kept, unfinished ones resumed
    python bench/rl_vs_sft.py --config recipes/smoke.yaml --no-strong   # a check of this script
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from provenance import finish, provenance
from runs import ROOT, ci, summary, train

from furlong.config import load_config
from furlong.metrics.gains import eval_passes
from furlong.metrics.stats import bootstrap_mean, bootstrap_paired_diff
from furlong.tasks.family import load_family

RESULTS = ROOT / "bench" / "results" / "rl_vs_sft.json"


def passes(run: Path, phase: str, families: tuple[str, ...]) -> dict[str, float]:
    return {task: float(ok) for task, (fam, ok) in eval_passes(run, phase).items() if fam in families}


def sft_budget(a: Path, cfg) -> dict:
    """B's SFT size: A's SFT + RL seconds spent on every available demonstration and the epochs that fit
    (at least A's), from A's own cost per demonstration and per demonstration-epoch."""
    phases = json.loads((a / "state.json").read_text())["phases"]
    sft, t = phases["sft"], cfg.train
    budget = sft["seconds"] + phases["rl"]["seconds"]
    per_demo = sft["demo_seconds"] / sft["demos"]
    per_demo_epoch = (sft["seconds"] - sft["demo_seconds"]) / (sft["demos"] * sft["epochs"])
    fams = t.demonstrated()
    available = min(len(load_family(t.tasks / f).seeds["train"]) for f in fams)
    n = available
    epochs = int((budget / (n * len(fams)) - per_demo) // per_demo_epoch)
    if epochs < t.sft.epochs + 1:  # more epochs than A, then as many demonstrations as still fit
        epochs = t.sft.epochs + 1
        n = min(available, int(budget / (len(fams) * (per_demo + epochs * per_demo_epoch))))
    return {"budget_seconds": round(budget, 1), "instances_per_family": max(n, t.sft.instances_per_family),
            "epochs": epochs, "available_per_family": available}


def trained_size(run: Path) -> dict:
    """What B's SFT did (a B kept from an earlier invocation was sized from that invocation's A)."""
    sft = json.loads((run / "state.json").read_text())["phases"]["sft"]
    return {"demos": sft["demos"], "epochs": sft["epochs"], "seconds": round(sft["seconds"], 1)}


def arm(run: Path, phase: str, groups: dict[str, tuple[str, ...]]) -> dict:
    s = summary(run)
    out = {g: ci(bootstrap_mean(list(passes(run, phase, fams).values()))) for g, fams in groups.items()}
    return {**out, "wall_seconds": s["wall_seconds_this_invocation"], "phase_seconds": s["phase_seconds"]}


def paired(a: Path, b: Path, families: tuple[str, ...]) -> list[float]:
    pa, pb = passes(a, "eval_after", families), passes(b, "eval_after", families)
    tasks = sorted(set(pa) & set(pb))
    return ci(bootstrap_paired_diff([pa[t] for t in tasks], [pb[t] for t in tasks]), 100)


def note_baseline(a: Path, result: dict) -> None:
    """Arm A's summary.json gains the SFT-only baseline's figures (kept when A is kept)."""
    s = summary(a)
    s["sft_only_baseline"] = {"pass_at_1": result["B_sft_only"], "size": result["sft_only_size"],
                              "sft_rl_minus_sft_only_points": result["A_minus_B_points"],
                              "by": "bench/rl_vs_sft.py"}
    (a / "summary.json").write_text(json.dumps(s, indent=1))


def run_arm(run: Path, label: str, overrides: list[str]) -> None:
    """Train one arm, unless a finished run of it is already there (--keep DIR of an earlier invocation);
    an unfinished one there is resumed."""
    if (run / "summary.json").is_file():
        print(f"{label}: kept from {run}", flush=True)
    elif (run / "state.json").is_file():
        print(f"{label}: resuming {run} ...", flush=True)
        train(["--resume", str(run)], f"({label[0]})")
    else:
        print(f"{label} ...", flush=True)
        train([*overrides, f"train.run_dir={run}"], f"({label[0]})")


def run_arms(work: Path, base: list[str], from_run: Path | None, strong: bool, cfg) -> dict[str, Path]:
    runs = {"A": from_run or work / "A", "B": work / "B", "C": work / "C"}
    run_arm(runs["A"], "A sft+rl: furlong train", base)
    size = sft_budget(runs["A"], cfg)
    run_arm(runs["B"], f"B sft-only: {size}", [*base, "train.rl.steps=0", f"train.sft.epochs={size['epochs']}",
                                                f"train.sft.instances_per_family={size['instances_per_family']}"])
    if strong:
        # no further SFT; B's demonstrations are collected again only if RL's anchor (rl.sft_coef) uses them
        run_arm(runs["C"], "C strong-sft+rl: A's RL from B's SFT model",
                [*base, f"train.model.path={runs['B'] / 'checkpoints' / 'sft'}", "train.sft.epochs=0",
                 f"train.sft.instances_per_family={size['instances_per_family']}"])
    return {"size": size, **runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="a recipe (default: the embedded default)")
    ap.add_argument("--from-run", type=Path, help="use this finished run of the same recipe as arm A")
    ap.add_argument("--no-strong", action="store_true", help="skip arm C")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", type=Path, help="keep the run directories here (default: deleted)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every arm")
    args = ap.parse_args()
    prov = provenance()
    cfg = load_config(Path(args.config) if args.config else None, args.overrides)
    base = [*(["--config", args.config] if args.config else []), *args.overrides]
    groups = {"reward_only": cfg.train.reward_only(), "demonstrated": cfg.train.demonstrated(),
              "all": cfg.train.families}
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-rl-vs-sft-"))
    try:
        runs = run_arms(work, base, args.from_run, not args.no_strong, cfg)
        result = {"provenance": finish(prov),
                  "pass_at_1": "held-out pass@1 [value, 90% bootstrap low, high]; differences in points",
                  "groups": {g: list(f) for g, f in groups.items()},
                  "sft_only_size": {**runs["size"], "trained": trained_size(runs["B"])},
                  "A_sft_rl": arm(runs["A"], "eval_after", groups),
                  "B_sft_only": arm(runs["B"], "eval_after", groups),
                  "A_minus_B_points": {g: paired(runs["A"], runs["B"], f) for g, f in groups.items() if f}}
        note_baseline(runs["A"], result)
        if not args.no_strong:
            result["C_strong_sft_rl"] = {**arm(runs["C"], "eval_after", groups),
                                         "gain_from_its_sft": summary(runs["C"])["heldout_gain"]}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1), f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
