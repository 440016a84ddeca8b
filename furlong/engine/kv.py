"""The running decode batch: left-padded KV cache rows that requests join and leave between steps.

Layout: every layer's keys/values are [B, kv_heads, L, head_dim], row b holding its tokens right-aligned
(left padding). `mask` [B, L] is 1 on real cached tokens. Pad slots hold zeros and are masked out, so they get
exactly zero attention weight: a row's results do not depend on which other rows share the batch.

Prompts are prefilled one at a time, unpadded (a fully padded query row would produce garbage hidden states
that leak into pad K/V); identical prompts (a GRPO group) share one prefill. Decode steps then run all rows
together with one new token each.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel

Row = TypeVar("Row")
KV = list[tuple[torch.Tensor, torch.Tensor]]


def _cache_tensors(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr,misc]


def _adopt(kv: KV) -> DynamicCache:
    """A cache holding `kv` without copying it (seeding through update() would concatenate onto empty
    tensors, one extra full copy of the cache per step)."""
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in kv])
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = k, v  # type: ignore[union-attr]
    return cache


def _forward(model: PreTrainedModel, input_ids: torch.Tensor, kv: KV | None,
             attention_mask: torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
    """Last-position logits [B, V] (fp32) and the grown cache. No config on the cache on purpose: every layer
    keeps its full history, which the padding arithmetic here assumes (sliding windows are applied by the
    attention mask instead)."""
    cache = _adopt(kv) if kv else DynamicCache()
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :].float(), _cache_tensors(out.past_key_values)


def prefill(model: PreTrainedModel, prompt: list[int]) -> tuple[torch.Tensor, KV]:
    """Forward one unpadded prompt: logits [1, V] for its first output token, and its cache."""
    device = model.device
    return _forward(model, torch.tensor([prompt], device=device), None)


class DecodeBatch(Generic[Row]):
    """Rows (opaque request objects) in cache order, with their KV tensors and padding mask."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.kv: KV | None = None
        self.mask: torch.Tensor | None = None  # [B, L] long

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Row], kv: KV) -> None:
        """Append rows whose caches are unpadded and equal in length (`kv` batch 1 is broadcast to all)."""
        n, length = len(rows), kv[0][0].shape[-2]
        kv = [(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv]
        mask = torch.ones(n, length, dtype=torch.long, device=kv[0][0].device)
        if self.kv is None or self.mask is None:
            self.rows, self.kv, self.mask = list(rows), [(k.contiguous(), v.contiguous()) for k, v in kv], mask
            return
        width = max(self.mask.shape[1], length)
        self.kv = [(torch.cat([_left_pad(k0, width), _left_pad(k1, width)]),
                    torch.cat([_left_pad(v0, width), _left_pad(v1, width)]))
                   for (k0, v0), (k1, v1) in zip(self.kv, kv, strict=True)]
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
        self.rows.extend(rows)

    def step(self, model: PreTrainedModel, last_tokens: list[int]) -> torch.Tensor:
        """Feed each row its last sampled token; return next-token logits [B, V]."""
        assert self.kv is not None and self.mask is not None and len(last_tokens) == len(self.rows)
        device = self.mask.device
        ids = torch.tensor(last_tokens, device=device)[:, None]
        positions = self.mask.sum(dim=1, keepdim=True)  # real tokens before the new one
        mask = torch.cat([self.mask, torch.ones_like(positions)], dim=1)
        logits, self.kv = _forward(model, ids, self.kv, attention_mask=mask, position_ids=positions)
        self.mask = mask
        return logits

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at indices `keep` (in order), then drop pad columns no row needs any more."""
        if not keep:
            self.rows, self.kv, self.mask = [], None, None
            return
        if len(keep) == len(self.rows):
            return
        assert self.kv is not None and self.mask is not None
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        lead = int((mask.shape[1] - mask.sum(dim=1)).min())  # pad columns shared by every remaining row
        self.mask = mask[:, lead:]
        self.kv = [(k.index_select(0, index)[:, :, lead:], v.index_select(0, index)[:, :, lead:])
                   for k, v in self.kv]
        self.rows = [self.rows[i] for i in keep]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dimension -2 (KV) or -1 (mask) on the left up to `width`."""
    dim = -1 if t.dim() == 2 else -2
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    return F.pad(t, (pad, 0)) if dim == -1 else F.pad(t, (0, 0, pad, 0))
