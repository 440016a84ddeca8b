"""Sandbox benchmark: start-up, per-command overhead, a concurrency sweep, and cold start against the
size of the host's mount table, each beside its baseline.

    python bench/sandbox_bench.py [--samples 40] [--out bench/results/sandbox.json]
    python bench/sandbox_bench.py --remote [--out bench/results/sandbox_remote.json]   (bench/remote_sandbox.py)
    python bench/sandbox_bench.py --backends bwrap,gvisor   (bench/sandbox_backends.py, sandbox_backends.json)
    python bench/sandbox_bench.py --cold-start   (bench/sandbox_cold_start.py, sandbox_cold_start.json: the
        cold start's phases beside bare bwrap)

Everything is measured in this one run (this machine is noisy: only same-run ratios mean much). The mount
measurements (root only) each run in a private mount namespace, so the host's own table is untouched:
cold start with N dummy bind mounts added, and with the views that looking up every layer of the image
store leaves, through the store's one view (this code) and one view per layer (before it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mount_table import add_mounts
from provenance import finish, provenance

from furlong.sandbox.images import layers
from furlong.sandbox.base import Limits, SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.pool import WarmPool

CPU_BOUND = "python3 -c 'sum(i * i for i in range(1_500_000))'"
TARGETS = {"fresh_p50_ms": 10.0, "command_overhead_ms": 1.0, "slowdown_at_cores": 1.25}
DUMMY_MOUNTS = (0, 500, 1500)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def stats_ms(xs: list[float]) -> dict:
    return {"p50_ms": 1000 * pct(xs, 0.5), "p95_ms": 1000 * pct(xs, 0.95), "n": len(xs)}


def raw_bwrap_args(backend: BwrapBackend, spec: SandboxSpec, command: list[str]) -> tuple[list[str], list[int]]:
    """bwrap with the same namespaces, overlay and mounts (bwrap's own uncapped tmpfs upper: no launcher)."""
    args, fds = backend.bwrap_args(spec)
    args = args[: args.index("--")] + ["--", *command]
    at = args.index("--overlay")
    args[at:at + 4] = ["--tmp-overlay", "/"]
    return args, fds


def raw_bwrap(backend: BwrapBackend, spec: SandboxSpec, n: int, command: list[str]) -> list[float]:
    """bwrap running `command` as the sandbox uid: the floor (/bin/true), or the old python3 daemon's start."""
    args, fds = raw_bwrap_args(backend, spec, command)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(args, pass_fds=fds, user=backend.host_uid, group=backend.host_uid, extra_groups=[], check=True)
        times.append(time.perf_counter() - t)
    return times


def _tree_rss_kib(pid: int) -> int:
    """Resident memory of a process and all its descendants (each counted once)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        total += next((int(l.split()[1]) for l in status.splitlines() if l.startswith("VmRSS:")), 0)
        todo += [int(c) for c in children]
    return total


async def idle_memory(backend, spec, n: int) -> tuple[list[int], list[int]]:
    """KiB resident per idle sandbox (launcher-made bwrap + init) vs raw bwrap holding /bin/sleep."""
    boxes = [await backend.create(spec) for _ in range(n)]
    await asyncio.gather(*(b.exec("true") for b in boxes))
    ours = [_tree_rss_kib(b._proc.pid) for b in boxes]
    for b in boxes:
        await b.close()
    args, fds = raw_bwrap_args(backend, spec, ["/bin/sleep", "60"])
    procs = [subprocess.Popen(args, pass_fds=fds, user=backend.host_uid, group=backend.host_uid, extra_groups=[])
             for _ in range(n)]
    await asyncio.sleep(0.5)
    raw = [_tree_rss_kib(p.pid) for p in procs]
    for p in procs:
        p.kill()
        p.wait()
    return ours, raw


async def cold_start(backend, spec, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        box = await backend.create(spec)
        await box.exec("true")
        times.append(time.perf_counter() - t)
        await box.close()
    return times


async def pooled_start(backend, spec, n: int) -> list[float]:
    pool = WarmPool(backend, spec, size=2)
    await pool.start()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        box = await pool.acquire()
        await box.exec("true")
        times.append(time.perf_counter() - t)
        await box.close()
        await asyncio.sleep(0.1)  # an episode's length, during which the pool refills
    await pool.close()
    return times


async def command_overhead(backend, spec, n: int) -> tuple[list[float], list[float]]:
    box = await backend.create(spec)
    await box.exec("true")
    inside = []
    for _ in range(n):
        t = time.perf_counter()
        await box.exec("true")
        inside.append(time.perf_counter() - t)
    await box.close()
    host = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(["/bin/bash", "-c", "true"], check=True)
        host.append(time.perf_counter() - t)
    return inside, host


async def sweep(backend, spec, loads: list[int], rounds: int) -> dict[int, list[float]]:
    out = {}
    for k in loads:
        boxes = [await backend.create(spec) for _ in range(k)]
        await asyncio.gather(*(b.exec("true") for b in boxes))
        lat: list[float] = []

        async def one(box):
            t = time.perf_counter()
            r = await box.exec(CPU_BOUND, timeout_s=120)
            assert r.ok, r
            lat.append(time.perf_counter() - t)

        for _ in range(rounds):
            await asyncio.gather(*(one(b) for b in boxes))
        for b in boxes:
            await b.close()
        out[k] = lat
    return out



def _mount_count() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


def _store_layers(store: ImageStore) -> list[Path]:
    """Every layer directory in the store, as a run over all its tasks would look them up."""
    return sorted({*store.root.glob("*/upper"), *store.root.glob("*/rootfs"), *store.root.glob("*/rootfs-*"),
                   *store.root.glob("registry/*/rootfs")})


async def mounts_child(mode: str, n: int, samples: int, work: Path) -> dict:
    """In a private mount namespace: cold start with `n` dummy bind mounts added (mode "dummy"), or after
    looking up every layer of the store (mode "layers"): through the store's one view, then one view each."""
    store = ImageStore()
    backend = BwrapBackend(layers=store)
    spec = SandboxSpec(image=store.base(), limits=Limits(cpus=1.0))
    row: dict = {"mounts_at_start": _mount_count()}
    if mode == "dummy":
        add_mounts(n, work)
        row.update(extra_mounts=n, mounts=_mount_count(), cold=stats_ms(await cold_start(backend, spec, samples)))
        return row
    found = _store_layers(store)
    for layer in found:
        store.layer_dir(store.layer("x", layer))
    row.update(layers=len(found), store_view={"mounts": _mount_count(),
                                              "cold": stats_ms(await cold_start(backend, spec, samples))})
    for layer in found:  # the behaviour before the store's one view: a view per layer, kept until reboot
        layers.readonly_view(layer, store.host_uid)
    row["per_layer_views"] = {"mounts": _mount_count(), "cold": stats_ms(await cold_start(backend, spec, samples))}
    return row


def mounts_sweep(samples: int) -> dict:
    """Each measurement in a child in its own mount namespace; its views go under a temporary directory."""
    rows = []
    for mode, n in [*(("dummy", k) for k in DUMMY_MOUNTS), ("layers", 0)]:
        with tempfile.TemporaryDirectory(dir="/run/furlong") as views, tempfile.TemporaryDirectory() as work:
            os.chmod(views, 0o755)  # the sandbox uid resolves its layers through it
            res = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, __file__,
                                  "--mounts-child", mode, str(n), "--samples", str(samples), "--work", work],
                                 capture_output=True, text=True, env={**os.environ, "FURLONG_LAYER_MOUNTS": views})
        if res.returncode != 0:
            raise RuntimeError(f"the mount measurement {mode} {n} failed:\n{res.stderr[-2000:]}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    dummy, run = rows[:-1], rows[-1]
    base = dummy[0]["cold"]["p50_ms"]
    per_100 = (dummy[-1]["cold"]["p50_ms"] - base) / max(dummy[-1]["extra_mounts"] / 100, 1)
    return {"dummy_bind_mounts": [{**r, "p50_vs_none": r["cold"]["p50_ms"] / base} for r in dummy],
            "p50_ms_per_100_mounts": per_100, "every_store_layer_looked_up": run,
            "host_mounts_before_and_after_this_bench": None}


async def main_async(args) -> dict:
    store = ImageStore()
    backend = BwrapBackend(layers=store)
    spec = SandboxSpec(image=store.base(), limits=Limits(cpus=1.0))
    n = args.samples
    raw = raw_bwrap(backend, spec, n, ["/bin/true"])
    python_daemon = raw_bwrap(backend, spec, n, ["/usr/bin/python3", "-I", "-S", "-c", "import json, selectors, threading"])
    cold = await cold_start(backend, spec, n)
    mem_ours, mem_raw = await idle_memory(backend, spec, 10)
    pooled = await pooled_start(backend, spec, n)
    inside, host = await command_overhead(backend, spec, 5 * n)
    loads = [1, 2, 4, 8, 16]
    lat = await sweep(backend, spec, loads, args.rounds)
    single = pct(lat[1], 0.95)
    sweep_rows = [{"sandboxes": k, **stats_ms(lat[k]), "p50_slowdown": pct(lat[k], 0.5) / pct(lat[1], 0.5),
                   "p95_slowdown": pct(lat[k], 0.95) / single} for k in loads]
    capacity = max([r["sandboxes"] for r in sweep_rows if r["p95_slowdown"] <= 1.5], default=0)
    cores = os.cpu_count() or 1
    at_cores = next((r for r in sweep_rows if r["sandboxes"] >= cores), sweep_rows[-1])
    overhead_ms = 1000 * (pct(inside, 0.5) - pct(host, 0.5))
    return {
        "machine": {"cores": cores, "load_avg_at_end": os.getloadavg(),  # cgroup moves: install.sh, docs/sandboxes.md
                    "cgroup_favordynmods": "favordynmods" in Path("/proc/mounts").read_text()},
        "start": {"raw_bwrap_true": stats_ms(raw), "raw_bwrap_python3_daemon_imports": stats_ms(python_daemon),
                  "python3_daemon_vs_raw_p50": pct(python_daemon, 0.5) / pct(raw, 0.5),
                  "cold_sandbox_first_command": stats_ms(cold),
                  "pooled_sandbox_first_command": stats_ms(pooled),
                  "cold_vs_raw_p50": pct(cold, 0.5) / pct(raw, 0.5), "pooled_vs_raw_p50": pct(pooled, 0.5) / pct(raw, 0.5)},
        "idle_memory_kib": {"sandbox": statistics.median(mem_ours), "raw_bwrap_sleep": statistics.median(mem_raw),
                            "ratio": statistics.median(mem_ours) / max(statistics.median(mem_raw), 1)},
        "command": {"sandbox_exec_true": stats_ms(inside), "host_subprocess_bash_true": stats_ms(host),
                    "overhead_p50_ms": overhead_ms, "ratio_p50": pct(inside, 0.5) / pct(host, 0.5)},
        "sweep": {"command": CPU_BOUND, "rows": sweep_rows, "capacity_p95_le_1.5x": capacity,
                  "p95_slowdown_at_cores": at_cores["p95_slowdown"]},
        "targets": {
            "fresh_p50_ms<=10 (pooled)": 1000 * pct(pooled, 0.5) <= TARGETS["fresh_p50_ms"],
            "fresh_p50_ms<=10 (cold)": 1000 * pct(cold, 0.5) <= TARGETS["fresh_p50_ms"],
            "command_overhead_ms<=1": overhead_ms <= TARGETS["command_overhead_ms"],
            "p95_slowdown_at_cores<=1.25": at_cores["p95_slowdown"] <= TARGETS["slowdown_at_cores"],
        },
    }


def report(res: dict, console: Console) -> None:
    t = Table(title="sandbox start-up and command latency (this run)")
    for col in ("measurement", "p50 ms", "p95 ms", "vs baseline (p50)"):
        t.add_column(col)
    s, c = res["start"], res["command"]
    t.add_row("raw bwrap … /bin/true (baseline)", f"{s['raw_bwrap_true']['p50_ms']:.2f}", f"{s['raw_bwrap_true']['p95_ms']:.2f}", "1.00×")
    t.add_row("cold: new sandbox + first command", f"{s['cold_sandbox_first_command']['p50_ms']:.2f}",
              f"{s['cold_sandbox_first_command']['p95_ms']:.2f}", f"{s['cold_vs_raw_p50']:.2f}×")
    t.add_row("raw bwrap … python3 (the old daemon's start)", f"{s['raw_bwrap_python3_daemon_imports']['p50_ms']:.2f}",
              f"{s['raw_bwrap_python3_daemon_imports']['p95_ms']:.2f}", f"{s['python3_daemon_vs_raw_p50']:.2f}×")
    t.add_row("warm pool: fresh sandbox + first command", f"{s['pooled_sandbox_first_command']['p50_ms']:.2f}",
              f"{s['pooled_sandbox_first_command']['p95_ms']:.2f}", f"{s['pooled_vs_raw_p50']:.2f}×")
    t.add_row("host: subprocess bash -c true (baseline)", f"{c['host_subprocess_bash_true']['p50_ms']:.2f}",
              f"{c['host_subprocess_bash_true']['p95_ms']:.2f}", "1.00×")
    t.add_row("live sandbox: exec('true')", f"{c['sandbox_exec_true']['p50_ms']:.2f}",
              f"{c['sandbox_exec_true']['p95_ms']:.2f}", f"{c['ratio_p50']:.2f}× (+{c['overhead_p50_ms']:.2f} ms)")
    console.print(t)
    m = res["idle_memory_kib"]
    console.print(f"idle sandbox resident memory: {m['sandbox'] / 1024:.1f} MiB (bwrap + init) vs raw bwrap + sleep "
                  f"{m['raw_bwrap_sleep'] / 1024:.1f} MiB: {m['ratio']:.2f}×")
    w = Table(title=f"concurrency sweep: {res['sweep']['command']}")
    for col in ("sandboxes", "p50 ms", "p95 ms", "p50 slowdown", "p95 slowdown"):
        w.add_column(col)
    for r in res["sweep"]["rows"]:
        w.add_row(str(r["sandboxes"]), f"{r['p50_ms']:.1f}", f"{r['p95_ms']:.1f}", f"{r['p50_slowdown']:.2f}×", f"{r['p95_slowdown']:.2f}×")
    console.print(w)
    console.print(f"capacity (largest load with p95 ≤ 1.5× single): {res['sweep']['capacity_p95_le_1.5x']} sandboxes "
                  f"on {res['machine']['cores']} cores")
    if "mounts" in res:
        report_mounts(res["mounts"], console)
    for name, ok in res["targets"].items():
        console.print(f"target {name}: {'[green]met' if ok else '[red]missed'}")


def report_mounts(m: dict, console: Console) -> None:
    t = Table(title="cold start against the host's mount table (each in a private mount namespace)")
    for col in ("table", "mounts", "p50 ms", "p95 ms", "p50 vs none"):
        t.add_column(col)
    for r in m["dummy_bind_mounts"]:
        t.add_row(f"+{r['extra_mounts']} dummy bind mounts", str(r["mounts"]), f"{r['cold']['p50_ms']:.2f}",
                  f"{r['cold']['p95_ms']:.2f}", f"{r['p50_vs_none']:.2f}×")
    run = m["every_store_layer_looked_up"]
    for key, what in (("store_view", "one view per store (now)"), ("per_layer_views", "one view per layer (before)")):
        t.add_row(f"{run['layers']} layers looked up: {what}", str(run[key]["mounts"]),
                  f"{run[key]['cold']['p50_ms']:.2f}", f"{run[key]['cold']['p95_ms']:.2f}", "")
    console.print(t)
    console.print(f"{m['p50_ms_per_100_mounts']:.2f} ms of cold start per 100 mounts; host mount table before and "
                  f"after this bench: {m['host_mounts_before_and_after_this_bench']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5, help="commands per sandbox at each sweep load")
    ap.add_argument("--out", type=Path, help="default: bench/results/sandbox.json (sandbox_remote.json with --remote, "
                    "sandbox_snapshots.json with --snapshots)")
    ap.add_argument("--remote", action="store_true", help="through a sandbox host beside the local backend")
    ap.add_argument("--snapshots", action="store_true",
                    help="snapshot, fork, pause and resume beside a cold start (bench/sandbox_snapshots.py)")
    ap.add_argument("--backends", help="backends side by side, e.g. bwrap,gvisor (bench/sandbox_backends.py)")
    ap.add_argument("--cold-start", action="store_true",
                    help="cold start's phases beside bare bwrap (bench/sandbox_cold_start.py)")
    ap.add_argument("--density", type=int, nargs="?", const=1000, metavar="N",
                    help="N live sandboxes (default 1000), most paused (bench/sandbox_density.py)")
    ap.add_argument("--running", type=int, default=8, help="--density: sandboxes running at a time")
    ap.add_argument("--concurrency", type=int, default=8, help="--density: starts and closes at a time")
    ap.add_argument("--watcher", choices=("threaded", "pidfd"),
                    help="--density: asyncio's child watcher (default: the one the backend leaves)")
    ap.add_argument("--mounts-child", nargs=2, metavar=("MODE", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mounts_child:
        mode, n = args.mounts_child
        print(json.dumps(asyncio.run(mounts_child(mode, int(n), args.samples, args.work))))
        return
    prov = provenance()
    results = Path(__file__).parent / "results"
    if args.remote or args.snapshots or args.backends or args.cold_start or args.density:  # a part of its own: it runs alone,
        import remote_sandbox  # into its own JSON
        import sandbox_backends
        import sandbox_cold_start
        import sandbox_density
        import sandbox_snapshots

        part, name = (
            (remote_sandbox, "sandbox_remote")
            if args.remote
            else (sandbox_snapshots, "sandbox_snapshots")
            if args.snapshots
            else (sandbox_cold_start, "sandbox_cold_start")
            if args.cold_start
            else (sandbox_density, "sandbox_density")
            if args.density
            else (sandbox_backends, "sandbox_backends")
        )
        args.out = args.out or results / f"{name}.json"
        res = {"provenance": None, **part.run(sys.modules[__name__], args)}
        res["provenance"] = finish(prov)
        args.out.write_text(json.dumps(res, indent=2))
        part.report(res, Console())
        print(f"wrote {args.out}")
        return
    args.out = args.out or results / "sandbox.json"
    host_before = _mount_count()
    res = asyncio.run(main_async(args))
    if os.geteuid() == 0:  # as a user, layers are not mounted and bind mounts need a namespace of one's own
        res["mounts"] = mounts_sweep(args.samples)
        res["mounts"]["host_mounts_before_and_after_this_bench"] = [host_before, _mount_count()]
        view = res["mounts"]["every_store_layer_looked_up"]["store_view"]["cold"]["p50_ms"]
        res["targets"]["fresh_p50_ms<=10 (cold, every store layer looked up)"] = view <= TARGETS["fresh_p50_ms"]
    res = {"provenance": finish(prov), **res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    report(res, Console())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
