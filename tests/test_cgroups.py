"""A sandbox's cgroups: the agent's nested pids limit leaves the init and the verifier room, an agent
command can be moved into it from inside the sandbox, and cgroups that a killed furlong process left are
swept, and nothing else is. Run through the real launcher and bwrap, as root and as an ordinary user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

import as_user
import skips
from conftest import run, spec
from furlong.sandbox.runtime import cgroups
from furlong.sandbox.base import Limits
from test_rootless import user  # noqa: F401 (the CI user, with a subuid range and delegated cgroups)

REPO = Path(__file__).resolve().parent.parent

AGENT_PIDS = 24

# Inside the sandbox: a child moves itself into the agent's cgroup by writing "0" to the fds the host
# opened (what the init does for each agent command), then forks without bound; its parent stays
# behind, as the verifier does, and forks what it can.
INSIDE = """
import json, os, sys, time
agent, verifier = int(sys.argv[1]), int(sys.argv[2])
def forks(limit):
    n = 0
    while n < limit:
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
    return n
r, w = os.pipe()
if os.fork() == 0:
    for fd in sys.argv[3:]:
        os.write(int(fd), b"0")
    moved = open("/proc/self/cgroup").read()
    os.write(w, json.dumps({"moved": moved, "agent_forks": forks(3 * agent)}).encode() + b"\\n")
    time.sleep(60)
    os._exit(0)
out = json.loads(os.fdopen(r).readline())
out["init"] = open("/proc/self/cgroup").read()
out["verifier_forks"] = forks(2 * verifier)
print(json.dumps(out), flush=True)
time.sleep(60)
"""

# On the host: make the cgroup (or only its v2 layout, under a directory of the v2 hierarchy), start the
# real launcher and bwrap in it, read what happened inside, then remove it all.
HOST = """
import json, os, subprocess, sys, uuid
from pathlib import Path
from furlong.sandbox.runtime import cgroups, native
from furlong.sandbox.base import DEFAULT_HOST_UID, Limits
from furlong.sandbox.runtime.bwrap import bwrap_executable
parent, agent = sys.argv[1], int(sys.argv[2])
name = "t" + uuid.uuid4().hex[:8]
if parent:
    (Path(parent) / name).mkdir()
    cg = cgroups._nest_v2(Path(parent) / name)
else:
    cg = cgroups.create(name, Limits(pids=agent))
    if cg is None:
        print(json.dumps({"cgroup": None})); sys.exit()
fds = [os.open(f, os.O_WRONLY | os.O_CLOEXEC) for f in cg.agent_procs_files]
verifier = cgroups.VERIFIER_PIDS if agent else 0
argv = [str(native.binary("launch")), *(a for f in cg.procs_files for a in ("--cgroup", str(f)))]
argv += ["--uid", str(DEFAULT_HOST_UID)] if os.geteuid() == 0 else []
argv += ["--", bwrap_executable(), "--unshare-all", "--unshare-user", "--uid", "0", "--gid", "0",
         "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--",
         "/usr/bin/python3", "-c", sys.stdin.read(), str(agent), str(verifier), *map(str, fds)]
proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, pass_fds=fds)
out = json.loads(proc.stdout.readline() or "{}")
out["agent_on_host"] = len(cg.agent_pids())
out["total_on_host"] = len(cg.pids())
cg.remove()
proc.wait(10)
out.update(cgroup=[str(d) for d in cg.dirs], v2=cg.v2, left=len(cg.pids()), v2_mount=str(cgroups._v2_mount()),
           dirs_left=[str(d) for d in cg._tree() if d.exists()])
print(json.dumps(out))
"""


def _run(user: str | None, parent: str = "", agent: int = AGENT_PIDS, prefix: tuple[str, ...] = ()) -> dict:
    """HOST as `user` (None: this process's user), started through `prefix` (a command that execs the rest)."""
    argv = [sys.executable, "-c", HOST, parent, str(agent)]
    if user is not None:
        argv = as_user.command(user, argv, {"PYTHONPATH": str(REPO)})
    res = subprocess.run([*prefix, *argv], input=INSIDE, capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check_limits(out: dict) -> None:
    if out.get("cgroup", True) is None:
        pytest.skip("this user may not make cgroups here (see `furlong sandbox delegate`)")
    # 72 asked for; the mover takes one pid of the limit + 1 (the one the init keeps for its waiting agent child)
    assert out["agent_forks"] == AGENT_PIDS, out
    assert out["agent_on_host"] == AGENT_PIDS + 1, out  # counted on the host: all of them moved, and held
    # the init side keeps its headroom: the whole sandbox, the launcher's bwrap and init included, fits
    assert cgroups.VERIFIER_PIDS - 8 <= out["verifier_forks"] <= cgroups.VERIFIER_PIDS, out
    assert out["total_on_host"] <= AGENT_PIDS + cgroups.VERIFIER_PIDS, out
    _check_moved_and_gone(out)


def _check_moved_and_gone(out: dict) -> None:
    # seen from inside the sandbox's cgroup namespace: the agent's cgroup is not below the init's
    moved = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in out["moved"].splitlines()}
    init = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in out["init"].splitlines()}
    key = "" if out["v2"] else "pids"
    assert init[key] == "/" and moved[key] in ("/agent", "/../agent"), out
    assert out["left"] == 0 and out["dirs_left"] == [], out


