"""furlong.engine.router over real engine server processes (uvicorn on loopback, the tiny model): placement,
stickiness, an instance killed (SIGKILL) or hung (SIGSTOP) mid-request, a recovered one put back after
catching up on weights, weight sync fan-out, and a whole `furlong train` run that loses one of its two
engines mid-RL."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from furlong.engine.base import SamplingParams
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import PrefixIndex, Router, RouterSettings, _prefix_hashes
from furlong.model.loading import load_model
from furlong.sync.publish import Publisher
from furlong.sync.transport import DirectoryTransport

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(n: int) -> list[int]:
    return [5, 17, 300 + n, 42, 1000, 7]


def _sampling(seed: int, tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=seed)


def _publish_v0(model_dir: Path, updates: Path) -> Publisher:
    import torch

    publisher = Publisher(DirectoryTransport(updates), engine_dtype=torch.float32)
    publisher.publish(load_model(model_dir).state_dict(), 0)
    return publisher


def _start(model_dir: Path, tmp: Path, n: int = 2) -> list[EngineProcess]:
    with ThreadPoolExecutor(n) as pool:  # each start is mostly importing torch: overlap them
        return list(pool.map(lambda i: EngineProcess(model_dir, updates=str(tmp / "updates"),
                                                     log=tmp / f"engine-{i}.log"), range(n)))


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two engine servers for the whole module (each start is seconds of importing torch), their relay's
    updates directory and its publisher (v0 first). The tests that SIGKILL them run last of the module's."""
    tmp = tmp_path_factory.mktemp("pair")
    publisher = _publish_v0(tiny_dir, tmp / "updates")
    procs = _start(tiny_dir, tmp)
    yield tmp, publisher, procs
    for p in procs:
        p.stop()


@pytest.fixture
def pair(engines, tiny_dir: Path) -> list[EngineProcess]:
    """The module's two servers, running: one an earlier test killed (run alone or out of order) is started
    again on the same updates, so no test depends on which ran before it."""
    procs = engines[2]
    for i, proc in enumerate(procs):
        if proc._proc.poll() is not None:
            _restart(engines, i, tiny_dir)
    return procs


@pytest.fixture
def live_engine(engines, tiny_dir: Path) -> EngineProcess:
    """A running server of the module's pair (the test that kills the last one left): one is started again
    only if none runs."""
    live = [p for p in engines[2] if p._proc.poll() is None]
    return live[-1] if live else _restart(engines, 1, tiny_dir)


def _restart(engines, i: int, tiny_dir: Path) -> EngineProcess:
    tmp, _, procs = engines
    procs[i].stop()
    procs[i] = EngineProcess(tiny_dir, updates=str(tmp / "updates"), log=tmp / f"engine-{i}-again.log")
    return procs[i]


@pytest.fixture
def publishing_pair(engines, pair: list[EngineProcess]) -> tuple[Publisher, list[EngineProcess]]:
    """The module's running pair and the publisher of their relay's updates (at whatever version the
    module's earlier tests left: a test reads it from the router's sync)."""
    return engines[1], pair


def test_prefix_index_finds_the_longest_recorded_conversation_a_prompt_extends():
    index = PrefixIndex(capacity=3)
    index.record([1, 2, 3], owner=0)
    index.record([1, 2, 3, 4, 5], owner=1)
    found = index.lookup(_prefix_hashes([1, 2, 3, 4, 5, 6]), lambda n: True)
    assert found is not None and found[1] == 1  # the longest match wins
    assert index.lookup(_prefix_hashes([1, 2, 3, 4, 5, 6]), lambda n: n != 1)[1] == 0  # an unusable owner is skipped
    assert index.lookup(_prefix_hashes([1, 2]), lambda n: True) is None  # shorter than any conversation
    assert index.lookup(_prefix_hashes([9, 2, 3, 4]), lambda n: True) is None
    index.record([1, 2, 3, 4, 5, 6, 7], owner=1, replaces=found[0])  # the episode's next turn replaces its last
    assert len(index) == 2
    for k in range(3):
        index.record([7, 7, k], owner=0)
    assert len(index) == 3 and index.lookup(_prefix_hashes([1, 2, 3, 9]), lambda n: True) is None  # evicted


def test_new_episodes_go_to_the_instance_with_fewest_requests_in_flight(pair):
    async def main() -> None:
        router = Router([RemoteEngine(p.url, token=p.token) for p in pair])
        try:
            long = asyncio.create_task(router.generate(_prompt(0), _sampling(0, tokens=400)))
            await asyncio.sleep(0)  # placed: its instance has one request in flight
            busy, idle = sorted(router.instances, key=lambda i: -i.in_flight)
            for n in (1, 2, 3):  # one at a time: the idle instance wins although it has served more
                await router.generate(_prompt(n), _sampling(n, tokens=2))
            assert not long.done() and (busy.requests, idle.requests) == (1, 3)
            await long
            before = [i.requests for i in router.instances]
            await asyncio.gather(*(router.generate(_prompt(10 + n), _sampling(n)) for n in range(6)))
            assert [i.requests - b for i, b in zip(router.instances, before)] == [3, 3]  # spread evenly
        finally:
            await router.close()

    asyncio.run(main())


