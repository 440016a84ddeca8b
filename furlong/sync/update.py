"""Metadata of a weight update and its binary framing.

A payload is `preamble | header | body`:

* preamble, 36 bytes little-endian (`struct` format `<4sHBBIQ16s`): magic `b"FLWU"`, format
  version (u16), checksum-algorithm id (u8), flags (u8; bit 0: header is zstd-compressed),
  header length (u32), body length (u64), and a 16-byte digest of `header | body` with that
  algorithm. The digest is checked before anything is decoded, so a flipped or missing byte
  anywhere is a `CorruptUpdate`.
* header: UTF-8 JSON of `WeightUpdate.to_dict()` (zstd-compressed: names repeat a lot):
  versions, kind, encoding and one entry per tensor (name, shape, dtype, per-tensor encoding,
  checksum of the FINAL tensor, where its section lies in the body, and the layout
  parameters of furlong.sync.sections; fields at their default value are omitted).
* body: the tensor sections back to back, in header order.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import torch
import zstandard as zstd

from furlong.sync.checksum import ALGO_IDS, stream_hasher
from furlong.sync.codec import word_width
from furlong.sync.errors import CorruptUpdate
from furlong.sync.tiers import ALLOWED_BITS

MAGIC = b"FLWU"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<4sHBBIQ16s")
MAX_HEADER = 1 << 30  # sanity bound before decoding a damaged length field
HEADER_ZSTD = 1  # preamble flag

Kind = Literal["full", "delta", "adapter"]
KINDS = ("full", "delta", "adapter")
# Per-tensor encodings; their section layouts are documented in furlong.sync.sections.
TENSOR_ENCODINGS = ("same", "sparse", "bitmap", "dense", "planes")


@dataclass(frozen=True)
class TensorDelta:
    """How one tensor is carried, and the checksum it must have once applied."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    encoding: str  # one of TENSOR_ENCODINGS
    checksum: str  # hex digest of the final tensor's raw bytes
    n_changed: int = 0  # words whose bits differ from the base (all words for "planes")
    offset: int = 0  # byte offset of the zstd section in the body
    length: int = 0  # compressed section length in bytes (0 for "same")
    raw_length: int = 0  # decompressed section length, checked on decode
    gap_shift: int = 0  # "sparse": 8 = gaps' low bytes sent as a plane (furlong.sync.tiers)
    gap_tiers: tuple[int, ...] = ()  # "sparse": symbol bits per gap tier
    value_tiers: tuple[int, ...] = ()  # delta encodings: symbol bits per value tier
    chunk: int = 0  # "dense"/"planes": words per run of the section layout
    predicted: bool = False  # "dense": values are changes minus the recorded momentum (furlong.sync.momentum)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def n_words(self) -> int:
        """Length of the tensor viewed as unsigned words (see codec.word_width)."""
        return self.numel * self.torch_dtype.itemsize // word_width(self.torch_dtype)


