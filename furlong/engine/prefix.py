"""The in-process engine's prefix cache: KV of finished token sequences, reused by later prompts that start
with the same tokens.

An episode's turn k+1 prompt is its turn-k prompt + the sampled reply + the tool result, all as token ids
(never re-tokenized), so the KV of turn k covers all but the tail of turn k+1; members of a GRPO group share
their whole prompt; every episode shares the system prompt. Keys and values of a causal model at position i
depend only on tokens 0..i, so the first n cached positions of any sequence are valid for any prompt sharing
its first n tokens, under the same weights: the engine clears the cache on every weight update.

Entries are whole sequences, each with its own KV (batch 1, unpadded), kept in LRU order within a byte
budget. A new sequence replaces the entries it extends (the turn before), so an episode holds one entry.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from furlong.engine.kv import KV


@dataclass(frozen=True)
class PrefixHit:
    """`tokens` leading prompt tokens have cached KV `kv` ([1, kv_heads, tokens, head_dim] per layer)."""

    tokens: int = 0
    kv: KV | None = None


@dataclass(eq=False)
class _Entry:
    ids: bytes  # the token ids as int32 bytes: common prefixes are found by C-speed slice compares
    kv: KV
    nbytes: int


class PrefixCache:
    """LRU cache of sequence KV within `max_bytes` (0 disables it: lookups miss, inserts are dropped)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"prefix cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # id -> entry, least recently used first
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> PrefixHit:
        """The longest cached prefix of `prompt`, at most len(prompt) - 1 tokens (the last prompt token must be
        run to get the next token's logits). The entry it came from becomes the most recently used."""
        if not self._entries or len(prompt) < 2:
            return PrefixHit()
        ids = _key(prompt[:-1])
        best, best_id = 0, -1
        for key, entry in self._entries.items():
            n = _common_prefix(ids, entry.ids)
            if n > best:
                best, best_id = n, key
        if best == 0:
            return PrefixHit()
        self._entries.move_to_end(best_id)
        kv = [(k[:, :, :best], v[:, :, :best]) for k, v in self._entries[best_id].kv]
        return PrefixHit(best, kv)

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Remember `kv` ([1, h, len(tokens), d] per layer, owned by the cache from now on) for `tokens`."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if not tokens or nbytes > self.max_bytes:
            return
        if kv[0][0].shape[-2] != len(tokens):
            raise ValueError(f"prefix cache: {len(tokens)} tokens but KV of {kv[0][0].shape[-2]} positions")
        ids = _key(tokens)
        for key, entry in list(self._entries.items()):
            n = _common_prefix(ids, entry.ids)
            if n == len(tokens):  # already covered by a longer (or equal) entry
                self._entries.move_to_end(key)
                return
            if n * _WIDTH == len(entry.ids):  # the new sequence extends this one: it is redundant now
                self._drop(key)
        self._entries[self._next_id] = _Entry(ids, kv, nbytes)
        self._next_id += 1
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def prefix_metrics(engine: object) -> dict[str, float]:
    """The engine's prefix reuse so far, for step logs: {} for an engine without hf stats (a remote one)."""
    stats = getattr(engine, "stats", None)
    if stats is None or not hasattr(stats, "prefix_hit_rate"):
        return {}
    return {
        "engine_prefix_hit_rate": stats.prefix_hit_rate,
        "engine_prompt_tokens": stats.prompt_tokens,
        "engine_prefill_tokens": stats.prefill_tokens,
    }


_WIDTH = 4  # bytes per token id in a key


def _key(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def _common_prefix(a: bytes, b: bytes) -> int:
    """How many leading token ids two keys share: a binary search of memcmp slice compares (a torch
    comparison per cached entry cost ~20 us, several ms per admitted prompt with a full cache)."""
    low, high = 0, min(len(a), len(b)) // _WIDTH
    while low < high:
        mid = (low + high + 1) // 2
        if a[: mid * _WIDTH] == b[: mid * _WIDTH]:
            low = mid
        else:
            high = mid - 1
    return low
