"""Public Terminal-Bench 2 tasks run as published: `furlong eval` with the oracle, then a no-op agent, on each.

    python bench/tb2_bench.py TASKS_DIR [--limit 40] [--seed 0] [--tasks a,b] [--timeout-s 900]
                              [--network offline|harbor|packages] [--out bench/results/tb2.json]

TASKS_DIR is a checkout of the task collection below, never committed here:

    git clone https://github.com/purple29th/purple29th-tbench-2 tb2-tasks
    git -C tb2-tasks checkout 20b8213075732fabbc45b8cdfdcdd9da55a69b16

(87 tasks in Harbor's TB2 format: task.toml, instruction.md, environment/Dockerfile, tests/test.sh,
solution/solve.sh; the official laude-institute/terminal-bench-2 was not reachable from here, docs/tb2.md.)
Each task is one `furlong eval` subprocess per agent, in its own process group, killed past --timeout-s so
one hung build cannot eat the run; the oracle's run builds the image, the no-op's reuses it. Both run with
eval.verifier_toolchain=true and images.trust_host_ca=true (TB2's tests fetch uv and pytest; builds here go
through a TLS-intercepting proxy). TB2's task.toml names no network mode, so `--network` picks furlong's
default for such tasks (NETWORKS): offline (furlong's own default), harbor (public in both phases, Harbor's
default) or packages (the agent offline, the tests with package indexes only). The cause of every failure is
read from the episode's error, verifier and solution output (CAUSES, first match wins), and the JSON is
rewritten after every task.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, finish, provenance

COLLECTION = {"url": "https://github.com/purple29th/purple29th-tbench-2",
              "commit": "20b8213075732fabbc45b8cdfdcdd9da55a69b16"}
OVERRIDES = ["eval.verifier_toolchain=true", "images.trust_host_ca=true", "images.offline_uv=true",
             "images.ubuntu_standins=nearest"]
# sandbox.network: the phases of a task that names no network mode (TB2's name none; docs/tb2.md)
NETWORKS = {"offline": [],
            "harbor": ["sandbox.network.agent=public", "sandbox.network.verifier=public"],
            "packages": ["sandbox.network.verifier=packages"]}

# (cause, pattern over the episode's error + outputs), the groups, most specific first
CAUSES = [
    ("task's own bug", (r"has no solution|outside the build context|not loaded|COPY failed|"
                        r"COPY source .* not found|No such file or directory: '/tests/|a Harbor task needs")),
    ("no registry for the base", (r"no registry|registry.*(unreachable|refused|could not)|no stand-in|"
                                  r"cannot pull|RegistryError|pull .* failed")),
    ("https during build", (r"(?s)image unavailable.*(CERTIFICATE_VERIFY_FAILED|Could not resolve host|"
                            r"Failed to connect|curl: \(\d+\)|SSL|Temporary failure in name resolution|"
                            r"HTTPSConnection|ConnectionError|403 Forbidden|404 Not Found)")),
    ("tests need internet", (r"Could not resolve host|Temporary failure in name resolution|Failed to fetch|"
                             r"astral\.sh|No interpreter found|failed to download|dns error|Network is unreachable")),
    ("timeout", r"timed out|timeout"),
]
BUILD_FAILED = re.compile(r"image unavailable|image build failed")
FAILED_AT = re.compile(r"Dockerfile:(\d+):")
PYTEST_RAN = re.compile(r"\d+ (passed|failed|errors?)\b|short test summary")
UVX_PYTHON = re.compile(r"\buvx\b[^\n]*?(?:--python|-p)[ =](\d+\.\d+)")
FETCH = re.compile(r"^\s*RUN\b.*\b(https?://|pip3? install|uv pip install|git clone)", re.IGNORECASE)


def pick(root: Path, limit: int | None, seed: int | None, names: list[str]) -> list[Path]:
    """The tasks to run: the named ones, else a seeded sample (or the first `limit` sorted without a seed)."""
    every = sorted(p.parent for p in root.glob("*/task.toml"))
    if names:
        missing = [n for n in names if not (root / n / "task.toml").is_file()]
        if missing:
            sys.exit(f"--tasks: no task.toml under {root} for {', '.join(missing)}")
        return [root / n for n in names]
    if not every:
        sys.exit(f"{root}: no */task.toml here; expected a checkout of {COLLECTION['url']}")
    if seed is not None:
        every = sorted(random.Random(seed).sample(every, min(limit or len(every), len(every))))
    return every[:limit] if limit else every


def run_eval(task: Path, agent: str, timeout_s: float, overrides: list[str]) -> dict:
    """One `furlong eval` of one task; its episode line, or why there is none (a timeout, a crash)."""
    with tempfile.TemporaryDirectory(prefix="tb2-bench-") as tmp:
        out = Path(tmp) / "episodes.jsonl"
        cmd = [sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(task), "--agent", agent,
               "--out", str(out), *overrides]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own group: a timeout kills its builds too
        try:
            log, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            timed_out = True
        lines = out.read_text().splitlines() if out.exists() else []
    record = json.loads(lines[0]) if lines else {}
    return {"seconds": round(time.monotonic() - started, 1), "timed_out": timed_out, "exit_code": proc.returncode,
            "record": record, "log_tail": None if record else (log or "")[-2000:]}


def cause_of(task: Path, evidence: str, timed_out: bool, note: str = "") -> str:
    """The issue's group for an oracle run that did not score 1, from what the episode said."""
    if timed_out:
        return "timeout"
    for cause, pattern in CAUSES:
        if cause == "tests need internet" and PYTEST_RAN.search(evidence) and "No interpreter found" not in evidence:
            continue  # the tests ran and failed: a failed download beside them (uv's installer) did not decide it
        if re.search(pattern, evidence, re.IGNORECASE):
            return cause
    if BUILD_FAILED.search(evidence) and _fetched_before_failure(task, evidence):
        return "https during build"
    if not (BUILD_FAILED.search(evidence) or PYTEST_RAN.search(evidence)) and _python_uv_downloads(task, note):
        return "tests need internet"
    return "other"


