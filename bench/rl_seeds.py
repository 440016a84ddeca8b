"""Is the default's RL gain reliable? `furlong train` (the embedded default, or --config) once per seed
(train.seed 0, 1, 2 by default: SFT data order, RL task stream and sampling), each from scratch, and per
seed: held-out pass@1 gain on the reward-only families (never demonstrated) and on the demonstrated ones,
each with its paired 90% bootstrap interval (summary.json's heldout_gain), and the run's stability
(entropy over the steps, train reward in each half; see runs.stability). Writes bench/results/rl_seeds.json.

    python bench/rl_seeds.py                        # 3 default runs: about 20 min on 2 cores
    python bench/rl_seeds.py --seeds 3 4 --out bench/results/rl_seeds_more.json
    python bench/rl_seeds.py --jobs 3               # the seeds at once (each run's wall time then grows)
    python bench/rl_seeds.py --config recipes/smoke.yaml --seeds 0   # a check of this script
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from provenance import finish, provenance
from runs import ROOT, TrainFailed, stability, summary, train

RESULTS = ROOT / "bench" / "results" / "rl_seeds.json"


def one_seed(work: Path, seed: int, config: str | None, overrides: list[str]) -> dict:
    run = work / f"seed{seed}"
    if (run / "summary.json").exists():  # --keep DIR of an earlier invocation: its finished runs count
        print(f"seed {seed}: the finished run {run}", flush=True)
    else:
        print(f"seed {seed}: furlong train ...", flush=True)
        train([*(["--config", config] if config else []), f"train.seed={seed}", f"train.run_dir={run}", *overrides],
              f"(seed {seed})")
    s = summary(run)
    gain = s["heldout_gain"]
    return {"seed": seed, "pass_at_1_before": s["heldout_pass_at_1_before_rl"],
            "pass_at_1_after": s["heldout_pass_at_1_after_rl"],
            "reward_only": gain["reward_only"], "demonstrated": gain["demonstrated"],
            "per_family": gain["per_family"], "stability": stability(run),
            "wall_seconds": s["wall_seconds_this_invocation"], "phase_seconds": s["phase_seconds"]}


def _line(r: dict) -> str:
    def g(part: dict | None) -> str:
        return "n/a" if not part else f"{part['gain_points']:+.1f} [{part['gain_ci90'][0]:+.1f}, {part['gain_ci90'][1]:+.1f}]"
    st = r["stability"]
    return (f"seed {r['seed']}: reward-only {g(r['reward_only'])}  demonstrated {g(r['demonstrated'])}  "
            f"entropy {st['entropy_first_third']:.3f} -> {st['entropy_last_third']:.3f}  "
            f"train reward {st['reward_first_half']:.2f} -> {st['reward_second_half']:.2f}  "
            f"{r['wall_seconds'] / 60:.1f} min")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", help="a recipe (default: the embedded default)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", type=Path, help="keep the run directories here (default: deleted); a seed whose "
                    "run there has finished (DIR/seedN/summary.json) is summarized, not run again")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_args()
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-rl-seeds-"))
    def go(seed: int) -> dict:
        try:
            result = one_seed(work, seed, args.config, args.overrides)
        except TrainFailed as exc:  # reported as a failed seed, never silently left out
            print(exc, file=sys.stderr, flush=True)
            return {"seed": seed, "error": str(exc)[-1500:]}
        print(_line(result), flush=True)
        return result

    try:
        with ThreadPoolExecutor(args.jobs) as pool:  # threads only wait on `furlong train` subprocesses
            results = list(pool.map(go, args.seeds))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = [bool(r.get("reward_only")) and r["reward_only"]["gain_ci90"][0] > 0 for r in results]
    out = {"provenance": finish(prov), "config": args.config or "default",
           "jobs": args.jobs,
           "gain": "held-out pass@1 after minus before RL, points, [paired 90% bootstrap interval]",
           "seeds": results, "reward_only_gain_above_zero_in_every_seed": all(ok),
           "reward_only_gain_min_points": min((r["reward_only"]["gain_points"] for r in results if r.get("reward_only")),
                                              default=None)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print("\n".join(_line(r) if "error" not in r else f"seed {r['seed']}: FAILED" for r in results),
          f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
