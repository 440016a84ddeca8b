"""The local GRPO trainer: episodes in, one policy update (or several minibatch updates) out, TrainStats back.

A step: drop infra errors, filter zero-variance groups, compute group advantages, compute the pre-step
("old") logprobs without grad, then per minibatch accumulate gradients over right-padded micro-batches,
clip, and take one AdamW step. Weights stay fp32 (the master copy); bf16 autocast is optional.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from furlong.agent.episode import Episode
from furlong.rollout.group_filter import filter_zero_variance_groups, group_key
from furlong.train.atomic import fsync_dir, replace_dir, write_synced
from furlong.train.batch import collate
from furlong.train.distill import Teacher, TeacherPass, distill_advantages
from furlong.train.export import is_peft, write_hf
from furlong.train.grpo import (
    LossMetrics,
    OffPolicy,
    group_advantages,
    merge_metrics,
    policy_loss,
    weigh_negatives,
)
from furlong.train.grpo_config import GRPOConfig, lr_at
from furlong.train.logprobs import token_logprobs
from furlong.train.routing import Routing
from furlong.train.sft import Demo, demo_nll, nll_tokens
from furlong.train.stats import TrainStats

CHECKPOINT_FILE = "trainer.pt"
Advantages = torch.Tensor | list[torch.Tensor]  # one per episode, or one per token of each (distillation)


def _chunks(items: Sequence[int], size: int) -> Iterator[list[int]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


class LocalTrainer:
    """GRPO on one process (furlong.train.protocol.Trainer). `version` counts weight updates (the engine's
    weight_version after a push)."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: GRPOConfig,
        ref_model: PreTrainedModel | None = None,
        demos: Sequence[Demo] = (),
        teacher: Teacher | None = None,
    ) -> None:
        wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if wrong:
            raise ValueError(
                f"the trainer keeps fp32 master weights; the model has {wrong} parameters "
                "(load it in fp32, use bf16_autocast for bf16 compute)"
            )
        if config.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a ref_model")
        if config.micro_batch_size < 1 or config.epochs < 1 or config.minibatches < 1:
            raise ValueError("micro_batch_size, epochs and minibatches must be >= 1")
        if config.sft_coef > 0 and (not demos or config.sft_batch < 1):
            raise ValueError("sft_coef > 0 needs demonstrations and sft_batch >= 1")
        self.teacher = teacher if config.distill_mode != "off" else None
        self.demos = list(demos) if config.sft_coef > 0 else []
        # eval(): no dropout, so the no-grad "old" pass and the grad pass compute the same function.
        self.model = model.eval()
        self.ref_model = ref_model.eval() if ref_model is not None and config.kl_coef > 0 else None
        self.config = config
        self._device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.adam_betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.off_policy = OffPolicy(config.off_policy, config.tis_cap, config.is_low, config.is_high, config.mask_level)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.routing = Routing(model, config.routing_replay, config.moe_aux_coef)
        self._opt_steps = 0
        self.version = 0
        # This process's share of every pass (a sharded subclass sets them; here: all of it, alone).
        self.rank, self.world_size = 0, 1
        self.last_minibatches: tuple[LossMetrics, ...] = ()  # per optimizer step of the last train_step

    @property
    def device(self) -> torch.device:
        return self._device

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The live weights (no copies): the engine copies them in update_weights, before the next step.
        A LoRA policy sends only its adapters."""
        if is_peft(self.model):
            from peft import get_peft_model_state_dict  # peft loads slowly: only LoRA runs need it here

            return {k: v.detach() for k, v in get_peft_model_state_dict(self.model).items()}
        return self.model.state_dict()

    def export_hf(self, out: Path, tokenizer, base_model: Path | None = None) -> Path:
        return write_hf(self.model, tokenizer, out, base_model=base_model)

    def close(self) -> None:
        pass  # nothing of its own runs

    def _autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.bf16_autocast)

    def score_teacher(self, episodes: Sequence[Episode]) -> TeacherPass:
        """The teacher's logprobs on every scored episode (furlong.train.distill), without grad: a frozen
        checkpoint's, or (self-distillation) the policy's current weights under the teacher's prompt."""
        if self.teacher is None:
            raise ValueError("score_teacher: this trainer has no teacher (train.distill.mode is off)")
        with self._autocast():
            return self.teacher.score(episodes, self.model)

    def train_step(self, episodes: Sequence[Episode]) -> TrainStats:
        start = time.perf_counter()
        scored = [e for e in episodes if e.reward is not None]
        if self.config.filter_zero_variance:
            kept = filter_zero_variance_groups(scored)
            train, groups_used, filtered = list(kept.episodes), kept.groups_kept, kept.groups_dropped
        else:
            train, groups_used, filtered = scored, len({group_key(e) for e in scored}), 0
        train, advantages = self._advantages(train)
        stats = dict(
            _rollout_stats(scored),
            groups_used=groups_used,
            groups_filtered=filtered,
            episodes_dropped=len(episodes) - len(scored),
            tokens=sum(len(e.tokens) for e in train),
            loss_tokens=sum(e.response_len for e in train),
        )
        if stats["loss_tokens"] == 0:  # nothing to learn from: not an error; the anchor still acts
            if not self.demos:
                return _finish(stats, None, {}, False, self.version, start)
            self.optimizer.zero_grad(set_to_none=True)
            update = self._step(self._anchor)
            self.version += 1
            return _finish(
                stats, None, {"grad_norm": update.norm, "sft_nll": update.sft_nll}, True, self.version, start
            )
        metrics, extra = self._optimize(train, advantages)
        extra.update(self.routing.metrics(train))
        self.version += 1
        return _finish(stats, metrics, extra, True, self.version, start)

    def _advantages(self, train: list[Episode]) -> tuple[list[Episode], Advantages]:
        """GRPO's group advantages; with distillation, per token (the teacher's term alone, or beside GRPO's),
        and in opd mode only the episodes the teacher scored."""
        if not train:
            return train, torch.zeros(0)
        cfg = self.config
        rewards = [float(e.reward) for e in train if e.reward is not None]
        advantages = group_advantages(rewards, [group_key(e) for e in train], cfg.normalize_std, cfg.adv_eps)
        advantages = weigh_negatives(advantages, cfg.negative_weight)
        if cfg.distill_mode == "off":
            return train, advantages
        return distill_advantages(train, advantages, cfg.distill_mode, cfg.distill_weight)

    def _optimize(self, episodes: list[Episode], advantages: Advantages) -> tuple[LossMetrics, dict[str, float]]:
        cfg = self.config
        # With a single optimizer step the grad pass runs on the pre-step weights, so its detached logprobs
        # *are* the old logprobs: skip the extra no-grad forward (a third of the step's compute).
        old = None if cfg.epochs * cfg.minibatches == 1 else self._logprobs(self.model, episodes)
        ref = None if self.ref_model is None else self._logprobs(self.ref_model, episodes)
        updates: list[_Update] = []
        for _ in range(cfg.epochs):
            order = torch.randperm(len(episodes), generator=self.generator).tolist()
            for part in _split(order, cfg.minibatches):
                if not any(episodes[i].response_len for i in part):
                    continue  # no sampled token: an AdamW step would still apply momentum and decay
                updates.append(self._minibatch_update(episodes, part, advantages, old, ref))
        # a minibatch's update always has metrics (only the anchor-only step has none)
        self.last_minibatches = tuple(u.metrics for u in updates if u.metrics is not None)
        merged = merge_metrics(self.last_minibatches)
        # merge_metrics sums losses (right for micro-batches of one minibatch); across steps, average them.
        merged = LossMetrics(**{**asdict(merged), "loss": merged.loss / len(updates)})
        n = len(updates)
        return merged, {
            "entropy": sum(u.entropy for u in updates) / max(merged.tokens, 1),
            "grad_norm": sum(u.norm for u in updates) / n,
            "grad_norm_rl": sum(u.norm_rl for u in updates) / n,
            "sft_nll": sum(u.sft_nll for u in updates) / n,
        }

    def _minibatch_update(
        self,
        episodes: list[Episode],
        indices: list[int],
        advantages: Advantages,
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
    ) -> _Update:
        """Gradient accumulation over micro-batches (and the demonstration anchor, if any), then one clipped
        AdamW step."""
        cfg = self.config
        indices = sorted(indices, key=lambda i: len(episodes[i].tokens))  # similar lengths pad less
        # Every rank sees every episode: the denominator is the whole minibatch's, whatever its share.
        denominator = float(sum(episodes[i].response_len for i in indices))
        parts: list[LossMetrics] = []
        entropy = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for chunk in self._micro_batches(indices):
            if not chunk:
                self._idle(self.model, grad=True)
                continue
            adv = advantages[chunk] if isinstance(advantages, torch.Tensor) else [advantages[i] for i in chunk]
            mb = collate([episodes[i] for i in chunk], adv, self.device, _pick(old, chunk), _pick(ref, chunk))
            with self._autocast(), self.routing.forward(mb.routes):
                logp, ent = self._forward(
                    self.model, token_logprobs, mb.tokens, mb.attention_mask, cfg.temperature, True, mb.loss_mask
                )
            loss, metrics = policy_loss(
                logp,
                logp.detach() if mb.old_logprobs is None else mb.old_logprobs,
                mb.rollout_logprobs,
                mb.advantages,
                mb.loss_mask,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                tis_cap=cfg.tis_cap,
                kl_coef=cfg.kl_coef,
                logp_ref=mb.ref_logprobs,
                denominator=denominator,
                off_policy=self.off_policy,
            )
            aux = self.routing.aux_loss(mb.attention_mask, float(mb.loss_mask.sum()) / max(denominator, 1.0))
            if aux is not None:  # the router's load-balancing term, inside the step's loss
                loss = loss + aux
                metrics = replace(metrics, loss=metrics.loss + float(aux.detach()))
            loss.backward()
            parts.append(metrics)
            entropy += float((ent * mb.loss_mask).sum())
        update = self._step(self._anchor if self.demos else None)
        gathered = self._all_gather((parts, entropy))
        return replace(
            update, metrics=merge_metrics([m for ms, _ in gathered for m in ms]), entropy=sum(e for _, e in gathered)
        )

    def _micro_batches(self, indices: list[int]) -> list[list[int]]:
        """This rank's micro-batches of a pass over `indices` (sorted by length), padded with empty ones to
        the most any rank has: a sharded model's forwards are collectives, so every rank runs as many."""
        mine = list(_chunks(indices[self.rank :: self.world_size], self.config.micro_batch_size))
        most = math.ceil(math.ceil(len(indices) / self.world_size) / self.config.micro_batch_size)
        return mine + [[] for _ in range(most - len(mine))]

    def _forward(self, model: PreTrainedModel, fn: Callable, *args):
        """`fn(model, *args)`: a sharded subclass runs it inside its root module's forward."""
        return fn(model, *args)

    def _all_gather(self, obj: object) -> list:
        """`obj` of every rank, in rank order."""
        return [obj]

    def _idle(self, model: PreTrainedModel, grad: bool) -> None:
        """A rank without a share of this pass runs a zero-weighted one-token forward (and backward) so its
        collectives match its peers'."""
        tokens = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(grad), self._autocast():
            logp = self._forward(
                model,
                token_logprobs,
                tokens,
                torch.ones_like(tokens),
                1.0,
                False,
                torch.ones_like(tokens, dtype=torch.float32),
            )
        if grad:
            (logp.sum() * 0).backward()

    def _step(self, anchor: Callable[[], float] | None) -> _Update:
        """Adds the anchor's gradient (if any) to the accumulated one, clips, and takes one AdamW step."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm_rl, nll = None, 0.0
        if anchor is not None:  # the policy loss's own norm is measured before the anchor's gradient joins it
            norm_rl = _scalar(self._grad_norm(params))
            nll = anchor()
        total = self._grad_norm(params)
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], clip, total)
        norm = _scalar(total)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.config, self._opt_steps)
        self.optimizer.step()
        self._opt_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return _Update(None, norm, norm if norm_rl is None else norm_rl, nll, 0.0)

    def _grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The total norm of `params`' gradients (a subclass whose ranks hold different parameters adds theirs)."""
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None] or [torch.zeros(1)])

    def _anchor(self) -> float:
        """PPO-ptx (Ouyang et al. 2022): add sft_coef times the NLL of a random batch of demonstrations to the
        gradient. A group whose samples all fail has no reward variance, so GRPO never pulls a forgotten
        demonstrated skill back; this term does, and it costs almost nothing while the skill is kept."""
        picked = [
            self.demos[i]
            for i in torch.randint(len(self.demos), (self.config.sft_batch,), generator=self.generator).tolist()
        ]
        mine = picked[self.rank :: self.world_size]
        if not mine:
            self._idle(self.model, grad=True)
            return sum(self._all_gather(0.0))
        with self._autocast():  # this rank's part of the mean over every picked demonstration's tokens
            nll = self._forward(self.model, demo_nll, mine, 0, nll_tokens(picked) if self.world_size > 1 else None)
        (self.config.sft_coef * nll).backward()
        return sum(self._all_gather(float(nll.detach())))

    @torch.no_grad()
    def _logprobs(self, model: PreTrainedModel, episodes: list[Episode]) -> list[torch.Tensor]:
        """Per-episode [len(tokens)] logprobs under `model`'s current weights."""
        mine: dict[int, torch.Tensor] = {}
        order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].tokens))
        for chunk in self._micro_batches(order):
            if not chunk:
                self._idle(model, grad=False)
                continue
            mb = collate([episodes[i] for i in chunk], torch.zeros(len(chunk)), self.device)
            replayed = self.routing.forward(mb.routes) if model is self.model else nullcontext()
            with self._autocast(), replayed:
                logp = self._forward(
                    model, token_logprobs, mb.tokens, mb.attention_mask, self.config.temperature, False, mb.loss_mask
                )
            for row, i in enumerate(chunk):
                mine[i] = logp[row, : len(episodes[i].tokens)]
        if self.world_size > 1:  # every rank's share, so any rank can train on any episode
            mine = {
                i: t.to(self.device)
                for part in self._all_gather({i: t.cpu() for i, t in mine.items()})
                for i, t in part.items()
            }
        return [mine[i] for i in range(len(episodes))]

    def save(self, path: Path | str) -> None:
        """Write model, optimizer, version and RNG state to directory `path`: built in a temp dir beside it,
        fsynced, then renamed into place, so a crash never leaves a half-written checkpoint at `path`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            state = {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "version": self.version,
                "opt_steps": self._opt_steps,
                "rng": _rng_state(self.generator),
            }
            write_synced(tmp / CHECKPOINT_FILE, lambda f: torch.save(state, f))
            meta = json.dumps({"version": self.version, "config": asdict(self.config)}, indent=1)
            write_synced(tmp / "meta.json", lambda f: f.write(meta.encode()))
            fsync_dir(tmp)
            replace_dir(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, path: Path | str) -> None:
        """Restore what `save` wrote; the model and config must be the ones it was saved from."""
        state = torch.load(Path(path) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self._opt_steps = int(state["opt_steps"])
        _set_rng_state(self.generator, state["rng"])


@dataclass(frozen=True)
class _Update:
    """One optimizer step's results."""

    metrics: LossMetrics | None  # None: an anchor-only step
    norm: float  # pre-clip, everything
    norm_rl: float  # pre-clip, the policy loss alone
    sft_nll: float
    entropy: float  # summed over masked tokens


