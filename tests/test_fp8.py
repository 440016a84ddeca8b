"""FP8 rollout weights (`train.sync.quantize=fp8`): the e4m3 quantizer, the trainer publishing fp8 weights + scales
(full and delta updates through a real relay), the in-process hf engine generating from them, the per-step
checksum of both sides' quantized tensors, and the trainer's quantized forward (furlong.model.fp8)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from furlong.build.links import weight_link
from furlong.build.training import grpo_config, local_trainer
from furlong.config import load_config
from furlong.engine.base import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model.fp8 import FP8, dequantize, fp8_targets, quantize, save_fp8, to_fp8_engine
from furlong.model.loading import load_model
from furlong.sync import InProcessTransport, Publisher, Relay
from furlong.sync.checksum import verify_fp8
from furlong.sync.errors import ChecksumMismatch
from furlong.train.logprobs import token_logprobs

PROMPT = [5, 17, 300, 42, 1000, 7]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("block", [None, 128, 16])
def test_round_trip_is_within_e4m3_rounding(block: int | None) -> None:
    w = torch.randn(70, 130, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 130)
    w[3] = 0.0  # an all-zero row: scale 1, exact zeros
    q, scale = quantize(w, block)
    assert q.dtype == FP8 and scale.dtype == torch.float32
    assert scale.shape == ((70, 1) if block is None else (-(-70 // block), -(-130 // block)))
    back = dequantize(q, scale, block)
    full = dequantize(q, scale.new_ones(scale.shape), block).abs()
    assert full.max() <= 448.0  # scale = amax / 448: every scaled value in e4m3's range
    per_elem_scale = dequantize(torch.ones(q.shape).to(FP8), scale, block)
    # e4m3: 3 mantissa bits (relative error <= 2^-4); below 2^-6 the subnormal step is 2^-9 (error <= 2^-10)
    bound = w.abs() * 2.0**-4 + per_elem_scale * 2.0**-10
    assert ((back - w).abs() <= bound).all()
    assert (back[3] == 0).all()
    assert (back - w).abs().max() > 0  # it did round


def test_targets_are_decoder_linears_only(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    spec = fp8_targets(model)
    assert spec.weights and all(".layers." in n and n.endswith("_proj.weight") for n in spec.weights)
    assert len(spec.weights) == sum(
        isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if ".layers." in n
    )
    assert spec.scale_name("a.weight") == "a.weight_scale"
    assert fp8_targets(model, 128).scale_name("a.weight") == "a.weight_scale_inv"


def _steps(model, count: int, size: float = 3e-3) -> list[dict[str, torch.Tensor]]:
    """The model's weights and `count` optimizer-like steps of them (tied tensors stay one)."""
    g = torch.Generator().manual_seed(0)
    state = model.state_dict()
    weights = {k: v.detach().clone() for k, v in state.items()}
    weights["lm_head.weight"] = weights.get("model.embed_tokens.weight", weights["lm_head.weight"])
    out = [weights]
    for _ in range(count):
        moved = {k: v + size * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        if state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr():
            moved["lm_head.weight"] = moved["model.embed_tokens.weight"]
        weights = moved
        out.append(weights)
    return out


async def _sample(engine, seed: int = 3):
    return await engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed))


async def _dequantized_reference(
    tiny_dir: Path, weights: dict[str, torch.Tensor], block: int | None, dtype: torch.dtype = torch.float32
):
    """A plain fp32 engine given the fp8-rounded weights (the rest rounded to the published `dtype`): what the
    fp8 engine must sample, token for token."""
    model = load_model(tiny_dir)
    spec = fp8_targets(model, block)
    rounded = {k: dequantize(*quantize(v, block), block) if k in spec.weights else v.to(dtype).float()
               for k, v in weights.items()}  # fmt: skip
    engine = HFEngine(model, eos_token_ids=())
    await engine.update_weights(rounded, 0)
    try:
        return await _sample(engine)
    finally:
        await engine.close()


