"""Attacks on the sandbox from inside it, each with the verdict read on the host.

A policy learns whatever raises its reward, so every way an agent command could stop, trace, impersonate
or starve the sandbox's init is tried here as an agent would: a shell command in a real sandbox.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import init_host_uid, run, spec
from skips import skip
from furlong.sandbox.runtime import protocol as proto
from furlong.sandbox.backends import make_backend
from furlong.sandbox.runtime import headroom
from furlong.sandbox.base import ImageRef, Limits, SandboxDied, SandboxError
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.headroom import agent_caps

ALIVE = "echo alive"


@pytest.fixture(params=["bwrap", "gvisor"])
def kernel(request, backend, store):
    """The backends these attacks run on: bwrap, and gVisor (root only: it mounts and runs runsc as root)."""
    if request.param == "bwrap":
        return backend
    if os.geteuid() != 0:
        skip("root", "sandbox.backend=gvisor runs as root only")
    if gap := GVISOR_GAPS.get(request.node.originalname):  # strict: a gap that closes fails, so the docs follow
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"runsc 0.0~20221219: {gap}"))
    return make_backend("gvisor", layers=store)


# What the gvisor backend does not stop (docs/sandboxes.md, "The gvisor backend"): each xfails there, strictly
GVISOR_GAPS = {
    "test_the_init_cannot_be_traced_read_or_hijacked_through_proc": "/proc/1/environ and /proc/1/fd/0 and 1 "
    "(the init's channel to the host) open for the agent",
    "test_disk_tmpfs_and_memory_fills_leave_the_init_standing": "a full writable layer plus a memory fill passes "
    "the host cgroup's limit, whose OOM killer ends the whole sandbox",
    "test_fork_bomb_then_memory_then_disk_one_after_the_other": "a fork bomb's ptrace stubs reach the host's pids "
    "limit, and the sentry ends",
}


async def _survives(box, attack: str, timeout_s: float = 20.0, disk_full: bool = False):
    """Runs the attack, then checks the init still answers every kind of request."""
    result = await box.exec(attack, timeout_s=timeout_s)
    assert (await box.exec(ALIVE)).stdout == "alive\n", f"init did not survive {attack!r}: {result}"
    if not disk_full:
        await box.write_file("/tmp/probe", b"x")
        assert await box.read_file("/tmp/probe") == b"x"
    assert await box.ping() == 1  # still the namespace's pid 1
    return result


@pytest.mark.parametrize("attack", [
    "kill -9 -1",
    "kill -KILL 1; kill -STOP 1; kill -TERM 1; kill -INT 1; kill -HUP 1; kill -USR1 1; kill -SEGV 1",
    "for s in $(seq 1 31); do kill -$s 1 2>/dev/null; done; kill -9 -1",
    "kill -CHLD 1; kill -CHLD 1",  # spurious child signals: the init must not mistake them for exits
])
def test_signals_cannot_stop_the_init(kernel, base_image, attack):
    async def go():
        box = await kernel.create(spec(base_image))
        try:
            await box.exec("sleep 100 >/dev/null 2>&1 &")
            await _survives(box, attack)
        finally:
            await box.close()

    run(go())


def test_the_command_after_a_kill_of_everything_runs(kernel, base_image):
    """`kill -9 -1` and `kill -STOP -1` reach the child the init keeps ready for the next agent command too, and
    the signal may still be pending when that command arrives: it must run all the same, at once."""
    async def go():
        box = await kernel.create(spec(base_image))
        try:
            for attack in ("kill -9 -1", "kill -STOP -1") * 10:
                await box.exec(attack, timeout_s=20)
                r = await box.exec(ALIVE, timeout_s=10)
                assert (r.stdout, r.timed_out) == ("alive\n", False), (attack, r)
        finally:
            await box.close()

    run(go())


PTRACE = ("python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
          "r = libc.ptrace(16, 1, 0, 0); print('ptrace', r, os.strerror(ctypes.get_errno()))\"")


def test_the_init_cannot_be_traced_read_or_hijacked_through_proc(kernel, base_image):
    async def go():
        box = await kernel.create(spec(base_image))
        try:
            r = await box.exec(PTRACE)
            assert r.stdout.strip() == "ptrace -1 Operation not permitted", r
            for probe in ("head -c1 /proc/1/mem", "head -c1 /proc/1/environ", "head -c1 /proc/1/fd/0",
                          "ls /proc/1/root/", "readlink /proc/1/fd/0", "readlink /proc/1/exe"):
                r = await box.exec(probe)
                assert r.exit_code != 0 and ("Permission denied" in r.stderr or r.stdout == ""), (probe, r)
            r = await box.exec("echo forged > /proc/1/fd/1")
            assert r.exit_code != 0 and "Permission denied" in r.stderr
            # The agent's own fds: only its stdio (and what ls opens to list them); no host layer fds.
            r = await box.exec("ls /proc/self/fd | wc -l")
            assert int(r.stdout) <= 4, r
            await _survives(box, "true")
        finally:
            await box.close()

    run(go())


def test_forged_replies_are_refused_and_end_the_sandbox(backend, base_image):
    """An agent cannot reach the reply channel (above); if anything ever did, a reply without the secret,
    with an unknown id, or with a body that does not parse is a dead sandbox, never a result."""
    async def go():
        for forged in (
            proto.frame(b"\0" * proto.SECRET_LEN + b"\1" * proto.ID_LEN + b"\0" + b"1.0\n"),  # no secret
            proto.frame(b"\0" * 7),  # shorter than a header
            b"\xff\xff\xff\x7f",  # a frame length far past any reply
        ):
            box = await backend.create(spec(base_image))
            try:
                await box.exec("true")
                reading = asyncio.create_task(box.read_file("/logs/verifier/reward.txt"))
                box._proc.stdout.feed_data(forged)  # as if it had come from inside the sandbox
                with pytest.raises(SandboxDied, match="protocol"):
                    await reading
                with pytest.raises(SandboxDied):
                    await box.exec("true")
            finally:
                await box.close()

    run(go())


async def _start(box, stream: bool) -> tuple[asyncio.Task, bytes]:
    """A command that runs on, writing nothing, until the sandbox ends; and its request id."""
    before = set(box._pending)
    task = asyncio.create_task(box.exec("sleep 60", on_output=(lambda *_: None) if stream else None))
    while not set(box._pending) - before:
        await asyncio.sleep(0.01)
    return task, (set(box._pending) - before).pop()


async def _finished_stream(box) -> bytes:
    """The request id of a streaming exec that has had its final reply."""
    seen: list[bytes] = []
    await box.exec("echo done", on_output=lambda *_: seen.extend(box._listeners))
    return seen[0]


@pytest.mark.parametrize(("case", "why"), [
    ("unknown id", "no running streaming exec"), ("not streaming", "no running streaming exec"),
    ("after its reply", "no running streaming exec"), ("stream 2", "stream 2"), ("no data", "chunk of 1 bytes"),
    ("over the cap", "past the output cap"),
])
def test_forged_or_oversized_chunks_end_the_sandbox(backend, base_image, case, why):
    """A chunk must name a streaming exec still running and stdout or stderr, carry data, and keep its stream
    within the output cap the final reply has: else it is a protocol violation, like a forged reply. The
    forgeries carry the sandbox's secret, as if the init itself had sent them."""
    async def go():
        box = await backend.create(spec(base_image))
        try:
            ended = await _finished_stream(box)
            running = [await _start(box, stream=True), await _start(box, stream=False)]
            rid = {"unknown id": proto.new_id(), "not streaming": running[1][1], "after its reply": ended}.get(
                case, running[0][1])
            body = {"stream 2": b"\2x", "no data": b"\0", "over the cap": b"\1" + b"x" * (box._cap + 1)}.get(
                case, b"\0forged")
            box._proc.stdout.feed_data(proto.frame(box._secret + rid + bytes([proto.CHUNK]) + body))
            for task, _ in running:
                with pytest.raises(SandboxDied, match=f"protocol: .*{why}"):
                    await task
            with pytest.raises(SandboxDied):
                await box.exec("true")
        finally:
            await box.close()

    run(go())


