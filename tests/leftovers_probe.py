"""Run as a script by test_leftovers.py: builds an image through buildah, runs a networked sandbox and a
short `furlong eval --agent oracle`, twice (the first warms caches and the store's one id-mapped view),
and prints, as JSON, what the second round left on the host: processes, namespaces, mounts, cgroups.
With `--killed-host` it instead SIGKILLs a `furlong sandbox serve` whose sandboxes run background
commands, starts a new host, and prints what the killed one left, before and once the new one answers.

This process makes itself a child subreaper, so a process any of them leaves behind (a daemon, pasta's
child once pasta died) is reparented here, not to the host's init: it is told apart from other work on a
shared machine, and still counted as alive. The checkout's root is the first argument, a work directory
the second; a CA bundle, third and optional, lends the build and the sandbox the host's CAs and mirrors.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PR_SET_CHILD_SUBREAPER = 36
NS_KINDS = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, with its command line."""
    found, todo = {}, [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                except OSError:
                    continue
                todo.append(child)
    return found


def namespaces(pids) -> set[str]:
    """The namespaces those processes hold (a namespace lives while a process or a mount holds it)."""
    held = set()
    for pid in pids:
        for kind in NS_KINDS:
            try:
                held.add(os.readlink(f"/proc/{pid}/ns/{kind}"))
            except OSError:
                pass
    return held


def mounts() -> set[str]:
    """The host mount table (this process's namespace is the host's): mount point, type and source."""
    rows = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        rows.add(f"{fields[4]} {fields[sep + 1]} {fields[sep + 2]}")
    return rows


def cgroups(ours: set[int]) -> set[str]:
    """The sandbox cgroups (directories below a `furlong` or `furlong-<user>` cgroup) that are empty or
    hold one of `ours`: a leaked one is either, while another run's live ones on a shared machine hold
    its own processes (a walk ignores one removed under it)."""
    found = set()
    for dirpath, _, _ in os.walk("/sys/fs/cgroup"):
        parts = Path(dirpath).parts
        if any(p == "furlong" or p.startswith("furlong-") for p in parts[:-1]):
            try:
                procs = {int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()}
            except OSError:
                continue
            if not procs or procs & ours:
                found.add(dirpath)
    return found


def reap() -> None:
    """Waits for the orphans that ended here (zombies are gone, not left: they are not counted)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def snapshot() -> dict[str, list[str]]:
    reap()
    procs = descendants(os.getpid())
    return {"processes": sorted(f"{pid} {cmd}" for pid, cmd in procs.items()),
            "namespaces": sorted(namespaces(procs) - namespaces([os.getpid()])),
            "mounts": sorted(mounts()), "cgroups": sorted(cgroups(set(procs)))}


async def one_round(root: Path, work: Path, nonce: str, ca_bundle: Path | None) -> None:
    from furlong.sandbox.base import Limits, SandboxSpec
    from furlong.sandbox.runtime.bwrap import BwrapBackend
    from furlong.sandbox.runtime.egress import host_egress
    from furlong.sandbox.images.store import ImageStore
    from furlong.sandbox.network import PUBLIC

    lent = host_egress(True, ca_bundle, "host") if ca_bundle else None  # the host's CAs bound into both
    store = ImageStore(egress=lent)
    backend = BwrapBackend(layers=store, egress=lent)
    env = work / nonce / "environment"
    env.mkdir(parents=True)
    (env / "Dockerfile").write_text(  # a second stage: buildah builds it, its RUNs in a network namespace
        f"FROM furlong/base AS one\nRUN echo {nonce} > /nonce\nFROM furlong/base\nCOPY --from=one /nonce /nonce\n"
        "RUN cat /nonce\nWORKDIR /app\n")
    image = await store.image(env / "Dockerfile", backend)
    box = await backend.create(SandboxSpec(image=image, network=PUBLIC, limits=Limits()))
    try:
        res = await box.exec("cat /nonce; pwd", cwd=image.workdir)
        assert res.ok and res.stdout.split() == [nonce, "/app"], (res.stdout, res.stderr)
    finally:
        await box.close()
    out = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(root / "tasks/make-directory"),
                          "--agent", "oracle", "--per-family", "1", "--out", str(work / f"{nonce}.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["pass_rate"] == 1.0, out.stderr[-2000:]


HOST_TOKEN = "killed-host-probe-token"


def start_host(root: Path, work: Path, name: str) -> tuple[subprocess.Popen, httpx.Client]:
    """A `furlong sandbox serve` (capacity 4) on a free loopback port, once it answers /v1/health."""
    (work / "token").write_text(HOST_TOKEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "sandbox", "serve", "--port", str(port),
                                 "--token-file", str(work / "token"), "--capacity", "4"],
                                cwd=root, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(root)})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {HOST_TOKEN}"},
                          timeout=60)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if client.get("/v1/health").status_code == 200:
                return proc, client
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"host {name} did not answer: {(work / f'{name}.log').read_text()[-2000:]}")


def busy_sandboxes(client: httpx.Client, n: int) -> None:
    """`n` sandboxes, each left running commands in the background (one in a session of its own)."""
    for _ in range(n):
        r = client.post("/v1/sandboxes", json={})
        assert r.status_code == 200, r.text
        sid, token = r.json()["id"], r.json()["token"]
        r = client.post(f"/v1/sandboxes/{sid}/exec", headers={"X-Sandbox-Token": token},
                        json={"cmd": "sleep 1000 & setsid sleep 1001 >/dev/null 2>&1 & echo started"})
        assert r.json()["stdout"] == "started\n", r.text


def furlong_files() -> list[str]:
    """What is in furlong's own places for host files: /run/furlong, the cache's native directory (where
    each launcher mounts its sandbox's writable layer, in its own mount namespace), /tmp's furlong* entries."""
    from furlong.paths import cache_dir

    places = [*Path("/run/furlong").glob("*"), *(cache_dir() / "native").glob("*"),
              *(cache_dir() / "native" / "upper").glob("*"), *Path("/tmp").glob("furlong*")]
    return sorted(str(p) for p in places)


def owned_cgroups(pid: int) -> list[str]:
    """The sandbox cgroup directories whose name says process `pid` made them (furlong.sandbox.runtime.cgroups)."""
    from furlong.sandbox.runtime.cgroups import owner_pid

    return sorted(d for d, _, _ in os.walk("/sys/fs/cgroup") if owner_pid(Path(d).name) == pid)


def killed_host(root: Path, work: Path) -> dict:
    """SIGKILLs a host with 3 busy sandboxes; what it left once its processes are gone, and once a new
    host answers (not counting the new host's own process), against a snapshot taken before it started."""
    def take(spare: int = 0) -> dict[str, list[str]]:
        snap = snapshot()
        snap["processes"] = [p for p in snap["processes"] if not p.startswith(f"{spare} ")]
        return {**snap, "files": furlong_files()}

    warm, client = start_host(root, work, "warm")  # the base image's view, bwrap's copy: made once, kept
    busy_sandboxes(client, 1)
    warm.terminate()
    warm.wait(60)
    before = take()
    host, client = start_host(root, work, "killed")
    busy_sandboxes(client, 3)
    live = {"processes": len(descendants(host.pid)), "cgroups": len(owned_cgroups(host.pid))}
    host.kill()
    host.wait()
    deadline = time.monotonic() + 10
    while descendants(os.getpid()) and time.monotonic() < deadline:  # its sandboxes end with their inits
        reap()
        time.sleep(0.05)
    killed = {k: sorted(set(v) - set(before[k])) for k, v in take().items()}
    new, client = start_host(root, work, "new")
    try:
        left = left_since(before, lambda: take(spare=new.pid))
        dead_cgroups = owned_cgroups(host.pid)
    finally:
        new.terminate()
        new.wait(60)
    return {"before": {k: len(v) for k, v in before.items()}, "live": live, "killed_left": killed, "left": left,
            "dead_host_cgroups": dead_cgroups, "new_host_log": (work / "new.log").read_text()}


def left_since(before: dict[str, list[str]], take, wait_s: float = 15.0) -> dict[str, list[str]]:
    """What `take()` finds that `before` did not, once that is nothing or `wait_s` passed (a killed process
    may take a moment to be gone)."""
    deadline = time.monotonic() + wait_s
    while True:
        after = take()
        left = {k: sorted(set(after[k]) - set(before[k])) for k in after}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root, work = Path(args[0]), Path(args[1])
    ca_bundle = Path(args[2]) if len(args) > 2 else None
    sys.path.insert(0, str(root))  # this checkout's furlong, not an installed one
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    if "--killed-host" in sys.argv:
        print(json.dumps(killed_host(root, work)))
        return
    asyncio.run(one_round(root, work, f"warm{time.time_ns()}", ca_bundle))
    before = snapshot()
    asyncio.run(one_round(root, work, f"check{time.time_ns()}", ca_bundle))
    left = left_since(before, snapshot)
    print(json.dumps({"before": {k: len(v) for k, v in before.items()}, "left": left}))


if __name__ == "__main__":
    main()