@pytest.mark.parametrize(("transport", "block", "dtype"),
                         [("inprocess", None, "float32"), ("directory", 16, "bfloat16"), ("direct", None, "float32")])
def test_engine_holds_the_trainers_fp8_tensors_after_full_and_delta_updates(
    tiny_dir: Path, tmp_path: Path, transport: str, block: int | None, dtype: str
) -> None:
    """bfloat16: the other tensors are published in bf16, the scales stay float32 (the checksum covers them)."""
    block_key = [] if block is None else [f"train.sync.fp8_block={block}"]
    cfg = load_config(None, [f"train.sync.transport={transport}", "train.sync.quantize=fp8",
                             "train.sync.full_every=3", f"train.sync.engine_dtype={dtype}", *block_key])  # fmt: skip
    history = _steps(load_model(tiny_dir), 4)

    async def run():
        link = await weight_link(cfg, tmp_path, tiny_dir)
        try:
            metrics = [await link.push(w, v) for v, w in enumerate(history, start=1)]
            sampled = await _sample(link.engine)
            engine_fp8 = {n: t for n, t in link.engine.model.state_dict().items() if t.dtype == FP8}
            # tamper with one held scale: the checksum must see it
            scale = next(t for n, t in link.engine.model.state_dict().items() if n.endswith("_scale" if block is None else "_scale_inv"))
            expected = link.publisher.fp8_digest() if transport != "direct" else link.engine.fp8_digest()
            scale.mul_(1.0 + 2**-20)
            with pytest.raises(ChecksumMismatch, match="fp8 weights hash to"):
                verify_fp8(link.engine, expected, 5)
            return metrics, sampled, engine_fp8
        finally:
            await link.close()

    metrics, sampled, engine_fp8 = asyncio.run(run())
    assert all(m["sync_fp8_checksum_ok"] == 1.0 for m in metrics)
    assert engine_fp8 and len(engine_fp8) == len(fp8_targets(load_model(tiny_dir)).weights)
    if transport != "direct":
        assert [m["sync_full"] for m in metrics] == [1.0, 0.0, 0.0, 1.0, 0.0]  # full, deltas, full_every, delta
    reference = asyncio.run(_dequantized_reference(tiny_dir, history[-1], block, getattr(torch, dtype)))
    assert sampled.output_ids == reference.output_ids
    assert sampled.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def _trainer(cfg, tiny_dir: Path):
    """The run's local trainer (no SFT anchor: no demonstrations here)."""
    return local_trainer(cfg.train, tiny_dir, replace(grpo_config(cfg.train), sft_coef=0.0), [])


@pytest.mark.parametrize("quantized_forward", [True, False])
def test_trainer_logprobs_match_the_fp8_engine_only_with_the_quantized_forward(
    tiny_dir: Path, tmp_path: Path, quantized_forward: bool
) -> None:
    cfg = load_config(None, ["train.sync.transport=inprocess", "train.sync.quantize=fp8",
                             f"train.sync.quantized_forward={str(quantized_forward).lower()}"])  # fmt: skip
    trainer = _trainer(cfg, tiny_dir)

    async def run():
        link = await weight_link(cfg, tmp_path, tiny_dir)
        try:
            await link.push(dict(trainer.model.state_dict()), 1)  # step 0's weights
            return await _sample(link.engine)
        finally:
            await link.close()

    gen = asyncio.run(run())
    tokens = torch.tensor([PROMPT + list(gen.output_ids)])
    with torch.no_grad():
        logp = token_logprobs(trainer.model, tokens, torch.ones_like(tokens), 1.0)[0, len(PROMPT):]
    diff = (logp - torch.tensor(gen.logprobs)).abs().max().item()
    if quantized_forward:
        assert diff < 1e-4
    else:
        assert diff > 1e-3  # fp8 rounding is visible to an fp32 trainer


