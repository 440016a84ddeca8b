"""The running decode batch: left-padded KV cache rows that requests join and leave between steps.

Layout: every layer's keys/values are [B, kv_heads, L, head_dim], row b holding its tokens right-aligned
(left padding). `mask` [B, L] is 1 on real cached tokens. Pad slots hold zeros and are masked out, so they get
exactly zero attention weight: a row's results do not depend on which other rows share the batch.

Prompts are prefilled together, RIGHT-padded, each after its cached prefix (if any; left-padded in the past
KV): a right pad position still attends to its row's real tokens, so no query row is fully masked (that would
produce NaN hidden states whose K/V leak into real rows: 0 attention weight times NaN is NaN), and a real
position never sees a pad one (they lie in its future). Each row's real KV is then re-packed left-padded.
Identical prompts (a GRPO group) share one row. Decode steps then run all rows together with one new token each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


def _forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    kv: KV | None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KV]:
    """Last-position logits [B, V] (fp32) and the grown cache. No config on the cache on purpose: every layer
    keeps its full history, which the padding arithmetic here assumes (sliding windows are applied by the
    attention mask instead)."""
    cache = _adopt(kv) if kv else DynamicCache()
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :].float(), _cache_tensors(out.past_key_values)


@dataclass(frozen=True)
class PrefillRow:
    """A prompt to prefill: `tokens` to run after `cached`, the KV of the prompt's first tokens (batch 1)."""

    tokens: list[int]
    cached: KV | None = None

    @property
    def cached_len(self) -> int:
        return 0 if self.cached is None else self.cached[0][0].shape[-2]


def prefill(model: PreTrainedModel, rows: list[PrefillRow]) -> tuple[torch.Tensor, list[KV]]:
    """One forward over every row: logits [n, V] for each row's first output token, and each row's whole
    cache (cached prefix + its tokens) unpadded, as views [1, h, L_i, d] per layer."""
    device = model.device
    past = max(r.cached_len for r in rows)
    width = max(len(r.tokens) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), past + width, dtype=torch.long, device=device)
    positions = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r.tokens)] = torch.tensor(r.tokens, device=device)
        mask[i, past - r.cached_len : past + len(r.tokens)] = 1
        # Pad positions keep counting: their outputs are discarded, and positions stay in range.
        positions[i] = torch.arange(r.cached_len, r.cached_len + width, device=device)
    last = sorted({len(r.tokens) - 1 for r in rows})
    cache = _adopt(_left_packed([r.cached for r in rows], past)) if past else DynamicCache()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=torch.tensor(last, device=device),
    )
    kv = _cache_tensors(out.past_key_values)
    logits = torch.stack([out.logits[i, last.index(len(r.tokens) - 1)] for i, r in enumerate(rows)]).float()
    spans = [(past - r.cached_len, past + len(r.tokens)) for r in rows]
    return logits, [[(k[i : i + 1, :, a:b], v[i : i + 1, :, a:b]) for k, v in kv] for i, (a, b) in enumerate(spans)]


def _left_packed(kvs: Sequence[KV | None], width: int) -> KV:
    """Batch per-row caches (None: empty) right-aligned into zero-padded [n, h, width, d] tensors."""
    template = next(kv for kv in kvs if kv is not None)
    out = []
    for layer, (k0, v0) in enumerate(template):
        k = k0.new_zeros(len(kvs), k0.shape[1], width, k0.shape[3])
        v = v0.new_zeros(len(kvs), v0.shape[1], width, v0.shape[3])
        for i, kv in enumerate(kvs):
            if kv is not None and (n := kv[layer][0].shape[-2]):
                k[i, :, width - n :] = kv[layer][0][0]
                v[i, :, width - n :] = kv[layer][1][0]
        out.append((k, v))
    return out


class DecodeBatch(Generic[Row]):
    """Rows (opaque request objects) in cache order, with their KV tensors and padding mask."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.kv: KV | None = None
        self.mask: torch.Tensor | None = None  # [B, L] long

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Row], kvs: list[KV]) -> None:
        """Append rows, each with its own unpadded cache ([1, h, L_i, d] per layer; rows may share one)."""
        lengths = [kv[0][0].shape[-2] for kv in kvs]
        width = max(lengths)
        kv = _left_packed(kvs, width)
        mask = torch.zeros(len(rows), width, dtype=torch.long, device=kv[0][0].device)
        for i, n in enumerate(lengths):
            mask[i, width - n :] = 1
        if self.kv is None or self.mask is None:
            self.rows, self.kv, self.mask = list(rows), kv, mask
            return
        width = max(self.mask.shape[1], width)
        self.kv = [
            (
                torch.cat([_left_pad(k0, width), _left_pad(k1, width)]),
                torch.cat([_left_pad(v0, width), _left_pad(v1, width)]),
            )
            for (k0, v0), (k1, v1) in zip(self.kv, kv, strict=True)
        ]
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
        self.rows.extend(rows)

    def row_kv(self, index: int) -> KV:
        """A copy of row `index`'s real cache, unpadded [1, h, L, d] (a copy: a view would pin the batch)."""
        assert self.kv is not None and self.mask is not None
        n = int(self.mask[index].sum())
        width = self.mask.shape[1]
        return [
            (k[index : index + 1, :, width - n :].clone(), v[index : index + 1, :, width - n :].clone())
            for k, v in self.kv
        ]

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
        self.kv = [(k.index_select(0, index)[:, :, lead:], v.index_select(0, index)[:, :, lead:]) for k, v in self.kv]
        self.rows = [self.rows[i] for i in keep]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad dimension -2 (KV) or -1 (mask) on the left up to `width`."""
    dim = -1 if t.dim() == 2 else -2
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    return F.pad(t, (pad, 0)) if dim == -1 else F.pad(t, (0, 0, pad, 0))


class SoloBatch(Generic[Row]):
    """DecodeBatch's interface, but every row runs its own batch-1 forward on its own unpadded KV.

    On CPU a matmul row's bits depend on how many rows share the call and where the row sits (the BLAS picks its kernel
    per shape; measured with torch 2.13 here), and attention's sums on the padded width: in a shared batch
    a request's logprobs move by ~1e-6 with whatever else is running, so which requests arrive together
    (sandbox timing) reaches the trainer. Here a request's forwards have shapes set by its own tokens alone,
    so its logits are a function of the request and the weights: bit-reproducible, at the cost of one
    forward per row per step (HFEngine(deterministic=True))."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.kvs: list[KV] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, rows: list[Row], kvs: list[KV]) -> None:
        self.rows.extend(rows)
        self.kvs.extend(kvs)

    def row_kv(self, index: int) -> KV:
        return [(k.clone(), v.clone()) for k, v in self.kvs[index]]

    def step(self, model: PreTrainedModel, last_tokens: list[int]) -> torch.Tensor:
        assert len(last_tokens) == len(self.rows)
        device = self.kvs[0][0][0].device if self.kvs else model.device
        logits = []
        for i, token in enumerate(last_tokens):
            position = self.kvs[i][0][0].shape[-2]
            out, self.kvs[i] = _forward(
                model,
                torch.tensor([[token]], device=device),
                self.kvs[i],
                position_ids=torch.tensor([[position]], device=device),
            )
            logits.append(out)
        return torch.cat(logits)

    def keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.kvs = [self.kvs[i] for i in keep]
