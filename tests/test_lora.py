"""LoRA adapter-only training and sync: the base stays bit-identical, only adapters train, an engine holding
the same base applies published adapters exactly, and adapters save/load in PEFT format."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from tests_support import SMALL, grpo

from furlong.agent.episode import Episode, EpisodeTiming
from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import load_model
from furlong.model.lora import (
    LoraSpec,
    adapter_state_dict,
    base_state_dict,
    load_adapter,
    save_adapter,
    trainable_model,
    wrap_lora,
)
from furlong.sync.adapter import AdapterPublisher, state_dict_nbytes
from furlong.sync.relay import Relay
from furlong.sync.transport import InProcessTransport
from furlong.train import LocalTrainer, token_logprobs
from furlong.train.batch import collate

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONFIG = grpo(lr=1e-2, micro_batch_size=8)


def episodes(seed: int, groups: int = 3, group_size: int = 4) -> list[Episode]:
    """Synthetic groups (random tokens, mixed rewards): enough for a real GRPO gradient."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(10, SMALL.vocab_size) for _ in range(4 + 3 * g))
        for i in range(group_size):
            resp = tuple(rng.randrange(10, SMALL.vocab_size) for _ in range(5 + i))
            p, n = len(prompt), len(resp)
            out.append(Episode(task_id="toy", group_id=g, sample_id=i, prompt_len=p, tokens=prompt + resp,
                               loss_mask=(0,) * p + (1,) * n, rollout_logprobs=(0.0,) * p + (-6.0,) * n,
                               token_weight_versions=(-1,) * p + (0,) * n, reward=float(i % 2), status="ok",
                               timing=EpisodeTiming(), turns=1))
    return out


def clone(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


def test_only_adapters_train(small_dir: Path) -> None:
    peft = wrap_lora(load_model(small_dir), LoraSpec())
    base0, adapter0 = clone(base_state_dict(peft)), clone(adapter_state_dict(peft))
    assert adapter0 and all("lora_" in k for k in adapter0)
    assert len(adapter0) == SMALL.num_layers * 4 * 2  # q,k,v,o x (A, B)
    trainer = LocalTrainer(trainable_model(peft), CONFIG)
    n_opt = sum(len(g["params"]) for g in trainer.optimizer.param_groups)
    assert n_opt == len(adapter0)
    for step in range(3):
        assert trainer.train_step(episodes(step)).updated
    base1, adapter1 = base_state_dict(peft), adapter_state_dict(peft)
    assert base1.keys() == base0.keys()
    for k, v in base0.items():  # bitwise
        assert torch.equal(v, base1[k]), k
    assert all(not torch.equal(v, adapter1[k]) for k, v in adapter0.items() if "lora_B" in k)
    assert any(not torch.equal(v, adapter1[k]) for k, v in adapter0.items() if "lora_A" in k)


def _engine_logprobs_match(trainer_model, engine: HFEngine, prompts: list[list[int]], version: int) -> None:
    async def sample():
        return await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=6, seed=i))
                                      for i, p in enumerate(prompts)])
    gens = asyncio.get_event_loop().run_until_complete(sample())
    eps = []
    for i, (p, gen) in enumerate(zip(prompts, gens, strict=True)):
        assert gen.weight_version == version
        n = len(gen.output_ids)
        eps.append(Episode(task_id="t", group_id=i, sample_id=0, prompt_len=len(p), tokens=tuple(p) + gen.output_ids,
                           loss_mask=(0,) * len(p) + (1,) * n, rollout_logprobs=(0.0,) * len(p) + gen.logprobs,
                           token_weight_versions=(-1,) * len(p) + gen.token_weight_versions, reward=0.0,
                           status="ok", timing=EpisodeTiming(), turns=1))
    mb = collate(eps, torch.zeros(len(eps)), torch.device("cpu"))
    with torch.no_grad():
        logp = token_logprobs(trainer_model, mb.tokens, mb.attention_mask, 1.0)
    diff = ((logp - mb.rollout_logprobs) * mb.loss_mask).abs().max().item()
    assert diff <= TOL, diff


def test_engine_applies_published_adapter(small_dir: Path) -> None:
    """Trainer publishes adapter-only updates (a snapshot, then a delta) through InProcessTransport; a Relay
    stages them bit-exactly and pushes them into an HFEngine over a PeftModel; the engine then samples with
    exactly the trainer's policy."""
    peft = wrap_lora(load_model(small_dir))
    trainer = LocalTrainer(trainable_model(peft), CONFIG)
    engine_peft = wrap_lora(load_model(small_dir), seed=123)  # a different adapter init: the push must fix it
    transport = InProcessTransport()
    publisher = AdapterPublisher(transport)
    prompts = [[random.Random(i).randrange(10, 500) for _ in range(3 + 2 * i)] for i in range(3)]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        engine = HFEngine(engine_peft, eos_token_ids=())
        relay = Relay(transport, engine)
        for version, kind in ((1, "full"), (2, "delta")):
            trainer.train_step(episodes(version))
            published = publisher.publish(peft, version)
            assert published.kind == kind
            report = loop.run_until_complete(relay.sync_once())
            assert report.engine_version == version and engine.weight_version == version
            sent = adapter_state_dict(peft)
            assert relay.staged.keys() == sent.keys()
            for k, v in sent.items():  # the round trip through the transport is bit-exact
                assert torch.equal(relay.staged[k], v), k
            live = adapter_state_dict(engine_peft)
            for k, v in sent.items():
                assert torch.equal(live[k], v), k
            _engine_logprobs_match(trainer.model, engine, prompts, version)
        sizes = publisher.sizes
        assert [s.kind for s in sizes] == ["full", "delta"]
        for s in sizes:
            print(f"adapter update v{s.version} {s.kind}: payload {s.payload_bytes} B, raw adapter "
                  f"{s.adapter_bytes} B, full model {s.full_model_bytes} B, ratio {s.ratio:.4f}")
            assert s.ratio < 0.1
        loop.run_until_complete(engine.close())
    finally:
        loop.close()
        asyncio.set_event_loop(None)


def test_peft_format_save_load(small_dir: Path, tmp_path: Path) -> None:
    peft = wrap_lora(load_model(small_dir))
    trainer = LocalTrainer(trainable_model(peft), CONFIG)
    trainer.train_step(episodes(7))
    out = save_adapter(peft, tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(load_model(small_dir), str(out))
    again = load_adapter(load_model(small_dir), out)
    want = adapter_state_dict(peft)
    for got in (adapter_state_dict(loaded), adapter_state_dict(again)):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    tokens = torch.tensor([[11, 42, 99, 7, 300]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, peft(input_ids=tokens).logits)


def test_adapter_is_small_fraction_of_model(small_dir: Path) -> None:
    peft = wrap_lora(load_model(small_dir))
    adapter, full = state_dict_nbytes(adapter_state_dict(peft)), state_dict_nbytes(peft.state_dict())
    print(f"raw adapter/full (fp32): {adapter}/{full} = {adapter / full:.4f}")
    assert adapter / full < 0.1


def test_trainer_takes_the_peft_model_itself(small_dir: Path) -> None:
    peft = wrap_lora(load_model(small_dir), LoraSpec())
    base0 = clone(base_state_dict(peft))
    trainer = LocalTrainer(peft, CONFIG)
    assert trainer.train_step(episodes(0)).updated
    assert all(torch.equal(v, base_state_dict(peft)[k]) for k, v in base0.items())
