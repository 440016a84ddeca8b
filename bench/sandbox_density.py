"""`python bench/sandbox_bench.py --density [N]`: N live sandboxes on this host, most paused (issue 45: 1,000
live, the running ones' exec p95 at most 1.5x one sandbox alone, and the memory an idle one costs). In one run:

1. baseline: one sandbox alone, `--samples` execs each of a small command (`true`) and a short shell loop,
   before the fleet starts and again once it is closed (pooled: the shared machine's drift falls on both);
2. N sandboxes (the base image, the bwrap backend, default limits) started `--concurrency` at a time, each
   paused (cgroup freezer) once its first command returned; then a rotation as an RL run whose sandboxes
   wait on the model makes it: each round resumes the next `--running` paused sandboxes, runs the two
   commands in each, one exec at a time as in the baseline (so only the paused ones' presence differs), and
   pauses them again. Exec p50/p95 and their ratio to the baseline, pause/resume p50/p95, the start rate;
   and each sandbox's CPU time while paused (its processes' /proc/PID/schedstat run time at its resume
   minus at its pause: this host's v1 cpuacct is not a hierarchy furlong makes cgroups in), which is 0;
3. memory with every sandbox live and paused: /proc/meminfo deltas (MemAvailable, Slab, KernelStack,
   PageTables, Shmem) per sandbox, the sandboxes' own memory cgroups summed, one sandbox's process tree
   RSS, and this process's RSS, threads and fds per sandbox;
4. close all (`--concurrency` at a time), timed, and what is left: this process's child processes, the
   sandbox cgroups it made (named with its owner tag), its mounts, threads and fds against before the start.

A part of sandbox_bench.py, which writes sandbox_density.json with the run's provenance. The machine is
shared and noisy: only figures of the same run are compared.
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.runtime import cgroups, childwatch
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.owner_tags import owner_tag

COMMANDS = {"true": "true", "loop": "i=0; while [ $i -lt 200 ]; do i=$((i+1)); done"}
TARGET_RATIO = 1.5
MEMINFO = ("MemAvailable", "Slab", "KernelStack", "PageTables", "Shmem")


def meminfo() -> dict[str, int]:
    """The /proc/meminfo rows MEMINFO, in KiB."""
    rows = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {k: int(rows[k].split()[0]) for k in MEMINFO}


def own() -> dict[str, int]:
    """This process's resident memory (KiB), threads and open fds."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {"rss_kib": int(status["VmRSS"].split()[0]), "threads": int(status["Threads"]),
            "fds": len(os.listdir("/proc/self/fd"))}


