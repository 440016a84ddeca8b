"""On-policy distillation (furlong.train.distill, docs/distill.md): what the teacher scores, the advantage it
gives, how it joins GRPO's, a teacher that fails, and the config and tokenizer checks."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests_support import SMALL, gpt2_teacher, grpo

from furlong.agent.episode import Episode, EpisodeTiming
from furlong.config import ConfigError, load_config
from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.metrics.episodes import episode_record
from furlong.model import load_model
from furlong.model.chat import Message, continuation_ids, render_prompt_ids
from furlong.model.loading import load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.train import LocalTrainer, token_logprobs
from furlong.train.distill import (
    Teacher,
    TokenizerMismatch,
    check_tokenizers,
    distill_advantages,
    opd_advantage,
    teacher_for,
)
from furlong.train.grpo import OffPolicy

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SYSTEM = "You are an agent in a Linux terminal."
BRIEF = "Answer in as few words as you can."


def prompt_of(instruction: str) -> tuple[Message, ...]:
    return (Message("system", SYSTEM), Message("user", instruction))


def sample(model_dir: Path, prompts: list[list[int]], n: int, seed: int, max_new: int = 12) -> list:
    """`n` samples per prompt from a real hf engine over the model (temperature 1)."""

    async def main():
        async with HFEngine(load_model(model_dir), eos_token_ids=()) as engine:
            calls = [
                engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed + 100 * i + k))
                for i, p in enumerate(prompts)
                for k in range(n)
            ]
            return await asyncio.gather(*calls)

    return asyncio.run(main())


def one_turn(tokenizer, instruction: str, gen, group: int, sample_id: int, reward: float = 1.0) -> Episode:
    """A one-turn episode as the agent records it: its rendered prompt, then the sampled ids."""
    prompt = prompt_of(instruction)
    ids = render_prompt_ids(tokenizer, prompt)
    p, n = len(ids), len(gen.output_ids)
    return Episode(task_id=f"t{group}", group_id=group, sample_id=sample_id, prompt_len=p,
                   tokens=tuple(ids) + tuple(gen.output_ids), loss_mask=(0,) * p + (1,) * n,
                   rollout_logprobs=(0.0,) * p + tuple(gen.logprobs), token_weight_versions=(-1,) * p + (0,) * n,
                   reward=reward, status="ok", timing=EpisodeTiming(), turns=1, prompt=prompt)


def two_turns(tokenizer, instruction: str, first, second) -> Episode:
    """prompt, sampled turn, a tool observation (context, mask 0), sampled turn: how observations interleave."""
    e = one_turn(tokenizer, instruction, first, 0, 0)
    obs = continuation_ids(tokenizer, [Message("tool", "3 files")], end_of_turn="<|im_end|>")
    n = len(second.output_ids)
    return replace(e, tokens=e.tokens + tuple(obs) + tuple(second.output_ids),
                   loss_mask=e.loss_mask + (0,) * len(obs) + (1,) * n,
                   rollout_logprobs=e.rollout_logprobs + (0.0,) * len(obs) + tuple(second.logprobs),
                   token_weight_versions=e.token_weight_versions + (-1,) * len(obs) + (0,) * n, turns=2)


def own_logprobs(model, e: Episode) -> tuple[float, ...]:
    """The episode's logprobs under `model` in a batch of one, as the teacher computes a batch of one."""
    t = torch.tensor([e.tokens])
    logp = token_logprobs(model, t, torch.ones_like(t), 1.0, False, torch.tensor([e.loss_mask], dtype=torch.float32))
    return tuple(logp[0].tolist())


