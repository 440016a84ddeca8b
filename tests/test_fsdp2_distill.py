"""On-policy distillation with the FSDP2 trainer (docs/distill.md "Where the teacher lives") at world size 2 on
gloo, against LocalTrainer on the same batch and weights: the teacher's per-token logprobs, the step's distill
metrics, then the grpo+opd step trained on them (the loss code is the local trainer's: the same stats).

A checkpoint teacher (a GPT-2 whose context is shorter than some episodes: those fail on their rank, recorded,
as locally) is whole on each rank; a self-distillation teacher is the sharded policy (here with LoRA) under
another system prompt. Micro-batches of 2 over 9 episodes: the ranks' shares differ, so one rank makes an idle
collective forward. Tolerances: test_fsdp2's (the same sums, other paddings and orders)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from furlong.model.loading import load_tokenizer
from furlong.train.distill import TeacherSpec
from fsdp2_support import prompted_episodes
from test_fsdp2 import LORA, STAT_TOL, WEIGHT_TOL, _assert_same_weights, _fsdp2, _local, _spec
from tests_support import SMALL, gpt2_teacher

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BRIEF = "Answer in as few words as you can."


@pytest.mark.parametrize("kind", ["checkpoint", "self-lora"])
def test_teacher_logprobs_and_step_match_the_local_trainer(small_dir: Path, tmp_path: Path, kind: str) -> None:
    episodes = prompted_episodes(load_tokenizer(small_dir))
    lengths = sorted(len(e.tokens) for e in episodes)
    context = lengths[len(lengths) // 2]  # the longer episodes overflow the checkpoint teacher's positions
    if kind == "checkpoint":
        teacher, lora = TeacherSpec(path=gpt2_teacher(tmp_path / "gpt2", small_dir, context)), None
    else:
        teacher, lora = TeacherSpec(system_prompt=BRIEF, hints=(("t1", "wc -l *"),)), LORA
    base = _spec(small_dir, lora=lora, filter_zero_variance=False)
    spec = replace(base, config=replace(base.config, distill_mode="grpo+opd", distill_weight=0.5), teacher=teacher)
    local, fsdp = _local(spec), _fsdp2(spec)
    try:
        want, got = local.score_teacher(episodes), fsdp.score_teacher(episodes)
        assert [e.distill.status for e in got.episodes] == [e.distill.status for e in want.episodes]
        failed = [e for e in got.episodes if e.distill.status == "teacher_failed"]
        if kind == "checkpoint":  # exactly the episodes longer than the teacher's context, with the error
            assert len(failed) == sum(n > context for n in lengths) > 0
            assert all("IndexError" in e.distill.error for e in failed)
        else:
            assert not failed
        for a, b in zip(got.episodes, want.episodes, strict=True):
            assert (a.task_id, a.sample_id, a.distill.tokens) == (b.task_id, b.sample_id, b.distill.tokens)
            assert (a.teacher_logprobs is None) == (b.teacher_logprobs is None)
            if a.teacher_logprobs is not None:
                assert a.teacher_logprobs == pytest.approx(b.teacher_logprobs, abs=1e-5)
                assert a.distill.reverse_kl == pytest.approx(b.distill.reverse_kl, abs=1e-5)
        ours, theirs = got.metrics(), want.metrics()
        assert got.tokens == want.tokens > 0 and ours["distill_scored"] == theirs["distill_scored"] > 0
        for key in ("distill_failed", "distill_unscorable", "distill_reverse_kl"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-6), key
        assert ours["teacher_seconds"] > 0
        a, b = fsdp.train_step(got.episodes), local.train_step(want.episodes)
        for name in ("loss", "grad_norm", "entropy", "clip_frac"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=STAT_TOL, abs=1e-7), name
        assert a.loss_tokens == b.loss_tokens
        _assert_same_weights(dict(fsdp.engine_weights()), local.engine_weights(), WEIGHT_TOL)
        if kind != "checkpoint":  # the live teacher is the sharded policy: after the step, its new weights
            again, locally = fsdp.score_teacher(episodes), local.score_teacher(episodes)
            assert again.episodes[0].teacher_logprobs != got.episodes[0].teacher_logprobs
            assert again.episodes[0].teacher_logprobs == pytest.approx(locally.episodes[0].teacher_logprobs, abs=1e-5)
    finally:
        fsdp.close()


def test_a_self_teacher_that_cannot_read_an_episode_fails_it_not_the_run(small_dir: Path) -> None:
    """A sampled id outside the vocabulary (a student's added token the checkpoint's embedding lacks) makes the
    teacher's forward raise (IndexError in the embedding). Under FSDP2 that forward is a collective: before this
    was screened, the rank holding the episode raised inside it and the step ended with RankFailed. Now the
    episode fails on its rank before any forward, the other ranks still meet it in every pass, and the statuses,
    logprobs and metrics are the local trainer's (which screens the same way)."""
    episodes = prompted_episodes(load_tokenizer(small_dir))
    bad = len(episodes) // 2
    e = episodes[bad]
    episodes[bad] = replace(e, tokens=e.tokens[:-1] + (SMALL.vocab_size + 7,))
    base = _spec(small_dir, lora=LORA, filter_zero_variance=False)
    spec = replace(base, config=replace(base.config, distill_mode="grpo+opd"), teacher=TeacherSpec(system_prompt=BRIEF))
    local, fsdp = _local(spec), _fsdp2(spec)
    try:
        with pytest.raises(IndexError):  # what the forward itself does with the id, unscreened
            local.teacher._forward(local.model, [episodes[bad]], [(0, list(episodes[bad].tokens), 0)])
        want, got = local.score_teacher(episodes), fsdp.score_teacher(episodes)
        statuses = [x.distill.status for x in got.episodes]
        assert statuses == [x.distill.status for x in want.episodes]
        assert statuses[bad] == "teacher_failed" and statuses.count("teacher_failed") == 1
        assert got.episodes[bad].teacher_logprobs is None
        assert f"token id {SMALL.vocab_size + 7} is outside the teacher's vocabulary" in got.episodes[bad].distill.error
        for a, b in zip(got.episodes, want.episodes, strict=True):
            if a.teacher_logprobs is not None:
                assert a.teacher_logprobs == pytest.approx(b.teacher_logprobs, abs=1e-5)
        metrics = got.metrics()
        assert metrics["distill_failed"] == 1 and metrics["distill_scored"] == len(episodes) - 1
        assert metrics["teacher_tokens"] == want.tokens > 0
        good = [x for i, x in enumerate(got.episodes) if i != bad]  # the run goes on: the ranks train together
        assert fsdp.train_step(good).loss_tokens == local.train_step([x for i, x in enumerate(want.episodes) if i != bad]).loss_tokens
    finally:
        fsdp.close()