def test_reply_bodies_are_validated_field_by_field():
    secret = proto.new_secret()
    rid = proto.new_id()
    good = secret + rid + b"\0" + b"body"
    assert proto.parse_reply(good, secret).body == b"body"
    assert proto.parse_reply(secret + rid + b"\2\1err", secret) == proto.Chunk(rid, "stderr", b"err")
    for bad in (proto.new_secret() + rid + b"\0", secret + rid + b"\2", secret + rid + b"\2\0",
                secret + rid + b"\2\2x", secret + rid + b"\3x", secret[:10]):
        with pytest.raises(proto.ProtocolError):
            proto.parse_reply(bad, secret)
    fixed = (0).to_bytes(4, "little") + b"\0\0" + (5).to_bytes(8, "little")
    ok = fixed + (2).to_bytes(4, "little") + b"hi" + (0).to_bytes(4, "little")
    assert proto.parse_exec(ok, cap=16).stdout == b"hi"
    for bad in (ok[:-1], ok + b"x", b"\0" * 3, (999).to_bytes(4, "little") + ok[4:],
                fixed + (1 << 20).to_bytes(4, "little") + b"x" * 10):
        with pytest.raises(proto.ProtocolError):
            proto.parse_exec(bad, cap=16)


def test_disk_tmpfs_and_memory_fills_leave_the_init_standing(kernel, base_image):
    async def go():
        box = await kernel.create(spec(base_image, memory_mb=512, disk_mb=256))
        try:
            r = await _survives(box, "dd if=/dev/zero of=/big bs=1M count=2048", disk_full=True)
            assert "No space left" in r.stderr
            r = await _survives(box, "dd if=/dev/zero of=/tmp/big bs=1M count=2048", disk_full=True)
            assert "No space left" in r.stderr
            r = await _survives(box, "dd if=/dev/zero of=/dev/shm/big bs=1M count=2048", disk_full=True)
            assert "No space left" in r.stderr
            r = await _survives(box, "touch /dev/newfile", disk_full=True)
            assert "Read-only" in r.stderr
            # with the disks full, memory runs out too: the OOM killer must take the agent, not the init
            r = await _survives(box, "python3 -c \"xs = []\nwhile True: xs.append(bytearray(8 << 20))\"",
                                disk_full=True)
            assert r.exit_code == 137
            r = await _survives(box, "python3 -c \"x = bytearray(30 << 30)\"", disk_full=True)
            assert r.exit_code != 0
            # disk_mb 256, less what /dev/shm and the log mounts take of memory_mb's budget for files (headroom)
            assert (await box.exec("df -m / | tail -1")).stdout.split()[1] == "240"
        finally:
            await box.close()

    run(go())


