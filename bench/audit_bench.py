"""`furlong audit` over the bundled tasks (tasks/, families at their default two instances per split) and the
parity suite (tasks-parity/, with tests/test_parity.py's overrides), every exploit of the library.

    python bench/audit_bench.py [--out bench/results/audit.json]

Writes per suite: the command, its exit status, the verdict counts, per exploit how many tasks it earned
reward on and on how many tamper detection caught it, wall seconds and seconds per task (concurrency 2),
and per task its verdict, the exploits that earned and those caught.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, finish, provenance

SUITES = {
    "bundled": ["--tasks", "tasks"],
    "parity": ["--tasks", "tasks-parity", "sandbox.network.verifier=packages", "images.trust_host_ca=true"],
}


def _suite(args: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "audit.jsonl"
        cmd = ["python", "-m", "furlong.cli", "audit", *args, "--out", str(out)]
        t = time.perf_counter()
        res = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t
        if not out.exists():
            raise SystemExit(f"furlong audit wrote nothing: {(res.stdout + res.stderr)[-2000:]}")
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    exploits = [a["agent"] for a in rows[0]["attempts"][2:]] if rows else []
    return {
        "command": " ".join(cmd[:-2]),
        "exit_code": res.returncode,
        "tasks": len(rows),
        **{v: sum(r["verdict"] == v for r in rows) for v in ("hackable", "not_hackable", "broken")},
        "exploits": {e: {"earned": sum(e in r["hackable_by"] for r in rows), "caught": sum(e in r["caught"] for r in rows)}
                     for e in exploits},
        "wall_seconds": round(wall, 1),
        "seconds_per_task": round(wall / max(len(rows), 1), 2),
        "episode_seconds_per_task": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 2),
        "per_task": {r["task"]: {"verdict": r["verdict"], "hackable_by": r["hackable_by"], "caught": r["caught"]}
                     for r in rows},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "audit.json")
    args = parser.parse_args()
    prov = provenance()
    result = {name: _suite(suite) for name, suite in SUITES.items()}
    args.out.write_text(json.dumps({"provenance": finish(prov), **result}, indent=1) + "\n")
    for name, r in result.items():
        print(f"{name}: {r['tasks']} tasks, {r['hackable']} hackable, {r['broken']} broken, {r['wall_seconds']} s")


if __name__ == "__main__":
    main()
