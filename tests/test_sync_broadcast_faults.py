"""`train.sync.transport=broadcast` losing engines over real gloo groups (furlong.train.weights.BroadcastLink):
two real engine server processes behind a router, one SIGKILLed and later restarted at its address; and two
SGLangStandIn servers (tests/sglang_standin.py, a TEST DOUBLE of SGLang, which cannot run here) refusing; and a
whole `furlong train` run that loses one of its two engine servers mid-RL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_sync_broadcast import GREEDY, PROMPT, TOKEN

from furlong.engine.base import SamplingParams
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.sglang import SGLangEngine
from furlong.engine.sglang_launch import SGLangLaunch, SGLangServer
from furlong.engine.router import Router, RouterSettings
from furlong.sync.broadcast import GROUP_NAME
from furlong.train.weights import BroadcastLink, start_engines
from tests_support import moved_weights, reference_generation

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LONG = SamplingParams(temperature=1.0, max_new_tokens=120, seed=3)


def _kill(proc: EngineProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.stop()  # reaps it and closes its log


def _run_then_stop(main: Callable[[], Awaitable[None]], servers: Sequence[EngineProcess | SGLangServer]) -> None:
    try:
        asyncio.run(main())
    finally:
        for s in servers:
            s.stop()


async def _served_by(router: Router, n: int) -> dict[str, float]:
    """`n` greedy requests through the router; its per-instance request counters after them."""
    for _ in range(n):
        await router.generate(PROMPT, GREEDY)
    return router.metrics()


def test_a_killed_engine_is_dropped_from_the_group_and_rejoins_at_the_live_version(tmp_path: Path, tiny_dir: Path):
    weights = {v: moved_weights(tiny_dir, 2e-2, 10 + v) for v in (1, 2, 3)}
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
            want = await reference_generation(tiny_dir, weights[2], PROMPT, GREEDY)
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
            want = await reference_generation(tiny_dir, weights[3], PROMPT, GREEDY)
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

    _run_then_stop(main, procs)


def _standins(model_dir: Path, tmp_path: Path, n: int) -> list[SGLangServer]:
    """`n` SGLangStandIn servers started at once; if one fails to start, the others are stopped."""
    launches = [SGLangLaunch(model_dir=model_dir, log=tmp_path / f"standin-{i}.log", module="tests.sglang_standin",
                             start_timeout_s=120) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        started = [pool.submit(SGLangServer, launch) for launch in launches]
    servers = [f.result() for f in started if f.exception() is None]
    if len(servers) < n:
        for s in servers:
            s.stop()
        raise next(f.exception() for f in started if f.exception() is not None)
    return servers


async def _refuse(engine: SGLangEngine, route: str) -> None:
    """The stand-in's test switch: its next call of `route` answers HTTP 200 {"success": false}."""
    out = await engine._post_json("/standin/refuse", {"route": route, "times": 1})
    assert out["success"], out


async def _versions(members: list[SGLangEngine]) -> list[str]:
    return [(await m.model_info())["weight_version"] for m in members]