def test_fork_bomb_then_memory_then_disk_one_after_the_other(kernel, base_image):
    """The observed failure: these in sequence once killed the daemon in about 1 run of 5. A fork bomb
    that outlives its command can hold every pid, so later commands may fail to start (SandboxError,
    which the episode runner scores as the agent's doing); the init itself must live on."""
    async def attempt(box, cmd: str) -> None:
        try:
            await box.exec(cmd, timeout_s=20)
        except SandboxDied:
            raise
        except SandboxError as exc:
            assert "fork" in str(exc)

    async def go():
        for _ in range(3):
            box = await kernel.create(spec(base_image, memory_mb=512, pids=128, disk_mb=256))
            try:
                await attempt(box, "bomb() { bomb | bomb & }; bomb; sleep 2")
                await attempt(box, "python3 -c \"x = bytearray(30 << 30)\"; "
                                   "python3 -c \"xs = []\nwhile True: xs.append(bytearray(8 << 20))\"")
                await attempt(box, "dd if=/dev/zero of=/tmp/fill bs=1M count=2048")
                assert await box.ping() == 1
                assert box.alive
            finally:
                await box.close()

    run(go())


def test_output_flood_is_capped_and_background_floods_never_block(kernel, base_image):
    async def go():
        box = await kernel.create(spec(base_image))
        try:
            r = await box.exec("head -c 200000000 /dev/zero | tr '\\0' a", timeout_s=60)
            assert r.truncated and len(r.stdout) < (2 << 20)
            # background writers keep the command's pipes: the init drains them forever, never blocking
            # the command ends a second after the floods began (a fixed 0.2 s from the start caught none of
            # their output once on a loaded host)
            r = await box.exec("(touch /tmp/flooding; exec yes flood) & yes flood >&2 & "
                               "until [ -e /tmp/flooding ]; do sleep 0.05; done; sleep 1", timeout_s=10)
            assert r.exit_code == 0 and not r.timed_out and r.truncated
            for _ in range(3):
                assert (await box.exec("echo quiet")).stdout == "quiet\n"
            r = await box.exec("cat /dev/urandom", timeout_s=1)
            assert r.timed_out and r.truncated
            await _survives(box, "true")
        finally:
            await box.close()

    run(go())


