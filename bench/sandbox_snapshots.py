"""`python bench/sandbox_bench.py --snapshots`: snapshot, fork, pause and resume of a bwrap sandbox whose
writable layer holds 10 MB, beside a cold start, in one run (docs/sandboxes.md, "Snapshot, fork, pause and
resume"). Each figure is the p50 (and p95) of `--samples` tries:

- cold: create + first command (`true`), as sandbox_bench.py measures it;
- snapshot: `box.snapshot()` of the 10 MB sandbox (freeze, copy and hash the layer, thaw);
- restore: `create(spec, from_snapshot=ref)` + first command, from a snapshot already taken;
- fork: `box.fork(1)` + the fork's first command (a snapshot, then a restore);
- pause, resume: `box.pause()`, `box.resume()` each, with a busy loop running in the sandbox.

The store is a scratch one under furlong's cache, removed at the end.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from furlong.paths import cache_dir
from furlong.sandbox.base import Limits, SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.bwrap_box import remove_tree
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.runtime.snapshots import SnapshotStore

UPPER_MB = 10
TARGETS_MS = {"fork_first_command": 5.0, "snapshot": 10.0, "pause": 5.0, "resume": 5.0}


async def _timed(n: int, step) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        await step()
        times.append(time.perf_counter() - t)
    return times


async def measure(bench, backend: BwrapBackend, spec: SandboxSpec, n: int) -> dict:
    cold = await bench.cold_start(backend, spec, n)
    box = await backend.create(spec)
    made = []
    try:
        await box.exec(f"head -c {UPPER_MB << 20} /dev/urandom > /root/blob")
        ref = await box.snapshot()

        async def restore():
            made.append(await backend.create(spec, from_snapshot=ref))
            await made[-1].exec("true")

        async def fork():
            (child,) = await box.fork(1)
            made.append(child)
            await child.exec("true")

        snapshot = await _timed(n, box.snapshot)
        restored = await _timed(n, restore)
        forked = await _timed(n, fork)
        await asyncio.gather(*(m.close() for m in made))
        await box.exec("(while :; do :; done) >/dev/null 2>&1 &")
        pause, resume = [], []
        for _ in range(n):
            pause += await _timed(1, box.pause)
            resume += await _timed(1, box.resume)
    finally:
        await asyncio.gather(box.close(), *(m.close() for m in made))
    rows = {"cold_first_command": cold, "snapshot": snapshot, "restore_first_command": restored,
            "fork_first_command": forked, "pause": pause, "resume": resume}
    out = {k: bench.stats_ms(v) for k, v in rows.items()}
    return {"upper_mb": UPPER_MB, "snapshot_bytes": ref.size_bytes, **out,
            "targets": {f"{k}_p50_ms<={v:g}": out[k]["p50_ms"] <= v for k, v in TARGETS_MS.items()}}


def run(bench, args) -> dict:
    root = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="bench-snapshots-"))
    try:
        backend = BwrapBackend(layers=ImageStore())
        backend._snapshots = SnapshotStore(root, ttl_s=600, max_mb=4096, group=backend.host_uid)
        spec = SandboxSpec(image=backend.layers.base(), limits=Limits(cpus=1.0))  # type: ignore[attr-defined]
        return {"snapshots": asyncio.run(measure(bench, backend, spec, args.samples))}
    finally:
        remove_tree(root)


def report(res: dict, console: Console) -> None:
    s = res["snapshots"]
    t = Table(title=f"snapshot, fork, pause, resume (writable layer of {s['upper_mb']} MB)")
    for col in ("measurement", "p50 ms", "p95 ms"):
        t.add_column(col)
    for key in ("cold_first_command", "snapshot", "restore_first_command", "fork_first_command", "pause", "resume"):
        t.add_row(key, f"{s[key]['p50_ms']:.2f}", f"{s[key]['p95_ms']:.2f}")
    console.print(t)
    console.print(s["targets"])
