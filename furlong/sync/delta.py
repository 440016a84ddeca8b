"""Weight updates from trainer to inference engines: bit-exact deltas and full snapshots.

`encode_delta(prev, new)` ships only the words whose bits changed (for bf16 weights after an
RL step, ~1-5% of them). Per tensor it picks a layout by density (furlong.sync.sections):
change positions as gaps, a change bitmap, or every word's difference; values are
zigzag(new_bits - old_bits), small for small updates; both are coded as narrow, packed
symbol streams (furlong.sync.tiers) that zstd's Huffman stage codes close to their entropy.
`encode_full` ships a snapshot (byte planes + zstd). Wire format: furlong.sync.update.

Applying is atomic per update: the payload digest, versions, tensor names/shapes/dtypes and
every section are checked before or while decoding, and each tensor's final checksum is
verified right after it is patched in place. On any failure every tensor already patched is
rolled back by subtracting the same differences (exact: the arithmetic wraps modulo
2**bits), so the receiver's tensors stay bit-identical to before and no extra copy of the
model is needed. Re-applying an update, or applying it to the wrong version, is refused.
Snapshots are decoded into fresh tensors and swapped in only once all are verified.

Everything runs on one core (numpy, zstd without workers); tensors must be CPU-resident. For weights
on a GPU the Publisher does not copy them whole to the host per step: furlong.sync.staging finds the
changes on the device, moves only what each layout needs into a persistent host mirror and builds the
same payload from it with `pack_delta` and the same section encoders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import cast

import numpy as np
import torch
import zstandard as zstd

from furlong.sync import codec
from furlong.sync.checksum import DEFAULT_ALGO, tensor_digest
from furlong.sync.errors import (
    BaseVersionMismatch,
    ChecksumMismatch,
    IncompatibleBase,
    StaleUpdate,
    SyncError,
)
from furlong.sync.momentum import Momentum, MomentumMismatch
from furlong.sync.patches import DensePatch, Patch, decode_full, decode_patch
from furlong.sync.sections import encode_tensor_delta, encode_tensor_full, section_compressor
from furlong.sync.update import Kind, TensorDelta, WeightUpdate, pack_payload, unpack_payload

DELTA_ENCODING = "furlong-delta/1"
FULL_ENCODING = "furlong-full/1"

Tensors = Mapping[str, torch.Tensor]
Section = tuple[TensorDelta, bytes | list[bytes]]  # a tensor's header and its section's bytes (or pieces)


def encode_delta(
    prev: Tensors,
    new: Tensors,
    *,
    version: int,
    base_version: int,
    level: int | None = None,
    checksum_algo: str = DEFAULT_ALGO,
    momentum: Momentum | None = None,
    out: bytearray | None = None,
) -> bytes | memoryview:
    """Payload turning `prev` (published as `base_version`) into `new` (as `version`).

    `out`: a buffer to write the payload into, reused from update to update (see pack_payload); the
    returned view is valid until the next use of `out`.

    `level`: zstd level for the sections; None = tuned fast parameters (see section_compressor).
    `momentum`: the sender's state (furlong.sync.momentum): dense tensors are predicted from the update
    that made `base_version` where it recorded them, and this update records; call `momentum.commit()`
    once the payload is delivered (until then the previous state stays in force)."""
    _check_newer(version, base_version)
    _check_same_layout(prev, new)

    def section(name: str, cctx: zstd.ZstdCompressor) -> Section:
        return encode_tensor_delta(
            name, prev[name].contiguous(), new[name].contiguous(), cctx, checksum_algo, momentum, base_version
        )

    return pack_delta(
        list(new),
        section,
        version=version,
        base_version=base_version,
        level=level,
        checksum_algo=checksum_algo,
        momentum=momentum,
        out=out,
    )


def pack_delta(
    names: list[str],
    section: Callable[[str, zstd.ZstdCompressor], Section],
    *,
    version: int,
    base_version: int,
    level: int | None,
    checksum_algo: str,
    momentum: Momentum | None,
    out: bytearray | None,
) -> bytes | memoryview:
    """The delta payload of the tensors `names`, in order, each section made by `section` (encode_delta's,
    or the device encoder's in furlong.sync.staging); the other arguments as encode_delta's."""
    _check_newer(version, base_version)
    cctx = section_compressor(level)
    metas, sections, offset = [], [], 0
    if momentum is not None:
        momentum.begin(version)
    for name in names:
        td, data = section(name, cctx)
        metas.append(replace(td, offset=offset))
        sections.extend(data) if isinstance(data, list) else sections.append(data)
        offset += td.length
    upd = WeightUpdate(
        version, base_version, "delta", DELTA_ENCODING, checksum_algo, tuple(metas), momentum=momentum is not None
    )
    return pack_payload(upd, sections, out)


def encode_full(
    tensors: Tensors,
    *,
    version: int,
    kind: Kind = "full",
    level: int | None = None,
    checksum_algo: str = DEFAULT_ALGO,
) -> bytes:
    """A snapshot payload ("full": the whole model; "adapter": tensors merged by name).

    `level`: zstd level; None = the fast section parameters (smaller than level 3 here)."""
    if kind not in ("full", "adapter"):
        raise ValueError(f"encode_full makes 'full' or 'adapter' updates, not {kind!r}")
    cctx = section_compressor(level)
    metas, sections, offset = [], [], 0
    for name, t in tensors.items():
        td, data = encode_tensor_full(name, t.contiguous(), cctx, checksum_algo)
        metas.append(replace(td, offset=offset))
        sections.append(data)
        offset += len(data)
    upd = WeightUpdate(version, None, kind, FULL_ENCODING, checksum_algo, tuple(metas))
    return cast(bytes, pack_payload(upd, sections))  # no `out`: a bytes payload, not a view


def read_update(payload: bytes | memoryview) -> WeightUpdate:
    """The verified header of a payload (raises CorruptUpdate like apply does)."""
    return unpack_payload(payload)[0]


def apply_delta(
    base: dict[str, torch.Tensor],
    payload: bytes | memoryview,
    *,
    current_version: int,
    momentum: Momentum | None = None,
) -> dict[str, torch.Tensor]:
    """Patch `base` (holding `current_version`) in place; returns it. See the module doc.

    `momentum`: the receiver's state, needed for an update with predicted tensors and updated by
    every applied update (furlong.sync.momentum)."""
    upd, body = unpack_payload(payload)
    _apply_delta_parsed(base, upd, body, current_version, momentum)
    return base


def apply_full(payload: bytes | memoryview, *, current_version: int | None = None) -> dict[str, torch.Tensor]:
    """Fresh tensors from a snapshot payload, each verified against its checksum."""
    upd, body = unpack_payload(payload)
    return _decode_snapshot(upd, body, current_version)


def apply_update(
    tensors: dict[str, torch.Tensor],
    payload: bytes | memoryview,
    *,
    current_version: int | None,
    momentum: Momentum | None = None,
) -> WeightUpdate:
    """Apply any kind of update to `tensors` in place; returns its header (for .version)."""
    upd, body = unpack_payload(payload)
    if upd.kind == "delta":
        if current_version is None:
            raise BaseVersionMismatch(
                f"delta v{upd.version} needs base v{upd.base_version}, but the receiver holds no version yet"
            )
        _apply_delta_parsed(tensors, upd, body, current_version, momentum)
        return upd
    fresh = _decode_snapshot(upd, body, current_version)
    if upd.kind == "full":  # swap only after every tensor verified
        tensors.clear()
    tensors.update(fresh)
    if momentum is not None:
        momentum.clear(upd.version)
    return upd


class WeightReceiver:
    """An engine-side holder of tensors plus the version they are at."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, version: int | None = None):
        self.tensors: dict[str, torch.Tensor] = tensors if tensors is not None else {}
        self.version = version
        self.momentum = Momentum()  # holds states only while the sender asks updates to record them

    def apply(self, payload: bytes | memoryview) -> WeightUpdate:
        upd = apply_update(self.tensors, payload, current_version=self.version, momentum=self.momentum)
        self.version = upd.version
        return upd


def _check_versions(upd: WeightUpdate, current: int | None) -> None:
    if current is not None and upd.version <= current:
        raise StaleUpdate(f"update v{upd.version} is not newer than the receiver's v{current} (already applied?)")
    if upd.kind == "delta" and upd.base_version != current:
        raise BaseVersionMismatch(
            f"delta v{upd.version} was made against v{upd.base_version}, but the receiver holds v{current}"
        )


def _check_newer(version: int, base_version: int) -> None:
    if version <= base_version:
        raise ValueError(f"version {version} must be newer than base_version {base_version}")


def _check_same_layout(prev: Tensors, new: Tensors) -> None:
    if set(prev) != set(new):
        diff = sorted(set(prev) ^ set(new))[:5]
        raise ValueError(f"prev and new hold different tensor names ({diff}...); use encode_full")
    for name, t in new.items():
        p = prev[name]
        if p.shape != t.shape or p.dtype != t.dtype:
            raise ValueError(
                f"{name}: {p.dtype}{tuple(p.shape)} -> {t.dtype}{tuple(t.shape)} changes layout; use encode_full"
            )


def _base_words(base: Mapping[str, torch.Tensor], upd: WeightUpdate) -> dict[str, np.ndarray]:
    """Word views of the receiver's tensors, after checking they fit the update."""
    words: dict[str, np.ndarray] = {}
    seen: dict[int, str] = {}
    for td in upd.tensors:
        t = base.get(td.name)
        if t is None:
            raise IncompatibleBase(f"{td.name}: in the update but not in the receiver's tensors")
        if tuple(t.shape) != td.shape or t.dtype != td.torch_dtype:
            raise IncompatibleBase(
                f"{td.name}: receiver has {t.dtype}{tuple(t.shape)}, update is for {td.dtype}{td.shape}"
            )
        if t.numel() and t.data_ptr() in seen:  # tied weights would be patched twice
            raise IncompatibleBase(f"{td.name} shares storage with {seen[t.data_ptr()]}: pass each storage once")
        seen[t.data_ptr()] = td.name
        try:
            words[td.name] = codec.as_words(t)
        except ValueError as e:
            raise IncompatibleBase(f"{td.name}: {e}") from e
    return words


def _apply_delta_parsed(
    base: dict[str, torch.Tensor],
    upd: WeightUpdate,
    body: memoryview,
    current: int,
    momentum: Momentum | None = None,
) -> None:
    if upd.kind != "delta":
        raise SyncError(f"a {upd.kind!r} update is not a delta: use apply_full / apply_update")
    _check_versions(upd, current)
    words = _base_words(base, upd)
    _check_momentum(upd, momentum)
    record = momentum if momentum is not None and upd.momentum else None
    if record is not None:
        record.begin(upd.version)
    dctx = zstd.ZstdDecompressor()
    done = []
    try:
        for td in upd.tensors:
            _patch(td, body, dctx, momentum, record).apply(words[td.name])
            done.append(td)
            got = tensor_digest(base[td.name], upd.checksum_algo)
            if got != td.checksum:
                raise ChecksumMismatch(
                    f"{td.name}: patched tensor hashes to {got}, sender "
                    f"recorded {td.checksum}: the receiver's v{current} "
                    "differs from the sender's; resync with a full update"
                )
    except Exception:
        for td in reversed(done):  # decoding succeeded once, so it succeeds again
            _patch(td, body, dctx, momentum, None).apply(words[td.name], -1)
        raise
    if record is not None:
        record.commit()
    elif momentum is not None:
        momentum.clear(upd.version)


def _check_momentum(upd: WeightUpdate, momentum: Momentum | None) -> None:
    """Every predicted tensor's state must be here, recorded by the update that made the base version."""
    for td in upd.tensors:
        if not td.predicted:
            continue
        p = None if momentum is None else momentum.prediction(td.name, upd.base_version)
        if p is None or p.size != td.n_words:
            held = "no state" if momentum is None else f"states of v{momentum.version}"
            raise MomentumMismatch(
                f"{td.name}: predicted from the update that made v{upd.base_version}, but the receiver "
                f"holds {held} for it; resync with a full update"
            )


def _patch(
    td: TensorDelta, body: memoryview, dctx: zstd.ZstdDecompressor, momentum: Momentum | None, record: Momentum | None
) -> Patch:
    patch = decode_patch(td, body[td.offset : td.offset + td.length], dctx)
    if isinstance(patch, DensePatch):
        if td.predicted:
            assert momentum is not None  # checked by _check_momentum before anything was written
            patch.p = momentum.state[td.name]
        if record is not None:
            patch.state = record.buffer(td.name, td.n_words)
    return patch


def _decode_snapshot(upd: WeightUpdate, body: memoryview, current: int | None) -> dict[str, torch.Tensor]:
    if upd.kind not in ("full", "adapter"):
        raise SyncError(f"a {upd.kind!r} update is not a snapshot: use apply_delta / apply_update")
    _check_versions(upd, current)
    dctx = zstd.ZstdDecompressor()
    out = {}
    for td in upd.tensors:
        t = decode_full(td, body[td.offset : td.offset + td.length], dctx)
        got = tensor_digest(t, upd.checksum_algo)
        if got != td.checksum:
            raise ChecksumMismatch(f"{td.name}: snapshot tensor hashes to {got}, sender recorded {td.checksum}")
        out[td.name] = t
    return out