def _python_uv_downloads(task: Path, note: str) -> bool:
    """The tests hide pytest's output in a log file (none in the evidence) and ask `uvx --python X.Y` for a Python the
    image's note does not name (e.g. 3.12 over the gcc stand-in's 3.11): uv would download CPython from
    github.com, which fails here (checked by hand on transaction-log-replay; docs/tb2.md)."""
    test = task / "tests/test.sh"
    asked = UVX_PYTHON.search(test.read_text(errors="replace")) if test.exists() else None
    return bool(asked) and f"Python {asked.group(1)}" not in note


def _fetched_before_failure(task: Path, evidence: str) -> bool:
    """A build step at or above the failed line fetches from the internet (`curl URL | sh` exits 0 on an
    unreachable host, so the failure shows later, e.g. `cp: cannot stat '/root/.local/bin/uv'`)."""
    failed = FAILED_AT.search(evidence)
    lines = (task / "environment/Dockerfile").read_text(errors="replace").splitlines()
    upto = int(failed.group(1)) if failed else len(lines)
    return any(FETCH.search(line) for line in lines[:upto])


def built(run: dict) -> bool:
    """The image was built and a sandbox started: the episode reached the agent phase."""
    rec = run["record"]
    if not rec:
        return False
    if rec.get("status") != "infra_error":
        return True
    error = rec.get("error") or ""
    return rec.get("agent_output") is not None or error.startswith("agent failed")


def row(task: Path, oracle: dict, noop: dict | None) -> dict:
    rec = oracle["record"]
    passed = rec.get("reward") == 1
    out = {"task": task.name, "base": _base(task), "built": built(oracle), "oracle_pass": passed,
           "oracle_status": rec.get("status"), "oracle_reward": rec.get("reward"),
           "noop_pass": None if noop is None else noop["record"].get("reward") == 1,
           "noop_status": None if noop is None else noop["record"].get("status"), "cause": None,
           "timed_out": oracle["timed_out"], "image_note": rec.get("image_note"),
           "seconds": {"oracle": oracle["seconds"], "noop": noop and noop["seconds"]}}
    if not passed:
        out["evidence"] = _evidence(oracle)
        out["cause"] = cause_of(task, out["evidence"], oracle["timed_out"], rec.get("image_note") or "")
    return out


def _base(task: Path) -> str | None:
    for line in (task / "environment/Dockerfile").read_text(errors="replace").splitlines():
        if line.strip().upper().startswith("FROM "):
            return line.split()[1]
    return None


def _evidence(run: dict) -> str:
    """The lines that decided the cause: the error, then the tail of the solution's and the tests' output."""
    rec = run["record"]
    parts = [rec.get("error") or "", (rec.get("agent_output") or "")[-600:],
             (rec.get("verifier_output") or "")[-1500:], run["log_tail"] or ""]
    return "\n---\n".join(p for p in parts if p)[-2500:]