def test_later_turns_of_an_episode_stay_on_its_instance(pair):
    async def main() -> None:
        router = Router([RemoteEngine(p.url, token=p.token) for p in pair])
        try:
            first = await router.generate(_prompt(0), _sampling(1))
            home = next(i for i in router.instances if i.requests)
            other = next(i for i in router.instances if i is not home)
            turn2 = _prompt(0) + list(first.output_ids) + [9, 10, 11]  # + the tool's reply
            second = await router.generate(turn2, _sampling(2))
            # least-loaded alone would have picked `other` (fewer requests); the conversation stays home
            assert (home.requests, home.sticky, other.requests) == (2, 1, 0)
            turn3 = turn2 + list(second.output_ids) + [12]
            await router.generate(turn3, _sampling(3))
            assert (home.requests, home.sticky) == (3, 2)
            # the router forwards the request intact: the same request straight to that engine agrees
            direct = await home.engine.generate(turn2, _sampling(2))
            # the same sample; logprobs within float noise (the routed turn reused cached KV, this one may not)
            assert direct.output_ids == second.output_ids
            assert max(abs(a - b) for a, b in zip(direct.logprobs, second.logprobs)) < 1e-4
            await router.generate(_prompt(0), _sampling(4))  # a group sibling (same first prompt) is a new episode
            assert other.requests == 1 and len(router.prefixes) == 2
        finally:
            await router.close()

    asyncio.run(main())


def test_a_hung_instance_fails_its_health_checks_and_its_request_is_restarted(pair):
    async def main() -> None:
        settings = RouterSettings(health_interval_s=0.2, health_timeout_s=0.5, unhealthy_after=2)
        router = Router([RemoteEngine(p.url, token=p.token) for p in pair], settings)
        try:
            task = asyncio.create_task(router.generate(_prompt(0), _sampling(0, tokens=300)))
            await asyncio.sleep(0.1)
            hung = next(i for i in router.instances if i.in_flight)
            os.kill(pair[hung.index].pid, signal.SIGSTOP)
            try:
                gen = await asyncio.wait_for(task, 60)
            finally:
                os.kill(pair[hung.index].pid, signal.SIGCONT)
            assert not hung.live and "health checks failed" in hung.reason
            assert len(gen.output_ids) == 300 and sum(i.retries for i in router.instances) == 1
        finally:
            await router.close()

    asyncio.run(main())


def test_slow_health_takes_out_one_of_two_but_never_the_last_live_instance(pair):
    """SIGSTOPped engines answer no poll in time: the first of two is taken out, the last live one stays and
    serves the request it holds once it runs again."""
    async def main() -> None:
        settings = RouterSettings(health_interval_s=0.2, health_timeout_s=0.5, unhealthy_after=2)
        router = Router([RemoteEngine(p.url, token=p.token) for p in pair], settings)
        first, last = router.instances
        try:
            await router.generate(_prompt(0), _sampling(0))  # starts the health polls
            os.kill(pair[0].pid, signal.SIGSTOP)
            await _until(lambda: not first.live, 30)
            assert "health checks failed" in first.reason and "Timeout" in first.reason
            os.kill(pair[1].pid, signal.SIGSTOP)
            held = asyncio.create_task(router.generate(_prompt(1), _sampling(1)))
            # twice the polls in a row that take out one of several (or until it is taken out: a failure)
            await _until(lambda: last.strikes >= 2 * settings.unhealthy_after or not last.live, 30)
            assert last.live and last.in_flight == 1, last.reason
            os.kill(pair[1].pid, signal.SIGCONT)
            gen = await asyncio.wait_for(held, 60)
            assert len(gen.output_ids) == 8 and last.live and last.failures == last.retries == 0
        finally:
            for p in pair:
                os.kill(p.pid, signal.SIGCONT)
            await router.close()

    asyncio.run(main())


async def _until(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.05)


def test_a_recovered_instance_catches_up_on_the_weights_it_missed_and_is_put_back(tiny_dir: Path, publishing_pair):
    publisher, procs = publishing_pair

    async def main() -> None:
        settings = RouterSettings(health_interval_s=0.2, health_timeout_s=0.5, unhealthy_after=2, readmit_after=3)
        router = Router([RemoteEngine(p.url, token=p.token) for p in procs], settings)
        out = router.instances[0]
        try:
            v = (await router.sync())["engine_version"]  # what the module's earlier tests published
            os.kill(procs[0].pid, signal.SIGSTOP)
            try:
                await _until(lambda: not out.live, 30)
                await asyncio.to_thread(publisher.publish, load_model(tiny_dir).state_dict(), v + 1)
                report = await router.sync()  # reaches the live instance only
                await router.pause()
                assert report["instances_live"] == 1 and router.weight_version == v + 1 and out.engine.weight_version == v
                await asyncio.sleep(1.0)
                assert not out.live and out.readmitted == 0  # still stopped: no healthy polls
            finally:
                os.kill(procs[0].pid, signal.SIGCONT)
            await _until(lambda: out.live, 30)
            health = await out.engine.health()
            assert out.readmitted == 1 and health["weight_version"] == v + 1 and health["paused"]
            assert router.weight_version == v + 1 and router.metrics()["engine0_readmitted"] == 1.0
            await router.resume()
            served = out.requests
            gen = await router.generate(_prompt(1), _sampling(1))  # a tie on load: the lowest index, engine0
            assert out.requests == served + 1 and set(gen.token_weight_versions) == {v + 1}
        finally:
            await router.close()

    asyncio.run(main())


