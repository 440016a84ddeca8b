"""GRPO trainer: exact agreement with the engine at step 0, advantages and filtering, the DAPO loss, masking,
learning a toy task end to end with the HF engine, and checkpoint resume."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tests_support import grpo

from furlong.agent.episode import Episode, EpisodeTiming
from furlong.engine import Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import load_model
from furlong.rollout.group_filter import filter_zero_variance_groups
from furlong.train import (
    LocalTrainer,
    group_advantages,
    logprobs_from_logits,
    policy_loss,
    token_logprobs,
)
from furlong.train.batch import collate
from furlong.train.grpo import weigh_negatives
from furlong.train.sft import Demo, demo_nll
from furlong.train.trainer import lr_at

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def episode(prompt: list[int], gen: Generation, reward: float | None, group_id: int, sample_id: int,
            task_id: str = "toy") -> Episode:
    """An episode of one model turn: the prompt is context (mask 0), the sampled ids are trained on."""
    n, p = len(gen.output_ids), len(prompt)
    return Episode(task_id=task_id, group_id=group_id, sample_id=sample_id, prompt_len=p,
                   tokens=tuple(prompt) + gen.output_ids, loss_mask=(0,) * p + (1,) * n,
                   rollout_logprobs=(0.0,) * p + gen.logprobs,
                   token_weight_versions=(-1,) * p + gen.token_weight_versions, reward=reward,
                   status="ok" if reward is not None else "infra_error", timing=EpisodeTiming(), turns=1)


async def sample_groups(engine: HFEngine, prompts: list[list[int]], group_size: int, sampling: SamplingParams,
                        seed: int) -> list[list[Generation]]:
    """`group_size` samples per prompt, all in flight together (the engine batches them)."""
    calls = [engine.generate(p, replace(sampling, seed=seed + 1000 * g + i))
             for g, p in enumerate(prompts) for i in range(group_size)]
    gens = await asyncio.gather(*calls)
    return [list(gens[g * group_size:(g + 1) * group_size]) for g in range(len(prompts))]


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(3 + 7 * i)] for i in range(n)]


# --- step 0: the trainer recomputes exactly what the engine sampled with --------------------------------------


def test_token_logprobs_match_engine(tiny_dir: Path) -> None:
    """Both temperatures in one engine batch (mixed lengths, KV cache, left padding) against one right-padded
    trainer forward per temperature."""
    model = load_model(tiny_dir)
    prompts = random_prompts(4, 4000, seed=1)
    temperatures = (1.0, 0.7)

    async def main() -> list[list[Generation]]:
        async with HFEngine(model, eos_token_ids=()) as engine:
            runs = [sample_groups(engine, prompts, 2, SamplingParams(temperature=t, max_new_tokens=10), seed=7)
                    for t in temperatures]
            return await asyncio.gather(*runs)

    for temperature, groups in zip(temperatures, asyncio.run(main()), strict=True):
        eps = [episode(prompts[g], gen, 0.0, g, i) for g, group in enumerate(groups) for i, gen in enumerate(group)]
        mb = collate(eps, torch.zeros(len(eps)), torch.device("cpu"))
        with torch.no_grad():
            logp = token_logprobs(model, mb.tokens, mb.attention_mask, temperature)
        diff = ((logp - mb.rollout_logprobs) * mb.loss_mask).abs().max().item()
        assert diff <= TOL, (temperature, diff)
        assert (logp[:, 0] == 0).all() and (logp * (1 - mb.attention_mask)).abs().max() == 0


def test_first_step_is_on_policy(tiny_dir: Path) -> None:
    """Engine and trainer share weights at step 0: the trainer sees no mismatch and, on the first minibatch
    (computed by the separate no-grad pass and the grad pass), no policy movement and no clipping."""
    model, engine_model = load_model(tiny_dir), load_model(tiny_dir)
    prompts = random_prompts(3, 4000, seed=2)

    async def main() -> list[list[Generation]]:
        async with HFEngine(engine_model, eos_token_ids=()) as engine:
            sampling = SamplingParams(temperature=0.7, max_new_tokens=8)
            return await sample_groups(engine, prompts, 4, sampling, seed=3)

    groups = asyncio.run(main())
    eps = [episode(prompts[g], gen, float(i % 2), g, i)
           for g, group in enumerate(groups) for i, gen in enumerate(group)]
    trainer = LocalTrainer(model, grpo(lr=1e-3, temperature=0.7, minibatches=2, micro_batch_size=3))
    stats = trainer.train_step(eps)
    first = trainer.last_minibatches[0]
    assert stats.updated and stats.version == 1 and stats.groups_used == 3
    assert stats.logprob_diff_max <= TOL and abs(stats.rollout_train_kl) < 1e-5
    assert abs(first.ppo_kl) < 1e-6 and first.clip_frac == 0.0
    assert stats.tis_capped_frac == 0.0 and abs(stats.tis_weight_mean - 1.0) < 1e-3
    assert trainer.last_minibatches[1].ppo_kl != 0.0  # the second minibatch runs on updated weights


# --- advantages and dynamic sampling ---------------------------------------------------------------------------


def test_group_advantages_known_values() -> None:
    rewards, groups = [1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 2.0], [0, 0, 0, 0, 1, 1, 7]
    plain = group_advantages(rewards, groups, normalize_std=False)
    assert torch.allclose(plain, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    scaled = group_advantages(rewards, groups, normalize_std=True, eps=0.0)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased: sqrt(1/3)
    assert torch.allclose(scaled[:4], plain[:4] / std)
    assert scaled[4:].abs().max() == 0  # zero-variance group and singleton: advantage 0, no NaN
    assert torch.allclose(group_advantages([2.0, 0.0], ["a", "a"], eps=1e-6), torch.tensor([0.7071, -0.7071]),
                          atol=1e-4)


def test_negative_advantages_are_scaled_by_negative_weight() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], normalize_std=False)  # 0.75, -0.25 x3
    assert torch.equal(weigh_negatives(adv, 1.0), adv)
    assert torch.allclose(weigh_negatives(adv, 0.5), torch.tensor([0.75, -0.125, -0.125, -0.125]))
    assert torch.equal(weigh_negatives(adv, 0.0), torch.tensor([0.75, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="negative_weight"):
        weigh_negatives(adv, 1.5)


def test_lr_warms_up_then_follows_a_cosine_to_its_floor() -> None:
    cfg = grpo(lr=1.0, warmup_steps=4, lr_decay="cosine", steps=15, min_lr_ratio=0.1)  # 11 steps of decay
    assert cfg.decay_steps == 11
    lrs = [lr_at(cfg, step) for step in range(20)]
    assert lrs[:5] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert all(a > b for a, b in zip(lrs[4:14], lrs[5:15]))  # strictly down over the decay
    assert lrs[14] == pytest.approx(0.1) and lrs[19] == pytest.approx(0.1)
    assert [lr_at(grpo(lr=1.0, warmup_steps=4), s) for s in (3, 4, 100)] == [1.0, 1.0, 1.0]


def test_filter_zero_variance_groups() -> None:
    gen = Generation(output_ids=(5,), logprobs=(-1.0,), finish_reason="stop", weight_version=0,
                     token_weight_versions=(0,))
    rewards = {("a", 0): [1.0, 1.0], ("a", 1): [0.0, 1.0], ("b", 0): [0.0, 0.0, 0.0], ("b", 1): [0.5, 0.25]}
    eps = [episode([1, 2], gen, r, g, i, task_id=t) for (t, g), rs in rewards.items() for i, r in enumerate(rs)]
    kept = filter_zero_variance_groups(eps)
    assert (kept.groups_kept, kept.groups_dropped) == (2, 2)
    assert [(e.task_id, e.group_id) for e in kept.episodes] == [("a", 1), ("a", 1), ("b", 1), ("b", 1)]


def test_step_without_surviving_groups_does_not_update(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen = Generation(output_ids=(5, 6), logprobs=(-8.0, -8.0), finish_reason="stop", weight_version=0,
                     token_weight_versions=(0, 0))
    eps = [episode([1, 2, 3], gen, 1.0, 0, 0), episode([1, 2, 3], gen, 1.0, 0, 1),
           episode([1, 2, 3], gen, None, 0, 2)]  # an infra error would have made the group look varied
    trainer = LocalTrainer(model, grpo(lr=1e-2))
    stats = trainer.train_step(eps)
    assert not stats.updated and stats.groups_used == 0 and stats.groups_filtered == 1
    assert stats.episodes_dropped == 1 and stats.reward_mean == 1.0 and trainer.version == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the demonstration anchor needs no reward variance: it still takes its step, and the version moves
    anchored = LocalTrainer(load_model(tiny_dir), grpo(lr=1e-2, sft_coef=1.0, sft_batch=2), demos=_demos())
    stats = anchored.train_step(eps)
    assert stats.updated and stats.groups_used == 0 and anchored.version == 1
    assert stats.sft_nll > 0 and stats.grad_norm > 0 and stats.grad_norm_rl == 0 and stats.loss == 0
    assert any(not torch.equal(before[k], v) for k, v in anchored.model.state_dict().items())


# --- the loss ----------------------------------------------------------------------------------------------------


def test_clip_higher_stops_gradient_outside_the_trust_region() -> None:
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.0, 1.5, 1.2, 0.5]])).requires_grad_()  # ratios
    adv, mask = torch.tensor([1.0]), torch.ones(1, 4)
    loss, m = policy_loss(new, old, old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert new.grad is not None
    # ratio 1.5 > 1 + clip_high with A > 0: clipped, no gradient; 1.2 is inside [0.8, 1.28]: gradient; 0.5 with
    # A > 0 is below the range but the min keeps the unclipped (pessimistic) term: gradient.
    assert new.grad[0, 1] == 0 and new.grad[0, 2] != 0 and new.grad[0, 3] != 0 and new.grad[0, 0] != 0
    assert m.clip_frac == pytest.approx(0.25)
    # The asymmetry: with A < 0, ratio 0.75 < 1 - clip_low is clipped, but 1.25 (< 1 + clip_high) is not.
    new2 = torch.log(torch.tensor([[0.75, 1.25]])).requires_grad_()
    loss2, m2 = policy_loss(new2, torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    loss2.backward()
    assert new2.grad is not None and new2.grad[0, 0] == 0 and new2.grad[0, 1] != 0 and m2.clip_frac == 0.5


def test_tis_weight_is_capped_and_detached() -> None:
    new = torch.zeros(1, 3, requires_grad=True)
    old = torch.zeros(1, 3)
    rollout = torch.log(torch.tensor([[1.0, 0.25, 2.0]]))  # weights old/rollout: 1, 4 -> capped 2, 0.5
    loss, m = policy_loss(new, old, rollout, torch.tensor([1.0]), torch.ones(1, 3), tis_cap=2.0)
    loss.backward()
    assert new.grad is not None
    # d(-A * w * ratio)/d logp_new at ratio 1 is -A * w / n_tokens.
    assert torch.allclose(new.grad, -torch.tensor([[1.0, 2.0, 0.5]]) / 3)
    assert m.tis_capped_frac == pytest.approx(1 / 3) and m.tis_weight_mean == pytest.approx(3.5 / 3)
    assert m.logprob_diff_max == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert m.rollout_train_kl == pytest.approx((0 - 1.3863 + 0.6931) / 3, abs=1e-4)  # mean(rollout - old)


def test_kl_penalty_pulls_toward_reference() -> None:
    new = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -0.5]])
    loss, m = policy_loss(new, new.detach(), new.detach(), torch.tensor([0.0]), torch.ones(1, 2), kl_coef=0.5,
                          logp_ref=ref)
    loss.backward()
    expected = torch.exp(torch.tensor(0.5)) - 0.5 - 1  # k3 at ref - new = 0.5
    assert m.ref_kl == pytest.approx(expected.item() / 2, abs=1e-6)
    assert new.grad is not None and new.grad[0, 0] == 0 and new.grad[0, 1] < 0  # descent raises logp_new


def test_only_masked_tokens_contribute() -> None:
    torch.manual_seed(0)
    b, t, v = 3, 7, 11
    tokens = torch.randint(0, v, (b, t))
    mask = torch.tensor([[0, 0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0]], dtype=torch.float32)
    rollout = -torch.rand(b, t) * 3 * mask
    adv = torch.tensor([1.0, -0.5, 2.0])

    def run(tokens: torch.Tensor, rollout: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.clone().requires_grad_()
        logp = logprobs_from_logits(logits, tokens, 1.0)
        old = logp.detach() + 0.1 * torch.randn(b, t, generator=torch.Generator().manual_seed(1))
        loss, _ = policy_loss(logp, old, rollout, adv, mask, logp_ref=old - 0.2, kl_coef=0.3)
        loss.backward()
        assert logits.grad is not None
        return loss.detach(), logits.grad

    logits = torch.randn(b, t, v)
    loss, grad = run(tokens, rollout, logits)
    # logits[t - 1] predict token t: only those feeding a masked token get a gradient (never the last one).
    feeds_masked = torch.nn.functional.pad(mask[:, 1:], (0, 1)) > 0
    assert grad[~feeds_masked].abs().max() == 0 and grad[feeds_masked].abs().sum(-1).min() > 0
    # Scramble every unmasked token, rollout logprob and the logits that only feed unmasked tokens.
    off = mask == 0
    tokens2 = torch.where(off, torch.randint(0, v, (b, t)), tokens)
    rollout2 = torch.where(off, torch.full((b, t), -50.0), rollout)
    logits2 = torch.where(feeds_masked[..., None], logits, 1e3 * torch.randn(b, t, v))
    loss2, grad2 = run(tokens2, rollout2, logits2)
    assert torch.allclose(loss, loss2) and torch.allclose(grad[feeds_masked], grad2[feeds_masked])
    assert grad2[~feeds_masked].abs().max() == 0


# --- end to end: GRPO learns a toy task ----------------------------------------------------------------------


async def toy_grpo_steps(engine, trainer: LocalTrainer, prompts: list[list[int]], targets: set[int], steps: int) -> list[float]:
    """GRPO on the toy task, as the sync driver runs it: sample groups, score, train, push the weights to the
    engine; checks the engine ran exactly the trainer's weights at every step. The reward of each step."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    rewards: list[float] = []
    for step in range(steps):
        groups = await sample_groups(engine, prompts, 8, sampling, seed=100_000 * step)
        assert all(gen.weight_version == trainer.version for group in groups for gen in group)
        eps = [episode(prompts[g], gen, float(bool(targets & set(gen.output_ids))), g, i)
               for g, group in enumerate(groups) for i, gen in enumerate(group)]
        stats = trainer.train_step(eps)
        assert stats.logprob_diff_max <= TOL  # the engine runs exactly the trainer's weights
        rewards.append(stats.reward_mean)
        await engine.update_weights(trainer.engine_weights(), trainer.version)
    return rewards


