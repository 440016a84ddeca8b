"""`train.cluster=ray` against local mode on one recipe (the embedded default unless --config): each run's
wall time and held-out gain, and Ray's own overhead during the Ray run: the CPU seconds and the peak
resident memory of Ray's processes (head, raylet, agents, idle workers, furlong's reaper), the actors that
host the trainer and the engines not counted (they do the work local mode does in its one process).
Writes bench/results/cluster.json.

    python bench/cluster_bench.py                                  # 2 default runs: about 13 min on 2 cores
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


def run(mode: str, work: Path, config: str | None, overrides: list[str]) -> dict:
    run_dir = work / mode
    args = [*(["--config", config] if config else []), f"train.cluster={mode}", f"train.run_dir={run_dir}", *overrides]
    env = {**os.environ, MARK: mode}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu: dict[int, float] = {}
    peak_rss = 0

    def sample() -> None:
        nonlocal peak_rss
        while proc.poll() is None:
            seen = _marked(mode, proc.pid)
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
    return {"mode": mode, "wall_seconds": round(wall, 1), "phase_seconds": s["phase_seconds"],
            "pass_at_1_before": s["heldout_pass_at_1_before_rl"], "pass_at_1_after": s["heldout_pass_at_1_after_rl"],
            "gain_points": s["improvement_points"], "heldout_gain": s["heldout_gain"],
            "ray_overhead": {"processes": len(cpu), "cpu_seconds": round(sum(cpu.values()), 1),
                             "peak_rss_mb": round(peak_rss / 2**20, 1)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a recipe (default: the embedded default)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cluster.json")
    ap.add_argument("overrides", nargs="*", help="key=value for both runs")
    args = ap.parse_args()
    prov = provenance()
    with tempfile.TemporaryDirectory(prefix="furlong-cluster-bench-") as tmp:
        runs = {mode: run(mode, Path(tmp), args.config, args.overrides) for mode in ("local", "ray")}
        for r in runs.values():
            print(f"{r['mode']}: {r['wall_seconds']} s, gain {r['gain_points']:+.1f} points, "
                  f"Ray overhead {r['ray_overhead']}", flush=True)
    ratio = runs["ray"]["wall_seconds"] / runs["local"]["wall_seconds"]
    print(f"wall time ray / local: {ratio:.3f}")
    result = {"provenance": finish(prov), "config": args.config, "overrides": args.overrides,
              "wall_ratio_ray_over_local": round(ratio, 3), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