def _scalar(norm: torch.Tensor) -> float:
    full = getattr(norm, "full_tensor", None)  # a DTensor (sharded parameters): its global value
    return float(full() if full is not None else norm)


def _pick(rows: list[torch.Tensor] | None, indices: list[int]) -> list[torch.Tensor] | None:
    return None if rows is None else [rows[i] for i in indices]


def _split(order: list[int], parts: int) -> list[list[int]]:
    return [chunk.tolist() for chunk in torch.tensor(order, dtype=torch.long).tensor_split(parts) if len(chunk)]


def _rollout_stats(scored: list[Episode]) -> dict[str, float]:
    n = max(len(scored), 1)
    return {
        "reward_mean": sum(e.reward for e in scored) / n,  # type: ignore[misc]
        "pass_rate": sum(e.reward >= 1 for e in scored) / n,  # type: ignore[operator]
        "response_len_mean": sum(e.response_len for e in scored) / n,
    }


def _finish(
    stats: dict, metrics: LossMetrics | None, extra: dict[str, float], updated: bool, version: int, start: float
) -> TrainStats:
    """`extra`: entropy, grad_norm, grad_norm_rl and sft_nll (all 0 for a step without an update)."""
    seconds = time.perf_counter() - start
    m: dict[str, Any] = asdict(metrics) if metrics is not None else dict.fromkeys(LossMetrics.__dataclass_fields__, 0.0)
    m.pop("tokens")
    zeros: dict[str, Any] = dict.fromkeys(("entropy", "grad_norm", "grad_norm_rl", "sft_nll"), 0.0)
    return TrainStats(
        **stats,
        **m,
        **{**zeros, **extra},
        seconds=seconds,
        updated=updated,
        version=version,
        tokens_per_s=stats["tokens"] / seconds if updated else 0.0,
    )


def _rng_state(generator: torch.Generator) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    state: dict[str, torch.Tensor | list[torch.Tensor]] = {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(generator: torch.Generator, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