def children() -> list[int]:
    """This process's live child processes (every thread's: asyncio's watcher threads are tasks of it)."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def cpu_ns(box) -> int:
    """Run time of the sandbox's processes so far, in ns (each thread's schedstat)."""
    total = 0
    for pid in box._cgroup.pids():
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


def own_cgroups() -> list[str]:
    """Sandbox cgroups this process made and left (their names end with its owner tag)."""
    tag = owner_tag()
    return [str(d) for parent in cgroups.sandbox_parents() if parent.is_dir()
            for d in parent.iterdir() if d.name.endswith(tag)]


def mounts() -> int:
    return len(Path("/proc/self/mountinfo").read_text().splitlines())


async def timed(step) -> float:
    t = time.perf_counter()
    await step
    return time.perf_counter() - t


async def exec_ok(box, cmd: str) -> float:
    t = time.perf_counter()
    r = await box.exec(cmd)
    took = time.perf_counter() - t
    assert r.ok, r
    return took


async def baseline(backend, spec, n: int) -> dict[str, list[float]]:
    """Each command `n` times in one sandbox, alone on the host (as far as this run goes)."""
    box = await backend.create(spec)
    try:
        await box.exec("true")
        return {name: [await exec_ok(box, cmd) for _ in range(n)] for name, cmd in COMMANDS.items()}
    finally:
        await box.close()


class Fleet:
    """N sandboxes, each paused once started; turns are given round-robin."""

    def __init__(self, backend, spec) -> None:
        self.backend, self.spec = backend, spec
        self.boxes: list = []
        self.start_s: list[float] = []
        self.pause_s: list[float] = []  # the rotation's (a start's own pause is in start_pause_s)
        self.start_pause_s: list[float] = []
        self.resume_s: list[float] = []
        self.exec_s: dict[str, list[float]] = {k: [] for k in COMMANDS}
        self.paused_cpu_ns: list[int] = []  # each paused stretch's run time: 0 if pausing releases the CPU
        self._at_pause: dict[int, int] = {}
        self.next = 0
        self._said = 0  # the progress line last printed

    async def _pause(self, i: int, into: list[float]) -> None:
        into.append(await timed(self.boxes[i].pause()))
        self._at_pause[i] = cpu_ns(self.boxes[i])

    async def _start_one(self) -> None:
        t = time.perf_counter()
        box = await self.backend.create(self.spec)
        await box.exec("true")
        self.start_s.append(time.perf_counter() - t)
        self.boxes.append(box)
        await self._pause(len(self.boxes) - 1, self.start_pause_s)

    async def start(self, n: int, concurrency: int, say) -> float:
        """Starts n, `concurrency` at a time; the wall seconds it took."""
        gate = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()

        async def one() -> None:
            async with gate:
                await self._start_one()
                if len(self.boxes) % max(1, n // 10) == 0 and len(self.boxes) != self._said:
                    self._said = len(self.boxes)
                    say(f"  {len(self.boxes)}/{n} live (paused) after {time.perf_counter() - t0:.1f} s")

        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0

    async def round(self, k: int) -> None:
        """The next k sandboxes' turn: resume, each command once (one exec at a time), pause again."""
        turn = [(self.next + j) % len(self.boxes) for j in range(k)]
        self.next = (self.next + k) % len(self.boxes)
        for i in turn:
            self.paused_cpu_ns.append(cpu_ns(self.boxes[i]) - self._at_pause.pop(i))
            self.resume_s.append(await timed(self.boxes[i].resume()))
        for i in turn:
            for name, cmd in COMMANDS.items():
                self.exec_s[name].append(await exec_ok(self.boxes[i], cmd))
        for i in turn:
            await self._pause(i, self.pause_s)

    async def close(self, concurrency: int) -> float:
        gate = asyncio.Semaphore(concurrency)

        async def one(box) -> None:
            async with gate:
                await box.close()

        t = time.perf_counter()
        await asyncio.gather(*(one(b) for b in self.boxes))
        return time.perf_counter() - t