@dataclass(frozen=True)
class WeightUpdate:
    """One published version: a full snapshot, an adapter, or a delta against `base_version`."""

    version: int
    base_version: int | None  # None for "full" / "adapter": they need no base
    kind: Kind
    encoding: str  # payload-level codec id, e.g. "furlong-delta/1"
    checksum_algo: str
    tensors: tuple[TensorDelta, ...]
    momentum: bool = False  # receivers record this update's dense changes (furlong.sync.momentum)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        """Size of all final tensors, the denominator of compression ratios and GB/s."""
        return sum(t.numel * t.torch_dtype.itemsize for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tensors"] = [_compact(t) for t in self.tensors]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WeightUpdate:
        """Parse and validate a header; any structural problem is a CorruptUpdate."""
        try:
            tensors = tuple(_tensor_from_dict(t) for t in d["tensors"])
            upd = cls(
                version=int(d["version"]),
                base_version=None if d["base_version"] is None else int(d["base_version"]),
                kind=d["kind"],
                encoding=str(d["encoding"]),
                checksum_algo=str(d["checksum_algo"]),
                tensors=tensors,
                momentum=d.get("momentum", False),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptUpdate(f"malformed update header: {e!r}") from e
        _validate(upd)
        return upd


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if isinstance(dt, torch.dtype):
        return dt
    raise ValueError(f"unknown dtype {name!r}")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _compact(t: TensorDelta) -> dict[str, Any]:
    """t's fields minus those at their default value (they are restored on parsing)."""
    return {f.name: getattr(t, f.name) for f in fields(t) if getattr(t, f.name) != f.default}


def _tensor_from_dict(d: dict[str, Any]) -> TensorDelta:
    d = dict(d)
    for key in ("shape", "gap_tiers", "value_tiers"):
        d[key] = tuple(int(x) for x in d.get(key, ()))
    return TensorDelta(**d)


def _validate(upd: WeightUpdate) -> None:
    """Cross-field checks that keep a bad header from driving out-of-bounds work later."""
    if upd.kind not in KINDS:
        raise CorruptUpdate(f"unknown update kind {upd.kind!r}")
    if upd.kind == "delta" and upd.base_version is None:
        raise CorruptUpdate("a delta update must name its base_version")
    if not isinstance(upd.momentum, bool) or not all(isinstance(t.predicted, bool) for t in upd.tensors):
        raise CorruptUpdate("update header: momentum and predicted must be true or false")
    if len(set(upd.names)) != len(upd.names):
        raise CorruptUpdate("duplicate tensor names in update header")
    expected_offset = 0
    for t in upd.tensors:
        if t.encoding not in TENSOR_ENCODINGS:
            raise CorruptUpdate(f"{t.name}: unknown tensor encoding {t.encoding!r}")
        try:
            dtype_from_name(t.dtype)
        except ValueError as e:
            raise CorruptUpdate(f"{t.name}: {e}") from e
        if any(s < 0 for s in t.shape) or not 0 <= t.n_changed <= t.n_words:
            raise CorruptUpdate(f"{t.name}: bad shape {t.shape} or n_changed {t.n_changed}")
        if any(b not in ALLOWED_BITS for b in t.gap_tiers + t.value_tiers) or len(t.gap_tiers + t.value_tiers) > 8:
            raise CorruptUpdate(f"{t.name}: bad tier bits {t.gap_tiers} / {t.value_tiers}")
        if t.predicted and (t.encoding != "dense" or upd.kind != "delta"):
            raise CorruptUpdate(f"{t.name}: only dense delta sections are predicted")
        if t.gap_shift not in (0, 8):
            raise CorruptUpdate(f"{t.name}: bad gap shift {t.gap_shift}")
        if t.offset != expected_offset or t.length < 0 or t.raw_length < 0:
            raise CorruptUpdate(f"{t.name}: section at {t.offset}+{t.length} is out of order")
        expected_offset += t.length


def pack_payload(update: WeightUpdate, sections: list[bytes], out: bytearray | None = None) -> bytes | memoryview:
    """Frame `update` and its body (the sections in update.tensors order, each as one or more pieces).

    With `out`, the payload is written into it (grown if too small) and a view of it is returned, valid until
    `out` is reused: a buffer reused update after update is memory already paged in, where a fresh payload
    costs a page fault per 4 KiB (at 1 B parameters and 67% density, ~10% of the encode)."""
    header_json = json.dumps(update.to_dict(), separators=(",", ":")).encode()
    header = zstd.ZstdCompressor(level=3).compress(header_json)
    h = stream_hasher(update.checksum_algo)
    h.update(header)
    for s in sections:
        h.update(s)
    body_len = sum(len(s) for s in sections)
    algo = ALGO_IDS[update.checksum_algo]
    pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, algo, HEADER_ZSTD, len(header), body_len, h.digest())
    if out is None:
        return b"".join([pre, header, *sections])
    total = len(pre) + len(header) + body_len
    if len(out) < total:
        out.extend(bytes(total - len(out)))
    view, pos = memoryview(out), 0
    for piece in (pre, header, *sections):
        view[pos : pos + len(piece)] = piece
        pos += len(piece)
    return view[:total]


def unpack_payload(payload: bytes | bytearray | memoryview) -> tuple[WeightUpdate, memoryview]:
    """Check framing and digest, parse the header; returns the update and a view of the body."""
    mv = memoryview(payload).cast("B")
    if len(mv) < PREAMBLE.size:
        raise CorruptUpdate(f"payload is {len(mv)} bytes, shorter than the {PREAMBLE.size}-byte preamble")
    magic, fmt, algo_id, flags, hlen, blen, digest = PREAMBLE.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptUpdate(f"bad magic {bytes(magic)!r}: not a furlong weight update")
    if fmt != FORMAT_VERSION or flags & ~HEADER_ZSTD:
        raise CorruptUpdate(f"unsupported format {fmt}/flags {flags} (this reader: {FORMAT_VERSION})")
    algo = {v: k for k, v in ALGO_IDS.items()}.get(algo_id)
    if algo is None:
        raise CorruptUpdate(f"unknown checksum algorithm id {algo_id}")
    if hlen > MAX_HEADER or PREAMBLE.size + hlen + blen != len(mv):
        raise CorruptUpdate(
            f"payload is {len(mv)} bytes but its preamble announces {PREAMBLE.size}+{hlen}+{blen}: truncated or padded"
        )
    h = stream_hasher(algo)
    h.update(mv[PREAMBLE.size :])
    if h.digest() != digest:
        raise CorruptUpdate("payload digest mismatch: the update was damaged in transit or storage")
    upd = _parse_header(mv[PREAMBLE.size : PREAMBLE.size + hlen], flags)
    if upd.checksum_algo != algo or sum(t.length for t in upd.tensors) != blen:
        raise CorruptUpdate("update header disagrees with its preamble (algorithm or body length)")
    return upd, mv[PREAMBLE.size + hlen :]


def _parse_header(header: memoryview, flags: int) -> WeightUpdate:
    try:
        raw = bytes(header)
        if flags & HEADER_ZSTD:
            raw = zstd.ZstdDecompressor().decompress(raw, max_output_size=MAX_HEADER)
        return WeightUpdate.from_dict(json.loads(raw))
    except (zstd.ZstdError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptUpdate(f"update header does not decode: {e}") from e
