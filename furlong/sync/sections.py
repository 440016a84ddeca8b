"""Per-tensor sections of a payload: how one tensor's change (or snapshot) becomes bytes.

Every non-empty section is ONE zstd frame (content size recorded) of a raw byte layout.
In all layouts `k` is the number of changed words, `w` the word width, and "planes of x"
means byte 0 of every word of x, then byte 1, ... (see codec.write_planes). Values are
zigzag(new_bits - old_bits mod 2**(8w)), so a one-ulp bf16 step is 1 or 2, its high byte 0.

* "same":   no section; the tensor did not change (its checksum is still verified).
* "sparse": planes of min(gap, C) as `gap_width`-byte words, C = 2**(8*gap_width) - 1,
            where gap = position - previous position - 1 (previous of the first is -1);
            then planes of (gap - C) for every gap >= C, as uint32 (uint64 for tensors of
            >= 2**32 words), `n_escapes` of them; then planes of the k values.
* "bitmap": the change mask, packbits little bit order, ceil(n / 8) bytes; then planes of
            the k values, in position order.
* "planes": full snapshot: for each run of `chunk` words (the last may be shorter), the
            planes of that run's raw words.

The encoder picks per tensor whichever of sparse/bitmap is smaller (compressing both only
in the density band where it is not obvious).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import zstandard as zstd

from furlong.sync import codec
from furlong.sync.checksum import tensor_digest
from furlong.sync.errors import CorruptUpdate
from furlong.sync.update import TensorDelta, dtype_name

# Measured on bf16 training steps (see bench/weight_sync_synthetic.py): gaps beat the bitmap
# below ~10% changed and lose above ~25%; in between both are tried.
SPARSE_ONLY_BELOW = 0.08
BITMAP_ONLY_ABOVE = 0.30
ONE_BYTE_GAPS_ABOVE = 1 / 96  # mean gap < ~96: uint8 gaps; sparser: uint16 (fewer escapes)
FULL_CHUNK = 1 << 20


def encode_tensor_delta(
    name: str, prev: torch.Tensor, new: torch.Tensor, cctx: zstd.ZstdCompressor, algo: str
) -> tuple[TensorDelta, bytes]:
    """The section carrying prev -> new for one tensor (offset is filled in by the caller)."""
    a, b = codec.as_words(prev), codec.as_words(new)
    n = a.size
    ch = codec.scan_changes(a, b, max_sparse=int(n * BITMAP_ONLY_ABOVE))
    meta = TensorDelta(
        name=name, shape=tuple(new.shape), dtype=dtype_name(new.dtype), encoding="same",
        checksum=tensor_digest(new, algo), n_changed=ch.count,
    )
    if ch.count == 0:
        return meta, b""
    values = codec.zigzag(ch.values)
    options = []
    if ch.gaps is not None:
        options.append(_sparse(meta, ch.gaps, values, n, cctx))
    if ch.gaps is None or ch.count >= n * SPARSE_ONLY_BELOW:
        options.append(_bitmap(meta, ch.bitmap, values, cctx))
    return min(options, key=lambda o: len(o[1]))


def _sparse(
    meta: TensorDelta, gaps: np.ndarray, values: np.ndarray, n: int, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    gw = 1 if meta.n_changed >= n * ONE_BYTE_GAPS_ABOVE else 2
    prim, esc = codec.split_gaps(gaps, gw, n)
    raw = np.empty(prim.nbytes + esc.nbytes + values.nbytes, dtype=np.uint8)
    off = codec.write_planes(raw, 0, prim)
    off = codec.write_planes(raw, off, esc)
    codec.write_planes(raw, off, values)
    data = cctx.compress(raw)
    return _with(meta, "sparse", data, raw.size, gap_width=gw, n_escapes=esc.size), data


def _bitmap(
    meta: TensorDelta, bitmap: np.ndarray, values: np.ndarray, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    raw = np.empty(bitmap.size + values.nbytes, dtype=np.uint8)
    raw[: bitmap.size] = bitmap
    codec.write_planes(raw, bitmap.size, values)
    data = cctx.compress(raw)
    return _with(meta, "bitmap", data, raw.size), data


def _with(meta: TensorDelta, encoding: str, data: bytes, raw_length: int, **kw: int) -> TensorDelta:
    return TensorDelta(**{**meta.__dict__, "encoding": encoding, "length": len(data),
                          "raw_length": raw_length, **kw})


def encode_tensor_full(
    name: str, t: torch.Tensor, cctx: zstd.ZstdCompressor, algo: str
) -> tuple[TensorDelta, bytes]:
    """A snapshot section: byte planes per FULL_CHUNK run, streamed through one zstd frame."""
    x = codec.as_words(t)
    n, w = x.size, x.itemsize
    cobj = cctx.compressobj(size=n * w)
    buf = np.empty(min(n, FULL_CHUNK) * w, dtype=np.uint8)
    parts = []
    for s in range(0, n, FULL_CHUNK):
        end = codec.write_planes(buf, 0, x[s : s + FULL_CHUNK])
        parts.append(cobj.compress(buf[:end]))
    parts.append(cobj.flush())
    data = b"".join(parts)
    meta = TensorDelta(
        name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype), encoding="planes",
        checksum=tensor_digest(t, algo), n_changed=n, length=len(data), raw_length=n * w,
        chunk=FULL_CHUNK,
    )
    return meta, data


def expected_raw_length(td: TensorDelta) -> int:
    """The decompressed size the header fields imply; a mismatch means a corrupt header."""
    w, n, k = codec.word_width(td.torch_dtype), td.n_words, td.n_changed
    if td.encoding == "sparse":
        return k * td.gap_width + td.n_escapes * codec.escape_width(n) + k * w
    if td.encoding == "bitmap":
        return (n + 7) // 8 + k * w
    if td.encoding == "planes":
        return n * w
    return 0


def decompress(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> np.ndarray:
    """The raw layout of a section, with every length checked against the header."""
    if td.raw_length != expected_raw_length(td):
        raise CorruptUpdate(f"{td.name}: header says {td.raw_length} raw bytes, fields imply "
                            f"{expected_raw_length(td)}")
    if td.encoding == "same":
        return np.empty(0, dtype=np.uint8)
    try:
        raw = dctx.decompress(section, max_output_size=td.raw_length)
    except zstd.ZstdError as e:
        raise CorruptUpdate(f"{td.name}: zstd section does not decode: {e}") from e
    if len(raw) != td.raw_length:
        raise CorruptUpdate(f"{td.name}: section decoded to {len(raw)} bytes, expected {td.raw_length}")
    return np.frombuffer(raw, dtype=np.uint8)


@dataclass
class Patch:
    """A decoded delta for one tensor: add (or, to roll back, subtract) values at positions."""

    values: np.ndarray
    positions: np.ndarray | None = None  # "sparse"
    bitmap: np.ndarray | None = None  # "bitmap"

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        if self.positions is not None:
            codec.add_at(dst, self.positions, self.values, sign)
            return
        if self.bitmap is None:
            return  # "same"
        vi = 0
        for s in range(0, dst.size, codec.CHUNK):
            c = min(codec.CHUNK, dst.size - s)
            bits = np.unpackbits(self.bitmap[s // 8 : (s + c + 7) // 8], count=c, bitorder="little")
            local = np.flatnonzero(bits)
            codec.add_at(dst[s : s + c], local, self.values[vi : vi + local.size], sign)
            vi += local.size


def decode_patch(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> Patch:
    """Decode and bounds-check a delta section; nothing is written to any tensor here."""
    raw = decompress(td, section, dctx)
    w, n, k = codec.word_width(td.torch_dtype), td.n_words, td.n_changed
    if td.encoding == "same":
        return Patch(values=np.empty(0, dtype=codec.UINT[w]))
    if td.encoding == "bitmap":
        nb = (n + 7) // 8
        bitmap = raw[:nb]
        pad_ok = n % 8 == 0 or int(bitmap[-1]) >> (n % 8) == 0
        if int(np.bitwise_count(bitmap).sum(dtype=np.int64)) != k or not pad_ok:
            raise CorruptUpdate(f"{td.name}: change bitmap disagrees with n_changed={k}")
        return Patch(values=codec.unzigzag(codec.read_planes(raw, nb, k, w)), bitmap=bitmap)
    if td.encoding != "sparse" or td.gap_width not in (1, 2):
        raise CorruptUpdate(f"{td.name}: {td.encoding!r} is not a delta encoding")
    prim = codec.read_planes(raw, 0, k, td.gap_width)
    ew = codec.escape_width(n)
    esc = codec.read_planes(raw, k * td.gap_width, td.n_escapes, ew)
    cap = (1 << (8 * td.gap_width)) - 1
    if int(np.count_nonzero(prim == cap)) != td.n_escapes:
        raise CorruptUpdate(f"{td.name}: escape count disagrees with the header")
    positions = codec.gaps_to_positions(codec.join_gaps(prim, esc))
    if k and positions[-1] >= n:
        raise CorruptUpdate(f"{td.name}: change position {positions[-1]} beyond {n} elements")
    values = codec.unzigzag(codec.read_planes(raw, k * td.gap_width + td.n_escapes * ew, k, w))
    return Patch(values=values, positions=positions)


def decode_full(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> torch.Tensor:
    """A fresh tensor rebuilt from a "planes" section (checksum verified by the caller)."""
    if td.encoding != "planes" or td.chunk <= 0:
        raise CorruptUpdate(f"{td.name}: {td.encoding!r} is not a snapshot encoding")
    raw = decompress(td, section, dctx)
    out = torch.empty(td.shape, dtype=td.torch_dtype)
    x = codec.as_words(out)
    w = x.itemsize
    for s in range(0, x.size, td.chunk):
        c = min(td.chunk, x.size - s)
        codec.read_planes(raw, s * w, c, w, out=x[s : s + c])
    return out
