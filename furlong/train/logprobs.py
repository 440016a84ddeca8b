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
def token_logprobs(
    model: PreTrainedModel,
    batch_tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: Literal[False] = ...,
    positions: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def token_logprobs(
    model: PreTrainedModel,
    batch_tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: Literal[True],
    positions: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def token_logprobs(
    model: PreTrainedModel,
    batch_tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs [B, T] (fp32, differentiable) of a padded batch; with `with_entropy`, also the
    per-token entropy [B, T] (detached: a metric, not a loss term). Pad positions hold 0.

    With `positions` ([B, T], nonzero where a value is wanted, e.g. the loss mask) the output layer runs
    only there, and every other position holds 0: on a small model the vocabulary projection and its
    softmax over every prompt token cost as much as the rest of the network.
    """
    # Positions count real tokens only, so right- and left-padded rows see the positions the engine used.
    position_ids = (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    head = model.get_output_embeddings()
    if positions is not None and head is not None and _plain_head(model):
        return _selected(model, head, batch_tokens, attention_mask, position_ids, temperature, with_entropy, positions)
    logits = model(
        input_ids=batch_tokens, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    valid = attention_mask.to(torch.float32)
    logp = logprobs_from_logits(logits, batch_tokens, temperature) * valid
    if not with_entropy:
        return logp
    with torch.no_grad():
        entropy = entropy_from_logits(logits.detach(), temperature) * valid
    return logp, entropy


def _plain_head(model: PreTrainedModel) -> bool:
    """True when logits are just the output layer applied to the decoder's last hidden state."""
    cfg = model.config
    return not getattr(cfg, "final_logit_softcapping", None) and getattr(cfg, "logit_scale", None) in (None, 1.0)


def _selected(model, head, tokens, attention_mask, position_ids, temperature, with_entropy, positions):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the LM
    decoder = getattr(inner, inner.base_model_prefix)
    hidden = decoder(
        input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    want = (positions != 0) & (attention_mask != 0)
    want[:, 0] = False  # the first token has no context
    rows, cols = want.nonzero(as_tuple=True)
    z = _tempered(head(hidden[rows, cols - 1]), temperature)  # hidden state t-1 predicts token t
    chosen = z.gather(-1, tokens[rows, cols, None]).squeeze(-1) - z.logsumexp(dim=-1)
    logp = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device).index_put((rows, cols), chosen)
    if not with_entropy:
        return logp
    with torch.no_grad():
        zl = torch.log_softmax(z.detach(), dim=-1)
        ent = torch.zeros_like(logp).index_put((rows, cols), -(zl.exp() * zl).sum(dim=-1))
    return logp, ent
