"""Expert parallelism in the FSDP2 trainer (train.fsdp2.expert_parallel, furlong.train.experts): a tiny qwen3_moe
(2 layers of 8 experts, top-2) at world size 2 on gloo with ep=2 (so dp=1: each rank holds 4 experts of each
layer), against LocalTrainer on the same fixed batch, with routing replay of routes drawn at random (so the
replayed experts are not the routers' own choice: a trainer that ignored them would not match).

Tolerance as tests/test_fsdp2.py: the ranks sum the experts' outputs in another order, so logprobs agree to
float32 rounding (1e-5), stats to a relative 1e-4, weights after two AdamW steps to an absolute 1e-5."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from furlong.config import TrainConfig
from furlong.model.families import init_family
from furlong.model.loading import load_model
from furlong.train.experts import check_split
from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer
from fsdp2_support import fixed_episodes
from test_fsdp2 import STAT_TOL, WEIGHT_TOL, _assert_same_weights, _fsdp2, _local, assert_resumes
from tests_support import grpo

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LAYERS, EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def moe_dir() -> Path:
    return init_family("qwen3_moe")  # cached beside the default tiny model


def routed(seed: int = 0) -> list:
    """fixed_episodes with random top-2 routes on every token but the last (UNKNOWN there, as an engine's)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for e in fixed_episodes():
        n = len(e.tokens)
        routes = torch.rand(n, LAYERS, EXPERTS, generator=gen).argsort(-1)[..., :TOP_K].to(torch.int16)
        routes[-1] = -1
        out.append(replace(e, routes=routes))
    return out


@pytest.fixture(scope="module")
def pair(moe_dir: Path):
    """The local trainer and FSDP2 with ep=2 over the same qwen3_moe, before any step."""
    config = replace(grpo(lr=1e-3, micro_batch_size=2, minibatches=2), routing_replay="on")
    spec = FSDP2Spec(moe_dir, config, expert_parallel=2)
    fsdp = _fsdp2(spec)
    try:
        yield _local(spec), fsdp
    finally:
        fsdp.close()


def test_each_rank_holds_half_the_experts(pair) -> None:
    _, fsdp = pair
    held = fsdp.ranks.call("local_experts")
    for shapes in held:
        assert len(shapes) == 2 * LAYERS  # gate_up_proj and down_proj of each layer
        assert all(shape[0] == EXPERTS // 2 for shape in shapes.values()), shapes


def test_logprobs_and_step_match_the_local_trainer(pair) -> None:
    local, fsdp = pair
    episodes = routed()
    want = local._logprobs(local.model, episodes)
    own = local._logprobs(local.model, [replace(e, routes=None) for e in episodes])
    assert max(float((a - b).abs().max()) for a, b in zip(want, own, strict=True)) > 1e-3  # the routes matter
    for got in fsdp.ranks.call("logprobs", episodes):  # each rank: the same, whole answer
        assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) <= 1e-5

    before = {k: v.clone() for k, v in local.engine_weights().items()}
    expect, stats = local.train_step(episodes), fsdp.train_step(episodes)
    for name in ("loss", "grad_norm", "grad_norm_rl", "entropy", "ppo_kl", "clip_frac"):
        assert getattr(stats, name) == pytest.approx(getattr(expect, name), rel=STAT_TOL, abs=1e-7), name
    assert expect.moe_route_mismatch > 0.1  # the replayed experts are not the routers' own choices
    assert stats.moe_route_mismatch == pytest.approx(expect.moe_route_mismatch)
    after = local.engine_weights()
    experts = [k for k in before if "experts" in k]
    assert experts and min(float((after[k] - before[k]).abs().max()) for k in experts) > 50 * WEIGHT_TOL
    _assert_same_weights(dict(fsdp.engine_weights()), after, WEIGHT_TOL)  # every expert gathered, each trained


def test_bad_expert_parallel_is_refused(moe_dir: Path, small_dir: Path) -> None:
    with pytest.raises(ValidationError, match=r"train\.fsdp2\.expert_parallel=3 must divide train\.fsdp2\.world_size"):
        TrainConfig(fsdp2={"world_size": 2, "expert_parallel": 3})
    with pytest.raises(ValueError, match=r"train\.fsdp2\.expert_parallel=3 must divide the number of experts \(8"):
        check_split(load_model(moe_dir), 3)
    with pytest.raises(ValueError, match=r"train\.fsdp2\.expert_parallel=2: Qwen3ForCausalLM has no fused MoE"):
        check_split(load_model(small_dir), 2)


def test_save_and_resume_under_ep(pair, tmp_path: Path) -> None:
    """The whole training state at ep=2 (each ep rank's experts in its own part): a fresh ep=2 trainer loads it
    and one more step on each gives the same weights; a trainer at another expert_parallel is refused."""
    _, fsdp = pair
    fsdp.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt" / "shards").iterdir()) == ["ep0", "ep1"]
    assert_resumes(fsdp, _fsdp2(fsdp.spec), tmp_path / "ckpt", routed(seed=3))
    plain = FSDP2Trainer(fsdp.ranks, replace(fsdp.spec, expert_parallel=1))  # the facade checks before any rank
    with pytest.raises(ValueError, match=r"saved with train\.fsdp2\.expert_parallel=2; this trainer has 1"):
        plain.load(tmp_path / "ckpt")
