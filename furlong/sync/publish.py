"""Trainer side of weight sync: turn each new set of weights into a full or delta update.

The publisher casts the trainer's weights to the engine dtype (bf16 by default) and keeps the
last published engine-dtype copy: a delta is taken between two *published* copies, never
between fp32 masters, so the receiver (which holds exactly the previous published copy)
reconstructs the new one bit for bit and each tensor's checksum proves it. A full snapshot
starts the chain, restarts it every `full_every` publishes (so a relay that fell behind or
lost a file has a recent place to restart from), when the tensor layout changes, and when a
relay asked for one through the transport (`Transport.request_full`). Between snapshots, dense
tensors are predicted from the previous delta (furlong.sync.momentum; `momentum=False` turns it off).

Where the copy lives depends on where the weights are. CPU weights (HostStage): a fresh host copy per
publish, the previous one being the delta's base. Weights on a GPU (DeviceStage, furlong.sync.staging): the
copy stays on the device, is compared there with the previous one, and only what the delta's layouts
need crosses to a persistent host mirror; the payload is the same bytes either way. `PublishedUpdate.host_bytes`
says what each publish copied into host memory.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from furlong.model.fp8 import Fp8Spec, quantize_state
from furlong.sync.checksum import quantized_digest
from furlong.sync.delta import encode_delta, encode_full
from furlong.sync.momentum import Momentum
from furlong.sync.staging import DeviceStage, engine_copy, nbytes, same_layout
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
    # Bytes of weight data this publish wrote into host memory from the trainer's tensors. Host path: the
    # whole engine-dtype copy, every publish (= full_bytes). Device path (furlong.sync.staging): what was
    # moved device -> host: full_bytes for a snapshot; for a delta the scalars, positions or bitmaps and
    # changed words its layouts needed, and the dense tensors' words.
    host_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.payload_bytes / self.full_bytes if self.full_bytes else 0.0


class HostStage:
    """The host path: a fresh CPU engine-dtype copy at every publish, kept as the next delta's base."""

    def __init__(self, engine_dtype: torch.dtype) -> None:
        self.engine_dtype = engine_dtype
        self.base: dict[str, torch.Tensor] | None = None
        self.host_bytes = 0

    @property
    def published(self) -> dict[str, torch.Tensor] | None:
        return self.base

    def copy(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        new = engine_copy(state_dict, self.engine_dtype, torch.device("cpu"))
        self.host_bytes = nbytes(new)
        return new

    def full(self, new: dict[str, torch.Tensor], *, version: int, level: int | None) -> bytes:
        return encode_full(new, version=version, level=level)

    def delta(
        self,
        new: dict[str, torch.Tensor],
        *,
        version: int,
        base_version: int,
        level: int | None,
        momentum: Momentum | None,
        out: bytearray | None,
    ) -> bytes | memoryview:
        assert self.base is not None
        return encode_delta(
            self.base, new, version=version, base_version=base_version, level=level, momentum=momentum, out=out
        )

    def commit(self, new: dict[str, torch.Tensor]) -> None:
        self.base = new

    def rollback(self) -> None:
        pass  # nothing is written before commit


class Publisher:
    """Publishes versions of a state dict through a transport (one publisher per transport).

    Tensors that share storage (tied embeddings) are sent once, under the first name met:
    engines load by name into live parameters, so the alias is updated through its twin.

    `fp8`: the weights published as e4m3 + scales (furlong.model.fp8), quantized from the given (master)
    weights at each publish; every other tensor is cast to `engine_dtype`.

    `device_base`: keep the last published copy on the weights' device and move only what each delta
    needs to the host (furlong.sync.staging); None (default): when the first state dict published has a
    tensor off the CPU (a CUDA trainer); True: always (on CPU tensors too: tests); False: never."""

    def __init__(
        self,
        transport: Transport,
        *,
        full_every: int = 20,
        engine_dtype: torch.dtype = torch.bfloat16,
        level: int | None = None,
        momentum: bool = True,
        device_base: bool | None = None,
        fp8: Fp8Spec | None = None,
    ) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.transport = transport
        self.full_every = full_every
        self.engine_dtype = engine_dtype
        self.level = level  # zstd level; None = the codec's tuned fast parameters
        self.device_base = device_base
        self.fp8 = fp8  # quantize these weights to e4m3 + scales before publishing (furlong.model.fp8)
        self._stage: HostStage | DeviceStage | None = None  # chosen at the first publish
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
        """The engine-dtype tensors of the last published version (what relays reconstruct), on the host.
        On the device path this is the host mirror, patched in place by the next publish: clone to keep."""
        return None if self._stage is None else self._stage.published

    def fp8_digest(self) -> str:
        """quantized_digest of the last published version's fp8 weights and scales (what an engine must hold)."""
        if self.fp8 is None or self.published is None:
            raise ValueError("fp8_digest: nothing fp8 was published")
        return quantized_digest(self.published, self.fp8.tensor_names())

    @property
    def on_device(self) -> bool:
        """Whether the device path is in use (decided at the first publish)."""
        return isinstance(self._stage, DeviceStage)

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, force_full: bool = False
    ) -> PublishedUpdate:
        if self._version is not None and version <= self._version:
            raise ValueError(f"version {version} must be newer than the last published {self._version}")
        t0 = time.perf_counter()
        if self.fp8 is not None:
            state_dict = quantize_state(state_dict, self.fp8)
        stage = self._stage_for(state_dict)
        new = stage.copy(state_dict)
        reason = self._kind_reason(new, force_full)
        kind = "delta" if reason == "delta" else "full"
        try:
            t1, size = self._encode_and_put(stage, new, version, reason)
        except BaseException:
            stage.rollback()  # the mirror (device path) stays at the last published version
            raise
        # Only once the transport accepted it does it become the base of the next delta.
        base = self._version if kind == "delta" else None
        self._version = version
        stage.commit(new)
        if self._momentum is not None and kind == "delta":
            self._momentum.commit()
        elif self._momentum is not None:
            self._momentum.clear(version)
        self._since_full = self._since_full + 1 if kind == "delta" else 1
        return PublishedUpdate(
            version, kind, base, size, nbytes(new), t1 - t0, time.perf_counter() - t1, reason, stage.host_bytes
        )

    def _encode_and_put(
        self, stage: HostStage | DeviceStage, new: dict[str, torch.Tensor], version: int, reason: str
    ) -> tuple[float, int]:
        """Encode, hand to the transport; returns when encoding ended and the payload's size."""
        if reason == "delta":
            assert self._version is not None
            payload: bytes | memoryview = stage.delta(
                new,
                version=version,
                base_version=self._version,
                level=self.level,
                momentum=self._momentum,
                out=self._out,
            )
        else:
            payload = stage.full(new, version=version, level=self.level)
        t1 = time.perf_counter()
        try:
            self.transport.put(version, "delta" if reason == "delta" else "full", payload)  # copied: no view kept
        finally:
            size = len(payload)
            if isinstance(payload, memoryview):
                payload.release()  # else self._out could not grow next time
        return t1, size

    def _stage_for(self, state_dict: Mapping[str, torch.Tensor]) -> HostStage | DeviceStage:
        if self._stage is None:
            on_device = any(t.device.type != "cpu" for t in state_dict.values())
            use = on_device if self.device_base is None else self.device_base
            self._stage = DeviceStage(self.engine_dtype) if use else HostStage(self.engine_dtype)
        return self._stage

    def _kind_reason(self, new: Mapping[str, torch.Tensor], force_full: bool) -> str:
        # Consume a pending request even when a full is due anyway, so it does not cause two.
        requested = self.transport.take_full_request()
        base = None if self._stage is None else self._stage.base
        if base is None:
            return "first"
        if force_full:
            return "forced"
        if requested:
            return "requested"
        if not same_layout(base, new):
            return "layout"
        if self._since_full >= self.full_every:
            return "full_every"
        return "delta"