def test_grpo_learns_toy_task(small_dir: Path) -> None:
    """Reward 1 when the 4-token answer contains one of 32 target ids (~22% by chance at the start); 40 steps
    of 4 groups x 8 samples, weights pushed to the engine after each step, as the sync driver does."""
    torch.manual_seed(0)
    policy, engine_model = load_model(small_dir), load_model(small_dir)
    vocab = policy.config.vocab_size
    targets = set(random.Random(0).sample(range(vocab), vocab // 16))
    trainer = LocalTrainer(policy, grpo(lr=3e-3, micro_batch_size=32))
    prompts = random_prompts(4, vocab, seed=3)

    async def main() -> list[float]:
        async with HFEngine(engine_model, eos_token_ids=()) as engine:
            return await toy_grpo_steps(engine, trainer, prompts, targets, 40)

    rewards = asyncio.run(main())
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.4, rewards  # measured over 5 seeds: ~0.23 -> ~0.96


# --- checkpoints -------------------------------------------------------------------------------------------------


def fixed_episodes(model, n_groups: int, seed: int) -> list[Episode]:
    """Deterministic episodes sampled from `model` without an engine (faster, and identical on every call)."""
    g = torch.Generator().manual_seed(seed)
    eps = []
    for group in range(n_groups):
        prompt = torch.randint(10, 500, (4 + group,), generator=g).tolist()
        for i in range(4):
            out = torch.randint(10, 500, (5,), generator=g)
            tokens = torch.tensor([prompt + out.tolist()])
            with torch.no_grad():
                logp = token_logprobs(model, tokens, torch.ones_like(tokens), 1.0)[0, len(prompt):]
            gen = Generation(output_ids=tuple(out.tolist()), logprobs=tuple(logp.tolist()), finish_reason="length",
                             weight_version=0, token_weight_versions=(0,) * 5)
            eps.append(episode(prompt, gen, float((i + group) % 2), group, i))
    return eps


def test_save_load_resumes_exactly(small_dir: Path, tmp_path: Path) -> None:
    config = grpo(lr=1e-3, minibatches=2, epochs=2, micro_batch_size=3, weight_decay=0.01)
    batches = [fixed_episodes(load_model(small_dir), 3, seed=s) for s in range(3)]
    a = LocalTrainer(load_model(small_dir), config)
    a.train_step(batches[0])
    a.save(tmp_path / "ckpt")
    a.save(tmp_path / "ckpt")  # overwriting an existing checkpoint works and leaves no debris
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    b = LocalTrainer(load_model(small_dir), config)
    b.load(tmp_path / "ckpt")
    assert b.version == a.version == 1
    for (name, pa), pb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k][f], sb[k][f]) for k in sa for f in sa[k])
    for batch in batches[1:]:  # the shuffled minibatch order and Adam moments must carry over too
        ra, rb = a.train_step(batch), b.train_step(batch)
        assert abs(ra.loss - rb.loss) <= 1e-6 and ra.grad_norm == pytest.approx(rb.grad_norm, abs=1e-6)
        assert [m.loss for m in a.last_minibatches] == pytest.approx([m.loss for m in b.last_minibatches], abs=1e-6)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_bf16_autocast_keeps_fp32_weights_and_logprobs(small_dir: Path) -> None:
    model = load_model(small_dir)
    trainer = LocalTrainer(model, grpo(lr=1e-3, bf16_autocast=True))
    stats = trainer.train_step(fixed_episodes(load_model(small_dir), 2, seed=0))
    assert stats.updated and all(p.dtype == torch.float32 for p in model.parameters())
    # bf16 matmuls against fp32 rollouts: a visible but small mismatch, which TIS is there to absorb.
    assert 0 < stats.logprob_diff_max < 0.5 and torch.isfinite(torch.tensor(stats.loss))
    with pytest.raises(ValueError, match="fp32"):
        LocalTrainer(load_model(small_dir, dtype=torch.bfloat16), grpo())


