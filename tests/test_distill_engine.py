"""A distillation teacher served by an engine (furlong.train.distill_engine; docs/distill.md "A teacher on
its own engine"): the same TeacherScore records and logprobs as the trainer-held teacher on the same episodes
(the hf engine in fp32: within 1e-5, the trainer's micro-batches pad and select positions differently), a
self-teacher's re-rendered prompt included; an engine that fails (closed, too short a context, too slow) fails
its episodes' term, never the step; and the config's refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from fsdp2_support import prompted_episodes
from tests_support import gpt2_teacher, grpo

from furlong.config import ConfigError, load_config
from furlong.engine.hf import HFEngine
from furlong.model.loading import load_model, load_tokenizer
from furlong.train.distill import Teacher, teacher_for
from furlong.train.distill_engine import EngineTeacher, ServedTeacher

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BRIEF = "Answer in as few words as you can."


def _held(small_dir: Path, path: Path | None, system_prompt: str | None) -> Teacher:
    return teacher_for(small_dir, path=path, system_prompt=system_prompt, hints={"t1": "wc -l *"}, temperature=0.8,
                       micro_batch_size=4, device=torch.device("cpu"), load=load_model)


def _served(small_dir: Path, path: Path, system_prompt: str | None, engine, **kw) -> EngineTeacher:
    served = ServedTeacher("hf", path, system_prompt, (("t1", "wc -l *"),))
    return EngineTeacher(served.renderer(small_dir, grpo(temperature=0.8)), engine, **kw)


@pytest.mark.parametrize("kind", ["checkpoint", "frozen-self"])
def test_an_engine_teacher_scores_as_the_trainer_held_one(small_dir: Path, tmp_path: Path, kind: str) -> None:
    episodes = prompted_episodes(load_tokenizer(small_dir))
    lengths = sorted(len(e.tokens) for e in episodes)
    if kind == "checkpoint":  # a GPT-2 whose context is shorter than the longer episodes: those fail, both ways
        context = lengths[len(lengths) // 2]
        path, prompt = gpt2_teacher(tmp_path / "gpt2", small_dir, context), None
    else:
        path, prompt = small_dir, BRIEF
    held = _held(small_dir, path, prompt)
    want = held.score(episodes, load_model(small_dir))

    async def go():
        async with HFEngine(load_model(path)) as engine:
            return await _served(small_dir, path, prompt, engine).score(episodes)

    got = asyncio.run(go())
    statuses = [e.distill.status for e in got.episodes]
    assert statuses == [e.distill.status for e in want.episodes]
    if kind == "checkpoint":
        assert 0 < statuses.count("teacher_failed") < len(episodes)  # the hint lengthens t1's prompts: no count
        assert all("context" in e.distill.error for e in got.episodes if e.distill.status == "teacher_failed")
    else:
        assert statuses.count("scored") == len(episodes)
    for a, b in zip(got.episodes, want.episodes, strict=True):
        assert (a.teacher_logprobs is None) == (b.teacher_logprobs is None)
        if a.teacher_logprobs is not None:
            assert a.teacher_logprobs == pytest.approx(b.teacher_logprobs, abs=1e-5)
            assert a.distill.tokens == b.distill.tokens and a.distill.reverse_kl == pytest.approx(b.distill.reverse_kl, abs=1e-5)
    assert got.seconds > 0 and got.tokens == sum(len(held.prompt_ids(e)) - e.prompt_len + len(e.tokens)
                                                  for e in episodes) == want.tokens
    assert got.metrics()["distill_scored"] == want.metrics()["distill_scored"] > 0


def test_an_engine_that_fails_fails_the_term_not_the_step(small_dir: Path) -> None:
    episodes = prompted_episodes(load_tokenizer(small_dir))[:3]

    async def go():
        engine = HFEngine(load_model(small_dir))
        slow = _served(small_dir, small_dir, BRIEF, engine, timeout_s=1e-4)
        timed_out = await slow.score(episodes)
        await engine.close()
        closed = await _served(small_dir, small_dir, BRIEF, engine).score(episodes)
        return timed_out, closed

    timed_out, closed = asyncio.run(go())
    assert all(e.distill.status == "teacher_failed" and e.teacher_logprobs is None for e in closed.episodes)
    assert all("engine is closed" in e.distill.error for e in closed.episodes)
    assert closed.metrics()["distill_failed"] == 3
    assert all("did not score in" in e.distill.error for e in timed_out.episodes)


def test_config_refuses_an_engine_teacher_it_cannot_serve() -> None:
    with pytest.raises(ConfigError, match="frozen=true"):
        load_config(None, ["train.distill.mode=opd", "train.distill.teacher.system_prompt=Be brief.",
                           "train.distill.teacher.engine=hf"])
    with pytest.raises(ConfigError, match="temperature 1 only"):
        load_config(None, ["train.distill.mode=opd", "train.distill.teacher.path=/tmp",
                           "train.distill.teacher.engine=vllm", "train.rl.temperature=0.7"])
    cfg = load_config(None, ["train.distill.mode=opd", "train.distill.teacher.system_prompt=Be brief.",
                             "train.distill.teacher.frozen=true", "train.distill.teacher.engine=hf"])
    assert cfg.train.distill.teacher.engine == "hf"