def test_a_killed_instance_is_taken_out_and_its_requests_finish_elsewhere(tiny_dir: Path, publishing_pair):
    publisher, procs = publishing_pair

    async def main() -> None:
        router = Router([RemoteEngine(p.url, token=p.token) for p in procs])
        try:
            v = (await router.sync())["engine_version"]  # what the module's earlier tests published
            tasks = [asyncio.create_task(router.generate(_prompt(n), _sampling(n, tokens=200))) for n in range(6)]
            await asyncio.sleep(0.3)
            assert all(i.in_flight == 3 for i in router.instances)
            os.kill(procs[0].pid, signal.SIGKILL)
            gens = await asyncio.gather(*tasks)
            dead, alive = router.instances
            assert not dead.live and alive.live and dead.failures == 3 and alive.retries == 3
            survivor = RemoteEngine(procs[1].url, token=procs[1].token)
            directs = await asyncio.gather(*(survivor.generate(_prompt(n), _sampling(n, tokens=200)) for n in range(6)))
            for gen, direct in zip(gens, directs):  # each one complete, and wholly the survivor's sample
                assert len(gen.output_ids) == len(gen.logprobs) == len(gen.token_weight_versions) == 200
                assert gen.weight_version == v and set(gen.token_weight_versions) == {v}
                assert direct.output_ids == gen.output_ids
                assert max(abs(a - b) for a, b in zip(direct.logprobs, gen.logprobs)) < 1e-4
            await survivor.close()
            # updates, pause and resume now reach the survivor only; the version is the live instances'
            await asyncio.to_thread(publisher.publish, load_model(tiny_dir).state_dict(), v + 1)
            report = await router.sync()
            assert (report["engine_version"], report["instances_live"], router.weight_version) == (v + 1, 1, v + 1)
            await router.pause()
            await router.resume()
            after = await router.generate(_prompt(7), _sampling(7))
            assert set(after.token_weight_versions) == {v + 1} and router.metrics()["router_live"] == 1.0
        finally:
            await router.close()

    asyncio.run(main())


def test_a_dead_last_instance_is_still_taken_out_by_its_health_polls(live_engine: EngineProcess):
    async def main() -> None:
        proc = live_engine
        router = Router([RemoteEngine(proc.url, token=proc.token)], RouterSettings(health_interval_s=0.2, health_timeout_s=0.5))
        try:
            await router.generate(_prompt(0), _sampling(0))  # starts the health polls
            os.kill(proc.pid, signal.SIGKILL)
            await _until(lambda: not router.instances[0].live, 30)
            assert "health checks failed" in router.instances[0].reason  # no request met it: the polls did
            assert "ConnectError" in router.instances[0].reason
        finally:
            proc.stop()
            await router.close()

    asyncio.run(main())


def test_furlong_train_survives_losing_one_of_two_engine_servers(tmp_path: Path):
    from test_train_run import _rl_rows, _train_past_step_0
    from test_train_sync import _processes_mentioning

    run = tmp_path / "routed"
    proc = _train_past_step_0(run, "directory")
    engines = _engine_pids(run)
    assert len(engines) == 2, "expected two engine server processes"
    os.kill(engines[0], signal.SIGKILL)
    assert proc.wait(timeout=600) == 0, (run / "engine-server-1.log").read_text()[-2000:]

    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["router_live"] == 1.0
    counts = {k: sum(rows[-1][f"engine{i}_{k}"] for i in (0, 1)) for k in ("failures", "retries", "live")}
    assert counts["live"] == 1 and counts["failures"] == counts["retries"]  # each failed request ran again
    summary = json.loads((run / "summary.json").read_text())
    records = [r for r in map(json.loads, (run / "episodes.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    keys = [(r["step"], r["group"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == summary["rl_episodes"]["started"] == 4 * 4  # none lost, none twice
    assert all(r["status"] != "infra_error" for r in records)
    # sync mode: every token of step s came from weights v_s, on whichever engine served it
    assert all(r["version_first"] == r["version_last"] == r["step"] for r in records if r["tokens_response"])
    assert not _processes_mentioning(str(run)), "an engine server outlived the run"



def _engine_pids(run: Path) -> list[int]:
    """The engine server processes of the run (their --updates is RUN/weights)."""
    out = subprocess.run(["pgrep", "-f", f"furlong.engine.server .*{run}/weights"], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]
