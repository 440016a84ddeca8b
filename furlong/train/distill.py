"""On-policy distillation (docs/distill.md): a teacher scores every token the student sampled, prefill only,
and the per-token reverse KL to it is an advantage, alone (opd) or added to GRPO's (grpo+opd).

What the teacher reads: its own rendering of the episode's prompt (the system and first user message, with
its system prompt and the task's solution as a hint where asked), then the episode's tokens after the prompt
exactly as they are: the student's sampled ids and the tool observations between them, which the student's
template rendered. Only the sampled tokens (loss mask 1) are scored. The per-token advantage is

    A_t = -(logp_rollout(t) - logp_teacher(t))

with the rollout's own logprobs standing in for the student's (Thinking Machines, "On-Policy Distillation"):
the sampled token's reverse-KL estimate, not trained through (the teacher's logprobs carry no gradient,
the rollout's are data). A teacher that raises while scoring leaves its episodes without the term, recorded
on each (TeacherScore status teacher_failed), never a crashed step or a silent zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel

from furlong.agent.episode import Episode, TeacherScore
from furlong.model.chat import Message, render_prompt_ids
from furlong.model.loading import load_tokenizer
from furlong.train.grpo_config import GRPOConfig
from furlong.train.logprobs import token_logprobs

MODES = ("off", "opd", "grpo+opd")
HINT_HEADER = "A correct solution to this task, for your eyes only:"
Item = tuple[int, list[int], int]  # (the episode's index, the teacher's ids, shift: teacher position - episode's)


class TokenizerMismatch(ValueError):
    """The teacher's tokenizer gives other ids than the student's: it cannot score the student's ids."""


def check_tokenizers(student: Path, teacher: Path, student_tok=None) -> None:
    """Refuse a teacher whose vocabulary or encoding differs from the student's, in one line naming both."""
    s = student_tok if student_tok is not None else load_tokenizer(student, require_chat_template=False)
    t = load_tokenizer(teacher, require_chat_template=False)
    sv, tv = s.get_vocab(), t.get_vocab()
    probe = "The teacher scores the student's ids: ls -la /app && echo 42 > out.txt\n"
    differ = sum(1 for k in sv.keys() | tv.keys() if sv.get(k) != tv.get(k))
    if differ or s.encode(probe, add_special_tokens=False) != t.encode(probe, add_special_tokens=False):
        what = (
            f"{differ} of {len(sv | tv)} vocabulary entries differ" if differ else "the same text encodes to other ids"
        )
        raise TokenizerMismatch(
            f"train.distill.teacher.path: the teacher's tokenizer ({teacher}) is not the student's ({student}): "
            f"{what}; the teacher must score the student's token ids, so both need one tokenizer"
        )


@dataclass(frozen=True)
class TeacherPass:
    """One step's scoring: the episodes with their teacher logprobs (and a TeacherScore each), and its cost."""

    episodes: tuple[Episode, ...]
    seconds: float
    tokens: int  # prefilled by the teacher: whole sequences, prompts and observations included

    def metrics(self) -> dict[str, float]:
        """The step row's keys: the teacher's cost, how many episodes got the term, the mean reverse KL."""
        scores = [e.distill for e in self.episodes if e.distill is not None]
        scored = [s for s in scores if s.status == "scored" and s.tokens]
        kl_tokens = sum(s.tokens for s in scored)
        return {
            "teacher_seconds": self.seconds,
            "teacher_tokens": self.tokens,
            "distill_scored": sum(s.status == "scored" for s in scores),
            "distill_failed": sum(s.status == "teacher_failed" for s in scores),
            "distill_unscorable": sum(s.status == "unscorable" for s in scores),
            "distill_reverse_kl": sum(s.tokens * (s.reverse_kl or 0.0) for s in scored) / max(kl_tokens, 1),
        }


