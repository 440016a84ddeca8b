"""Sandbox snapshot, fork, pause and resume (furlong.sandbox.runtime.snapshots; the bwrap backend), and what an agent
does to break them: reach a sibling's or its parent's files, read a snapshot it was not restored from, find
the store, burn CPU while paused, or outgrow its pids limit after a resume."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import run, spec
from host_support import ThreadHost, remote

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxError, Snapshotting
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.bwrap_box import remove_tree
from furlong.sandbox.runtime.snapshots import CAP_SETTING, SnapshotStore


def _store_root() -> Path:
    """A store the sandbox uid can reach (bwrap resolves overlay sources by path): under furlong's cache."""
    return Path(tempfile.mkdtemp(dir=cache_dir(), prefix="test-snapshots-"))


@pytest.fixture(scope="module")
def snap_backend(store):
    """A backend of its own: its store's cap and TTL are this module's, apart from the session's."""
    backend = BwrapBackend(layers=store)
    root = _store_root()
    backend._snapshots = SnapshotStore(root, ttl_s=600, max_mb=64, group=backend.host_uid)
    yield backend
    remove_tree(root)


async def _agent_cpu_s(box) -> float:
    return await asyncio.to_thread(box._cgroup.cpu_seconds)


def test_fork_gives_independent_copies_of_the_filesystem(snap_backend, base_image):
    async def go():
        parent = await snap_backend.create(spec(base_image))
        forks = []
        try:
            assert isinstance(parent, Snapshotting)
            await parent.exec("mkdir -p /work && cd /work && echo parent > a.txt && rm /etc/hostname && export V=kept")
            await parent.exec("sleep 300 >/dev/null 2>&1 &")
            forks = await parent.fork(2)
            for i, box in enumerate(forks):
                r = await box.exec("pwd; cat a.txt; echo $V; ls /etc/hostname 2>&1 | grep -c 'No such'")
                assert r.stdout.split() == ["/work", "parent", "kept", "1"]
                # processes are not kept: the parent's sleeper is not running in the fork
                assert "sleep 300" not in (await box.exec("ps -eo args")).stdout
                await box.write_file("/work/a.txt", f"fork{i}")
            await parent.write_file("/work/a.txt", "parent-later")
            await parent.exec("echo new > /work/only-parent")
            # a fork sees neither its sibling's writes nor the parent's, made after the fork
            assert [await f.read_file("/work/a.txt") for f in forks] == [b"fork0", b"fork1"]
            assert (await forks[0].exec("ls /work/only-parent")).exit_code != 0
            assert await parent.read_file("/work/a.txt") == b"parent-later"
            # a fork of a fork stacks its writes on its parent's snapshot
            (grand,) = await forks[1].fork(1)
            forks.append(grand)
            assert (await grand.exec("cat /work/a.txt; cat /etc/hostname 2>&1 | grep -c 'No such'")).stdout == (
                "fork11\n"
            )
        finally:
            await asyncio.gather(parent.close(), *(f.close() for f in forks))

    run(go())


def test_snapshots_are_content_addressed_and_refused_over_another_image(snap_backend, base_image):
    async def go():
        a, b = await asyncio.gather(*(snap_backend.create(spec(base_image)) for _ in range(2)))
        try:
            for box in (a, b):
                await box.exec("echo same > /root/f")
            ra, rb = await a.snapshot(), await b.snapshot()
            assert ra.digest == rb.digest and ra.digest.startswith("sha256:")
            await b.exec("echo other > /root/f")
            assert (await b.snapshot()).digest != ra.digest
            other = spec(base_image).image.__class__(**{**spec(base_image).image.__dict__, "digest": "sha256:x"})
            with pytest.raises(SandboxError, match="taken over image"):
                await snap_backend.create(spec(base_image).__class__(image=other), from_snapshot=ra)
        finally:
            await asyncio.gather(a.close(), b.close())

    run(go())