def plain_logprobs(model, ids: list[int]) -> list[float]:
    """Independently of furlong.train.logprobs: full logits, log_softmax, the next token's entry."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return [0.0, *logp.tolist()]


@pytest.fixture(scope="module")
def student(small_dir: Path):
    return load_model(small_dir), load_tokenizer(small_dir)


@pytest.fixture(scope="module")
def gens(small_dir: Path, student):
    _, tok = student
    prompts = [render_prompt_ids(tok, prompt_of(f"count the lines of file {k}")) for k in range(3)]
    return prompts, sample(small_dir, prompts, 2, seed=5)


def test_teacher_equal_to_student_gives_exactly_zero_advantage(student, gens) -> None:
    model, tok = student
    _, samples = gens
    eps = [one_turn(tok, f"count the lines of file {i // 2}", g, i // 2, i % 2) for i, g in enumerate(samples)]
    exact = [replace(e, rollout_logprobs=own_logprobs(model, e)) for e in eps]
    for teacher in (Teacher(tok, system_prompt=SYSTEM, micro_batch_size=1), Teacher(tok, model=model)):
        scored = teacher.score(exact, model).episodes
        for e in scored:
            assert e.distill is not None and e.distill.status == "scored" and e.distill.tokens == e.response_len
            assert torch.equal(opd_advantage(e), torch.zeros(len(e.tokens)))
    # against the engine's own rollout logprobs the term is the engine/trainer mismatch: tiny, not zero
    engine = Teacher(tok, system_prompt=SYSTEM).score(eps, model).episodes
    assert max(opd_advantage(e).abs().max().item() for e in engine) < 1e-4


def test_advantage_is_the_logprob_difference_computed_independently(small_dir: Path, student, gens) -> None:
    """A brevity system prompt re-renders the prompt; after it every token (sampled or observed) is the
    episode's own, and only sampled tokens are scored."""
    model, tok = student
    _, samples = gens
    eps = [two_turns(tok, "count the lines of file 0", samples[0], samples[1]),
           one_turn(tok, "count the lines of file 1", samples[2], 1, 0)]
    scored = Teacher(tok, system_prompt=BRIEF, micro_batch_size=2).score(eps, model).episodes
    for e in scored:
        text = tok.apply_chat_template([{"role": "system", "content": BRIEF},
                                        {"role": "user", "content": e.prompt[1].content}],
                                       add_generation_prompt=True, tokenize=False)
        teacher_prompt = tok.encode(text, add_special_tokens=False)
        ids = list(teacher_prompt) + list(e.tokens[e.prompt_len:])
        ref = plain_logprobs(model, ids)[len(teacher_prompt):]
        adv = opd_advantage(e)
        for k, m in enumerate(e.loss_mask[e.prompt_len:]):
            pos = e.prompt_len + k
            want = (ref[k] - e.rollout_logprobs[pos]) if m else 0.0
            assert abs(adv[pos].item() - want) < 1e-5, (pos, adv[pos].item(), want)
        assert abs(e.distill.reverse_kl - (-adv.sum().item() / e.response_len)) < 1e-5
    assert any(opd_advantage(e).abs().max() > 1e-2 for e in scored)  # another prompt: another distribution


