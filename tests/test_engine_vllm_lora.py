"""LoRA adapters on the vllm engine, for real (vLLM's CPU build): every request runs the adapter, its logprobs
are the trainer's PEFT model's, and adapter-only updates (direct and published through the relay) load new
versions. One engine serves the module: vLLM takes 15-70 s to start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import skips
import torch
from test_engine_vllm import loop  # noqa: F401  (the module's event loop fixture)
from tests_support import Background

from furlong.engine.base import EngineError, SamplingParams
from furlong.engine.factory import make_engine
from furlong.engine.vllm import vllm_available
from furlong.model.loading import load_model
from furlong.model.lora import LoraSpec, adapter_state_dict, save_adapter, wrap_lora
from furlong.model.tiny import init_tiny
from furlong.sync.adapter import AdapterPublisher
from furlong.sync.relay import Relay
from furlong.sync.transport import InProcessTransport
from furlong.train.logprobs import token_logprobs

pytestmark = [skips.skipif("extra:vllm", not vllm_available(), "vLLM is not installed (bash install.sh --vllm)"),
              pytest.mark.usefixtures("one_torch_thread")]

# A prompt longer than vLLM's 16-token KV block, so a prefix cache that outlived an update would show.
PROMPT = [(13 * i) % 4000 + 5 for i in range(40)]
# every linear layer of Qwen3: vLLM serves them all (q/k/v packed into qkv_proj, gate/up into gate_up_proj)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft(base: Path, seed: int):
    """A LoRA policy whose adapter is far from the identity (lora_B is 0 when fresh), seeded."""
    peft = wrap_lora(load_model(base), LoraSpec(rank=4, alpha=8, targets=TARGETS), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return peft


@pytest.fixture(scope="module")
def base() -> Path:
    return Path(init_tiny(seed=0))


@pytest.fixture(scope="module")
def policy(base):
    return _peft(base, seed=1)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """test_train_smoke_with_lora_on_the_vllm_engine's `furlong train`, started with the module's engine (which
    asks for it) so that its own vLLM start and steps run beside the module's other tests; that test checks it."""
    tmp = tmp_path_factory.mktemp("vllm-lora-smoke")
    # every group trained, rewarded or not, so the logprob comparison has tokens
    run = Background(tmp / "train.log", "train", "--config", "recipes/smoke.yaml", "train.engine=vllm",
                     "train.lora.enabled=true", "train.rl.steps=2", "train.rl.filter_zero_variance=false",
                     f"train.run_dir={tmp / 'run'}")
    yield tmp / "run", run
    run.stop()


@pytest.fixture(scope="module")
def engine(base, policy, loop, tmp_path_factory, smoke):
    # through the factory, as `furlong eval --agent model --engine vllm --adapter DIR` starts it
    adapter = save_adapter(policy, tmp_path_factory.mktemp("adapter"))
    eng = make_engine("vllm", base, adapter=adapter, seed=0)
    yield eng
    loop.run_until_complete(eng.close())


def _max_diff(model, gen, temperature: float = 1.0) -> float:
    tokens = torch.tensor([PROMPT + list(gen.output_ids)])
    with torch.no_grad():
        lp = token_logprobs(model, tokens, torch.ones_like(tokens), temperature)[0, len(PROMPT):]
    return float((lp - torch.tensor(gen.logprobs)).abs().max())


def _generate(engine, loop, seeds, temperature: float = 1.0):
    async def run():
        return await asyncio.gather(*[engine.generate(PROMPT, SamplingParams(temperature=temperature,
                                                                            max_new_tokens=30, seed=s))
                                      for s in seeds])
    return loop.run_until_complete(run())


