"""`furlong train` with a distillation teacher, end to end on the smoke recipe (2 RL steps each): on-policy
distillation from another checkpoint whose context is too short for some episodes (their term is absent,
recorded, and the run goes on), and self-distillation beside GRPO with a hint, on LoRA in async mode; then
(1 RL step) the same checkpoint teacher on an hf engine of its own (train.distill.teacher.engine=hf)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tests_support import Background
from transformers import GPT2Config, GPT2LMHeadModel

from furlong.config import DEFAULT_SYSTEM_PROMPT, RECIPES
from furlong.metrics.episodes import read_jsonl
from furlong.model.loading import load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.report.build import report

SMOKE = ["--config", str(RECIPES / "smoke.yaml"), "train.rl.steps=2"]
CONTEXT = 97  # the smoke episodes are 96-99 tokens: a teacher this short fails on some of them


def short_context_teacher(out: Path) -> Path:
    """A GPT-2 checkpoint (another family) with the default student's tokenizer and a short context."""
    student = init_tiny()  # what `furlong train` starts from without train.model.path
    tok = load_tokenizer(student)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=CONTEXT, n_embd=32, n_layer=1, n_head=2)).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def rl(run: Path) -> tuple[list[dict], list[dict]]:
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if r["phase"] == "rl"]
    return rows, [r for r in read_jsonl(run / "episodes.jsonl") if r["phase"] == "rl" and r["outcome"] == "trained"]


def test_train_distils_from_a_checkpoint_and_from_itself(tmp_path: Path) -> None:
    teacher = short_context_teacher(tmp_path / "teacher")
    opd, selfd = tmp_path / "opd", tmp_path / "self"
    brief = f"{DEFAULT_SYSTEM_PROMPT} Use as few commands as you can."
    runs = [
        Background(tmp_path / "opd.log", "train", *SMOKE, f"train.run_dir={opd}", "train.distill.mode=opd",
                   f"train.distill.teacher.path={teacher}"),
        Background(tmp_path / "self.log", "train", *SMOKE, f"train.run_dir={selfd}", "train.distill.mode=grpo+opd",
                   "train.distill.weight=0.5", f"train.distill.teacher.system_prompt={brief}",
                   "train.distill.teacher.hint=solution", "train.lora.enabled=true", "train.rl.mode=async"),
    ]
    try:
        results = [r.result(timeout_s=900) for r in runs]
    finally:
        for r in runs:
            r.stop()
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]

    # a checkpoint teacher: exactly the episodes longer than its context lose the term, and say why
    rows, eps = rl(opd)
    assert len(rows) == 2 and json.loads((opd / "summary.json").read_text())["rl_steps"] == 2
    for e in eps:
        failed = e["tokens_total"] > CONTEXT
        assert e["distill"]["status"] == ("teacher_failed" if failed else "scored"), e
        assert ("IndexError" in e["distill"]["error"]) if failed else e["distill"]["tokens"] == e["tokens_response"]
    assert sum(r["distill_failed"] for r in rows) == sum(e["distill"]["status"] == "teacher_failed" for e in eps) > 0
    assert all(r["teacher_seconds"] > 0 and r["teacher_tokens"] > 0 for r in rows)

    # self-distillation: every episode scored; the teacher prefilled its longer prompt (and the solution hint)
    rows, eps = rl(selfd)
    assert len(rows) == 2 and all(e["distill"]["status"] == "scored" for e in eps)
    assert sum(r["teacher_tokens"] for r in rows) > sum(e["tokens_total"] for e in eps)
    assert all(r["distill_scored"] > 0 and r["updated"] for r in rows)
    text = (report(selfd, None, None, []).out / "report.md").read_text()
    assert "Distillation teacher" in text and "teacher s/step" in text


def test_train_distils_from_a_teacher_on_its_own_hf_engine(tmp_path: Path) -> None:
    """train.distill.teacher.engine=hf, 1 RL step: the short-context GPT-2 teacher served by one more hf engine
    (whose context is the checkpoint's 97 positions): the episodes longer than that are refused by the engine
    and recorded as failed, the others scored, and the step's teacher keys are there (tests/test_distill_engine.py
    checks the engine's logprobs against the trainer-held teacher's)."""
    teacher = short_context_teacher(tmp_path / "teacher")
    run = tmp_path / "run"
    bg = Background(tmp_path / "train.log", "train", *SMOKE, "train.rl.steps=1", f"train.run_dir={run}",
                    "train.distill.mode=grpo+opd", f"train.distill.teacher.path={teacher}",
                    "train.distill.teacher.engine=hf")
    try:
        res = bg.result(timeout_s=900)
    finally:
        bg.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    rows, eps = rl(run)
    assert len(rows) == 1 and eps
    for e in eps:
        failed = e["tokens_total"] > CONTEXT
        assert e["distill"]["status"] == ("teacher_failed" if failed else "scored"), e
        assert ("97-token context" in e["distill"]["error"]) if failed else e["distill"]["tokens"] == e["tokens_response"]
    assert rows[0]["teacher_seconds"] > 0 and rows[0]["teacher_tokens"] > 0
    assert rows[0]["distill_scored"] == sum(e["distill"]["status"] == "scored" for e in eps) > 0
