"""The Sandbox contract (furlong/sandbox/base.py, `Sandbox`'s docstring) checked with real commands on every
backend: bwrap, remote (a loopback `furlong sandbox serve` app over bwrap), gVisor, and the seam test's
recording backend (a backend of its own kind wrapping bwrap through the protocol). What a backend declares
in `guarantees` must be what its sandboxes do: a backend without a verifier identity or tamper tracking
says so, and is held to the rest."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import socket
import tarfile
import time
from collections.abc import Callable

import pytest
from conftest import run, spec
from host_support import ThreadHost, remote
from skips import skip
from test_backend_seam import RecordingBackend

from furlong.sandbox.backends import make_backend
from furlong.sandbox.base import (
    BASE_ENV,
    ChangeTracking,
    ImageRef,
    Limits,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    SnapshotRef,
    Snapshotting,
)
from furlong.sandbox.runtime.shell import shell_quote

WORKDIR = "/usr/share"  # the conformance image's WORKDIR: one the base image holds, and not "/"
# forks until the pids limit refuses one (at most 100), says how many it made, and ends them
FORKS = """import os, signal
kids = []
try:
    while len(kids) < 100:
        pid = os.fork()
        if pid == 0:
            signal.pause()
        kids.append(pid)
except OSError:
    pass
print(len(kids))
for k in kids:
    os.kill(k, signal.SIGKILL)