def test_every_request_runs_the_adapter_with_the_trainers_logprobs(engine, base, policy, loop):
    assert engine.adapter is not None and engine.adapter.max_lora_rank == 8  # rank 4 -> vLLM's next allowed
    lora_model = policy.get_base_model()
    for temperature in (1.0, 0.7):
        for g in _generate(engine, loop, range(4), temperature):
            assert g.num_tokens == 30 and g.token_weight_versions == (0,) * 30
            assert _max_diff(lora_model, g, temperature) < 1e-4
    # the adapter is not a no-op: the base alone computes other logprobs
    assert _max_diff(load_model(base), _generate(engine, loop, [0])[0]) > 1e-2


def test_adapter_update_loads_a_new_version_and_drops_the_old(engine, base, policy, loop):
    before = _generate(engine, loop, [5])[0]
    new = _peft(base, seed=2)
    update = {n: t for n, t in adapter_state_dict(new).items() if "layers.0." not in n}  # a subset
    with torch.no_grad():  # what the engine should now run: the old adapter with the subset replaced
        lora = policy.get_base_model()
        live = adapter_state_dict(policy)  # the live tensors
        for n, t in update.items():
            live[n].copy_(t)
    loop.run_until_complete(engine.update_weights(update, 1))
    after = _generate(engine, loop, [5])[0]
    assert engine.weight_version == 1 and after.token_weight_versions == (1,) * 30
    assert _max_diff(lora, after) < 1e-4 and after.logprobs != before.logprobs
    cost = engine.last_update
    assert cost["sync_pause_s"] >= cost["sync_stage_s"] > 0 and cost["sync_drain_s"] >= 0
    assert cost["sync_engine_bytes"] == sum(t.numel() * 4 for t in adapter_state_dict(policy).values())
    assert set(loop.run_until_complete(engine.llm.list_loras())) == {engine._lora.lora_int_id}  # the old one: gone
    versions = [p.name for p in engine.adapter._work.iterdir()]
    assert versions == [Path(engine._lora.lora_path).name]  # and so is its directory


def test_refused_updates_change_nothing(engine, loop):
    version = engine.weight_version
    with pytest.raises(EngineError, match="takes its lora_A/lora_B tensors only"):
        loop.run_until_complete(engine.update_weights({"model.norm.weight": torch.ones(256)}, 99))
    name = next(iter(engine.adapter.tensors))
    with pytest.raises(EngineError, match="shape"):
        loop.run_until_complete(engine.update_weights({name: torch.zeros(3)}, 99))
    assert engine.weight_version == version


def test_published_adapter_snapshot_and_delta_through_the_relay(engine, base, loop):
    transport = InProcessTransport()
    publisher = AdapterPublisher(transport, full_every=10)
    relay = Relay(transport, engine)
    kinds = []
    for version, seed in ((10, 3), (11, 4)):
        peft = _peft(base, seed)
        kinds.append(publisher.publish(peft, version).kind)
        report = loop.run_until_complete(relay.sync_once())
        assert report.engine_version == version == engine.weight_version
    assert kinds == ["full", "delta"]
    g = _generate(engine, loop, [9])[0]
    assert _max_diff(peft.get_base_model(), g) < 1e-4 and g.token_weight_versions == (11,) * 30


def test_a_directory_without_an_adapter_is_one_clear_error(base, tmp_path):
    from furlong.engine.vllm import VLLMEngine

    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    with pytest.raises(EngineError, match="adapter_model.safetensors"):
        VLLMEngine.start(base, adapter=tmp_path)


@pytest.mark.slow
def test_train_smoke_with_lora_on_the_vllm_engine(smoke):
    run, background = smoke
    res = background.result(timeout_s=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]  # vLLM shut down once, cleanly
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_episodes"] == 4 and all(s["infra_error"] == 0 for s in summary["status"].values())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["sync_pause_s"] > 0 and r["loss_tokens"] > 0 for r in rl)
    # only the adapter travels, and vLLM's logprobs under it are the trainer's PEFT model's
    assert all(r["sync_engine_bytes"] < 1e6 for r in rl)
    assert max(r["logprob_diff_max"] for r in rl) < 1e-3
    assert (run / "checkpoints").is_dir() and summary["hf_model"]
