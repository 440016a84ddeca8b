"""Batched next-token sampling with per-request parameters and per-request RNGs."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from furlong.engine.base import SamplingParams


def sample_next(
    logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[random.Random]
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its logprob under that row's sampling distribution.

    The logprob is log_softmax(logits / temperature) at the chosen id, taken *before* top-k / top-p
    truncation: the untruncated tempered distribution is what a trainer recomputes, and the truncation is a
    sampler detail it cannot see. Greedy rows (temperature 0) report log_softmax(logits) (temperature 1).
    """
    logits = logits.float()
    temps = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype, device=logits.device
    )
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        # One uniform per row from the request's own RNG: a seeded request samples the same tokens
        # whichever other requests share its batch.
        u = torch.tensor([rngs[i].random() for i in rows], dtype=torch.float64, device=logits.device)
        tokens[index] = _sample_rows(logp[index].exp(), [params[i] for i in rows], u)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _sample_rows(probs: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from `probs` [b, V] after each row's top-k / top-p filter."""
    vocab = probs.shape[-1]
    truncate = any(0 < p.top_k < vocab or p.top_p < 1 for p in params)
    if truncate:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        probs = probs * _keep_mask(probs, params)
    cdf = probs.double().cumsum(dim=-1)
    # right=True: the first index whose cdf exceeds u * total, so zero-probability ids are never chosen.
    pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    return (order.gather(1, pos) if truncate else pos).squeeze(1)


def _keep_mask(sorted_probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Which of the descending-sorted ids survive top-k and top-p (the most likely id always does)."""
    vocab = sorted_probs.shape[-1]
    device = sorted_probs.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=sorted_probs.dtype, device=device)
    ranks = torch.arange(vocab, device=device)
    # Mass strictly before each id: an id is kept while the ids above it hold less than top_p, i.e. the
    # smallest prefix whose mass reaches top_p.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return (ranks[None, :] < top_k[:, None]) & (before < top_p[:, None])
