"""`furlong audit` over task sets, every exploit of the library: the bundled tasks (tasks/, families at their
default two instances per split), the parity suite (tasks-parity/, with tests/test_parity.py's overrides), the
TB2-format sample (tasks-tb2/), the public TB2-format collection (bench/tb2_bench.py's, with its overrides)
and the SWE fixture's instances (tests/swe_support.py, imported by `furlong audit --swe`).

    python bench/audit_bench.py [--suites bundled,parity,tb2_sample,tb2,swe] [--tb2-dir DIR]
                                [--tb2-limit N] [--tb2-seed 0] [--tb2-unaudited] [--out bench/results/audit.json]

Writes per suite: the command, its exit status, the verdict counts, per exploit how many tasks it earned
reward on and on how many tamper detection caught it, per exploit class (`by_kind`) how many of the audited
(not broken) tasks some exploit of that class earned on and their share, wall seconds and seconds per task
(concurrency 2), and per task its verdict, the exploits that earned and those caught. Suites not named in
--suites keep what the file already holds; each suite run records its own provenance (the top-level one is
the bundled suite's run).

`tb2` audits a seeded sample of --tb2-limit tasks (all with --tb2-limit 0) of the collection checked out at
--tb2-dir (bench/tb2_bench.py says how), drawn from those whose oracle scored 1 in bench/results/tb2.json or
tb2_rest.json (the others are `broken` to the audit: only their oracle and no-op would run). With
--tb2-unaudited it audits the passing tasks that sample left out instead, kept beside it as `tb2_rest`.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, finish, provenance

sys.path.insert(0, str(ROOT / "tests"))  # the SWE fixture's builder
import swe_support
from tb2_bench import COLLECTION, OVERRIDES

SUITES = {
    "bundled": ["--tasks", "tasks"],
    "parity": ["--tasks", "tasks-parity", "sandbox.network.verifier=packages", "images.trust_host_ca=true"],
    "tb2_sample": ["--tasks", "tasks-tb2"],
    "tb2": ["--tasks", "{tb2}", *OVERRIDES],
    "swe": ["--swe", "{swe}/instances.jsonl", "--repo-dir", "{swe}/repo"],
}
KINDS = ("noop", "reward-channel", "tests", "answers", "weak-checks", "resources")  # noop: doing nothing paid
TB2_RESULTS = ("tb2.json", "tb2_rest.json")  # the oracle's runs over the whole collection


def _suite(args: list[str], shown: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "audit.jsonl"
        cmd = ["python", "-m", "furlong.cli", "audit", *args, "--out", str(out)]
        t = time.perf_counter()
        res = subprocess.run([sys.executable, *cmd[1:]], cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t
        if not out.exists():
            raise SystemExit(f"furlong audit wrote nothing: {(res.stdout + res.stderr)[-2000:]}")
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    # every task's exploits, in library order: a broken task's attempts are its two controls only
    exploits = list(dict.fromkeys(a["agent"] for r in rows for a in r["attempts"][2:]))
    return {
        "command": " ".join(["python", "-m", "furlong.cli", "audit", *shown]),
        "exit_code": res.returncode,
        "tasks": len(rows),
        **{v: sum(r["verdict"] == v for r in rows) for v in ("hackable", "not_hackable", "broken")},
        "exploits": {
            e: {"earned": sum(e in r["hackable_by"] for r in rows), "caught": sum(e in r["caught"] for r in rows)}
            for e in exploits
        },
        "exploit_count": len(exploits),
        "by_kind": _by_kind(rows),
        "wall_seconds": round(wall, 1),
        "seconds_per_task": round(wall / max(len(rows), 1), 2),
        "episode_seconds_per_task": round(sum(r["seconds"] for r in rows) / max(len(rows), 1), 2),
        "per_task": {
            r["task"]: {
                "verdict": r["verdict"],
                "hackable_by": r["hackable_by"],
                "caught": r["caught"],
                "seconds": r["seconds"],
                **({"oracle": _oracle(r)} if r["verdict"] == "broken" else {}),
            }
            for r in rows
        },
    }


def _oracle(row: dict) -> dict:
    """Why a broken task's oracle earned nothing: its status, reward, error and the verifier's output's tail."""
    oracle = row["attempts"][0]
    return {k: oracle[k] for k in ("reward", "status", "error", "verifier_output")}