def test_grpo_plus_opd_adds_the_weighted_term(student, gens) -> None:
    model, tok = student
    _, samples = gens
    eps = [one_turn(tok, f"count the lines of file {i // 2}", g, i // 2, i % 2, reward=float(i % 2))
           for i, g in enumerate(samples)]
    scored = list(Teacher(tok, system_prompt=BRIEF).score(eps, model).episodes)
    grpo_adv = torch.tensor([-0.5, 0.5, -0.25, 0.25, -1.0, 1.0])
    kept, adv = distill_advantages(scored, grpo_adv, "grpo+opd", 0.3)
    assert len(kept) == len(scored)
    for e, a, g in zip(scored, adv, grpo_adv):
        mask = torch.tensor(e.loss_mask, dtype=torch.float32)
        assert torch.allclose(a, g * mask + 0.3 * opd_advantage(e), atol=0)
    alone, adv_opd = distill_advantages(scored, grpo_adv, "opd", 0.3)
    assert all(torch.equal(a, opd_advantage(e)) for e, a in zip(alone, adv_opd))

    # the trainer's first step: ratio 1, so its loss is -mean(A_t x the off-policy weight) over sampled tokens
    trainer = LocalTrainer(load_model_copy(model), replace(grpo(filter_zero_variance=False, normalize_std=False,
                                                                negative_weight=1.0),
                                                           distill_mode="grpo+opd", distill_weight=0.3),
                           teacher=Teacher(tok, system_prompt=BRIEF))
    stats = trainer.train_step(trainer.score_teacher(eps).episodes)
    rewards = torch.tensor([e.reward for e in eps])
    centred = rewards - rewards.view(3, 2).mean(1).repeat_interleave(2)
    _, expect = distill_advantages(scored, centred, "grpo+opd", 0.3)
    loss = sum(-(a * _tis(e, model)).sum() for e, a in zip(scored, expect)) / sum(e.response_len for e in eps)
    assert stats.updated and abs(stats.loss - loss.item()) < 1e-5


def load_model_copy(model):
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def _tis(e: Episode, model) -> torch.Tensor:
    old = torch.tensor(own_logprobs(model, e))
    weight, _ = OffPolicy().weights((old - torch.tensor(e.rollout_logprobs)) * torch.tensor(e.loss_mask), None)
    return weight * torch.tensor(e.loss_mask)


@pytest.fixture(scope="module")
def short_teacher(tmp_path_factory, small_dir: Path) -> tuple[Path, int]:
    """A GPT-2 teacher with a 64-position context (tests_support.gpt2_teacher)."""
    return gpt2_teacher(tmp_path_factory.mktemp("teacher") / "gpt2", small_dir, 64), 64


def test_teacher_failure_leaves_those_episodes_without_the_term_and_training_goes_on(
    student, short_teacher, small_dir: Path
) -> None:
    model, tok = student
    path, context = short_teacher
    short = render_prompt_ids(tok, prompt_of("ls"))
    long = render_prompt_ids(tok, prompt_of("count the lines of every file " * 6))
    assert len(short) + 12 < context < len(long)
    samples = sample(small_dir, [short, long], 2, seed=9)
    eps = [one_turn(tok, "ls", samples[0], 0, 0, 1.0), one_turn(tok, "ls", samples[1], 0, 1, 0.0),
           one_turn(tok, "count the lines of every file " * 6, samples[2], 1, 0, 1.0),
           one_turn(tok, "count the lines of every file " * 6, samples[3], 1, 1, 0.0)]
    teacher = Teacher(load_tokenizer(path), model=load_model(path))
    trainer = LocalTrainer(load_model_copy(model), replace(grpo(filter_zero_variance=False), distill_mode="opd"),
                           teacher=teacher)
    taught = trainer.score_teacher(eps)
    statuses = [e.distill.status for e in taught.episodes]
    assert statuses == ["scored", "scored", "teacher_failed", "teacher_failed"]
    failed = taught.episodes[2]
    assert failed.teacher_logprobs is None and "IndexError" in failed.distill.error
    assert episode_record(failed, "rl", 0)["distill"] == {"status": "teacher_failed", "tokens": 0,
                                                        "reverse_kl": None, "error": failed.distill.error}
    assert taught.metrics()["distill_failed"] == 2 and taught.metrics()["distill_scored"] == 2
    stats = trainer.train_step(taught.episodes)  # opd: only the two the teacher scored are trained
    assert stats.updated and stats.loss_tokens == sum(e.response_len for e in eps[:2])
    trainer.config = replace(trainer.config, distill_mode="grpo+opd")  # grpo+opd: all four, GRPO's term alone
    assert trainer.train_step(taught.episodes).loss_tokens == sum(e.response_len for e in eps)


def test_teacher_with_another_tokenizer_is_refused_naming_both(small_dir: Path, tmp_path: Path) -> None:
    other = init_tiny(tmp_path / "other", spec=replace(SMALL, vocab_size=600))
    with pytest.raises(TokenizerMismatch) as err:
        check_tokenizers(small_dir, other)
    message = str(err.value)
    assert "\n" not in message and str(small_dir) in message and str(other) in message
    check_tokenizers(small_dir, small_dir)  # the same tokenizer passes
    # `furlong train` refuses it in one line before any phase runs
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", f"train.model.path={small_dir}",
                          f"train.run_dir={tmp_path / 'run'}", "train.distill.mode=opd",
                          f"train.distill.teacher.path={other}"], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and str(other) in res.stderr and str(small_dir) in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(("overrides", "names"), [
    (["train.distill.mode=opd"], "train.distill.teacher"),
    (["train.distill.mode=grpo+opd", "train.distill.teacher.path=/x", "train.distill.teacher.system_prompt=b"],
     "not both"),
    (["train.distill.teacher.system_prompt=b"], "train.distill.mode is off"),
    (["train.distill.mode=opd", "train.distill.teacher.system_prompt=b", "train.rl.filter_zero_variance=true"],
     "train.rl.filter_zero_variance"),
    (["train.distill.mode=opd", "train.distill.teacher.system_prompt=b", "train.agent.harness.command=[x]"],
     "train.agent.harness.command"),
    (["train.distill.mode=opd", "train.distill.teacher.system_prompt=b", "train.distill.weight=0"],
     "train.distill.weight"),
    (["train.distill.mode=opd", "train.distill.teacher.path=/x", "train.distill.teacher.frozen=true"],
     "train.distill.teacher.frozen"),
])
def test_config_errors_name_the_field(overrides: list[str], names: str) -> None:
    with pytest.raises(ConfigError, match=names.replace("+", r"\+")):
        load_config(None, overrides)


