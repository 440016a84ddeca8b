"""Run as a script by test_leftovers.py: builds an image through buildah, runs a networked sandbox and a
short `furlong eval --agent oracle`, twice (the first warms caches and the store's one id-mapped view),
and prints, as JSON, what the second round left on the host: processes, namespaces, mounts, cgroups.

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
import subprocess
import sys
import time
from pathlib import Path

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
    from furlong.sandbox.bwrap import BwrapBackend
    from furlong.sandbox.egress import host_egress
    from furlong.sandbox.images import ImageStore

    lent = host_egress(True, ca_bundle, "host") if ca_bundle else None  # the host's CAs bound into both
    store = ImageStore(egress=lent)
    backend = BwrapBackend(layers=store, egress=lent)
    env = work / nonce / "environment"
    env.mkdir(parents=True)
    (env / "Dockerfile").write_text(  # a second stage: buildah builds it, its RUNs in a network namespace
        f"FROM furlong/base AS one\nRUN echo {nonce} > /nonce\nFROM furlong/base\nCOPY --from=one /nonce /nonce\n"
        "RUN cat /nonce\nWORKDIR /app\n")
    image = await store.image(env / "Dockerfile", backend)
    box = await backend.create(SandboxSpec(image=image, network=True, limits=Limits()))
    try:
        res = await box.exec("cat /nonce; pwd", cwd=image.workdir)
        assert res.ok and res.stdout.split() == [nonce, "/app"], (res.stdout, res.stderr)
    finally:
        await box.close()
    out = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(root / "tasks/make-directory"),
                          "--agent", "oracle", "--per-family", "1", "--out", str(work / f"{nonce}.jsonl")],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0 and json.loads(out.stdout.splitlines()[-1])["pass_rate"] == 1.0, out.stderr[-2000:]


def main() -> None:
    root, work = Path(sys.argv[1]), Path(sys.argv[2])
    ca_bundle = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    sys.path.insert(0, str(root))  # this checkout's furlong, not an installed one
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    asyncio.run(one_round(root, work, f"warm{time.time_ns()}", ca_bundle))
    before = snapshot()
    asyncio.run(one_round(root, work, f"check{time.time_ns()}", ca_bundle))
    deadline = time.monotonic() + 15  # a killed process may take a moment to be gone
    while True:
        after = snapshot()
        left = {k: sorted(set(after[k]) - set(before[k])) for k in after}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print(json.dumps({"before": {k: len(v) for k, v in before.items()}, "left": left}))


if __name__ == "__main__":
    main()