class Teacher:
    """Scores episodes with `model` (a frozen checkpoint), or with the policy handed to `score` (model None:
    self-distillation, the student's current weights); `served`: by an engine (furlong.train.distill_engine),
    this object only rendering the teacher's prompts. `system_prompt` (None: the episode's own) replaces
    the prompt's system message; `hints` maps a task id to a privileged hint appended to it."""

    def __init__(
        self,
        tokenizer,
        *,
        model: PreTrainedModel | None = None,
        system_prompt: str | None = None,
        hints: Mapping[str, str] | None = None,
        temperature: float = 1.0,
        micro_batch_size: int = 16,
        served: bool = False,
    ) -> None:
        if model is None and system_prompt is None and not served:
            raise ValueError("a teacher is another model, or the policy under another system prompt")
        self.tokenizer, self.model, self.system_prompt = tokenizer, model, system_prompt
        self.hints = dict(hints or {})
        self.temperature, self.micro_batch_size = temperature, micro_batch_size
        if model is not None:
            model.eval().requires_grad_(False)

    def prompt_ids(self, e: Episode) -> list[int] | None:
        """The teacher's rendering of the episode's prompt; None where it cannot be rendered (a harness
        episode has no prompt messages: a checkpoint teacher then reads the student's own prompt ids)."""
        if not e.prompt:
            return list(e.tokens[: e.prompt_len]) if self.system_prompt is None else None
        messages = list(e.prompt)
        if messages[0].role != "system":
            messages.insert(0, Message("system", ""))
        system = self.system_prompt if self.system_prompt is not None else messages[0].content
        hint = self.hints.get(e.task_id)
        if hint:
            system = f"{system}\n\n{HINT_HEADER}\n{hint.strip()}"
        messages[0] = Message("system", system)
        tools = list(e.prompt_tools) if e.prompt_tools is not None else None
        return render_prompt_ids(self.tokenizer, messages, tools)

    def prepare(self, episodes: Sequence[Episode]) -> tuple[list[Episode], list[Item]]:
        """Each episode as it stands (failed or unscorable where its prompt cannot be rendered), and the teacher's
        ids of the others, shortest first (similar lengths pad less). No forward: it is this process's alone."""
        out: list[Episode] = list(episodes)
        todo: list[Item] = []
        for i, e in enumerate(episodes):
            if e.reward is None:
                continue  # an infra error is never trained on
            try:
                ids = self.prompt_ids(e)
            except Exception as err:  # noqa: BLE001 -- a template that cannot render this prompt fails this episode
                out[i] = failed_episode(e, err)
                continue
            if ids is None:
                out[i] = replace(e, distill=TeacherScore("unscorable", error="no prompt messages to re-render"))
            else:
                todo.append((i, ids + list(e.tokens[e.prompt_len :]), len(ids) - e.prompt_len))
        todo.sort(key=lambda item: len(item[1]))
        return out, todo

    def passes(self, todo: Sequence[Item]) -> int:
        """The micro-batches (forwards) `run` makes over `todo` when none fails."""
        return -(-len(todo) // self.micro_batch_size)

    @torch.no_grad()
    def score(self, episodes: Sequence[Episode], policy: PreTrainedModel) -> TeacherPass:
        """Every scored episode (reward not None) with teacher logprobs or the reason it has none."""
        start = time.perf_counter()
        out, todo = self.readable(episodes, policy)
        return self.run(episodes, out, todo, policy, start)

    def readable(self, episodes: Sequence[Episode], policy) -> tuple[list[Episode], list[Item]]:
        """`prepare`, less the items the scoring model (this teacher's own, else `policy`) cannot read (`screen`)."""
        out, todo = self.prepare(episodes)
        return out, self.screen(self.model if self.model is not None else policy, episodes, out, todo)

    def screen(self, model, episodes: Sequence[Episode], out: list[Episode], todo: list[Item]) -> list[Item]:
        """`todo` less the items `model` cannot read, whose episodes fail here (in `out`) before any forward: an id
        outside its vocabulary (a student's added token the teacher's embedding lacks) would raise inside the
        forward, and under FSDP2 a self-distillation teacher's forward is a collective that one rank cannot
        leave or retry alone (its peers would wait in it)."""
        vocab = model.get_input_embeddings().num_embeddings
        kept: list[Item] = []
        for item in todo:
            bad = next((t for t in item[1] if not 0 <= t < vocab), None)
            if bad is None:
                kept.append(item)
            else:
                err = IndexError(f"token id {bad} is outside the teacher's vocabulary (ids 0..{vocab - 1})")
                out[item[0]] = failed_episode(episodes[item[0]], err)
        return kept

    @torch.no_grad()
    def run(
        self,
        episodes: Sequence[Episode],
        out: list[Episode],
        todo: list[Item],
        policy: PreTrainedModel,
        start: float,
        forward: Callable | None = None,
    ) -> TeacherPass:
        """`prepare`'s episodes scored in micro-batches. `forward(*args)` runs `token_logprobs(policy, *args)` where
        the policy's forward is a collective (a sharded policy, self-distillation under FSDP2): every rank must make
        the same forwards, so a failure there is not retried one episode at a time; it raises."""
        model = self.model if self.model is not None else policy
        run_forward = forward if self.model is None and forward is not None else None
        tokens = 0
        for k in range(0, len(todo), self.micro_batch_size):
            chunk = todo[k : k + self.micro_batch_size]
            tokens += sum(len(ids) for _, ids, _ in chunk)
            for i, result in self._score_chunk(model, [episodes[i] for i, _, _ in chunk], chunk, run_forward):
                out[i] = result
        return TeacherPass(tuple(out), time.perf_counter() - start, tokens)

    def _score_chunk(self, model, eps: list[Episode], chunk: list[Item], forward: Callable | None):
        """One padded forward; if it raises, each episode alone, so only those that fail lose the term."""
        if forward is not None:  # collective: no retry (the peers would wait in a forward never made)
            try:
                batch = self._batch(model, eps, chunk)
            except Exception as err:  # noqa: BLE001 -- this rank's inputs fail: it still makes the pass's forward
                idle(forward, batch_device(model))
                return [(i, failed_episode(e, err)) for (i, _, _), e in zip(chunk, eps)]
            rows = self._forward(model, eps, chunk, forward, batch)
            return [(i, scored_episode(e, row)) for (i, _, _), e, row in zip(chunk, eps, rows)]
        try:
            rows = self._forward(model, eps, chunk)
        except Exception as err:  # noqa: BLE001 -- any teacher failure: recorded per episode, the run goes on
            if len(chunk) == 1:
                return [(chunk[0][0], failed_episode(eps[0], err))]
            return [r for e, item in zip(eps, chunk) for r in self._score_chunk(model, [e], [item], None)]
        return [(i, scored_episode(e, row)) for (i, _, _), e, row in zip(chunk, eps, rows)]

    def _batch(self, model, eps: list[Episode], chunk: list[Item]) -> tuple[torch.Tensor, ...]:
        """The padded ids, attention mask and sampled-token mask of a micro-batch, on the model's device."""
        device = batch_device(model)
        width = max(len(ids) for _, ids, _ in chunk)
        tokens = torch.zeros((len(chunk), width), dtype=torch.long)
        attention = torch.zeros_like(tokens)
        wanted = torch.zeros((len(chunk), width), dtype=torch.float32)
        for row, ((_, ids, shift), e) in enumerate(zip(chunk, eps)):
            tokens[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            sampled = [p + shift for p, m in enumerate(e.loss_mask) if m]
            wanted[row, sampled] = 1.0
        return tokens.to(device), attention.to(device), wanted.to(device)

    def _forward(
        self, model, eps: list[Episode], chunk: list[Item], forward: Callable | None = None, batch=None
    ) -> list[list[float]]:
        """Per episode, the teacher's logprob of each of its tokens (0.0 off the loss mask)."""
        tokens, attention, wanted = batch if batch is not None else self._batch(model, eps, chunk)
        run = forward if forward is not None else partial(token_logprobs, model)
        logp = run(tokens, attention, self.temperature, False, wanted).cpu()
        rows = []
        for row, ((_, _, shift), e) in enumerate(zip(chunk, eps)):
            values = logp[row].tolist()
            rows.append([values[p + shift] if m else 0.0 for p, m in enumerate(e.loss_mask)])
        return rows


def batch_device(model) -> torch.device:
    return next(model.parameters()).device


def idle(forward: Callable, device: torch.device) -> None:
    """A one-token collective forward whose result is dropped: a rank with nothing (left) to score in a pass
    still makes it, so its peers' forwards find it (furlong.train.trainer's `_idle`, without grad)."""
    tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
    forward(tokens, torch.ones_like(tokens), 1.0, False, torch.ones_like(tokens, dtype=torch.float32))


def scored_episode(e: Episode, teacher: list[float]) -> Episode:
    """`e` with the teacher's logprobs (aligned like rollout_logprobs) and its TeacherScore."""
    n = e.response_len
    kl = sum(r - t for r, t, m in zip(e.rollout_logprobs, teacher, e.loss_mask) if m) / n if n else None
    return replace(e, teacher_logprobs=tuple(teacher), distill=TeacherScore("scored", tokens=n, reverse_kl=kl))


def failed_episode(e: Episode, err: BaseException) -> Episode:
    """`e` without the term, its TeacherScore naming what failed (one line)."""
    line = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    return replace(e, teacher_logprobs=None, distill=TeacherScore("teacher_failed", error=line))


def opd_advantage(e: Episode) -> torch.Tensor:
    """[len(tokens)] per-token -(logp_rollout - logp_teacher) on sampled tokens, 0 elsewhere."""
    if e.teacher_logprobs is None:
        raise ValueError(f"episode {e.task_id}/{e.group_id}/{e.sample_id} has no teacher logprobs")
    mask = torch.tensor(e.loss_mask, dtype=torch.float32)
    teacher = torch.tensor(e.teacher_logprobs, dtype=torch.float32)
    rollout = torch.tensor(e.rollout_logprobs, dtype=torch.float32)
    return (teacher - rollout) * mask


def distill_advantages(
    episodes: Sequence[Episode], grpo: torch.Tensor, mode: str, weight: float
) -> tuple[list[Episode], list[torch.Tensor]]:
    """The episodes to train and each one's per-token advantage. opd: the distillation term alone, and an
    episode without it (its teacher failed) is not trained; grpo+opd: GRPO's advantage on every token plus
    `weight` times the term where the episode has it (GRPO's alone where not)."""
    if mode not in MODES[1:]:
        raise ValueError(f"distillation mode {mode!r}: expected one of {MODES[1:]}")
    kept: list[Episode] = []
    advantages: list[torch.Tensor] = []
    for e, a in zip(episodes, grpo.tolist(), strict=True):
        has = e.teacher_logprobs is not None
        if mode == "opd":
            if has:
                kept.append(e)
                advantages.append(opd_advantage(e))
            continue
        per_token = torch.full((len(e.tokens),), a, dtype=torch.float32) * torch.tensor(e.loss_mask)
        kept.append(e)
        advantages.append(per_token + weight * opd_advantage(e) if has else per_token)
    return kept, advantages


@dataclass(frozen=True)
class TeacherSpec:
    """A teacher as plain values, for a process that builds its own (an FSDP2 rank): `teacher_for`'s
    `path`, `system_prompt` and `hints` (pairs: the spec is frozen and pickled); `dtype`: a checkpoint
    teacher's weights (train.model.frozen_dtype)."""

    path: Path | None = None
    system_prompt: str | None = None
    hints: tuple[tuple[str, str], ...] = ()
    dtype: str = "float32"

    def build(self, tokenizer_dir: Path, config: GRPOConfig, device, load) -> Teacher:
        """`teacher_for` at the trainer's rollout temperature, in its micro-batches; `load(path, dtype=)`
        (furlong.model.loading.load_model) loads a checkpoint teacher in `dtype`."""
        return teacher_for(
            tokenizer_dir,
            path=self.path,
            system_prompt=self.system_prompt,
            hints=dict(self.hints),
            temperature=config.temperature,
            micro_batch_size=config.micro_batch_size,
            device=device,
            load=partial(load, dtype=getattr(torch, self.dtype)),
        )


def teacher_for(
    tokenizer_dir: Path,
    *,
    path: Path | None,
    system_prompt: str | None,
    hints: Mapping[str, str],
    temperature: float,
    micro_batch_size: int,
    device: torch.device,
    load: Callable[[Path], PreTrainedModel],
) -> Teacher:
    """The run's teacher: a frozen copy of `path` on `device` (its own chat template; the student's where it
    has none, e.g. a base model: the ids are the same, check_tokenizers saw to that), under `system_prompt` if
    given; or the policy itself under `system_prompt` (the student's tokenizer, in `tokenizer_dir`)."""
    if path is not None:
        model = load(path).to(device)  # type: ignore[arg-type]  # transformers' wrapped .to() misleads mypy
        return Teacher(
            teacher_tokenizer(tokenizer_dir, path),
            model=model,
            system_prompt=system_prompt,
            hints=hints,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
        )
    return Teacher(
        load_tokenizer(tokenizer_dir),
        system_prompt=system_prompt,
        hints=hints,
        temperature=temperature,
        micro_batch_size=micro_batch_size,
    )


def teacher_tokenizer(tokenizer_dir: Path, path: Path):
    """The checkpoint's own tokenizer where it has a chat template, else the student's (in `tokenizer_dir`)."""
    own = load_tokenizer(path, require_chat_template=False)
    return own if own.chat_template else load_tokenizer(tokenizer_dir)
