"""Trainer side of weight sync: turn each new set of weights into a full or delta update.

The publisher casts the trainer's weights to the engine dtype (bf16 by default) and keeps the
last published engine-dtype copy: a delta is taken between two *published* copies, never
between fp32 masters, so the receiver (which holds exactly the previous published copy)
reconstructs the new one bit for bit and each tensor's checksum proves it. A full snapshot
starts the chain, restarts it every `full_every` publishes (so a relay that fell behind or
lost a file has a recent place to restart from), when the tensor layout changes, and when a
relay asked for one through the transport (`Transport.request_full`). Between snapshots, dense
tensors are predicted from the previous delta (furlong.sync.momentum; `momentum=False` turns it off).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from furlong.sync.delta import encode_delta, encode_full
from furlong.sync.momentum import Momentum
from furlong.sync.transport import Transport


@dataclass(frozen=True)
class PublishedUpdate:
    """What one publish() did; sizes in bytes, times in seconds."""

    version: int
    kind: str  # "full" | "delta"
    base_version: int | None
    payload_bytes: int
    full_bytes: int  # the engine-dtype tensors' raw size (denominator of the ratio)
    encode_s: float  # cast + encode
    put_s: float  # handing the payload to the transport (write, fsync, rename)
    reason: str  # why this kind: "first", "delta", "full_every", "layout", "requested", "forced"

    @property
    def ratio(self) -> float:
        return self.payload_bytes / self.full_bytes if self.full_bytes else 0.0


class Publisher:
    """Publishes versions of a state dict through a transport (one publisher per transport).

    Tensors that share storage (tied embeddings) are sent once, under the first name met:
    engines load by name into live parameters, so the alias is updated through its twin."""

    def __init__(
        self,
        transport: Transport,
        *,
        full_every: int = 20,
        engine_dtype: torch.dtype = torch.bfloat16,
        level: int | None = None,
        momentum: bool = True,
    ) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.transport = transport
        self.full_every = full_every
        self.engine_dtype = engine_dtype
        self.level = level  # zstd level; None = the codec's tuned fast parameters
        self._prev: dict[str, torch.Tensor] | None = None  # last published engine-dtype copy
        self._version: int | None = None
        self._since_full = 0
        # Dense tensors are predicted from the previous delta (furlong.sync.momentum); costs up to two
        # bytes per dense word here and at each receiver.
        self._momentum = Momentum() if momentum else None
        self._out = bytearray()  # delta payloads are written here, update after update (see pack_payload)

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def published(self) -> Mapping[str, torch.Tensor] | None:
        """The engine-dtype tensors of the last published version (what relays reconstruct)."""
        return self._prev

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, force_full: bool = False
    ) -> PublishedUpdate:
        if self._version is not None and version <= self._version:
            raise ValueError(f"version {version} must be newer than the last published "
                             f"{self._version}")
        t0 = time.perf_counter()
        new = self.engine_copy(state_dict)
        reason = self._kind_reason(new, force_full)
        if reason == "delta":
            assert self._prev is not None and self._version is not None
            base: int | None = self._version
            payload: bytes | memoryview = encode_delta(self._prev, new, version=version, base_version=self._version,
                                                       level=self.level, momentum=self._momentum, out=self._out)
        else:
            base = None
            payload = encode_full(new, version=version, level=self.level)
        t1 = time.perf_counter()
        kind = "delta" if reason == "delta" else "full"
        try:
            self.transport.put(version, kind, payload)  # transports copy or write it: they keep no view
        finally:
            size = len(payload)
            if isinstance(payload, memoryview):
                payload.release()  # else self._out could not grow next time
        # Only once the transport accepted it does it become the base of the next delta.
        self._prev, self._version = new, version
        if self._momentum is not None and kind == "delta":
            self._momentum.commit()
        elif self._momentum is not None:
            self._momentum.clear(version)
        self._since_full = self._since_full + 1 if kind == "delta" else 1
        full_bytes = sum(t.numel() * t.element_size() for t in new.values())
        return PublishedUpdate(version, kind, base, size, full_bytes, t1 - t0,
                               time.perf_counter() - t1, reason)

    def engine_copy(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Detached CPU copies, floating tensors cast to the engine dtype, aliases dropped.

        Always a copy (copy=True): keeping a view of the trainer's live tensors as the next
        delta's base would make it drift as the optimizer steps."""
        out: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        for name, t in state_dict.items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.numel() and key in seen:
                continue
            seen.add(key)
            dtype = self.engine_dtype if t.is_floating_point() else t.dtype
            out[name] = t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()
        return out

    def _kind_reason(self, new: Mapping[str, torch.Tensor], force_full: bool) -> str:
        # Consume a pending request even when a full is due anyway, so it does not cause two.
        requested = self.transport.take_full_request()
        if self._prev is None:
            return "first"
        if force_full:
            return "forced"
        if requested:
            return "requested"
        if not _same_layout(self._prev, new):
            return "layout"
        if self._since_full >= self.full_every:
            return "full_every"
        return "delta"


def _same_layout(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a
    )
