"""Adapter-only weight sync: publish just the LoRA tensors through the ordinary Publisher and transports.

The payloads are the usual full snapshots and deltas (furlong.sync.delta) over the adapter's tensors only,
named as PEFT saves them; a Relay stages them like any update and pushes them to an engine whose model is a
PeftModel of the same LoraSpec (HFEngine maps the saved names onto its live adapter tensors). The base
weights never travel: the engine loads the same base checkpoint once.

Adapters are published in fp32 by default (they are small, and an fp32 engine then computes exactly what the
trainer does); pass engine_dtype=torch.bfloat16 to halve the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from peft import PeftModel

from furlong.model.lora import adapter_state_dict, base_state_dict
from furlong.sync.publish import PublishedUpdate, Publisher
from furlong.sync.transport import Transport


@dataclass(frozen=True)
class AdapterUpdateSize:
    """Bytes of one adapter update against shipping the whole model (both in the publish dtype)."""

    version: int
    kind: str  # "full" | "delta"
    payload_bytes: int  # what went through the transport
    adapter_bytes: int  # raw adapter tensors
    full_model_bytes: int  # raw base + adapter tensors (tied aliases counted once)

    @property
    def ratio(self) -> float:
        """payload bytes / full model bytes."""
        return self.payload_bytes / self.full_model_bytes

    @property
    def raw_ratio(self) -> float:
        """raw adapter bytes / full model bytes."""
        return self.adapter_bytes / self.full_model_bytes


def state_dict_nbytes(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> int:
    """Raw bytes of `tensors` (floating ones counted in `dtype` if given), each storage counted once."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    total = 0
    for t in tensors.values():
        key = (t.data_ptr(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        size = torch.empty((), dtype=dtype).element_size() if dtype and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


class AdapterPublisher:
    """Publishes a PeftModel's adapter tensors (never the base) through `transport`."""

    def __init__(
        self,
        transport: Transport,
        *,
        full_every: int = 20,
        engine_dtype: torch.dtype = torch.float32,
        level: int | None = None,
    ) -> None:
        self.publisher = Publisher(transport, full_every=full_every, engine_dtype=engine_dtype, level=level)
        self.sizes: list[AdapterUpdateSize] = []

    @property
    def version(self) -> int | None:
        return self.publisher.version

    def publish(self, peft: PeftModel, version: int, *, force_full: bool = False) -> PublishedUpdate:
        update = self.publisher.publish(adapter_state_dict(peft), version, force_full=force_full)
        self.sizes.append(adapter_update_size(peft, update, self.publisher.engine_dtype))
        return update


def adapter_update_size(
    peft: PeftModel, update: PublishedUpdate, dtype: torch.dtype | None = None
) -> AdapterUpdateSize:
    """Adapter bytes of `update` vs the full model's bytes (in `dtype`, default the publisher's)."""
    adapter = state_dict_nbytes(adapter_state_dict(peft), dtype)
    full = state_dict_nbytes(base_state_dict(peft), dtype) + adapter
    return AdapterUpdateSize(update.version, update.kind, update.payload_bytes, adapter, full)