def test_a_snapshot_is_read_only_where_restored_and_out_of_every_sandbox_reach(snap_backend, base_image):
    marker = "furlong-snapshot-marker-7d1c"

    async def go():
        parent, stranger = await asyncio.gather(*(snap_backend.create(spec(base_image)) for _ in range(2)))
        try:
            await parent.exec(f"echo {marker} > /root/secret; echo {marker} > /opt/public; chmod 4755 /opt/public")
            ref = await parent.snapshot()
            (child,) = await parent.fork(1)
            await child.exec("echo changed > /root/secret; rm -f /root/secret")
            # the restored child's writes went to its own layer: the stored snapshot is unchanged
            stored = snap_backend.snapshots._path(ref.digest) / "root" / "secret"
            assert stored.read_text() == f"{marker}\n"
            await child.close()
            if os.geteuid() == 0:  # another host user cannot enter the store (a copied set-id file stays out of reach)
                other = await asyncio.to_thread(
                    subprocess.run,
                    [
                        "setpriv",
                        "--reuid=65534",
                        "--regid=65534",
                        "--clear-groups",
                        "cat",
                        str(stored.parent.parent / "opt/public"),
                    ],
                    capture_output=True,
                    text=True,
                )
                assert other.returncode != 0 and "Permission denied" in other.stderr
            # a sandbox not restored from it finds it nowhere: not by content, not through /proc
            hunt = (
                f"grep -rls {marker} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr 2>/dev/null; "
                f"for p in /proc/[0-9]*; do grep -ls {marker} $p/root/root/secret $p/cwd/* 2>/dev/null; done; "
                f"ls -la {snap_backend.snapshots.dir} 2>&1 | head -1"
            )
            r = await stranger.exec(hunt, timeout_s=60)
            assert marker not in r.stdout and "No such file" in r.stdout
        finally:
            await asyncio.gather(parent.close(), stranger.close())

    run(go())


def test_pause_stops_cpu_and_resume_continues_where_it_was(snap_backend, base_image):
    async def go():
        box = await snap_backend.create(spec(base_image, pids=32))
        try:
            await box.exec("(while :; do echo; done >> /tmp/count) >/dev/null 2>&1 &")
            await asyncio.sleep(0.3)
            await box.pause()
            assert box.paused
            with pytest.raises(SandboxError, match="is paused: resume"):
                await box.exec("true")
            before = await _agent_cpu_s(box)
            await asyncio.sleep(1.0)
            assert await _agent_cpu_s(box) - before < 0.02  # frozen: no CPU at all (ticks of 10 ms)
            await box.resume()
            counts = [int((await box.exec("sleep 0.5; stat -c %s /tmp/count")).stdout) for _ in range(2)]
            assert counts[1] > counts[0] > 0  # the same loop, going on
            # a fork bomb after the pause still meets the pids limit, and the sandbox answers
            await box.exec("bomb() { bomb | bomb & }; bomb", timeout_s=1)
            agent = await asyncio.to_thread(box._cgroup.agent_pids)
            assert len(agent) <= 33
            assert (await box.exec("echo alive", as_verifier=True)).stdout == "alive\n"
        finally:
            t = time.monotonic()
            await box.close()
            assert time.monotonic() - t < 10

    run(go())


def test_a_paused_sandbox_closes_and_the_store_cap_is_enforced(store, base_image):
    backend = BwrapBackend(layers=store)
    root = _store_root()
    backend._snapshots = SnapshotStore(root, ttl_s=600, max_mb=2, group=backend.host_uid)

    async def go():
        box = await backend.create(spec(base_image))
        try:
            await box.exec("head -c 3000000 /dev/urandom > /root/big")
            with pytest.raises(SandboxError, match=f"cap is 2 MB \\({CAP_SETTING}\\)"):
                await box.snapshot()
            assert not box.paused and (await box.exec("echo ok")).stdout == "ok\n"
            assert backend.snapshots.usage() == 0 and not list(backend.snapshots.dir.iterdir())
            await box.pause()
        finally:
            await box.close()
        assert not box.alive

    try:
        run(go())
    finally:
        remove_tree(root)