def test_reference_kl_grows_as_the_policy_moves(small_dir: Path) -> None:
    trainer = LocalTrainer(load_model(small_dir), grpo(lr=3e-3, kl_coef=0.1), ref_model=load_model(small_dir))
    batch = fixed_episodes(load_model(small_dir), 2, seed=0)
    first, second = trainer.train_step(batch), trainer.train_step(batch)
    assert abs(first.ref_kl) < 1e-7 and second.ref_kl > 1e-5
    with pytest.raises(ValueError, match="ref_model"):
        LocalTrainer(load_model(small_dir), grpo(kl_coef=0.1))


def test_selected_positions_match_the_full_output_layer():
    from furlong.model.loading import load_model
    from furlong.model.tiny import init_tiny
    from furlong.train.logprobs import token_logprobs

    model = load_model(init_tiny())
    torch.manual_seed(0)
    tokens = torch.randint(1, 4000, (3, 20))
    attn = torch.ones_like(tokens)
    attn[2, 15:] = 0  # a right-padded row
    mask = (torch.rand(3, 20) < 0.5).float()
    full, full_ent = token_logprobs(model, tokens, attn, 0.7, with_entropy=True)
    part, part_ent = token_logprobs(model, tokens, attn, 0.7, with_entropy=True, positions=mask)
    keep = (mask > 0) & (attn > 0)
    keep[:, 0] = False
    assert torch.allclose(part[keep], full[keep], atol=1e-5) and torch.allclose(part_ent[keep], full_ent[keep], atol=1e-5)
    assert (part[~keep] == 0).all()
    part.sum().backward()  # differentiable through the selected positions
    assert model.get_output_embeddings().weight.grad is not None