def test_quantized_forward_gradient_reaches_the_master_weights(tiny_dir: Path) -> None:
    cfg = load_config(None, ["train.sync.quantize=fp8", "train.sync.quantized_forward=true"])
    model = _trainer(cfg, tiny_dir).model
    name = sorted(fp8_targets(model).weights)[0]
    tokens = torch.tensor([PROMPT])
    token_logprobs(model.train(), tokens, torch.ones_like(tokens), 1.0).sum().backward()
    weight = model.get_parameter(name)
    assert weight.dtype == torch.float32 and weight.grad is not None and weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("keys", "named"),
    [
        (["train.sync.quantize=fp8", "train.engine=vllm"], "train.sync.quantize=fp8"),
        (["train.sync.quantize=fp8", "train.sync.engine=server", "train.sync.transport=http"], "train.sync.engine"),
        (["train.sync.quantize=fp8", "train.lora.enabled=true"], "train.lora.enabled"),
        (["train.sync.quantized_forward=true"], "train.sync.quantize=fp8"),
    ],
)
def test_unsupported_fp8_settings_are_refused_naming_the_key(keys: list[str], named: str) -> None:
    with pytest.raises(Exception, match=named.replace(".", r"\.")):
        load_config(None, keys)


def test_furlong_train_with_fp8_rollout_weights_checks_them_every_step(tmp_path: Path) -> None:
    """The RL loop end to end: every step's push proves the engine's fp8 tensors are the trainer's, and with the
    quantized forward GRPO's own train/rollout logprob gap is fp32 noise."""
    from test_train_run import SMALL, _rl_rows, _train

    run = tmp_path / "fp8"
    res = _train(f"train.run_dir={run}", *SMALL, "train.rl.steps=2", "train.sync.transport=inprocess",
                 "train.sync.quantize=fp8", "train.sync.quantized_forward=true",
                 "train.rl.filter_zero_variance=false")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1] and all(r["updated"] for r in rows)
    assert all(r["sync_fp8_checksum_ok"] == 1.0 for r in rows)
    assert max(r["logprob_diff_max"] for r in rows) < 1e-5


def test_block_checkpoint_loads_in_transformers_as_the_engine_computes(tiny_dir: Path, tmp_path: Path) -> None:
    """The 128x128 layout is transformers' FineGrainedFP8: a saved checkpoint loads (dequantized on a CPU) to
    exactly the weights the fp8 engine computes with."""
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_dir)
    spec = fp8_targets(model, 128)
    out = save_fp8(model, spec, tmp_path / "fp8")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    engine_model = to_fp8_engine(load_model(tiny_dir), spec)
    for name in spec.weights:
        module = engine_model.get_submodule(name.removesuffix(".weight"))
        assert torch.equal(loaded.get_parameter(name).float(), dequantize(module.weight, module.scale, 128)), name
    with pytest.raises(ValueError, match="fp8_block"):
        save_fp8(model, fp8_targets(model), tmp_path / "channel")


def test_device_path_publishes_the_same_fp8_tensors(tiny_dir: Path) -> None:
    """The GPU trainer's path (furlong.sync.staging.DeviceStage, run here on CPU tensors): snapshot and deltas
    of fp8 weights rebuild bit for bit at a relay, and the engine's checksum is the publisher's."""
    model = load_model(tiny_dir)
    spec = fp8_targets(model)
    history = _steps(model, 3)
    transport = InProcessTransport()
    publisher = Publisher(transport, fp8=spec, device_base=True, engine_dtype=torch.bfloat16)

    async def run():
        async with HFEngine(to_fp8_engine(load_model(tiny_dir), spec), eos_token_ids=()) as engine:
            relay = Relay(transport, engine)
            kinds = []
            for v, w in enumerate(history, start=1):
                kinds.append(publisher.publish(w, v).kind)
                await relay.sync_once()
                verify_fp8(engine, publisher.fp8_digest(), v)
            return kinds, engine.weight_version

    kinds, version = asyncio.run(run())
    assert publisher.on_device and kinds == ["full", "delta", "delta", "delta"] and version == len(history)