def table(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["cause"] or "oracle passed"] = counts.get(r["cause"] or "oracle passed", 0) + 1
    lines = [(f"{len(rows)} tasks: built {sum(r['built'] for r in rows)}, oracle pass "
             f"{sum(r['oracle_pass'] for r in rows)}, noop pass {sum(bool(r['noop_pass']) for r in rows)}")]
    lines += [f"  {n:3d}  {c}" for c, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    lines += [f"{r['task'][:44]:44s} {str(r['base'])[:34]:34s} built={r['built']!s:5s} "
              f"oracle={r['oracle_pass']!s:5s} noop={r['noop_pass']!s:5s} {r['cause'] or ''}" for r in rows]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """The docs' tables: counts per cause, then one row per task."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["cause"] or "oracle passed"] = counts.get(r["cause"] or "oracle passed", 0) + 1
    out = ["| outcome | tasks |", "|---|---|"]
    out += [f"| {c} | {n} |" for c, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    out += ["", "| task | base | built | oracle | noop | cause |", "|---|---|---|---|---|---|"]
    yes = {True: "yes", False: "no", None: "-"}
    out += [f"| {r['task']} | `{r['base']}` | {yes[r['built']]} | {yes[r['oracle_pass']]} | "
            f"{yes[r['noop_pass']]} | {r['cause'] or ''} |" for r in rows]
    return "\n".join(out)


def reclassify(path: Path, root: Path, prov: dict) -> None:
    """The causes of an earlier run's failures again, under the current CAUSES; the run's provenance kept."""
    result = json.loads(path.read_text())
    for r in result["rows"]:
        if not r["oracle_pass"]:
            r["cause"] = cause_of(root / r["task"], r["evidence"], r.get("timed_out", False),
                                  r.get("image_note") or "")
    result["reclassified"] = finish(prov)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["rows"]))
    print(markdown(result["rows"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks_dir", type=Path, help=f"a checkout of {COLLECTION['url']} at {COLLECTION['commit']}")
    parser.add_argument("--limit", type=int, default=40, help="how many tasks (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="sample seed; -1: the first --limit sorted")
    parser.add_argument("--tasks", default="", help="comma-separated task names (overrides --limit)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="one task's eval, per agent")
    parser.add_argument("--network", choices=sorted(NETWORKS), default="offline",
                        help="the phases of tasks that name no network mode: offline (furlong's default), harbor "
                             "(public in both, Harbor's default), packages (tests reach package indexes only)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/tb2.json")
    parser.add_argument("--reclassify", action="store_true", help="rerun nothing: recompute --out's causes "
                                                                  "from its evidence with this script's rules")
    parser.add_argument("--update", action="store_true", help="run only --tasks and replace their rows in --out "
                                                              "(its run's provenance kept, this one's added)")
    args = parser.parse_args()
    prov = provenance()
    if args.reclassify:
        return reclassify(args.out, args.tasks_dir, prov)
    tasks = pick(args.tasks_dir, args.limit or None, None if args.seed < 0 else args.seed,
                 [n for n in args.tasks.split(",") if n])
    overrides = [*OVERRIDES, *NETWORKS[args.network]]
    if args.update:
        result = json.loads(args.out.read_text())
        if result["overrides"] != overrides:
            raise SystemExit(f"--update: {args.out} was run with {result['overrides']}, not {overrides}")
        result.setdefault("updates", []).append({"tasks": [t.name for t in tasks]})
    else:
        result = {"provenance": None, "collection": COLLECTION, "overrides": overrides, "network": args.network,
                  "selected": [t.name for t in tasks], "rows": []}
    for task in tasks:
        oracle = run_eval(task, "oracle", args.timeout_s, overrides)
        noop = run_eval(task, "noop", args.timeout_s, overrides) if built(oracle) else None
        new = row(task, oracle, noop)
        kept = [r for r in result["rows"] if r["task"] != task.name]
        result["rows"] = sorted([*kept, new], key=lambda r: r["task"])
        print(table([new]).splitlines()[-1], flush=True)
        if args.update:
            result["updates"][-1] = {"tasks": [t.name for t in tasks], "overrides": OVERRIDES, **finish(prov)}
        else:
            result["provenance"] = finish(prov)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