"""
BACKENDS = ("bwrap", "remote", "recording", "gvisor")


@pytest.fixture(scope="module")
def host(backend, store, base_image):
    served = ThreadHost(backend, base_image, store, capacity=8)
    yield served
    served.stop()


@pytest.fixture(params=BACKENDS)
def make(request, backend, store) -> Callable[[], SandboxBackend]:
    """A maker of the backend under test (remote: one per test, its HTTP clients are bound to one loop)."""
    kind = request.param
    if kind == "bwrap":
        return lambda: backend
    if kind == "remote":
        url = request.getfixturevalue("host").url
        return lambda: remote([url])[0]
    if kind == "recording":
        return lambda: RecordingBackend(backend)
    if os.geteuid() != 0:  # it mounts each sandbox's root and runs runsc as root
        skip("root", "sandbox.backend=gvisor runs as root only")
    made = make_backend(kind, layers=store)
    return lambda: made


@pytest.fixture(scope="module")
def image(base_image: ImageRef) -> ImageRef:
    """The base image with a WORKDIR and an ENV of its own, as a Dockerfile would set them."""
    return dataclasses.replace(base_image, workdir=WORKDIR, env=(("FROM_IMAGE", "image"), ("LANG", "C")))


async def _sh(box, cmd: str, **kw) -> str:
    r = await box.exec(cmd, timeout_s=30, **kw)
    assert r.exit_code == 0 and not r.timed_out, (cmd, r)
    return r.stdout


def test_cwd_starts_at_the_images_workdir_and_cd_export_persist(make, image):
    async def go():
        box = await make().create(SandboxSpec(image))
        try:
            assert await _sh(box, "pwd") == f"{WORKDIR}\n"
            await _sh(box, "cd /tmp && export KEPT=yes && LOCAL=no")
            assert await _sh(box, "pwd; echo $KEPT ${LOCAL-unset}") == "/tmp\nyes unset\n"
            assert await _sh(box, "pwd; cd /; export OTHER=1", cwd="/etc") == "/etc\n"
            # a call with cwd leaves the saved state alone; the verifier never sees it
            assert await _sh(box, "pwd; echo ${OTHER-unset}") == "/tmp\nunset\n"
            assert await _sh(box, "pwd; echo ${KEPT-unset}", as_verifier=True) == "/\nunset\n"
            r = await box.exec("cd /var; false")
            assert r.exit_code == 1 and await _sh(box, "pwd") == "/var\n", "state is kept after a failure too"
            r = await box.exec("cd /etc && export ENDED=1 && exit 3")  # a command that ends the shell itself
            assert r.exit_code == 3 and await _sh(box, "pwd; echo $ENDED") == "/etc\n1\n"
            r = await box.exec("set -e; cd /usr; false; cd /")
            assert r.exit_code == 1 and await _sh(box, "pwd") == "/usr\n"
        finally:
            await box.close()

    run(go())


def test_environment_and_results(make, image):
    async def go():
        box = await make().create(SandboxSpec(image))
        try:
            out = await _sh(box, 'echo "$PATH|$HOME|$LANG|$TERM|$FROM_IMAGE"')
            assert out == f"{BASE_ENV['PATH']}|/root|C|dumb|image\n", "BASE_ENV, then the image's ENV"
            out = await _sh(box, 'echo "$FROM_IMAGE|$NEW"', env={"FROM_IMAGE": "call", "NEW": "n"})
            assert out == "call|n\n", "a call's env wins"
            r = await box.exec("echo out; echo err >&2; printf '\\377'; exit 3")
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "out\n\ufffd", "err\n", False)
            t0 = time.monotonic()
            r = await box.exec("sleep 30; echo never", timeout_s=1)
            assert r.timed_out and not r.ok and "never" not in r.stdout and time.monotonic() - t0 < 15
            assert await _sh(box, "echo still") == "still\n", "a timeout kills the command, not the sandbox"
        finally:
            await box.close()

    run(go())


def test_files_in_and_out(make, image):
    async def go():
        box = await make().create(SandboxSpec(image))
        try:
            await box.write_file("/root/bin.dat", b"\x00\xffdata", mode=0o640)
            assert await box.read_file("/root/bin.dat") == b"\x00\xffdata"
            assert await _sh(box, "stat -c %a /root/bin.dat") == "640\n"
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                info = tarfile.TarInfo("sub/f.txt")
                info.size = 2
                tar.addfile(info, io.BytesIO(b"hi"))
            await box.put_tar(buf.getvalue(), "/data")
            assert await _sh(box, "cat /data/sub/f.txt") == "hi"
            with pytest.raises(SandboxError):
                await box.read_file("/no/such/file")
        finally:
            await box.close()

    run(go())


def test_users_and_the_verifier_identity_are_as_declared(make, image):
    async def go():
        backend = make()
        box = await backend.create(SandboxSpec(image))
        user = await backend.create(SandboxSpec(dataclasses.replace(image, user="daemon")))
        try:
            assert await _sh(box, "id -u") == "0\n", "the image's USER: root when it names none"
            assert await _sh(user, "id -u; id -g") == "1\n1\n", "the image's USER daemon"
            assert (await user.exec("touch /etc/x")).exit_code != 0, "a non-root USER cannot write root's files"
            declared = backend.guarantees.verifier_identity
            assert (box.verifier_uid is not None) == declared, "guarantees.verifier_identity says what it has"
            if not declared:
                assert await _sh(box, "id -u", as_verifier=True) == "0\n", "as_verifier runs as the agent"
                return
            await _sh(box, "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt", as_verifier=True)
            # the verifier may see itself as root (bwrap: a user namespace of its own); the agent sees its uid
            assert await _sh(box, "stat -c %u /logs/verifier/reward.txt") == f"{box.verifier_uid}\n"
            await _sh(box, "sleep 60 >/dev/null 2>&1 &", as_verifier=True)
            attack = "echo 0 > /logs/verifier/reward.txt; rm -f /logs/verifier/reward.txt; pkill -9 sleep; true"
            await _sh(box, attack)
            assert await box.read_file("/logs/verifier/reward.txt", as_verifier=True) == b"1\n"
            assert await _sh(box, "pgrep -c sleep || true", as_verifier=True) == "1\n", "the agent cannot signal it"
        finally:
            await box.close()
            await user.close()

    run(go())


def test_limits_hold_and_the_sandbox_keeps_answering(make, image):
    async def go():
        limits = Limits(memory_mb=256, pids=64, disk_mb=64)
        box = await make().create(SandboxSpec(image, limits=limits))
        try:
            r = await box.exec("python3 -c 'b = bytearray(600 << 20); b[::4096] = b\"x\" * len(b[::4096])'")
            assert r.exit_code != 0, "an allocation past memory_mb fails"
            r = await box.exec(f"python3 -c {shell_quote(FORKS)}")
            assert r.exit_code == 0 and 0 < int(r.stdout) < 100, ("pids caps the processes", r)
            r = await box.exec("dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; rm -f /root/fill")
            assert "No space left" in r.stdout, ("disk_mb caps the writes", r)
            assert await _sh(box, "echo alive") == "alive\n"
        finally:
            await box.close()
        short = await make().create(SandboxSpec(image, limits=Limits(lifetime_s=1.0)))
        try:
            await _sh(short, "true")
            await asyncio.sleep(2.0)
            with pytest.raises(SandboxError):
                for _ in range(50):  # the close may land a moment late on a loaded machine
                    await short.exec("true")
                    await asyncio.sleep(0.1)
        finally:
            await short.close()

    run(go())


def test_no_network_by_default(make, image):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]

    async def go():
        box = await make().create(SandboxSpec(image))
        try:
            out = await _sh(box, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
            assert set(out.split()) <= {"lo"}, f"no interface but loopback: {out!r}"
            probe = "timeout 5 bash -c ': > /dev/tcp/{}/{}' 2>/dev/null && echo reached || echo refused"
            assert await _sh(box, probe.format("127.0.0.1", port)) == "refused\n", "the host's loopback is not reached"
            assert await _sh(box, probe.format("1.1.1.1", 53)) == "refused\n"
        finally:
            await box.close()

    try:
        run(go())
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_tamper_tracking_is_as_declared(make, image):
    async def go():
        backend = make()
        box = await backend.create(SandboxSpec(image))
        try:
            await _sh(box, "echo evil > /usr/local/bin/pytest && chmod +x /usr/local/bin/pytest; echo x > /root/mine")
            if not backend.guarantees.tamper_tracking:
                assert not isinstance(box, ChangeTracking) or await box.changes(["/usr"]) is None
                return
            assert isinstance(box, ChangeTracking)
            changed = {c.path: c.kind for c in await box.changes(["/usr", "/root"]) or ()}
            assert changed.get("/usr/local/bin/pytest") == "added" and "/root/mine" in changed, changed
            assert await box.image_has(["/etc/passwd", "/root/mine"]) == frozenset({"/etc/passwd"})
        finally:
            await box.close()

    run(go())


def test_snapshots_or_a_clear_refusal(make, image):
    async def go():
        backend = make()
        box = await backend.create(SandboxSpec(image))
        made = [box]
        try:
            await _sh(box, "cd /root && echo kept > f && export K=v")
            if not isinstance(box, Snapshotting):
                ref = SnapshotRef(("sha256:" + "0" * 64,), image.digest, 0, time.time() + 60)
                with pytest.raises(SandboxError):
                    made.append(await backend.create(SandboxSpec(image), from_snapshot=ref))
                return
            ref = await box.snapshot()
            await _sh(box, "echo later > /root/f")
            made.append(await backend.create(SandboxSpec(image), from_snapshot=ref))
            assert await _sh(made[-1], "pwd; cat f; echo $K") == "/root\nkept\nv\n"
        finally:
            for b in made:
                await b.close()

    run(go())


def test_sandboxes_are_apart_and_a_closed_one_refuses(make, image):
    async def go():
        backend = make()
        a, b = await backend.create(SandboxSpec(image)), await backend.create(spec(image))
        try:
            await _sh(a, "echo mine > /root/only-a; mkdir /tmp/a")
            assert (await _sh(b, "ls /root/only-a /tmp/a 2>&1 || true")).count("No such file") == 2
        finally:
            await a.close()
            await b.close()
        assert not a.alive
        with pytest.raises(SandboxError):
            await a.exec("true")

    run(go())


def test_a_backend_without_integrity_says_so_when_built(store, caplog):
    from furlong.build.sandbox import sandbox_backend
    from furlong.config import SandboxConfig

    if os.geteuid() != 0:
        skip("root", "sandbox.backend=gvisor runs as root only")
    with caplog.at_level("WARNING", logger="furlong.build.sandbox"):
        assert sandbox_backend(SandboxConfig(backend="bwrap"), store).guarantees.integrity
        assert not caplog.records, "bwrap (as root, with subordinate ids) has both"
        made = sandbox_backend(SandboxConfig(backend="gvisor"), store)
    assert made.guarantees.missing() == ("verifier identity",)
    [warning] = caplog.records
    assert "no verifier identity" in warning.message and "integrity_checked: false" in warning.message
