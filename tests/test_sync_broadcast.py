"""`train.sync.transport=broadcast`: the trainer (rank 0) broadcasts its weights over a real gloo group to two
engine server processes (ranks 1 and 2), announced through their SGLang-shaped, token-guarded HTTP routes."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from furlong.engine.base import SamplingParams
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.model.loading import load_model
from furlong.sync.broadcast import FLAT, GROUP_NAME, GroupSpec, Manifest, WeightGroup, buckets, distinct, host_store
from furlong.train.weights import BroadcastLink, start_engines
from tests_support import moved_weights, reference_generation

PROMPT = [5, 17, 300, 42, 1000, 7]
TOKEN = "test-engine-token"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[EngineProcess]:
    procs = asyncio.run(start_engines(2, tiny_dir, None, tmp_path_factory.mktemp("engines"), 1, None, 16,
                                      engine_token=TOKEN))
    yield procs
    for p in procs:
        p.stop()


async def _open(engines: list[EngineProcess], **kw) -> tuple[BroadcastLink, list[RemoteEngine]]:
    members = [RemoteEngine(p.url, token=TOKEN) for p in engines]

    async def close_clients() -> None:
        await asyncio.gather(*(m.close() for m in members))

    link = await BroadcastLink.open(members[0], members, cleanup=close_clients, timeout_s=60, secret=TOKEN, **kw)
    return link, members


@pytest.mark.parametrize("load_format", [None, FLAT], ids=["per-tensor", "flattened"])
def test_both_layouts_carry_mixed_dtypes_bit_for_bit(load_format: str | None):
    """Rank 0 and rank 1 of one gloo group (two threads here); a bf16 tensor of odd size puts the next one off
    its alignment in the flat layout."""
    g = torch.Generator().manual_seed(0)
    sent = {"a": torch.randn(3, generator=g).to(torch.bfloat16), "b": torch.randn(2, 5, generator=g),
            "c": torch.randn(7, generator=g).to(torch.float16), "d": torch.randn(4, 4, generator=g)}
    manifest = Manifest.of(sent, load_format=load_format)
    store = host_store("127.0.0.1", 2, 30)
    spec = GroupSpec("127.0.0.1", store.port, 1, 2)

    async def main() -> dict[str, torch.Tensor]:
        joined = await asyncio.gather(asyncio.to_thread(WeightGroup, spec, 0, 30, store),
                                      asyncio.to_thread(WeightGroup, spec, 1, 30))
        _, got = await asyncio.gather(asyncio.to_thread(joined[0].send, manifest, list(sent.values())),
                                      asyncio.to_thread(joined[1].receive, manifest))
        return got

    got = asyncio.run(main())
    assert list(got) == list(sent) and manifest.nbytes == 3 * 2 + 10 * 4 + 7 * 2 + 16 * 4
    for name, t in sent.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    parts = buckets(sent, 50)  # 6 + 40 bytes, then 14, then 64: a tensor over the limit goes alone
    assert [list(b) for b in parts] == [["a", "b"], ["c"], ["d"]]



def test_closing_a_member_stuck_in_a_receive_returns_at_once():
    """An engine's receive stuck in a group the trainer abandoned (a peer died mid-broadcast): leaving that
    group must not wait out the group's timeout, or the engine cannot join the trainer's next group in time.
    A process group's destructor joins its worker threads, so close() must not drop the last reference."""
    store = host_store("127.0.0.1", 2, 60)
    spec = GroupSpec("127.0.0.1", store.port, 1, 2)
    manifest = Manifest.of({"w": torch.zeros(4)})
    outcome: list[BaseException] = []

    async def main() -> float:
        trainer, member = await asyncio.gather(asyncio.to_thread(WeightGroup, spec, 0, 60, store),
                                               asyncio.to_thread(WeightGroup, spec, 1, 60))

        def receive() -> None:  # the trainer never sends this bucket
            try:
                member.receive(manifest)
            except RuntimeError as e:
                outcome.append(e)

        receiving = threading.Thread(target=receive)
        receiving.start()
        await asyncio.sleep(0.5)
        began = time.perf_counter()
        member.close()
        closed = time.perf_counter() - began
        assert receiving.is_alive() and not outcome  # still stuck: close() did not wait for it
        trainer.close()  # its end hangs up: the stuck receive fails now, not at the 60 s timeout
        await asyncio.to_thread(receiving.join, 30)
        assert not receiving.is_alive() and len(outcome) == 1
        with pytest.raises(RuntimeError, match="is closed"):  # a receive queued behind it gets a clear error
            member.receive(manifest)
        return closed

    assert asyncio.run(main()) < 5  # the group's timeout is 60 s


def test_two_engine_servers_receive_a_broadcast_and_generate_with_it(engines, tiny_dir: Path):
    first, second = moved_weights(tiny_dir, 2e-2, 1), moved_weights(tiny_dir, 2e-2, 2)

    async def main() -> list[dict]:
        logged = []
        link, members = await _open(engines, bucket_bytes=1 << 20)  # several buckets: staged, then one switch
        try:
            for version, weights in ((1, first), (2, second)):
                logged.append(await link.push(weights, version))
                want = await reference_generation(tiny_dir, weights, PROMPT, GREEDY)
                for m in members:
                    got = await m.generate(PROMPT, GREEDY)
                    assert got.output_ids == want.output_ids and got.weight_version == version
                    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
                    health = await m.health()
                    assert health["weight_version"] == version and health["weight_groups"] == [GROUP_NAME]
            assert await link.push(second, 2) == {"sync_seconds": 0.0}  # an unchanged version is not resent
        finally:
            await link.close()
        for p in engines:  # close() left the group at every engine
            client = RemoteEngine(p.url, token=TOKEN)
            assert (await client.health())["weight_groups"] == []
            await client.close()
        return logged

    logged = asyncio.run(main())
    nbytes = sum(t.numel() * t.element_size() for t in distinct(first).values())
    assert [m["sync_payload_bytes"] for m in logged] == [nbytes, nbytes]  # tied tensors sent once
    assert all(m["sync_buckets"] > 1 and 0 < m["sync_pause_s"] < m["sync_seconds"] for m in logged)