def test_snapshots_expire_and_go_unless_a_sandbox_stacks_them(tmp_path: Path):
    """The store alone, over a plain directory standing for a writable layer."""
    upper = tmp_path / "upper"
    (upper / "d").mkdir(parents=True)
    (upper / "d" / "f").write_bytes(b"x" * 1000)
    (upper / "link").symlink_to("/etc/passwd")
    snaps = SnapshotStore(tmp_path / "store", ttl_s=0.2, max_mb=1)
    kept, gone = snaps.capture(upper, "img"), None
    assert (snaps._path(kept.digest) / "link").readlink() == Path("/etc/passwd")  # copied, never followed
    snaps.layers(kept, "img")  # leased, as by a sandbox restored from it
    (upper / "d" / "f").write_bytes(b"y")
    gone = snaps.capture(upper, "img")
    assert gone.digest != kept.digest and kept.size_bytes == 1000 + len("/etc/passwd")
    assert snaps.usage() == kept.size_bytes + gone.size_bytes
    time.sleep(0.25)
    with pytest.raises(SandboxError, match=r"expired .* ago \(sandbox.snapshot_ttl_s\)"):
        snaps.layers(gone, "img")
    (upper / "d" / "f").write_bytes(b"z")
    snaps.capture(upper, "img")  # each capture sweeps the expired: the leased one stays
    assert snaps._path(kept.digest).is_dir() and not snaps._path(gone.digest).exists()
    snaps.release(kept)


@pytest.fixture(scope="module")
def snap_host(snap_backend, base_image, store):
    host = ThreadHost(snap_backend, base_image, store=store, capacity=4)
    yield host
    host.stop()


@pytest.fixture(params=["bwrap", "remote"])
def any_backend(request, snap_backend, snap_host):
    """The same protocol calls on the local backend and through a sandbox host (furlong sandbox serve's app)."""
    if request.param == "bwrap":
        return snap_backend
    return remote([snap_host.url])[0]


def test_conformance_snapshot_restore_fork_pause_resume(any_backend, base_image):
    async def go():
        made = [await any_backend.create(spec(base_image))]
        try:
            box = made[0]
            await box.exec("cd /root && echo one > f && export K=v")
            ref = await box.snapshot()
            made.append(await any_backend.create(spec(base_image), from_snapshot=ref))
            made += await box.fork(2)
            await made[2].write_file("/root/f", "two\n")
            outs = [(await b.exec("pwd; cat f; echo $K")).stdout for b in made[1:]]
            assert outs == ["/root\none\nv\n", "/root\ntwo\nv\n", "/root\none\nv\n"]
            await box.pause()
            assert box.paused
            with pytest.raises(SandboxError, match="paused"):
                await box.exec("true")
            await box.resume()
            assert (await box.exec("cat f")).stdout == "one\n" and not box.paused
        finally:
            await asyncio.gather(*(b.close() for b in made))

    run(go())


def test_host_refuses_bad_snapshot_requests_without_side_effects(snap_host):
    c = snap_host.c
    sid, tok = snap_host.create()
    try:
        assert c.post(f"/v1/sandboxes/{sid}/snapshot").status_code == 403  # no sandbox token
        assert httpx.post(f"{snap_host.url}/v1/sandboxes/{sid}/pause", headers=tok).status_code == 401  # no host token
        snap = c.post(f"/v1/sandboxes/{sid}/snapshot", headers=tok).json()
        before = set(snap_host.reg.entries)
        wrong = {"digest": snap["layers"][0], "token": "not-" + snap["token"]}
        r = c.post("/v1/sandboxes", json={"snapshot": wrong})
        assert r.status_code == 403 and "token" in r.text
        r = c.post("/v1/sandboxes", json={"snapshot": {"digest": "sha256:0", "token": snap["token"]}})
        assert r.status_code == 403
        r = c.post(f"/v1/sandboxes/{sid}/fork", json={"n": 4}, headers=tok)  # 1 + 4 > capacity 4
        assert r.status_code == 429
        assert c.post(f"/v1/sandboxes/{sid}/fork", json={"n": 0}, headers=tok).status_code == 422
        assert set(snap_host.reg.entries) == before and snap_host.reg.reserved == 0
        good = c.post("/v1/sandboxes", json={"snapshot": {"digest": snap["layers"][0], "token": snap["token"]}})
        assert good.status_code == 200, good.text
        c.delete(f"/v1/sandboxes/{good.json()['id']}", headers={"X-Sandbox-Token": good.json()["token"]})
    finally:
        c.delete(f"/v1/sandboxes/{sid}", headers=tok)
