"""`python bench/sandbox_bench.py --remote`: the same sandboxes through a sandbox host's API beside the
local backend, in one run: start-up, command overhead, the concurrency sweep (capacity: the largest load
whose p95 stays within 1.5x of one sandbox's), and the e2b SDK's create -> first command through the host
beside furlong's own client doing the same.

The host is `furlong sandbox serve` on 127.0.0.1 in a process of its own, over the same image store.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from furlong.sandbox.base import Limits, SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.remote.hosts import Hosts
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.remote.backend import RemoteBackend

ROOT = Path(__file__).resolve().parent.parent
LOADS = [1, 2, 4, 8]


class Host:
    """`furlong sandbox serve --e2b-key-file` on a free loopback port; stopped with SIGTERM."""

    def __init__(self, work: Path, capacity: int):
        self.token, self.e2b_key = secrets.token_urlsafe(24), "e2b_" + secrets.token_hex(16)
        (work / "tok").write_text(self.token)
        (work / "key").write_text(self.e2b_key)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        port = sock.getsockname()[1]
        sock.close()
        self.proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "sandbox", "serve", "--port", str(port),
                                      "--token-file", str(work / "tok"), "--capacity", str(capacity),
                                      "--e2b-key-file", str(work / "key")],
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError("the sandbox host did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def e2b_first_command(host: Host, n: int) -> list[float]:
    """The real e2b SDK: Sandbox.create, then commands.run('true'), through the furlong host."""
    import e2b

    os.environ["E2B_API_URL"] = os.environ["E2B_SANDBOX_URL"] = host.url
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sbx = e2b.Sandbox.create("base", api_key=host.e2b_key, timeout=120)
        sbx.commands.run("true")
        times.append(time.perf_counter() - t)
        sbx.kill()
    return times


async def measure(bench, local, remote, spec, samples: int, rounds: int) -> dict:
    """Each measurement local, then through the host, back to back."""
    out: dict = {}
    for name, backend in (("local", local), ("remote", remote)):
        cold = await bench.cold_start(backend, spec, samples)
        inside, host = await bench.command_overhead(backend, spec, 5 * samples)
        lat = await bench.sweep(backend, spec, LOADS, rounds)
        single = bench.pct(lat[1], 0.95)
        rows = [{"sandboxes": k, **bench.stats_ms(lat[k]), "p95_slowdown": bench.pct(lat[k], 0.95) / single}
                for k in LOADS]
        out[name] = {"cold_sandbox_first_command": bench.stats_ms(cold),
                     "exec_true": bench.stats_ms(inside), "host_subprocess_bash_true": bench.stats_ms(host),
                     "sweep": rows,
                     "capacity_p95_le_1.5x": max([r["sandboxes"] for r in rows if r["p95_slowdown"] <= 1.5], default=0)}
    return out


def run(bench, args) -> dict:
    store = ImageStore()
    local = BwrapBackend(layers=store)
    spec = SandboxSpec(image=store.base(), limits=Limits(cpus=1.0))
    with tempfile.TemporaryDirectory() as work:
        host = Host(Path(work), capacity=max(LOADS) + 2)
        try:
            remote = RemoteBackend(Hosts([host.url], host.token))
            res = asyncio.run(measure(bench, local, remote, spec, args.samples, args.rounds))
            furlong_client = asyncio.run(bench.cold_start(remote, spec, args.samples))
            sdk = e2b_first_command(host, args.samples)
        finally:
            host.stop()
    p50 = lambda key, side: res[side][key]["p50_ms"]  # noqa: E731
    res["ratios_remote_vs_local_p50"] = {
        "cold_sandbox_first_command": p50("cold_sandbox_first_command", "remote") / p50("cold_sandbox_first_command", "local"),
        "exec_true": p50("exec_true", "remote") / p50("exec_true", "local")}
    res["e2b_sdk"] = {"create_then_first_command": bench.stats_ms(sdk),
                      "furlong_client_create_then_first_command": bench.stats_ms(furlong_client),
                      "sdk_vs_furlong_client_p50": bench.pct(sdk, 0.5) / bench.pct(furlong_client, 0.5)}
    res["machine"] = {"cores": os.cpu_count(), "load_avg_at_end": os.getloadavg()}
    return res


def report(res: dict, console: Console) -> None:
    t = Table(title="local backend vs through a sandbox host (this run)")
    for col in ("measurement", "local p50 ms", "remote p50 ms", "remote p95 ms", "remote / local"):
        t.add_column(col)
    for key, what in (("cold_sandbox_first_command", "new sandbox + first command"), ("exec_true", "exec('true')")):
        lo, re = res["local"][key], res["remote"][key]
        t.add_row(what, f"{lo['p50_ms']:.2f}", f"{re['p50_ms']:.2f}", f"{re['p95_ms']:.2f}",
                  f"{res['ratios_remote_vs_local_p50'][key]:.2f}×")
    console.print(t)
    w = Table(title="concurrency sweep (p95 slowdown vs one sandbox)")
    for col in ("sandboxes", "local p95 ms", "local slowdown", "remote p95 ms", "remote slowdown"):
        w.add_column(col)
    for lo, re in zip(res["local"]["sweep"], res["remote"]["sweep"]):
        w.add_row(str(lo["sandboxes"]), f"{lo['p95_ms']:.1f}", f"{lo['p95_slowdown']:.2f}×", f"{re['p95_ms']:.1f}",
                  f"{re['p95_slowdown']:.2f}×")
    console.print(w)
    console.print(f"capacity (p95 ≤ 1.5× single): local {res['local']['capacity_p95_le_1.5x']}, "
                  f"remote {res['remote']['capacity_p95_le_1.5x']} on {res['machine']['cores']} cores")
    e = res["e2b_sdk"]
    console.print(f"e2b SDK create → first command: p50 {e['create_then_first_command']['p50_ms']:.1f} ms; furlong's "
                  f"client: {e['furlong_client_create_then_first_command']['p50_ms']:.1f} ms "
                  f"({e['sdk_vs_furlong_client_p50']:.2f}×)")
