"""The parity suite (tasks-parity/) under `furlong eval`, this checkout beside a baseline checkout, in one run.

    python bench/parity_bench.py --baseline DIR [--baseline-overrides KEY=VALUE ...]

Each side runs `python -m furlong.cli eval --tasks <this checkout's tasks-parity> --agent oracle`, then
`--agent noop`, from its own checkout root (so with its own furlong): this one with tests/test_parity.py's
overrides, the baseline with `--baseline-overrides` (an older furlong may not know this one's keys). Writes
bench/results/parity.json: per side its commit and overrides, and per task the oracle's and the no-op's
reward and status, with the first line of what failed (the episode's error, else the tests' output).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import ROOT, finish, provenance

SUITE = ROOT / "tasks-parity"
OVERRIDES = ["sandbox.network.verifier=packages", "images.trust_host_ca=true"]  # as tests/test_parity.py


def _commit(checkout: Path) -> str:
    res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, check=False)
    return res.stdout.strip() or "unknown"


def _eval(checkout: Path, agent: str, overrides: list[str]) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "episodes.jsonl"
        res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(SUITE), "--agent", agent,
                              "--out", str(out), *overrides], cwd=checkout, capture_output=True, text=True, timeout=3600, check=False)
        if not out.exists():
            raise SystemExit(f"{checkout}: furlong eval wrote no episodes: {(res.stdout + res.stderr)[-2000:]}")
        return {r["task"]: r for r in map(json.loads, out.read_text().splitlines())}


def _why(record: dict, wanted: float) -> str:
    """The first line that says what went wrong, "" where the episode scored `wanted`."""
    if (record["reward"], record["status"]) == (wanted, "ok"):
        return ""
    text = record.get("error") or record.get("verifier_output") or ""
    return next((line.strip() for line in text.splitlines() if line.strip()), record["status"])[:300]


def side(checkout: Path, overrides: list[str]) -> dict:
    oracle, noop = _eval(checkout, "oracle", overrides), _eval(checkout, "noop", overrides)
    rows = {task: {"oracle": [r["reward"], r["status"]], "noop": [noop[task]["reward"], noop[task]["status"]],
                   "oracle_why": _why(r, 1.0), "noop_why": _why(noop[task], 0.0)}
            for task, r in sorted(oracle.items())}
    return {"commit": _commit(checkout), "overrides": overrides, "tasks": rows,
            "oracle_pass": sum(r["oracle"] == [1.0, "ok"] for r in rows.values()),
            "noop_zero": sum(r["noop"] == [0.0, "ok"] for r in rows.values()), "n": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="an older furlong checkout to compare with")
    parser.add_argument("--baseline-overrides", nargs="*", default=["images.trust_host_ca=true"])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/parity.json")
    args = parser.parse_args()
    prov = provenance()
    result = {"provenance": None, "suite": "tasks-parity",
              "baseline": side(args.baseline.resolve(), args.baseline_overrides), "current": side(ROOT, OVERRIDES)}
    result["provenance"] = finish(prov)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name in ("baseline", "current"):
        s = result[name]
        print(f"{name} {s['commit'][:7]}: oracle {s['oracle_pass']}/{s['n']}, no-op 0 on {s['noop_zero']}/{s['n']}")


if __name__ == "__main__":
    main()