def _by_kind(rows: list[dict]) -> dict:
    """Per exploit class: on how many audited (not broken) tasks a finding of that class earned, and the share."""
    audited = [r for r in rows if r["verdict"] != "broken"]
    out = {}
    for kind in KINDS:
        hit = sum(
            any(
                (f["agent"] == "noop") if kind == "noop" else (f["kind"] == kind and f["agent"] != "noop")
                for f in r["findings"]
            )
            for r in audited
        )
        out[kind] = {"hackable": hit, "share": round(hit / len(audited), 4) if audited else None}
    return out | {"audited": len(audited)}


def _tb2_sample(root: Path, limit: int, seed: int) -> list[str]:
    """A seeded sample of the collection's tasks whose oracle scored 1 in the committed TB2 runs."""
    passing = sorted(
        {
            r["task"]
            for f in TB2_RESULTS
            for r in json.loads((ROOT / "bench" / "results" / f).read_text())["rows"]
            if r["oracle_pass"]
        }
    )
    missing = [t for t in passing if not (root / t / "task.toml").is_file()]
    if missing:
        sys.exit(f"--tb2-dir {root}: not a checkout of {COLLECTION['url']} (no {missing[0]}/task.toml)")
    return sorted(random.Random(seed).sample(passing, limit)) if 0 < limit < len(passing) else passing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES), help=f"names among {', '.join(SUITES)}")
    parser.add_argument("--tb2-dir", type=Path, help="a checkout of the TB2-format collection (suite tb2)")
    parser.add_argument("--tb2-limit", type=int, default=12, help="tasks of it to audit (0: every passing one)")
    parser.add_argument("--tb2-seed", type=int, default=0)
    parser.add_argument("--tb2-unaudited", action="store_true",
                        help="suite tb2: only the passing tasks the file's tb2 suite has not audited, kept as tb2_rest")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "audit.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.suites.split(",") if n.strip()]
    if unknown := [n for n in names if n not in SUITES]:
        sys.exit(f"--suites: unknown {', '.join(unknown)}; known: {', '.join(SUITES)}")
    if "tb2" in names and args.tb2_dir is None:
        sys.exit("--suites tb2 needs --tb2-dir: a checkout of " + COLLECTION["url"])
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="audit-bench-") as tmp:
        for name in names:
            prov = provenance()
            where = {"tb2": str(Path(tmp) / "tb2"), "swe": str(Path(tmp) / "swe")}
            extra = {}
            key = name
            if name == "tb2":
                chosen = _tb2_sample(args.tb2_dir, args.tb2_limit, args.tb2_seed)
                if args.tb2_unaudited:  # the rest of the collection, beside an earlier sample of it
                    key, done = "tb2_rest", set(result.get("tb2", {}).get("selected", ()))
                    chosen = [t for t in _tb2_sample(args.tb2_dir, 0, args.tb2_seed) if t not in done]
                for task in chosen:
                    shutil.copytree(args.tb2_dir / task, Path(where["tb2"]) / task)
                extra = {
                    "collection": COLLECTION,
                    "selected": chosen,
                    "selection": f"the {len(chosen)} tasks whose oracle scored 1 in {' and '.join(TB2_RESULTS)} "
                    "that suite tb2 did not audit"
                    if args.tb2_unaudited
                    else f"seed {args.tb2_seed}, {len(chosen)} of the tasks whose oracle scored 1 "
                    f"in {' and '.join(TB2_RESULTS)}",
                }
            if name == "swe":
                swe_support.build(Path(where["swe"]))
            run = [a.format(**where) for a in SUITES[name]]
            shown = [a.replace("{tb2}", "TB2_SELECTED").replace("{swe}", "SWE_FIXTURE") for a in SUITES[name]]
            result[key] = {**_suite(run, shown), **extra, "provenance": finish(prov)}
            if name == "bundled":
                result["provenance"] = result[name]["provenance"]
            args.out.write_text(json.dumps(result, indent=1) + "\n")
            r = result[key]
            print(f"{name}: {r['tasks']} tasks, {r['hackable']} hackable, {r['broken']} broken, {r['wall_seconds']} s")


if __name__ == "__main__":
    main()
