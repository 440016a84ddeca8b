"""Decoding sections (layouts in furlong.sync.sections) into patches and snapshot tensors.

A Patch adds its differences to a word array, or subtracts them to roll back; because the
arithmetic wraps modulo 2**bits, `apply(dst, +1)` then `apply(dst, -1)` restores dst bit
for bit. Every length and bound is checked against the header before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import zstandard as zstd

from furlong.sync import codec
from furlong.sync.errors import CorruptUpdate
from furlong.sync.update import TensorDelta

PIECE = 1 << 20  # sparse changes expanded to int64 positions at a time
MAX_CHUNK = 1 << 26  # refuse absurd run lengths from a damaged header before allocating


class Patch(Protocol):
    def apply(self, dst: np.ndarray, sign: int = 1) -> None: ...


def expected_raw_length(td: TensorDelta) -> int:
    """The decompressed size the header fields imply; a mismatch means a corrupt header."""
    w, n, k = codec.word_width(td.torch_dtype), td.n_words, td.n_changed
    value_escapes = td.n_value_escapes * w
    if td.encoding == "sparse":
        return k * td.gap_width + k + td.n_escapes * codec.escape_width(n) + value_escapes
    if td.encoding == "bitmap":
        return (n + 7) // 8 + k + value_escapes
    if td.encoding == "dense":
        return n + value_escapes
    if td.encoding == "planes":
        return n * w
    return 0


def _check_lengths(td: TensorDelta) -> None:
    if td.raw_length != expected_raw_length(td):
        raise CorruptUpdate(f"{td.name}: header says {td.raw_length} raw bytes, its fields "
                            f"imply {expected_raw_length(td)}")
    if td.encoding in ("dense", "planes") and not 0 < td.chunk <= MAX_CHUNK:
        raise CorruptUpdate(f"{td.name}: bad run length {td.chunk}")


def decompress(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> np.ndarray:
    """The whole raw layout of a (small: sparse or bitmap) section, length-checked."""
    try:
        raw = dctx.decompress(section, max_output_size=td.raw_length)
    except zstd.ZstdError as e:
        raise CorruptUpdate(f"{td.name}: zstd section does not decode: {e}") from e
    if len(raw) != td.raw_length:
        raise CorruptUpdate(f"{td.name}: section decoded to {len(raw)} bytes, expected {td.raw_length}")
    return np.frombuffer(raw, dtype=np.uint8)


def read_runs(
    td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor, limit: int | None = None
) -> Iterator[tuple[int, np.ndarray]]:
    """(start, words) for each `chunk`-word run of a "dense"/"planes" section, streamed.

    "dense" runs yield zigzagged values, "planes" runs raw words. Only one run is in memory
    at a time, in reused buffers valid until the next run. `limit`: stop below that word."""
    w, n = codec.word_width(td.torch_dtype), td.n_words
    buf = np.empty(min(n, td.chunk) * w, dtype=np.uint8)
    words = np.empty(min(n, td.chunk), dtype=codec.UINT[w])
    symbols = np.empty(min(n, td.chunk) if td.encoding == "dense" else 0, dtype=np.uint8)
    n_esc = 0
    try:
        with dctx.stream_reader(section) as reader:
            for s in range(0, n if limit is None else limit, td.chunk):
                c = min(td.chunk, n - s)
                if td.encoding == "planes":
                    _fill(reader, buf[: c * w], td.name)
                    yield s, codec.read_planes(buf, 0, c, w, out=words[:c])
                    continue
                lo = _fill(reader, symbols[:c], td.name)
                e = codec.count_escapes(lo)
                esc = codec.read_planes(_fill(reader, buf[: e * w], td.name), 0, e, w)
                n_esc += e
                yield s, codec.join_escapes(lo, esc, codec.UINT[w])
            if limit is None and (reader.read(1) or n_esc != td.n_value_escapes):
                raise CorruptUpdate(f"{td.name}: section disagrees with its header")
    except zstd.ZstdError as e:
        raise CorruptUpdate(f"{td.name}: zstd section does not decode: {e}") from e


def _fill(reader: zstd.ZstdDecompressionReader, out: np.ndarray, name: str) -> np.ndarray:
    """Read exactly out.size bytes into `out`, or fail as a truncated section."""
    mv, got = memoryview(out), 0
    while got < len(mv):
        r = reader.readinto(mv[got:])
        if not r:
            raise CorruptUpdate(f"{name}: section ended {len(mv) - got} bytes early")
        got += r
    return out


@dataclass
class SparsePatch:
    """Positions stay in gap form and are expanded PIECE at a time: no 8 bytes per change."""

    values: np.ndarray
    prim: np.ndarray  # capped gap symbols
    esc_at: np.ndarray  # indices of the capped symbols
    esc: np.ndarray  # their excess, int64

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        last = -1
        for i in range(0, self.prim.size, PIECE):
            g = self.prim[i : i + PIECE].astype(np.int64)
            lo, hi = np.searchsorted(self.esc_at, [i, i + g.size])
            g[self.esc_at[lo:hi] - i] += self.esc[lo:hi]
            g += 1
            pos = np.cumsum(g, out=g)
            pos += last
            last = int(pos[-1])
            codec.add_at(dst, pos, self.values[i : i + PIECE], sign)


@dataclass
class BitmapPatch:
    values: np.ndarray
    bitmap: np.ndarray

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        vi = 0
        for s in range(0, dst.size, codec.CHUNK):
            c = min(codec.CHUNK, dst.size - s)
            bits = np.unpackbits(self.bitmap[s // 8 : (s + c + 7) // 8], count=c, bitorder="little")
            local = np.flatnonzero(bits.view(bool))  # bool: numpy's fast nonzero path
            codec.add_at(dst[s : s + c], local, self.values[vi : vi + local.size], sign)
            vi += local.size


@dataclass
class DensePatch:
    """Streams the section run by run; undoes its own runs if the stream breaks midway."""

    td: TensorDelta
    section: memoryview
    dctx: zstd.ZstdDecompressor

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        done = 0
        try:
            for s, d in self._runs(None):
                _add(dst[s : s + d.size], d, sign)
                done = s + d.size
        except CorruptUpdate:
            for s, d in self._runs(done):  # those runs decoded fine a moment ago
                _add(dst[s : s + d.size], d, -sign)
            raise

    def _runs(self, limit: int | None) -> Iterator[tuple[int, np.ndarray]]:
        for s, words in read_runs(self.td, self.section, self.dctx, limit):
            yield s, codec.unzigzag(words)


def _add(seg: np.ndarray, d: np.ndarray, sign: int) -> None:
    if sign > 0:
        seg += d
    else:
        seg -= d


class NoPatch:
    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        pass


def decode_patch(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> Patch:
    """Decode and bounds-check a delta section; nothing is written to any tensor here."""
    _check_lengths(td)
    if td.encoding == "same":
        return NoPatch()
    if td.encoding == "dense":
        return DensePatch(td, section, dctx)
    if td.encoding == "bitmap":
        return _decode_bitmap(td, decompress(td, section, dctx))
    if td.encoding != "sparse" or td.gap_width not in (1, 2):
        raise CorruptUpdate(f"{td.name}: {td.encoding!r} is not a delta encoding")
    return _decode_sparse(td, decompress(td, section, dctx))


def _decode_bitmap(td: TensorDelta, raw: np.ndarray) -> BitmapPatch:
    n, k = td.n_words, td.n_changed
    nb = (n + 7) // 8
    bitmap = raw[:nb]
    pad_ok = n % 8 == 0 or int(bitmap[-1]) >> (n % 8) == 0
    if int(np.bitwise_count(bitmap).sum(dtype=np.int64)) != k or not pad_ok:
        raise CorruptUpdate(f"{td.name}: change bitmap disagrees with n_changed={k}")
    return BitmapPatch(values=_values(td, raw, nb, nb + k), bitmap=bitmap)


def _values(td: TensorDelta, raw: np.ndarray, lo_at: int, esc_at: int) -> np.ndarray:
    """The k values from their symbols at raw[lo_at:] and escape planes at raw[esc_at:]."""
    w, k = codec.word_width(td.torch_dtype), td.n_changed
    lo = raw[lo_at : lo_at + k]
    if codec.count_escapes(lo) != td.n_value_escapes:
        raise CorruptUpdate(f"{td.name}: value escape count disagrees with the header")
    esc = codec.read_planes(raw, esc_at, td.n_value_escapes, w)
    return codec.unzigzag(codec.join_escapes(lo, esc, codec.UINT[w]))


def _decode_sparse(td: TensorDelta, raw: np.ndarray) -> SparsePatch:
    n, k, gw = td.n_words, td.n_changed, td.gap_width
    ew = codec.escape_width(n)
    prim = codec.read_planes(raw, 0, k, gw) if gw > 1 else raw[:k]
    esc = codec.read_planes(raw, k * (gw + 1), td.n_escapes, ew).astype(np.int64)
    esc_at = np.flatnonzero(prim == (1 << (8 * gw)) - 1)
    if esc_at.size != td.n_escapes:
        raise CorruptUpdate(f"{td.name}: gap escape count disagrees with the header")
    last = int(prim.sum(dtype=np.int64)) + int(esc.sum()) + k - 1  # position of the last change
    if last >= n:
        raise CorruptUpdate(f"{td.name}: change position {last} beyond {n} words")
    values = _values(td, raw, k * gw, k * (gw + 1) + td.n_escapes * ew)
    return SparsePatch(values=values, prim=prim, esc_at=esc_at, esc=esc)


def decode_full(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> torch.Tensor:
    """A fresh tensor rebuilt from a "planes" section (checksum verified by the caller)."""
    if td.encoding != "planes":
        raise CorruptUpdate(f"{td.name}: {td.encoding!r} is not a snapshot encoding")
    _check_lengths(td)
    out = torch.empty(td.shape, dtype=td.torch_dtype)
    x = codec.as_words(out)
    for s, words in read_runs(td, section, dctx):
        x[s : s + words.size] = words
    return out