def test_unauthenticated_and_malformed_requests_are_refused_and_change_nothing(engines, tiny_dir: Path):
    url = engines[0].url
    state = moved_weights(tiny_dir, 0.0, 0)
    good = Manifest.of({"model.norm.weight": state["model.norm.weight"]}, weight_version="7", load_format=FLAT).body()
    bad_bodies = [
        ({**good, "names": ["no.such.tensor"]}, "unknown tensors"),
        ({**good, "shapes": [[3, 3]]}, "shape"),
        ({**good, "dtypes": ["int7"]}, "dtypes"),
        ({**good, "weight_version": "seven"}, "invalid literal"),
        ({**good, "weight_version": "-1"}, "non-negative"),
        ({**good, "dtypes": []}, "as long as"),
        ({**good, "load_format": "zip"}, "load_format"),
        ({**good, "group_name": "other"}, "no group"),
        ({"names": ["model.norm.weight"]}, "dtypes"),
    ]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as raw:
            authed = {"Authorization": f"Bearer {TOKEN}"}
            for route in ("/update_weights_from_distributed", "/init_weights_update_group", "/generate"):
                assert (await raw.post(route, json=good)).status_code == 401
                assert (await raw.post(route, json=good, headers={"Authorization": "Bearer nope"})).status_code == 401
            no_group = await raw.post("/update_weights_from_distributed", json=good, headers=authed)
            assert no_group.status_code == 400 and "no group" in no_group.json()["message"]
            init = {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2}
            for body in ({**init, "world_size": 1}, {**init, "rank_offset": 0}, {**init, "backend": "mpi"},
                         {**init, "master_port": 0}, {k: v for k, v in init.items() if k != "master_port"}):
                assert (await raw.post("/init_weights_update_group", json=body, headers=authed)).status_code == 400

            link, members = await _open(engines[:1])
            try:
                await link.push(moved_weights(tiny_dir, 2e-2, 3), 4)
                before = await members[0].generate(PROMPT, GREEDY)
                for body, reason in bad_bodies:
                    resp = await raw.post("/update_weights_from_distributed", json=body, headers=authed)
                    assert resp.status_code == 400, (body, resp.text)
                    assert reason in resp.text, (reason, resp.text)
                after = await members[0].generate(PROMPT, GREEDY)
                assert (after.output_ids, after.weight_version) == (before.output_ids, 4)
                assert (await members[0].health())["weight_version"] == 4
                await link.push(moved_weights(tiny_dir, 2e-2, 4), 5)  # the group is still in step
                assert (await members[0].health())["weight_version"] == 5
            finally:
                await link.close()

    asyncio.run(main())


def test_a_lone_member_that_refuses_fails_the_push_at_once_and_the_link_stays_failed(engines, tiny_dir: Path):
    """With no other engine to go on with, a refusal ends the run (tests/test_sync_broadcast_faults.py: two)."""
    async def main() -> None:
        link, members = await _open(engines[:1])
        try:
            await link.push(moved_weights(tiny_dir, 2e-2, 5), 8)
            await members[0].destroy_weights_update_group(GROUP_NAME)  # the engine leaves behind the trainer's back
            with pytest.raises(RuntimeError, match="every engine is lost.*no group"):  # at once, not after 60 s
                await asyncio.wait_for(link.push(moved_weights(tiny_dir, 2e-2, 6), 9), 30)
            with pytest.raises(RuntimeError, match="failed earlier"):
                await link.push(moved_weights(tiny_dir, 2e-2, 7), 10)
            assert (await members[0].health())["weight_version"] == 8  # the refused version was never loaded
        finally:
            await link.close()

    asyncio.run(main())


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_furlong_train_with_the_broadcast_transport(tmp_path: Path, tiny_dir: Path, lora: bool):
    from test_train_run import _rl_rows, _train
    from test_train_sync import _processes_mentioning

    run = tmp_path / "bcast"
    res = _train("--config", "recipes/smoke.yaml", f"train.run_dir={run}", "train.rl.steps=2",
                 "train.sync.transport=broadcast", "train.sync.engine=server", "train.sync.servers=2",
                 f"train.lora.enabled={str(lora).lower()}")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1]
    model_bytes = sum(t.numel() * t.element_size() for t in distinct(load_model(tiny_dir).state_dict()).values())
    # the whole model each push; with LoRA only the adapters (a few percent of it)
    assert all((r["sync_payload_bytes"] < 0.1 * model_bytes) if lora else (r["sync_payload_bytes"] == model_bytes)
               for r in rows), [r["sync_payload_bytes"] for r in rows]
    assert (run / "engine-server-0.log").exists() and not (run / "weights").exists()
    assert not _processes_mentioning(str(run)), "an engine server outlived the run"
