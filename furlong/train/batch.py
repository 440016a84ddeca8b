"""Padded micro-batches: what one forward/backward of the trainer reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from furlong.agent.episode import Episode
from furlong.model.moe import UNKNOWN


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
    routes: torch.Tensor | None = None  # [B, T, layers, top_k] int16, UNKNOWN (-1) off the recorded routes


def _routes(episodes: Sequence[Episode], device: torch.device) -> torch.Tensor | None:
    """The episodes' engine routes, padded with UNKNOWN (an episode without any: all UNKNOWN); None if none has."""
    shapes = {tuple(e.routes.shape[1:]) for e in episodes if e.routes is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"episodes carry routes of different shapes (layers, top_k): {sorted(shapes)}")
    (shape,) = shapes
    rows = []
    for e in episodes:
        if e.routes is not None and len(e.routes) != len(e.tokens):
            raise ValueError(
                f"episode {e.task_id}/{e.group_id}/{e.sample_id}: {len(e.routes)} routes for {len(e.tokens)} tokens"
            )
        rows.append(
            e.routes if e.routes is not None else torch.full((len(e.tokens), *shape), UNKNOWN, dtype=torch.int16)
        )
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=UNKNOWN).to(device)


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
        routes=_routes(episodes, device),
    )


def _per_token(advantages) -> bool:
    return (
        not isinstance(advantages, torch.Tensor)
        and len(advantages) > 0
        and isinstance(advantages[0], torch.Tensor)
        and advantages[0].dim() == 1
    )
