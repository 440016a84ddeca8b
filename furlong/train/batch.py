"""Padded micro-batches: what one forward/backward of the trainer reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from furlong.agent.episode import Episode


@dataclass(frozen=True)
class MicroBatch:
    """Right-padded [B, T] tensors for one forward/backward."""

    tokens: torch.Tensor  # long, pad id 0 (never attended to, never in the loss)
    attention_mask: torch.Tensor  # long
    loss_mask: torch.Tensor  # float
    rollout_logprobs: torch.Tensor  # float
    advantages: torch.Tensor  # [B], or [B, T] per token (distillation: furlong.train.distill)
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def _pad(rows: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True).to(device)


def collate(
    episodes: Sequence[Episode],
    advantages: Sequence[float] | torch.Tensor | Sequence[torch.Tensor],
    device: torch.device,
    old: Sequence[torch.Tensor] | None = None,
    ref: Sequence[torch.Tensor] | None = None,
) -> MicroBatch:
    """Pad episodes (and their per-token old/ref logprobs, if given) into one MicroBatch. `advantages`: one
    per episode, or one [len(tokens)] tensor per episode (per-token advantages)."""
    for e in episodes:
        if not len(e.tokens) == len(e.loss_mask) == len(e.rollout_logprobs):
            raise ValueError(
                f"episode {e.task_id}/{e.group_id}/{e.sample_id}: tokens, loss_mask and "
                "rollout_logprobs differ in length"
            )
    return MicroBatch(
        tokens=_pad([torch.tensor(e.tokens, dtype=torch.long) for e in episodes], device),
        attention_mask=_pad([torch.ones(len(e.tokens), dtype=torch.long) for e in episodes], device),
        loss_mask=_pad([torch.tensor(e.loss_mask, dtype=torch.float32) for e in episodes], device),
        rollout_logprobs=_pad([torch.tensor(e.rollout_logprobs, dtype=torch.float32) for e in episodes], device),
        advantages=_pad(list(advantages), device)  # type: ignore[arg-type]  # per-token rows
        if _per_token(advantages)
        else torch.as_tensor(advantages, dtype=torch.float32).to(device),
        old_logprobs=None if old is None else _pad(old, device),
        ref_logprobs=None if ref is None else _pad(ref, device),
    )


def _per_token(advantages) -> bool:
    return (
        not isinstance(advantages, torch.Tensor)
        and len(advantages) > 0
        and isinstance(advantages[0], torch.Tensor)
        and advantages[0].dim() == 1
    )