def test_setuid_binaries_give_no_host_privilege(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec("cp /bin/bash /tmp/sbash && chmod 4755 /tmp/sbash && "
                               "(/tmp/sbash -p -c 'sleep 30' &) ; sleep 0.3; echo ok")
            assert r.stdout.strip() == "ok"
            if box._cgroup is not None:
                uids = {_host_uid(pid) for pid in box._cgroup.pids()} - {None}
                # the agent's processes are the sandbox uid; the init (many uids) its INIT_UID, never root
                assert uids - {init_host_uid(backend)} == {backend.host_uid} and 0 not in uids
        finally:
            await box.close()

    run(go())


def _host_uid(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return max(int(x) for x in next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1:])


def test_ten_thousand_files_in_and_out(kernel, base_image, tmp_path: Path):
    src = tmp_path / "many"
    src.mkdir()
    for i in range(10_000):
        (src / f"f{i}").write_text(str(i))

    async def go():
        box = await kernel.create(spec(base_image))
        try:
            await box.put_dir(src, "/data")
            r = await box.exec("ls /data | wc -l; cat /data/f9999; echo; mkdir /made && cd /made && "
                               "for i in $(seq 1 10000); do : > f$i; done; ls | wc -l", timeout_s=60)
            assert r.stdout.split() == ["10000", "9999", "10000"]
        finally:
            await box.close()

    run(go())


def test_a_hostile_image_interpreter_never_runs_as_the_init(kernel, base_image, store):
    """The init is furlong's own static binary: an image whose python3 is booby-trapped cannot touch it."""
    tmp_path = Path(tempfile.mkdtemp(dir=store.root))  # layers are found inside an image store
    layer = tmp_path / "layer"
    (layer / "usr/bin").mkdir(parents=True)
    trap = layer / "usr/bin/python3"
    trap.write_text("#!/bin/sh\necho trapped > /trap-ran\nexit 0\n")
    trap.chmod(0o755)
    for p in [tmp_path, layer, layer / "usr", layer / "usr/bin"]:
        p.chmod(0o755)
    image = ImageRef(digest="hostile", layers=(store.layer("hostile", layer), *base_image.layers))

    async def go():
        box = await kernel.create(spec(image))
        try:
            r = await box.exec("echo hi; test -e /trap-ran && echo TRAPPED; head -c 40 /usr/bin/python3")
            assert r.stdout.startswith("hi\n") and "TRAPPED" not in r.stdout and "trapped" in r.stdout
        finally:
            await box.close()

    try:
        run(go())
        assert not (layer / "trap-ran").exists()
    finally:
        shutil.rmtree(tmp_path)


def test_kernel_settings_in_proc_sys_and_sys_stay_untouched(kernel, base_image):
    watched = ["/proc/sys/kernel/hostname", "/proc/sys/vm/overcommit_memory", "/proc/sys/kernel/pid_max",
               "/sys/kernel/mm/transparent_hugepage/enabled"]
    before = {p: Path(p).read_text() for p in watched if Path(p).exists()}

    async def go():
        box = await kernel.create(spec(base_image))
        try:
            writes = "; ".join(f"echo 1 > {p}" for p in watched)
            r = await box.exec(f"{writes}; mount -t sysfs sysfs /sys; mount -t proc proc /mnt; "
                               "echo b > /proc/sysrq-trigger; ls /sys/kernel 2>&1 | head -3")
            assert r.stderr.count("Permission denied") + r.stderr.count("Read-only") + \
                r.stderr.count("No such file") >= len(watched), r.stderr
            await _survives(box, "true")
        finally:
            await box.close()

    run(go())
    assert {p: Path(p).read_text() for p in before} == before


# Writes SysV shared memory segments of 16 MiB, up to argv[2] MiB or until one fails: detached at once
# ("detach", the pin-shm exploit: no process left for the OOM killer) or kept attached ("hold", asleep).
PIN_SHM = """import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes, libc.shmat.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
libc.shmdt.argtypes = [ctypes.c_void_p]
held = 0
while held < int(sys.argv[2]):
    sid = libc.shmget(0, 16 << 20, 0o1600)
    addr = libc.shmat(sid, None, 0) if sid >= 0 else None
    if addr is None or addr == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(addr, 1, 16 << 20)
    if sys.argv[1] == "detach":
        libc.shmdt(addr)
    held += 16
print(held, flush=True)
if sys.argv[1] == "hold":
    time.sleep(3600)
"""
VERIFIER_CHECKER = "python3 -c 'w = bytearray(256 << 20)\nfor i in range(0, len(w), 4096): w[i] = 1\nprint(\"ran\")'"
SEGMENTS = "tail -n +2 /proc/sysvipc/shm | wc -l"  # the IPC namespace's segments, under a header line


def test_sysv_shared_memory_the_agent_leaves_never_starves_the_verifier(backend, base_image):
    """A segment goes once no process has it attached (shm_rmid_forced, set by the launcher in the sandbox's
    own IPC namespace): detached segments pin nothing (pin-shm pinned 2032 of 2048 MiB before), and one a
    background agent process holds is freed when the OOM killer takes that process for the verifier's
    checker. Semaphores and message queues, which no kill frees, are capped."""

    async def go():
        box = await backend.create(spec(base_image, memory_mb=512))
        try:
            pin = f"python3 -c {shlex.quote(PIN_SHM)}"
            r = await box.exec(f"{pin} detach 1024")
            assert r.stdout == "1024\n", r  # twice the memory limit, written and detached: nothing stays
            assert (await box.exec(SEGMENTS, as_verifier=True)).stdout == "0\n"
            r = await box.exec(f"nohup {pin} hold 384 > /tmp/held 2>&1 &\n"
                               "for i in $(seq 100); do [ -s /tmp/held ] && break; sleep 0.2; done; cat /tmp/held")
            assert r.stdout == "384\n", r
            assert (await box.exec(SEGMENTS, as_verifier=True)).stdout == "24\n"
            r = await box.exec(VERIFIER_CHECKER, as_verifier=True, timeout_s=30)
            assert r.ok and r.stdout == "ran\n", r  # the holder was killed, not the checker
            assert (await box.exec(SEGMENTS, as_verifier=True)).stdout == "0\n"
            r = await box.exec("cat /proc/sys/kernel/shm_rmid_forced /proc/sys/kernel/msgmni /proc/sys/kernel/sem; "
                               "echo 0 > /proc/sys/kernel/shm_rmid_forced")
            assert r.stdout.split() == ["1", "16", "32000", "32000", "500", "1024"] and "Read-only" in r.stderr, r
        finally:
            await box.close()

    run(go())


# Every tmpfs the agent can write, filled: the writable layer (through /tmp), /dev/shm and its two in /logs
FILL_ALL = "for d in /tmp /dev/shm /logs/agent /logs/artifacts; do head -c 4G /dev/zero > $d/fill; done; du -cm " + (
    " ".join(f"{d}/fill" for d in ("/tmp", "/dev/shm", "/logs/agent", "/logs/artifacts"))
)


def test_the_agents_full_disks_leave_the_verifier_its_memory_and_its_reward_file(backend, base_image):
    """Their files are memory no OOM kill frees, so their caps sum to memory_mb less the init's headroom and
    the verifier's reserve (furlong.sandbox.runtime.headroom), and /logs/artifacts is a mount of its own. Before, with
    memory_mb 1024, these fills got the verifier's 256 MiB checker OOM-killed, and a full /logs/artifacts,
    then on the verifier's /logs mount, left no room for its reward."""

    async def go():
        box = await backend.create(spec(base_image, memory_mb=1024))
        try:
            r = await box.exec(FILL_ALL, timeout_s=60)
            assert r.stderr.count("No space left") == 4, r
            assert int(r.stdout.split()[-2]) == agent_caps(Limits(memory_mb=1024)).total, r  # du's total
            checker = f"{VERIFIER_CHECKER} > /logs/verifier/out && echo 1 > /logs/verifier/reward.txt"
            r = await box.exec(checker, as_verifier=True, timeout_s=30)
            assert r.ok, r
            assert await box.read_file("/logs/verifier/reward.txt") == b"1\n"
            assert await box.read_file("/logs/verifier/out") == b"ran\n"
        finally:
            await box.close()

    run(go())


@pytest.mark.parametrize("memory_mb", [256, 512, 1024, 2048, 4096, 16384])
@pytest.mark.parametrize("disk_mb", [64, 1024, 10240])
def test_the_agents_tmpfs_caps_fit_inside_memory_less_the_init_and_the_verifier(memory_mb, disk_mb):
    caps = agent_caps(Limits(memory_mb=memory_mb, disk_mb=disk_mb))
    reserve = headroom.verifier_reserve_mb(memory_mb)
    assert caps.total <= memory_mb - headroom.INIT_HEADROOM_MB - reserve, caps
    assert reserve == min(256, memory_mb // 4)
    assert min(caps.shm, caps.agent_logs, caps.artifacts) >= headroom.MIN_MB
    # disk_mb is the layer's cap, and a small sandbox keeps at least a quarter of its memory for files
    assert min(disk_mb, memory_mb // 4) <= caps.layer <= disk_mb, caps
    assert agent_caps(Limits()).layer == Limits().disk_mb  # the defaults' (2048, 1024): the layer is unchanged


@pytest.mark.parametrize("many_uids", [True, False], ids=["many-uids", "one-uid"])
@pytest.mark.parametrize("network", [False, True], ids=["no-network", "network"])
def test_every_sandbox_gets_the_ipc_settings_and_the_agent_cannot_undo_them(store, base_image, many_uids, network):
    """The settings are the sandbox's own IPC namespace's, networked or not (pasta makes an IPC namespace of its
    own, so the launcher makes the sandbox's inside it). With many uids /proc/sys is read-only; with one, the
    namespace's owner is not the agent's, except behind pasta, where the agent, also the verifier's uid, could
    end the verifier's checker directly anyway (docs/sandboxes.md)."""

    async def go():
        box = await BwrapBackend(layers=store, many_uids=many_uids).create(spec(base_image, network=network))
        try:
            r = await box.exec("cat /proc/sys/kernel/shm_rmid_forced /proc/sys/kernel/msgmni; "
                               "echo 0 > /proc/sys/kernel/shm_rmid_forced; cat /proc/sys/kernel/shm_rmid_forced")
            if not many_uids and not network and os.geteuid() != 0:  # the kernel's defaults (bwrap._launcher_ipc)
                assert r.stdout.split()[0] == "0" and int(r.stdout.split()[1]) > 16, r
            else:
                undone = not many_uids and network
                assert r.stdout.split() == ["1", "16", "0" if undone else "1"], r
            assert (box.verifier_uid is not None) == many_uids
        finally:
            await box.close()

    run(go())