def test_agent_fork_bomb_leaves_the_verifier_its_pids():
    out = _run(None)
    _check_limits(out)


def test_agent_fork_bomb_leaves_the_verifier_its_pids_as_a_user(user):  # noqa: F811
    _check_limits(_run(user))


@dataclass(frozen=True)
class V2Tree:
    """A directory for a test in the v2 hierarchy: `host` as this process sees it, `seen` as the sandbox's
    side sees the same directory when started through `prefix`."""
    layout: str  # "hybrid" (v2 beside v1, at /sys/fs/cgroup/unified) or "v2-only" (v2 at /sys/fs/cgroup)
    host: Path
    seen: Path
    prefix: tuple[str, ...]


# The layout this host lacks, in a private mount namespace: the v2 hierarchy mounted where the other kind
# of host has it (the same hierarchy, so the directory made on the host is the one the sandbox sees).
LAYOUT_MOUNTS = {
    "v2-only": "mount -t cgroup2 none /sys/fs/cgroup",
    "hybrid": "mount -t tmpfs -o mode=755 furlong-hybrid /sys/fs/cgroup && mkdir /sys/fs/cgroup/unified "
              "&& mount -t cgroup2 none /sys/fs/cgroup/unified",
}


def _v2_tree(layout: str) -> V2Tree:
    if os.geteuid() != 0:
        skips.skip("root", "makes a directory in the v2 hierarchy and mounts it (root)")
    mount = cgroups._v2_mount()
    assert mount is not None, "no cgroup2 hierarchy under /sys/fs/cgroup (cgroups._v2_mount)"
    where = cgroups.ROOT if layout == "v2-only" else cgroups.ROOT / "unified"
    d = mount / f"furlong-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    if mount == where:
        return V2Tree(layout, d, d, ())
    prefix = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
              f'{LAYOUT_MOUNTS[layout]} && exec "$@"', layout)
    return V2Tree(layout, d, where / d.name, prefix)


@pytest.mark.parametrize("layout", ["hybrid", "v2-only"])
def test_v2_layout_lets_the_sandbox_move_an_agent_command(layout: str):
    """v2's rules (the no-internal-processes layout, the open-time namespace check) where a hybrid host and a
    v2-only host mount the v2 tree (the one this host lacks, emulated); furlong finds the tree in both."""
    tree = _v2_tree(layout)
    try:
        out = _run(None, str(tree.seen), agent=0, prefix=tree.prefix)
        assert out["v2_mount"] == str(tree.seen.parent), out
        assert out["agent_on_host"] == 1, out  # the mover, seen in S/agent from the host
        _check_moved_and_gone(out)
    finally:
        tree.host.rmdir()


@pytest.mark.parametrize("layout", ["hybrid", "v2-only"])
def test_v2_layout_in_a_delegated_tree_as_a_user(user, layout: str):  # noqa: F811
    """As a user who owns a delegated v2 directory (as `furlong sandbox delegate` leaves it), started in it."""
    tree = _v2_tree(layout)
    d = tree.host
    try:
        uid = int(subprocess.check_output(["id", "-u", user]))
        for p in (d, d / "cgroup.procs", d / "cgroup.subtree_control", d / "cgroup.threads"):
            os.chown(p, uid, uid)
        (d / "host").mkdir()
        # root moves the user's process into the delegated tree, as a login into a delegated scope would
        join = ("sh", "-c", f'echo $$ > {tree.seen}/host/cgroup.procs && exec "$@"', "join")
        out = _run(user, str(tree.seen), agent=0, prefix=(*tree.prefix, *join))
        assert out["v2_mount"] == str(tree.seen.parent), out
        assert out["agent_on_host"] == 1, out
        _check_moved_and_gone(out)
    finally:
        _rmdir(d / "host")
        d.rmdir()


def _cgroup_fd_holders(pids: set[int], files: list[Path]) -> set[int]:
    """The processes among `pids` that hold an fd open on one of `files` (seen from the host)."""
    targets = {str(f) for f in files}
    holders = set()
    for pid in pids:
        try:
            links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:  # gone meanwhile
            continue
        if links & targets:
            holders.add(pid)
    return holders


