"""bench/sandbox_density.py end to end on a small fleet, with the bench's own functions: 10 live sandboxes,
paused once started, a busy loop in each, 2 running at a time in a rotation that gives each its turn; a paused
sandbox's processes get no CPU time (a running one's loop does), and the closed fleet leaves no process,
cgroup, mount, watcher thread or fd behind."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from conftest import run

from furlong.sandbox.base import SandboxSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import sandbox_density as density  # noqa: E402

BUSY = "(while :; do :; done) >/dev/null 2>&1 &"
N, RUNNING = 10, 2


async def _busy_fleet(fleet) -> int:
    """A busy loop started in each (paused) sandbox, which is paused again; the first one's CPU time while
    it runs for 0.3 s, which shows that the measure sees a loop when one gets the CPU."""
    for i, box in enumerate(fleet.boxes):
        await box.resume()
        assert (await box.exec(BUSY)).ok
        if i == 0:
            t = density.cpu_ns(box)
            await asyncio.sleep(0.3)
            ran = density.cpu_ns(box) - t
        await box.pause()
        fleet._at_pause[i] = density.cpu_ns(box)
    return ran


def test_a_small_density_run_pauses_rotates_and_leaves_nothing(backend, base_image):
    async def main():
        spec = SandboxSpec(image=base_image)
        await (await backend.create(spec)).close()  # the backend's own fds (a layer's, kept open) are opened
        before = density.host_state()
        fleet = density.Fleet(backend, spec)
        try:
            await fleet.start(N, 4, lambda line: None)
            assert len(fleet.boxes) == N and all(b.paused for b in fleet.boxes)
            ran = await _busy_fleet(fleet)
            await asyncio.sleep(0.3)  # paused, ten loops would take this CPU time
            for _ in range(N // RUNNING):
                await fleet.round(RUNNING)
            assert all(b.paused for b in fleet.boxes)
        finally:
            await fleet.close(4)
        await asyncio.sleep(0.2)
        return fleet, ran, density.leftovers(before)

    fleet, ran, left = run(main())
    assert ran > 20_000_000, ran  # a running loop: tens of ms of 0.3 s, even on a loaded host
    assert len(fleet.paused_cpu_ns) == N and fleet.paused_cpu_ns == [0] * N  # each sandbox had its turn once
    assert len(fleet.exec_s["true"]) == N and len(fleet.resume_s) == N
    assert not any(b.alive for b in fleet.boxes)
    assert left["child_processes"] == [] and left["sandbox_cgroups"] == [] and left["watcher_threads"] == []
    assert left["mounts_added"] == 0 and left["fds_added"] == 0, left
