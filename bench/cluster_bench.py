"""`train.cluster=ray` against local mode on one recipe (the embedded default unless --config): each run's
wall time and held-out gain, and Ray's own overhead during the Ray run: the CPU seconds and the peak
resident memory of Ray's processes (head, raylet, agents, idle workers, furlong's reaper), the actors that
host the trainer and the engines not counted (they do the work local mode does in its one process).
The runs go in the order local, ray, ray, local (ABBA): whatever the first run pays once on a fresh machine
(cold page cache, first imports) or any drift in the machine's load falls on both modes alike, and each mode
is run twice. Writes bench/results/cluster.json: every run, and each mode's mean.

    python bench/cluster_bench.py                                  # 4 default runs: about 28 min on 2 cores
    python bench/cluster_bench.py --config recipes/smoke.yaml --out /tmp/cluster.json   # a check of this script
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from provenance import finish, provenance
from runs import ROOT, summary

MARK = "FURLONG_BENCH_RUN"
RAY = (b"ray::", b"/ray/", b"furlong.cluster.reaper")  # Ray's binaries and scripts, its workers, the reaper
WORKERS = (b"ray::EngineHost", b"ray::TrainerHost", b"ray::RankHost")  # the actors: the run's own work
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _marked(mark: str, driver: int) -> dict[int, tuple[float, int]]:
    """pid -> (CPU seconds, resident bytes) of Ray's processes for the run marked `mark`."""
    want, out = f"{MARK}={mark}".encode(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == driver:
            continue
        try:
            if want not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmd = (entry / "cmdline").read_bytes()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if not any(m in cmd for m in RAY) or any(cmd.startswith(w) for w in WORKERS):
            continue  # sandboxes, the driver's helpers, and the actors doing the work
        out[int(entry.name)] = ((int(fields[11]) + int(fields[12])) / TICK, int(fields[21]) * PAGE)
    return out


ORDER = ("local", "ray", "ray", "local")


def run(mode: str, index: int, work: Path, config: str | None, overrides: list[str]) -> dict:
    mark = f"{index}-{mode}"  # names the run's directory and tags its processes for the sampler
    run_dir = work / mark
    args = [*(["--config", config] if config else []), f"train.cluster={mode}", f"train.run_dir={run_dir}", *overrides]
    env = {**os.environ, MARK: mark}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu: dict[int, float] = {}
    peak_rss = 0

    def sample() -> None:
        nonlocal peak_rss
        while proc.poll() is None:
            seen = _marked(mark, proc.pid)
            for pid, (seconds, _) in seen.items():
                cpu[pid] = max(cpu.get(pid, 0.0), seconds)
            peak_rss = max(peak_rss, sum(rss for _, rss in seen.values()))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - start
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"furlong train ({mode}) failed:\n{err[-3000:]}")
    s = summary(run_dir)
    return {"mode": mode, "order": index, "wall_seconds": round(wall, 1), "phase_seconds": s["phase_seconds"],
            "pass_at_1_before": s["heldout_pass_at_1_before_rl"], "pass_at_1_after": s["heldout_pass_at_1_after_rl"],
            "gain_points": s["improvement_points"], "heldout_gain": s["heldout_gain"],
            "ray_overhead": {"processes": len(cpu), "cpu_seconds": round(sum(cpu.values()), 1),
                             "peak_rss_mb": round(peak_rss / 2**20, 1)}}


def mean(runs: list[dict], mode: str) -> dict:
    """The mode's runs averaged: wall time, each phase, held-out gain (all points), Ray's overhead."""
    mine = [r for r in runs if r["mode"] == mode]

    def avg(values: list[float | None]) -> float | None:  # None: a recipe without that figure
        return None if None in values else round(sum(values) / len(values), 2)

    return {"runs": len(mine), "wall_seconds": avg([r["wall_seconds"] for r in mine]),
            "phase_seconds": {k: avg([r["phase_seconds"][k] for r in mine]) for k in mine[0]["phase_seconds"]},
            "gain_points": avg([r["gain_points"] for r in mine]),
            "reward_only_gain_points": avg([(r["heldout_gain"].get("reward_only") or {}).get("gain_points")
                                            for r in mine]),
            "ray_overhead": {k: avg([r["ray_overhead"][k] for r in mine]) for k in mine[0]["ray_overhead"]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a recipe (default: the embedded default)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cluster.json")
    ap.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = ap.parse_args()
    prov = provenance()
    with tempfile.TemporaryDirectory(prefix="furlong-cluster-bench-") as tmp:
        runs = []
        for index, mode in enumerate(ORDER):
            runs.append(r := run(mode, index, Path(tmp), args.config, args.overrides))
            print(f"run {index + 1}/{len(ORDER)} {mode}: {r['wall_seconds']} s (phases {r['phase_seconds']}), "
                  f"gain {r['gain_points']:+.1f} points, Ray overhead {r['ray_overhead']}", flush=True)
    means = {mode: mean(runs, mode) for mode in ("local", "ray")}
    ratio = means["ray"]["wall_seconds"] / means["local"]["wall_seconds"]
    print(f"mean wall time ray / local: {ratio:.3f}")
    result = {"provenance": finish(prov), "config": args.config, "overrides": args.overrides, "order": list(ORDER),
              "wall_ratio_ray_over_local": round(ratio, 3), "means": means, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
