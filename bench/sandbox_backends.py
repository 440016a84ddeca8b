"""Sandbox backends side by side (`python bench/sandbox_bench.py --backends bwrap,gvisor`): for each, cold
start to the first command, per-command overhead (`exec("true")`), resident memory per idle sandbox (its
host processes: bwrap's launcher and init; gVisor's runsc, sentry, gofer and ptrace stubs) and a short
concurrency sweep of a CPU-bound command, in one run on one machine. A part of sandbox_bench.py, which writes
its sandbox_backends.json with the run's provenance; this module writes nothing itself.
"""

from __future__ import annotations

import asyncio
import os
import statistics

from rich.console import Console
from rich.table import Table

from furlong.sandbox.backends import make_backend
from furlong.sandbox.base import Limits, SandboxSpec
from furlong.sandbox.images.store import ImageStore

LOADS = (1, 2, 4)
IDLE = 8  # sandboxes held at once for the memory figure


def _pid(box) -> int:
    """The host process at the root of a sandbox's tree (GvisorSandbox wraps the init's channel)."""
    inner = getattr(box, "_box", box)
    return inner._proc.pid


async def _idle_kib(bench, backend, spec) -> float:
    boxes = [await backend.create(spec) for _ in range(IDLE)]
    try:
        await asyncio.gather(*(b.exec("true") for b in boxes))
        await asyncio.sleep(0.5)
        return statistics.median(bench._tree_rss_kib(_pid(b)) for b in boxes)
    finally:
        for b in boxes:
            await b.close()


async def _one(bench, kind: str, store: ImageStore, args) -> dict:
    backend = make_backend(kind, layers=store)
    spec = SandboxSpec(image=store.base(), limits=Limits(cpus=1.0))
    n = args.samples
    cold = await bench.cold_start(backend, spec, n)
    inside, host = await bench.command_overhead(backend, spec, 5 * n)
    idle = await _idle_kib(bench, backend, spec)
    lat = await bench.sweep(backend, spec, list(LOADS), args.rounds)
    single = bench.pct(lat[1], 0.95)
    return {
        "cold_sandbox_first_command": bench.stats_ms(cold),
        "command": {
            "sandbox_exec_true": bench.stats_ms(inside),
            "host_subprocess_bash_true": bench.stats_ms(host),
            "overhead_p50_ms": 1000 * (bench.pct(inside, 0.5) - bench.pct(host, 0.5)),
        },
        "idle_memory_kib_per_sandbox": idle,
        "sweep": [
            {"sandboxes": k, **bench.stats_ms(lat[k]), "p95_slowdown": bench.pct(lat[k], 0.95) / single} for k in LOADS
        ],
    }


def run(bench, args) -> dict:
    kinds = [k.strip() for k in args.backends.split(",") if k.strip()]
    store = ImageStore()
    store.base()
    out = {kind: asyncio.run(_one(bench, kind, store, args)) for kind in kinds}
    first = kinds[0]
    ratios = {
        kind: {
            "cold_p50": out[kind]["cold_sandbox_first_command"]["p50_ms"]
            / out[first]["cold_sandbox_first_command"]["p50_ms"],
            "exec_true_p50": out[kind]["command"]["sandbox_exec_true"]["p50_ms"]
            / out[first]["command"]["sandbox_exec_true"]["p50_ms"],
            "idle_memory": out[kind]["idle_memory_kib_per_sandbox"] / out[first]["idle_memory_kib_per_sandbox"],
        }
        for kind in kinds[1:]
    }
    return {
        "machine": {"cores": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
        "command": bench.CPU_BOUND,
        "backends": out,
        f"ratios_vs_{first}": ratios,
    }


def report(res: dict, console: Console) -> None:
    t = Table(title="sandbox backends (one run)")
    for col in ("backend", "cold p50 ms", "exec true p50 ms", "overhead p50 ms", "idle KiB/sandbox", "p95 x at 4"):
        t.add_column(col)
    for kind, r in res["backends"].items():
        t.add_row(
            kind,
            f"{r['cold_sandbox_first_command']['p50_ms']:.1f}",
            f"{r['command']['sandbox_exec_true']['p50_ms']:.2f}",
            f"{r['command']['overhead_p50_ms']:.2f}",
            f"{r['idle_memory_kib_per_sandbox']:.0f}",
            f"{r['sweep'][-1]['p95_slowdown']:.2f}",
        )
    console.print(t)