def memory(bench, fleet: Fleet, before: dict, own_before: dict) -> dict:
    """What the live (paused) fleet costs the host, per sandbox."""
    n = len(fleet.boxes)
    now, own_now = meminfo(), own()
    cg = [b._cgroup.memory_bytes() or 0 for b in fleet.boxes]
    trees = [bench._tree_rss_kib(b._proc.pid) for b in fleet.boxes[:: max(1, n // 20)]]
    return {
        "meminfo_delta_kib_per_sandbox": {k: (before[k] - now[k] if k == "MemAvailable" else now[k] - before[k]) / n
                                          for k in MEMINFO},
        "cgroup_memory_kib": {"sum": sum(cg) / 1024, "per_sandbox_mean": sum(cg) / n / 1024,
                              "per_sandbox_p50": bench.pct(cg, 0.5) / 1024},
        "process_tree_rss_kib_p50": bench.pct(trees, 0.5),
        "furlong_process": {"before": own_before, "live": own_now,
                            **{f"{k}_per_sandbox": (own_now[k] - own_before[k]) / n for k in own_now}},
    }


def watcher_threads() -> list[str]:
    """asyncio's child watcher threads (Python 3.11's ThreadedChildWatcher: one per live subprocess)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("waitpid-")]


def host_state() -> dict:
    """What leftovers() compares with: taken before the fleet starts."""
    return {"meminfo": meminfo(), "own": own(), "mounts": mounts(), "children": children(), "cgroups": own_cgroups(),
            "watchers": watcher_threads()}


def leftovers(before: dict) -> dict:
    """What the closed fleet left behind, against `before` (host_state()). Threads: the default executor's
    workers (asyncio.to_thread: pause, resume, close) stay for the loop's life, so only watcher threads count."""
    return {"child_processes": sorted(set(children()) - set(before["children"])),
            "sandbox_cgroups": sorted(set(own_cgroups()) - set(before["cgroups"])),
            "mounts_added": mounts() - before["mounts"], "watcher_threads": watcher_threads()[len(before["watchers"]):],
            "threads_added": own()["threads"] - before["own"]["threads"], "fds_added": own()["fds"] - before["own"]["fds"]}


async def measure(bench, backend, spec, args, say=print) -> dict:
    base = await baseline(backend, spec, args.samples)
    before = host_state()
    fleet = Fleet(backend, spec)
    try:
        wall = await fleet.start(args.density, args.concurrency, say)
        mem = memory(bench, fleet, before["meminfo"], before["own"])
        rounds = max(-(-args.samples // args.running), -(-len(fleet.boxes) // args.running))
        say(f"  rotation: {rounds} rounds of {args.running} running")
        t = time.perf_counter()
        for _ in range(rounds):
            await fleet.round(args.running)
        rotation_s = time.perf_counter() - t
    finally:
        say("  closing")
        close_s = await fleet.close(args.concurrency)
    await asyncio.sleep(0.2)  # the readers' last callbacks
    left = leftovers(before)
    after = await baseline(backend, spec, args.samples)  # alone again: the machine's drift falls on both sides
    base = {k: base[k] + after[k] for k in COMMANDS}
    return summary(bench, base, fleet, mem, wall, rounds, rotation_s, close_s, left, args)


def summary(bench, base, fleet: Fleet, mem, wall, rounds, rotation_s, close_s, left, args) -> dict:
    ratios = {name: {q: bench.pct(fleet.exec_s[name], p) / bench.pct(base[name], p) for q, p in
                     (("p50", 0.5), ("p95", 0.95))} for name in COMMANDS}
    worst = max(r["p95"] for r in ratios.values())
    return {
        "what": f"{args.density} bwrap sandboxes (base image, default limits), all paused but {args.running} at a "
                "time in a round-robin rotation; exec beside one sandbox alone in the same run",
        "sandboxes": len(fleet.boxes), "running": args.running, "concurrency": args.concurrency,
        "commands": COMMANDS,
        "baseline_exec": {k: bench.stats_ms(v) for k, v in base.items()},
        "rotation_exec": {k: bench.stats_ms(v) for k, v in fleet.exec_s.items()},
        "exec_ratio": ratios, "worst_p95_ratio": worst, f"target_p95_ratio<={TARGET_RATIO}": worst <= TARGET_RATIO,
        "pause": bench.stats_ms(fleet.pause_s), "resume": bench.stats_ms(fleet.resume_s),
        "start": {**bench.stats_ms(fleet.start_s), "wall_s": wall, "per_s": len(fleet.boxes) / wall,
                  "first_tenth": bench.stats_ms(fleet.start_s[: max(1, len(fleet.start_s) // 10)]),
                  "last_tenth": bench.stats_ms(fleet.start_s[-max(1, len(fleet.start_s) // 10):]),
                  "pause_after_start": bench.stats_ms(fleet.start_pause_s)},
        "rotation": {"rounds": rounds, "wall_s": rotation_s, "turns": len(fleet.paused_cpu_ns)},
        "paused_cpu_ns": {"stretches": len(fleet.paused_cpu_ns), "max": max(fleet.paused_cpu_ns, default=0),
                          "sum": sum(fleet.paused_cpu_ns)},
        "memory": mem,
        "teardown": {"wall_s": close_s, "per_sandbox_ms": 1000 * close_s / max(1, len(fleet.boxes)), "left": left},
        "clean": not any(left[k] for k in ("child_processes", "sandbox_cgroups", "mounts_added", "watcher_threads",
                                           "fds_added")),
    }


def use_watcher(name: str) -> str:
    """asyncio's child watcher for this run: 3.11's default (a thread per live subprocess) or a pidfd each."""
    if name == "pidfd":
        assert childwatch.install(), "no pidfd watcher here (kernel < 5.3, or another watcher chosen)"
    elif sys.version_info < (3, 12):
        asyncio.get_event_loop_policy().set_child_watcher(asyncio.ThreadedChildWatcher())
    return type(asyncio.get_event_loop_policy().get_child_watcher()).__name__


def run(bench, args) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 3-4 fds a sandbox: past 1,024 at ~250-330
    store = ImageStore()
    backend = BwrapBackend(layers=store)
    watcher = use_watcher(args.watcher) if args.watcher else type(asyncio.get_event_loop_policy().get_child_watcher()).__name__
    spec = SandboxSpec(image=store.base())
    res = asyncio.run(measure(bench, backend, spec, args, lambda s: print(s, file=sys.stderr, flush=True)))
    res["rlimit_nofile"] = [soft, hard]
    res["child_watcher"] = watcher
    return {"density": res}


def report(res: dict, console: Console) -> None:
    d = res["density"]
    t = Table(title=f"{d['sandboxes']} live sandboxes, {d['running']} running at a time (the rest paused)")
    for col in ("measurement", "p50 ms", "p95 ms", "p95 vs alone"):
        t.add_column(col)
    for name in COMMANDS:
        b, r = d["baseline_exec"][name], d["rotation_exec"][name]
        t.add_row(f"alone: exec {name}", f"{b['p50_ms']:.2f}", f"{b['p95_ms']:.2f}", "1.00x")
        t.add_row(f"among {d['sandboxes']}: exec {name}", f"{r['p50_ms']:.2f}", f"{r['p95_ms']:.2f}",
                  f"{d['exec_ratio'][name]['p95']:.2f}x")
    st = d["start"]
    for name, v in (("pause (rotation)", d["pause"]), ("resume (rotation)", d["resume"]), ("start + first exec", st),
                    ("  first tenth started", st["first_tenth"]), ("  last tenth started", st["last_tenth"]),
                    ("pause after start", st["pause_after_start"])):
        t.add_row(name, f"{v['p50_ms']:.2f}", f"{v['p95_ms']:.2f}", "")
    console.print(t)
    m = d["memory"]
    console.print(f"child watcher: {d['child_watcher']}")
    console.print(f"start: {d['start']['per_s']:.1f} sandboxes/s ({d['start']['wall_s']:.1f} s); "
                  f"CPU while paused: max {d['paused_cpu_ns']['max']} ns over {d['paused_cpu_ns']['stretches']} "
                  f"stretches")
    console.print(f"memory per live paused sandbox (KiB): {m['meminfo_delta_kib_per_sandbox']}; cgroup "
                  f"{m['cgroup_memory_kib']['per_sandbox_mean']:.0f}; furlong process: "
                  f"{m['furlong_process']['rss_kib_per_sandbox']:.0f} KiB, "
                  f"{m['furlong_process']['threads_per_sandbox']:.2f} threads, "
                  f"{m['furlong_process']['fds_per_sandbox']:.2f} fds")
    console.print(f"teardown {d['teardown']['wall_s']:.1f} s; left: {d['teardown']['left']} (clean: {d['clean']})")
    console.print(f"target p95 <= {TARGET_RATIO}x alone: {'met' if d[f'target_p95_ratio<={TARGET_RATIO}'] else 'missed'}"
                  f" ({d['worst_p95_ratio']:.2f}x)")


if __name__ == "__main__":
    import sandbox_bench

    sys.argv.append("--density")
    sandbox_bench.main()
