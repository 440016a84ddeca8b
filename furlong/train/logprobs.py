"""Per-token log-probabilities as the trainer sees them, in the engine's convention.

Position t holds log p(tokens[t] | tokens[<t]) under softmax(logits / temperature), untruncated (the engine
reports the same quantity before top-k / top-p; see `furlong.engine.base.Generation`). Position 0 has no
context and holds 0, as do pad positions, so the result lines up index-for-index with `Episode.tokens`,
`loss_mask` and `rollout_logprobs`.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # Temperature 0 (greedy) reports temperature-1 logprobs, as the engine does. fp32 always: bf16 logits
    # would put the trainer/rollout mismatch at 1e-2, far above what importance weights should correct.
    return logits.float() / (temperature if temperature > 0 else 1.0)


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T, V] logits and [B, T] tokens -> [B, T] logprobs of tokens[t] from logits[t - 1]; column 0 is 0."""
    z = _tempered(logits[:, :-1], temperature)
    # gather - logsumexp instead of log_softmax: never materialises a second [B, T, V] tensor.
    chosen = z.gather(-1, tokens[:, 1:, None]).squeeze(-1) - z.logsumexp(dim=-1)
    return F.pad(chosen, (1, 0))


def entropy_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] entropy of the tempered distribution that predicted tokens[t] (aligned like the logprobs)."""
    z = _tempered(logits[:, :-1], temperature)
    logp = torch.log_softmax(z, dim=-1)
    return F.pad(-(logp.exp() * logp).sum(dim=-1), (1, 0))


@overload
def token_logprobs(model: PreTrainedModel, batch_tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, with_entropy: Literal[False] = ...) -> torch.Tensor: ...


@overload
def token_logprobs(model: PreTrainedModel, batch_tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, with_entropy: Literal[True]) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(model: PreTrainedModel, batch_tokens: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float, with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs [B, T] (fp32, differentiable) of a padded batch; with `with_entropy`, also the
    per-token entropy [B, T] (detached: a metric, not a loss term). Pad positions hold 0."""
    # Positions count real tokens only, so right- and left-padded rows see the positions the engine used.
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(input_ids=batch_tokens, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    valid = attention_mask.to(torch.float32)
    logp = logprobs_from_logits(logits, batch_tokens, temperature) * valid
    if not with_entropy:
        return logp
    with torch.no_grad():
        entropy = entropy_from_logits(logits.detach(), temperature) * valid
    return logp, entropy