def test_distillation_turns_off_the_zero_variance_filter() -> None:
    cfg = load_config(None, ["train.distill.mode=opd", "train.distill.teacher.system_prompt=b"])
    assert cfg.train.distill.on and cfg.train.rl.filter_zero_variance is False
    assert load_config(None, []).train.rl.filter_zero_variance is True


def test_a_checkpoint_teacher_without_a_chat_template_renders_with_the_students(student, small_dir, tmp_path) -> None:
    model, tok = student
    out = tmp_path / "base"
    load_model(small_dir).save_pretrained(out)
    bare = load_tokenizer(small_dir)
    bare.chat_template = None
    bare.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    assert not load_tokenizer(out, require_chat_template=False).chat_template
    teacher = teacher_for(small_dir, path=out, system_prompt=None, hints={"t0": "wc -l < f"}, temperature=1.0,
                          micro_batch_size=4, device=torch.device("cpu"), load=load_model)
    e = one_turn(tok, "ls", SimpleNamespace(output_ids=(5, 6), logprobs=(-1.0, -2.0)), 0, 0)
    ids = teacher.prompt_ids(e)
    assert tok.decode(ids).count("wc -l < f") == 1  # the hint, in the teacher's system turn
    scored = teacher.score([e], model).episodes[0]
    assert scored.distill.status == "scored" and scored.distill.tokens == 2


def test_an_episode_without_prompt_messages_is_unscorable_by_a_prompt_teacher(student) -> None:
    """A harness episode keeps no prompt messages: a system-prompt teacher cannot re-render it and says so,
    while a checkpoint teacher reads the student's own prompt ids."""
    model, tok = student
    e = replace(one_turn(tok, "ls", SimpleNamespace(output_ids=(5, 6), logprobs=(-1.0, -2.0)), 0, 0), prompt=())
    out = Teacher(tok, system_prompt=BRIEF).score([e], model)
    assert out.episodes[0].distill.status == "unscorable" and out.episodes[0].teacher_logprobs is None
    assert out.metrics()["distill_unscorable"] == 1 and out.tokens == 0
    assert Teacher(tok, model=model).score([e], model).episodes[0].distill.status == "scored"


def test_a_zero_distillation_term_leaves_grpo_plus_opd_exactly_grpo(student, gens) -> None:
    """Teacher logprobs equal to the rollout's: the per-token path (grpo+opd) takes the step plain GRPO takes."""
    model, tok = student
    _, samples = gens
    eps = [one_turn(tok, f"count the lines of file {i // 2}", g, i // 2, i % 2, reward=float(i % 2))
           for i, g in enumerate(samples)]
    taught = [replace(e, teacher_logprobs=e.rollout_logprobs) for e in eps]
    cfg = grpo(filter_zero_variance=False, lr=1e-3, minibatches=2, negative_weight=0.1)
    plain, opd = (LocalTrainer(load_model_copy(model), c, teacher=t) for c, t in
                  ((cfg, None), (replace(cfg, distill_mode="grpo+opd"), Teacher(tok, model=model))))
    a, b = plain.train_step(eps), opd.train_step(taught)
    assert a.loss == pytest.approx(b.loss, abs=1e-7) and a.loss_tokens == b.loss_tokens
    for (name, p), q in zip(plain.model.named_parameters(), opd.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7), name


def test_a_frozen_self_teacher_holds_still_while_the_live_one_moves_with_the_policy(student, gens, small_dir) -> None:
    from furlong.build.training import teacher as build_teacher

    model, tok = student
    _, samples = gens
    eps = [one_turn(tok, f"count the lines of file {i // 2}", g, i // 2, i % 2, reward=float(i % 2))
           for i, g in enumerate(samples)]
    scores = {}
    for frozen in (False, True):
        t = load_config(None, ["train.distill.mode=grpo+opd", f"train.distill.teacher.system_prompt={BRIEF}",
                               f"train.distill.teacher.frozen={str(frozen).lower()}"]).train
        teacher = build_teacher(t, small_dir, torch.device("cpu"), {})
        assert (teacher.model is not None) == frozen and teacher.system_prompt == BRIEF
        trainer = LocalTrainer(load_model_copy(model), replace(grpo(lr=1e-2, filter_zero_variance=False),
                                                               distill_mode="grpo+opd"), teacher=teacher)
        before = trainer.score_teacher(eps).episodes
        assert trainer.train_step(before).updated
        after = trainer.score_teacher(eps).episodes
        scores[frozen] = [a.teacher_logprobs == b.teacher_logprobs for a, b in zip(before, after)]
    assert not any(scores[False]) and all(scores[True])