def test_agent_cannot_reach_its_cgroup_from_inside_the_sandbox(backend, base_image):
    """Its limits are files the sandbox uid may own (a delegated cgroup): the agent must find no cgroupfs,
    mount none, and inherit no fd the host opened on the agent's cgroup.procs (only the init holds one)."""
    async def go():
        box = await backend.create(spec(base_image, pids=40))
        try:
            r = await box.exec("sleep 30 & ls /sys/fs/cgroup; mkdir -p /tmp/m; "
                               "mount -t cgroup2 none /tmp/m || mount -t cgroup -o pids none /tmp/m || echo refused", 10)
            assert r.stdout.strip().endswith("refused") and "No such file" in r.stderr, r
            cg = box._cgroup
            if cg is not None:
                holders = _cgroup_fd_holders(cg.pids(), cg.agent_procs_files)
                assert len(holders) <= 1 and not holders & cg.agent_pids(), holders
        finally:
            await box.close()

    run(go())


def _rmdir(d) -> None:
    for _ in range(200):  # a killed process leaves its cgroup a moment after wait() returns
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def test_sweep_removes_empty_stale_cgroups_and_spares_busy_and_new_ones():
    cg = cgroups.create(f"sweeptest-{uuid.uuid4().hex[:8]}", Limits())
    if cg is None:
        pytest.skip("this process may not make cgroups here")
    parent = cg.dirs[0] / "sweep"  # not the sandbox's own directory, whose init and agent children are live
    stale, busy, nested = parent / "stale", parent / "busy", parent / "nested"
    for d in (parent, stale, busy, nested, nested / "init", nested / "agent", busy / "agent"):
        d.mkdir()
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        (busy / "agent" / "cgroup.procs").write_text(str(sleeper.pid))
        assert cgroups.sweep(parent, older_than_s=3600) == 0  # just made: maybe another run's, about to enter
        assert stale.is_dir()
        assert cgroups.sweep(parent, older_than_s=0) == 2  # stale, and nested with its empty children
        assert not stale.exists() and not nested.exists()
        assert busy.is_dir() and (busy / "agent").is_dir()  # the kernel keeps a cgroup with processes in it
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        for d in (busy / "agent", busy, stale, parent):
            _rmdir(d)
        cg.remove()
    assert not any(d.exists() for d in cg.dirs)


def test_sweep_kills_and_removes_a_dead_owners_cgroups_and_spares_a_live_or_unknown_owners():
    """A sandbox cgroup's name ends with its owner's pid namespace, pid and start time: once that process is
    dead, a sweep kills what still runs there and removes it, however new; a live owner's, or one another
    pid namespace's process made (which cannot be checked from here), is left alone, processes and all."""
    cg = cgroups.create(f"sweeptest-{uuid.uuid4().hex[:8]}", Limits())
    if cg is None:
        pytest.skip("this process may not make cgroups here")
    assert cgroups.owner_pid(cg.dirs[0].name) == os.getpid()
    gone_owner = subprocess.Popen(["sleep", "60"])
    tag = cgroups.owner_tag(gone_owner.pid)  # read while it lives: a later process with its pid differs
    gone_owner.kill()
    gone_owner.wait()
    ns, pid, start = tag.split(".")
    parent = cg.dirs[0] / "sweep"
    owners = {"dead": tag, "live": cgroups.owner_tag(), "elsewhere": f"{int(ns) + 1}.{pid}.{start}",
              "reused": f"{ns}.{os.getpid()}.{start}"}  # this process's pid, another start time: dead
    dirs = {k: parent / f"box@{v}" for k, v in owners.items()}
    sleepers = {k: subprocess.Popen(["sleep", "120"]) for k in dirs}
    try:
        parent.mkdir()
        for k, d in dirs.items():
            (d / "agent").mkdir(parents=True)
            (d / "agent" / "cgroup.procs").write_text(str(sleepers[k].pid))
        assert cgroups.sweep(parent) == 2
        assert not dirs["dead"].exists() and not dirs["reused"].exists()
        assert sleepers["dead"].wait(5) == -9 and sleepers["reused"].wait(5) == -9
        assert dirs["live"].is_dir() and dirs["elsewhere"].is_dir()
        assert sleepers["live"].poll() is None and sleepers["elsewhere"].poll() is None
    finally:
        for p in sleepers.values():
            p.kill()
            p.wait()
        for leftover in (*(x for d in dirs.values() for x in (d / "agent", d)), parent):
            _rmdir(leftover)
        cg.remove()
    assert not any(d.exists() for d in cg.dirs)
