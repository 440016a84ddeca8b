"""furlong.sandbox.runtime.childwatch: on Python 3.11 the bwrap backend has asyncio learn of its children's
exits by pidfds, as 3.12 does, so a sandbox start waits for no watcher thread; every loop's subprocesses still
get their exit status."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
from conftest import run

from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime import childwatch
from furlong.sandbox.runtime.bwrap import BwrapBackend


async def _exit_code(code: int) -> int:
    proc = await asyncio.create_subprocess_exec("sh", "-c", f"sleep 0.05; exit {code}")
    return await proc.wait()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.11's policy: 3.12 has this watcher by default")
def test_a_bwrap_backend_installs_it_over_the_default(store):
    policy = asyncio.get_event_loop_policy()
    policy.set_child_watcher(asyncio.ThreadedChildWatcher())  # 3.11's default
    BwrapBackend(layers=store)
    assert isinstance(policy.get_child_watcher(), childwatch.RunningLoopPidfdWatcher)


def test_a_sandbox_start_adds_no_thread_and_its_end_is_seen(backend, base_image):
    assert childwatch.install()

    async def main():
        spec = SandboxSpec(image=base_image)
        box = await backend.create(spec)
        try:
            # 3.11's default watcher starts a thread per subprocess, named asyncio-waitpid-N (counting every thread
            # instead failed in the full suite: other tests' daemon threads come and go meanwhile)
            assert not [t.name for t in threading.enumerate() if t.name.startswith("asyncio-waitpid-")]
            assert (await box.exec("true")).ok
        finally:
            await box.close()
        return box._proc.returncode

    assert run(main()) is not None  # the launcher's exit reached its Process through the watcher


def test_each_loops_subprocesses_get_their_exit_status(backend):
    assert childwatch.install()
    assert run(_exit_code(3)) == 3
    assert run(_exit_code(0)) == 0  # a second loop (asyncio.run's): the watcher is not tied to the first

    async def several():
        return await asyncio.gather(*(_exit_code(c) for c in (1, 2, 4)))

    assert run(several()) == [1, 2, 4]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.11's policy: 3.12 has this watcher by default")
def test_a_watcher_someone_chose_is_left_alone():
    policy = asyncio.get_event_loop_policy()
    kept = policy.get_child_watcher()
    try:
        mine = asyncio.SafeChildWatcher()
        policy.set_child_watcher(mine)
        assert not childwatch.install() and policy.get_child_watcher() is mine
    finally:
        policy.set_child_watcher(kept)


def test_a_bwrap_backend_raises_the_soft_fd_limit_toward_the_hard_one(store):
    """A live sandbox holds 3-4 fds in furlong's process: at a soft limit of 1,024 a run stops near 250."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(hard, 1024) if hard != resource.RLIM_INFINITY else 1024
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        BwrapBackend(layers=store)
        want = 1 << 16 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (max(low, want), hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