# --- the demonstration anchor (PPO-ptx) --------------------------------------------------------------------------


def _demos() -> list[Demo]:
    g = torch.Generator().manual_seed(7)
    return [Demo(task_id=f"d{i}", tokens=tuple(torch.randint(10, 500, (12,), generator=g).tolist()),
                 loss_mask=(0,) * 6 + (1,) * 6) for i in range(4)]


def test_the_demonstration_anchor_pulls_the_policy_toward_the_demonstrations(small_dir: Path) -> None:
    """RL on batches that say nothing about the demonstrations: with sft_coef their NLL falls and ends below
    the plain run's; without it the demonstrations are ignored and the run is exactly plain GRPO."""
    demos, batch = _demos(), fixed_episodes(load_model(small_dir), 3, seed=0)
    with torch.no_grad():
        start = float(demo_nll(load_model(small_dir), demos))
    plain = LocalTrainer(load_model(small_dir), grpo(lr=3e-3))
    ignored = LocalTrainer(load_model(small_dir), grpo(lr=3e-3), demos=demos)
    anchored = LocalTrainer(load_model(small_dir), grpo(lr=3e-3, sft_coef=1.0, sft_batch=4), demos=demos)
    for _ in range(4):
        a, b, c = plain.train_step(batch), ignored.train_step(batch), anchored.train_step(batch)
        assert a.sft_nll == b.sft_nll == 0 and c.sft_nll > 0 and a.loss == b.loss
        assert a.grad_norm == a.grad_norm_rl and c.grad_norm != c.grad_norm_rl
    assert all(torch.equal(p, q) for p, q in zip(plain.model.parameters(), ignored.model.parameters(), strict=True))
    with torch.no_grad():
        after_plain, after_anchored = float(demo_nll(plain.model, demos)), float(demo_nll(anchored.model, demos))
    assert after_anchored < start - 0.5 and after_anchored < after_plain - 0.5, (start, after_plain, after_anchored)
    with pytest.raises(ValueError, match="demonstrations"):
        LocalTrainer(load_model(small_dir), grpo(sft_coef=1.0))
