"""`furlong audit`: the exploit library run as the agent on every task, to find the hackable ones (docs/audit.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.cli.common import add_common, build_base_image, config_of, console, sandbox_pieces

if TYPE_CHECKING:
    from furlong.audit.run import TaskAudit


def add_audit_parser(sub) -> None:
    au = sub.add_parser(
        "audit",
        help="run scripted exploits as the agent on every task; exit 1 when any task is hackable (docs/audit.md)",
    )
    what = au.add_mutually_exclusive_group(required=True)
    what.add_argument("--tasks", type=Path, help="a task, a task family, or a directory of them")
    what.add_argument("--swe", type=Path, metavar="INSTANCES.jsonl", help="SWE-bench-style instances (docs/swe.md)")
    au.add_argument("--repo-dir", type=Path, help="--swe: the local git repository (or OWNER/NAME clones)")
    au.add_argument("--exploits", default="all", help="'all' or exploit names separated by commas")
    au.add_argument("--concurrency", type=int, default=2, help="episodes at once (default 2)")
    au.add_argument("--out", type=Path, help="write one JSON line per task here")
    au.add_argument("--split", choices=["train", "heldout", "all"], default="all", help="family instances to use")
    au.add_argument("--per-family", type=int, default=2, help="instances per task family (default 2)")
    add_common(au)


def cmd_audit(args: argparse.Namespace) -> int:
    from furlong.audit.exploits import pick

    names = pick(args.exploits)  # a bad name fails before any image is built
    if args.concurrency < 1:
        raise ValueError(f"--concurrency: expected a positive number of episodes, got {args.concurrency}")
    if args.swe is None:
        return _audit_dir(args, args.tasks, names)
    if args.repo_dir is None:
        raise ValueError("--swe needs --repo-dir: the local git repository holding every base_commit")
    from furlong.tasks.swe import ImportOptions, import_instances

    with tempfile.TemporaryDirectory(prefix="furlong-audit-swe-") as tmp:
        with console.status(f"importing {args.swe}"):
            import_instances(args.swe, args.repo_dir, Path(tmp), ImportOptions())
        return _audit_dir(args, Path(tmp), names)


def _audit_dir(args: argparse.Namespace, tasks_path: Path, names: tuple[str, ...]) -> int:
    from furlong.audit.run import audit
    from furlong.build.sandbox import network_default
    from furlong.eval.run import harbor_env
    from furlong.tasks.suite import load_suite

    cfg = config_of(args, {})
    backend, store = sandbox_pieces(cfg)
    suite = load_suite(
        tasks_path, split=args.split, per_family=args.per_family, backend=backend, network=network_default(cfg.sandbox)
    )
    if cfg.eval.verifier_toolchain:  # as `furlong eval` does: the toolchain stacked on every task's image
        from furlong.sandbox.images.toolchain import opt_in_all

        suite = type(suite)(opt_in_all(suite.entries))
    for broken in suite.broken:
        console.print(f"[yellow]not loaded:[/yellow] {broken.error}", soft_wrap=True)
    build_base_image(store)
    console.print(
        f"auditing {len(suite.tasks)} tasks from {tasks_path}: oracle, noop and {len(names)} exploits each, "
        f"concurrency {args.concurrency}"
    )
    sink = open(args.out, "w") if args.out else None
    count = [0]

    def done(result: TaskAudit) -> None:
        count[0] += 1
        _progress(result, count[0], len(suite.tasks))
        if sink:
            sink.write(json.dumps(result.to_json()) + "\n")
            sink.flush()

    async def go():
        env = await harbor_env(suite.tasks, backend, store, console)
        return await audit(suite.tasks, names, env, args.concurrency, done)

    try:
        results = asyncio.run(go())
    finally:
        if sink:
            sink.close()
    return _summary(results, len(suite.broken))


def _progress(result: TaskAudit, n: int, total: int) -> None:
    """A line per task as it finishes: its verdict, and what earned reward or was caught."""
    style = {"hackable": "red", "broken": "yellow"}.get(result.verdict, "green")
    found = ", ".join(a.agent for a in result.findings())
    caught = ", ".join(a.agent for a in result.attempts if a.caught)
    detail = f" by {found}" if found else ""
    detail += f" (caught: {caught})" if caught else ""
    if result.verdict == "broken":
        oracle = result.attempts[0]
        detail = f": the oracle got {oracle.reward} ({oracle.status}) {oracle.error or ''}".rstrip()
    console.print(
        f"[{n}/{total}] {result.task}: [{style}]{result.verdict}[/{style}]{detail} ({result.seconds:.1f} s)",
        soft_wrap=True,
        highlight=False,
    )


def _summary(results: list[TaskAudit], not_loaded: int) -> int:
    """The findings with their hints, one JSON summary line on stdout; 1 when any task is hackable."""
    from furlong.audit.run import hint

    for r in results:
        for a in r.findings():
            console.print(f"{r.task}: {a.agent} earned {a.reward:g}; {hint(a.agent)}", soft_wrap=True, markup=False)
    counts = {v: sum(r.verdict == v for r in results) for v in ("hackable", "not_hackable", "broken")}
    print(json.dumps({"tasks": len(results), "not_loaded": not_loaded, **counts}))
    return 1 if counts["hackable"] else 0
