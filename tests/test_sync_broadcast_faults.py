"""`train.sync.transport=broadcast` losing engines: two real engine server processes behind a router, one
SIGKILLed and later restarted at its address, over real gloo groups (furlong.train.weights.BroadcastLink)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from test_sync_broadcast import GREEDY, PROMPT, TOKEN, _moved, _reference

from furlong.engine.base import SamplingParams
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router, RouterSettings
from furlong.sync.broadcast import GROUP_NAME
from furlong.train.weights import BroadcastLink, start_engines

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LONG = SamplingParams(temperature=1.0, max_new_tokens=120, seed=3)


def _kill(proc: EngineProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.stop()  # reaps it and closes its log


async def _served_by(router: Router, n: int) -> dict[str, float]:
    """`n` greedy requests through the router; its per-instance request counters after them."""
    for _ in range(n):
        await router.generate(PROMPT, GREEDY)
    return router.metrics()


def test_a_killed_engine_is_dropped_from_the_group_and_rejoins_at_the_live_version(tmp_path: Path, tiny_dir: Path):
    weights = {v: _moved(tiny_dir, 2e-2, 10 + v) for v in (1, 2, 3)}
    procs = asyncio.run(start_engines(2, tiny_dir, None, tmp_path, 1, None, 16, engine_token=TOKEN))

    async def main() -> None:
        members = [RemoteEngine(p.url, token=TOKEN) for p in procs]
        # a lost engine is found by its refused connections; slow health answers from the survivor (one
        # thread, loading a broadcast while it generates on 2 busy cores) must not take it out too
        router = Router(members, RouterSettings(health_interval_s=0.2, health_timeout_s=60, readmit_after=0))
        link = await BroadcastLink.open(router, members, cleanup=router.close, timeout_s=60, bucket_bytes=1 << 20,
                                        secret=TOKEN)
        try:
            assert (await link.push(weights[1], 1))["sync_engines_live"] == 2
            # requests in flight on both engines when engine1 dies: the router restarts engine1's elsewhere
            running = [asyncio.ensure_future(router.generate(PROMPT, LONG)) for _ in range(4)]
            await asyncio.sleep(0.3)
            assert router.metrics()["engine1_in_flight"] > 0
            _kill(procs[1])
            began = time.perf_counter()
            logged = await link.push(weights[2], 2)
            assert time.perf_counter() - began < 20  # not the group's 60 s timeout
            assert (logged["sync_regroups"], logged["sync_engines_live"], logged["engine1_live"]) == (1, 1, 0)
            done = await asyncio.gather(*running)
            assert len(done) == 4 and router.metrics()["engine0_retries"] >= 1
            health = await members[0].health()
            assert health["weight_version"] == 2 and health["weight_groups"] == [f"{GROUP_NAME}_1"]
            want = await _reference(tiny_dir, weights[2])
            before = router.metrics()["engine1_requests"]
            got = await router.generate(PROMPT, GREEDY)
            assert (got.output_ids, got.weight_version) == (want.output_ids, 2)

            # restarted at its address: it answers at its start weights (version 0), and is not routed to
            procs[1] = await asyncio.to_thread(EngineProcess, tiny_dir, updates=None, log=tmp_path / "again.log",
                                               threads=1, prefix_cache_mb=16, engine_token=TOKEN,
                                               port=int(procs[1].url.rsplit(":", 1)[1]))
            assert procs[1].url == members[1].url and (await members[1].health())["weight_version"] == 0
            counted = await _served_by(router, 3)
            await asyncio.sleep(1.0)  # several health polls: the router does not put it back by itself
            assert counted["engine1_requests"] == before and not router.is_live(members[1])

            logged = await link.push(weights[3], 3)  # the push boundary: it rejoins, loads v3, then serves
            assert (logged["sync_regroups"], logged["sync_engines_live"], logged["engine1_live"]) == (2, 2, 1)
            want = await _reference(tiny_dir, weights[3])
            for m in members:
                health = await m.health()
                assert health["weight_version"] == 3 and health["weight_groups"] == [f"{GROUP_NAME}_2"]
                got = await m.generate(PROMPT, GREEDY)
                assert (got.output_ids, got.weight_version) == (want.output_ids, 3)
            assert router.metrics()["engine1_readmitted"] == 1

            for p in procs:  # every engine lost: the run stops with a one-line reason, later pushes refuse
                _kill(p)
            with pytest.raises(RuntimeError, match="every engine is lost") as lost:
                await link.push(weights[1], 4)
            assert "\n" not in str(lost.value) and all(m.url in str(lost.value) for m in members)
            with pytest.raises(RuntimeError, match="failed earlier"):
                await link.push(weights[2], 5)
        finally:
            await link.close()

    try:
        asyncio.run(main())
    finally:
        for p in procs:
            p.stop()
