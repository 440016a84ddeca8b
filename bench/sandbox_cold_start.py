"""Cold start beside bare bwrap, with furlong's start broken into phases (issue 45: at most 1.3x a bare
`bwrap ... /bin/true`, p50, in the same run).

    python bench/sandbox_bench.py --cold-start [--samples 40]   (also: python bench/sandbox_cold_start.py)

One sample of each, alternating, so the machine's drift falls on both alike (a few warm-up samples of each
first, not kept): the baseline, bare bwrap running /bin/true as the sandbox uid on the same image with the
same namespaces and mounts (sandbox_bench.raw_bwrap: no launcher, no init, bwrap's own tmpfs upper); and a
furlong sandbox of the default task image (the base image, the bwrap backend, default limits): create, then
the first exec('true') returns (the figure compared), then close (timed apart). furlong.timing.phases
records the start's phases as the backend marks them: layers (the image's layers resolved and opened),
identity (the image's USER), seccomp (the filter), cgroup (made, limits written), argv (fds and bwrap's
argv), spawn (the launcher started: fork+exec), box (the sandbox object); first_exec is create's return to
the first exec's reply: the launcher joining the cgroup and capping the upper, bwrap's namespaces and mounts,
the init starting, and the command. close: kill, cgroup removal, the wait for bwrap's exit.
A part of sandbox_bench.py, which writes sandbox_cold_start.json with the run's provenance.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.timing import phases

WARMUP = 3
TARGET_RATIO = 1.3
START = ("layers", "identity", "seccomp", "cgroup", "argv", "spawn", "box", "first_exec")
CLOSE = ("close_kill", "close_cgroup", "close_wait")


def _stats(bench, xs: list[float]) -> dict:
    return {"p50_ms": 1000 * bench.pct(xs, 0.5), "p90_ms": 1000 * bench.pct(xs, 0.9),
            "mean_ms": 1000 * sum(xs) / len(xs), "n": len(xs)}


async def _furlong_once(backend, spec) -> tuple[float, float, dict[str, float]]:
    """(create + first exec, close, phases) of one sandbox, in seconds."""
    with phases() as spent:
        t0 = time.perf_counter()
        box = await backend.create(spec)
        t1 = time.perf_counter()
        r = await box.exec("true")
        t2 = time.perf_counter()
        assert r.ok, r
        await box.close()
        t3 = time.perf_counter()
    spent["first_exec"] = t2 - t1
    spent["create_unmarked"] = (t1 - t0) - sum(spent.get(k, 0.0) for k in START[:-1])
    return t2 - t0, t3 - t2, spent


async def _run(bench, args) -> dict:
    store = ImageStore()
    backend = BwrapBackend(layers=store)
    spec = SandboxSpec(image=store.base())
    for _ in range(WARMUP):
        bench.raw_bwrap(backend, spec, 1, ["/bin/true"])
        await _furlong_once(backend, spec)
    raw: list[float] = []
    cold: list[float] = []
    close: list[float] = []
    spans: dict[str, list[float]] = {}
    for _ in range(args.samples):
        raw += bench.raw_bwrap(backend, spec, 1, ["/bin/true"])
        start, end, spent = await _furlong_once(backend, spec)
        cold.append(start)
        close.append(end)
        for k, v in spent.items():
            spans.setdefault(k, []).append(v)
    ratio = bench.pct(cold, 0.5) / bench.pct(raw, 0.5)
    return {
        "what": "furlong sandbox (base image, bwrap backend, default limits): create + first exec('true'), "
                "beside bare bwrap running /bin/true on the same image; samples alternate",
        "samples": args.samples, "warmup": WARMUP,
        "bare_bwrap_true": _stats(bench, raw),
        "cold_sandbox_first_command": _stats(bench, cold),
        "ratio_p50": ratio,
        "ratio_p90": bench.pct(cold, 0.9) / bench.pct(raw, 0.9),
        f"target_ratio_p50<={TARGET_RATIO}": ratio <= TARGET_RATIO,
        "start_phases": {k: _stats(bench, spans[k]) for k in (*START, "create_unmarked")},
        "close": _stats(bench, close),
        "close_phases": {k: _stats(bench, spans[k]) for k in CLOSE},
    }


def run(bench, args) -> dict:
    import asyncio

    return asyncio.run(_run(bench, args))


def report(res: dict, console: Console) -> None:
    t = Table(title=f"cold start beside bare bwrap ({res['samples']} samples each, alternating)")
    for col in ("measurement", "p50 ms", "p90 ms", "mean ms"):
        t.add_column(col)
    rows = [("bare bwrap /bin/true (baseline)", res["bare_bwrap_true"]),
            ("furlong: create + first exec", res["cold_sandbox_first_command"]),
            *((f"  phase: {k}", v) for k, v in res["start_phases"].items()),
            ("furlong: close", res["close"]), *((f"  phase: {k}", v) for k, v in res["close_phases"].items())]
    for name, s in rows:
        t.add_row(name, f"{s['p50_ms']:.2f}", f"{s['p90_ms']:.2f}", f"{s['mean_ms']:.2f}")
    console.print(t)
    console.print(f"ratio p50 {res['ratio_p50']:.2f}x, p90 {res['ratio_p90']:.2f}x (target p50 <= {TARGET_RATIO}x: "
                  f"{'met' if res[f'target_ratio_p50<={TARGET_RATIO}'] else 'missed'})")


if __name__ == "__main__":
    import sandbox_bench

    sys.argv.append("--cold-start")
    sandbox_bench.main()
