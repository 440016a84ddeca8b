"""Engine.score (furlong/engine/base.py): prefill only, the logprob of each of input_ids[start:] given the ids
before it, as the trainer computes it (furlong.train.logprobs.token_logprobs), which a distillation teacher
served by an engine relies on (docs/distill.md). Checked here for the in-process hf engine (fp32: within 1e-6 of
the trainer, the same fp32 log-softmax of the same logits), the HTTP engine server through RemoteEngine (one
real server process on loopback, its bearer token) and the Router over it; bad input is a 4xx naming the field.
The vllm engine's score is checked in tests/test_engine_vllm.py (its module's engine), SGLang's against the
stand-in in tests/test_sglang.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from furlong.engine.base import Engine, EngineError, EngineRefused
from furlong.engine.hf import HFEngine
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router
from furlong.model.loading import load_model
from furlong.train.logprobs import token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = [5, 17, 300, 42, 99, 7, 250, 11, 64, 3]
TOL = 1e-6  # fp32 on both sides: the same logits, the same log-softmax


def trainer(model, ids: list[int], start: int, temperature: float) -> list[float]:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model, tokens, torch.ones_like(tokens), temperature)[0, start:].tolist()


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    proc = EngineProcess(tiny_dir, updates=None, log=tmp_path_factory.mktemp("score") / "engine.log")
    yield proc
    proc.stop()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_engine_scores_as_the_trainer_does(tiny_dir: Path, temperature: float) -> None:
    model = load_model(tiny_dir)

    async def go():
        async with HFEngine(load_model(tiny_dir)) as engine:
            assert isinstance(engine, Engine)
            whole = await engine.score(IDS, 1, temperature)
            tail = await engine.score(IDS, 6, temperature)
            return whole, tail

    whole, tail = asyncio.run(go())
    want = trainer(model, IDS, 1, temperature)
    assert len(whole) == len(IDS) - 1 and len(tail) == len(IDS) - 6
    assert max(abs(a - b) for a, b in zip(whole, want)) <= TOL
    assert tail == pytest.approx(whole[5:], abs=TOL)  # a logprob depends only on the ids before it
    assert all(v < 0 for v in whole)


def test_hf_engine_refuses_what_it_cannot_score(tiny_dir: Path) -> None:
    async def go():
        async with HFEngine(load_model(tiny_dir), max_context=12) as engine:
            out = {}
            for name, args in {"start0": (IDS, 0), "start_end": (IDS, len(IDS)), "vocab": ([5, 10**6], 1),
                               "context": (IDS * 2, 1), "temperature": (IDS, 1, 0.0)}.items():
                with pytest.raises(EngineError) as err:
                    await engine.score(*args)
                out[name] = str(err.value)
            return out

    errors = asyncio.run(go())
    assert errors["start0"].startswith("start:") and errors["start_end"].startswith("start:")
    assert "outside the vocabulary" in errors["vocab"]
    assert "12-token context" in errors["context"]
    assert errors["temperature"].startswith("temperature:")


def test_server_remote_and_router_score_as_the_trainer(tiny_dir: Path, served: EngineProcess) -> None:
    want = trainer(load_model(tiny_dir), IDS, 3, 1.0)

    async def go():
        remote = RemoteEngine(served.url, token=served.token)
        router = Router([RemoteEngine(served.url, token=served.token)])
        try:
            via_remote = await remote.score(IDS, 3)
            via_router = await router.score(IDS, 3)
            with pytest.raises(EngineRefused, match="start"):
                await remote.score(IDS, 0)
            return via_remote, via_router
        finally:
            await remote.close()
            await router.close()

    via_remote, via_router = asyncio.run(go())
    assert max(abs(a - b) for a, b in zip(via_remote, want)) <= TOL
    assert via_router == via_remote


def test_score_route_names_a_bad_field(served: EngineProcess) -> None:
    headers = {"Authorization": f"Bearer {served.token}"}
    with httpx.Client(base_url=served.url, headers=headers, trust_env=False) as client:
        missing = client.post("/score", json={"input_ids": IDS})
        assert missing.status_code == 400 and "start" in missing.text  # furlong's apps answer a bad body with 400
        wrong = client.post("/score", json={"input_ids": ["a"], "start": 1})
        assert wrong.status_code == 400 and "input_ids" in wrong.text
        early = client.post("/score", json={"input_ids": IDS, "start": 0})
        assert early.status_code == 400 and "start" in early.json()["detail"]
        assert client.post("/score", json={"input_ids": IDS, "start": 1}, headers={"Authorization": "Bearer x"}).status_code == 401