def test_an_sglang_member_that_refuses_is_lost_and_rejoins_at_the_live_version(tmp_path: Path, tiny_dir: Path):
    weights = {v: moved_weights(tiny_dir, 2e-2, 10 + v) for v in range(1, 6)}
    servers = _standins(tiny_dir, tmp_path, 2)

    async def main() -> None:
        members = [SGLangEngine(s.url) for s in servers]

        async def close_clients() -> None:
            await asyncio.gather(*(m.close() for m in members))

        link = await BroadcastLink.open(members[0], members, cleanup=close_clients, timeout_s=60,
                                        bucket_bytes=1 << 20)  # SGLang: no secret, no handshake
        try:
            assert (await link.push(weights[1], 1))["sync_engines_live"] == 2
            await _refuse(members[1], "update_weights_from_distributed")
            logged = await link.push(weights[2], 2)  # regrouped without it; the other holds v2
            assert (logged["sync_regroups"], logged["sync_engines_live"]) == (1, 1)
            assert await _versions(members) == ["2", "1"]  # the refused version was never loaded
            await _refuse(members[1], "init_weights_update_group")
            logged = await link.push(weights[3], 3)  # it answers, so it is asked back; it refuses to join
            assert (logged["sync_regroups"], logged["sync_engines_live"]) == (3, 1)
            logged = await link.push(weights[4], 4)  # asked back again: it joins and loads the live version
            assert (logged["sync_regroups"], logged["sync_engines_live"]) == (4, 2)
            assert await _versions(members) == ["4", "4"]
            first, second = [await m.generate(PROMPT, GREEDY) for m in members]
            assert first.output_ids == second.output_ids and first.weight_version == second.weight_version == 4

            for m in members:  # every engine refuses: the run stops with a one-line reason
                await _refuse(m, "update_weights_from_distributed")
            with pytest.raises(RuntimeError, match="every engine is lost") as lost:
                await link.push(weights[5], 5)
            assert "\n" not in str(lost.value) and all(s.url in str(lost.value) for s in servers)
            assert "refused by the test switch" in str(lost.value)
        finally:
            await link.close()

    _run_then_stop(main, servers)


def _engine_servers(run: Path) -> dict[int, int]:
    """The run's engine server processes, pid by engine index (read off the log each writes its stderr to:
    RUN/engine-server-I.log)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            log = os.readlink(proc / "fd" / "2")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # exited while we looked, or not ours to read
            continue
        if b"furlong.engine.server" in cmdline and log.startswith(f"{run.resolve()}/engine-server-"):
            found[int(log.removesuffix(".log").rsplit("-", 1)[1])] = int(proc.name)
    return found


def test_furlong_train_with_broadcast_survives_an_engine_killed_mid_run(tmp_path: Path):
    from test_train_run import _rl_rows, _train_past_step_0
    from test_train_sync import _processes_mentioning

    run = tmp_path / "bcast-kill"
    proc = _train_past_step_0(run, "broadcast")
    engines = _engine_servers(run)
    assert sorted(engines) == [0, 1], engines
    os.kill(engines[1], signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, (run / "engine-server-0.log").read_text()[-2000:]

    rows = _rl_rows(run)
    assert [(r["step"], r["version"]) for r in rows] == [(0, 1), (1, 2), (2, 3), (3, 4)]  # each push, in order
    assert [(r["sync_engines_live"], r["engine1_live"]) for r in rows] == [(2, 1)] + [(1, 0)] * 3
    assert rows[-1]["sync_regroups"] == 1  # once, when engine1 was lost; later pushes only probe it
    # the survivor served the rest: engine1 took no request after the step it died in
    assert len({r["engine1_requests"] for r in rows[1:]}) == 1
    assert rows[1]["engine0_requests"] < rows[2]["engine0_requests"] < rows[3]["engine0_requests"]
    # engine1's requests in flight when it died (or sent to it before it was found out) ran again on engine0
    assert rows[-1]["engine1_failures"] >= 1 and rows[-1]["engine0_failures"] == 0
    assert rows[-1]["engine0_retries"] == rows[-1]["engine1_failures"] and rows[-1]["engine1_retries"] == 0
    summary = json.loads((run / "summary.json").read_text())
    records = [r for r in map(json.loads, (run / "episodes.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    keys = [(r["step"], r["group"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == summary["rl_episodes"]["started"] == 4 * 4  # none lost, none twice
    assert all(r["status"] != "infra_error" and r["error"] is None for r in records)  # none scored as failed
    assert summary["rl_episodes"]["trained"] == 16 and summary["rl_episodes"]["infra_error"] == 0
    # sync mode: every token of step s came from weights v_s, on whichever engine served it
    assert all(r["version_first"] == r["version_last"] == r["step"] for r in records if r["tokens_response"])
    assert not _processes_mentioning(str(run)), "an engine server outlived the run"
