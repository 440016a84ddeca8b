"""Decoding sections (layouts in furlong.sync.sections) into patches and snapshot tensors.

A Patch adds its differences to a word array, or subtracts them to roll back; because the
arithmetic wraps modulo 2**bits, `apply(dst, +1)` then `apply(dst, -1)` restores dst bit
for bit. Every length and bound is checked against the header before anything is written.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import zstandard as zstd

from furlong.sync import codec, kernels, momentum, tiers
from furlong.sync.errors import CorruptUpdate
from furlong.sync.update import TensorDelta

MAX_CHUNK = 1 << 26  # refuse absurd run lengths from a damaged header before allocating


class Patch(Protocol):
    def apply(self, dst: np.ndarray, sign: int = 1) -> None: ...


def _check_header(td: TensorDelta) -> None:
    w, n = codec.word_width(td.torch_dtype), td.n_words
    # Generous bound on any layout: refuse absurd sizes before allocating for them.
    if td.raw_length > (n + 8) * (w + 16) + 64 or (td.encoding == "same") != (td.length == 0):
        raise CorruptUpdate(f"{td.name}: header section sizes do not fit the tensor")
    if td.encoding in ("dense", "planes") and not 0 < td.chunk <= MAX_CHUNK:
        raise CorruptUpdate(f"{td.name}: bad run length {td.chunk}")


class _Cursor:
    """Reads exact byte counts from an in-memory raw layout; overruns are CorruptUpdate."""

    def __init__(self, raw: np.ndarray, name: str):
        self.raw, self.name, self.pos = raw, name, 0

    def read(self, nbytes: int) -> np.ndarray:
        if self.pos + nbytes > self.raw.size:
            raise CorruptUpdate(f"{self.name}: section is shorter than its contents")
        self.pos += nbytes
        return self.raw[self.pos - nbytes : self.pos]

    def finish(self) -> None:
        if self.pos != self.raw.size:
            raise CorruptUpdate(f"{self.name}: {self.raw.size - self.pos} unexpected bytes in section")


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

    "dense" runs yield zigzag values, "planes" runs raw words. Only one run is in memory at
    a time. `limit`: stop below that word (used to undo a partly applied section)."""
    w = codec.word_width(td.torch_dtype)
    for s, c, read in read_run_streams(td, section, dctx, limit):
        if td.encoding == "planes":
            yield s, codec.read_planes(read(c * w), w)
        else:
            yield s, tiers.decode(read, c, td.value_tiers, codec.UINT[w])


def read_run_streams(
    td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor, limit: int | None = None
) -> Iterator[tuple[int, int, tiers.Reader]]:
    """(start, words, read) for each `chunk`-word run of a "dense"/"planes" section: `read(n)`
    returns the run's next n raw bytes, for the caller to decode (read_runs, furlong.sync.kernels).
    Damaged data raises CorruptUpdate, whether met here or in the caller's reads."""
    n = td.n_words
    try:
        with dctx.stream_reader(section) as reader:
            read = functools.partial(_read_exact, reader, td.name)
            for s in range(0, n if limit is None else limit, td.chunk):
                yield s, min(td.chunk, n - s), read
            if limit is None and reader.read(1):
                raise CorruptUpdate(f"{td.name}: section holds more data than its header says")
    except zstd.ZstdError as e:
        raise CorruptUpdate(f"{td.name}: zstd section does not decode: {e}") from e


def _read_exact(reader: zstd.ZstdDecompressionReader, name: str, nbytes: int) -> np.ndarray:
    # Converts zstd's errors itself: a caller of read_run_streams calls this outside the
    # generator's own try block.
    out = np.empty(nbytes, dtype=np.uint8)
    mv, got = out.data, 0
    while got < nbytes:
        try:
            r = reader.readinto(mv[got:])
        except zstd.ZstdError as e:
            raise CorruptUpdate(f"{name}: zstd section does not decode: {e}") from e
        if not r:
            raise CorruptUpdate(f"{name}: section ended {nbytes - got} bytes early")
        got += r
    return out


@dataclass
class SparsePatch:
    values: np.ndarray
    positions: np.ndarray  # int64, strictly increasing

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        codec.add_at(dst, self.positions, self.values, sign)


@dataclass
class BitmapPatch:
    values: np.ndarray
    bitmap: np.ndarray

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        if kernels.available(dst.dtype):
            kernels.bitmap_apply(self.bitmap, self.values, dst, sign)
            return
        vi = 0
        for s in range(0, dst.size, codec.CHUNK):
            c = min(codec.CHUNK, dst.size - s)
            bits = np.unpackbits(self.bitmap[s // 8 : (s + c + 7) // 8], count=c, bitorder="little")
            local = np.flatnonzero(bits.view(bool))  # bool: numpy's fast nonzero path
            codec.add_at(dst[s : s + c], local, self.values[vi : vi + local.size], sign)
            vi += local.size


@dataclass
class DensePatch:
    """Streams the section run by run; undoes its own runs if the stream breaks midway.

    `p`: the int8 momentum predictions a "predicted" section's residuals are added to; `state`: where
    the changes are recorded, if wanted (furlong.sync.momentum)."""

    td: TensorDelta
    section: memoryview
    dctx: zstd.ZstdDecompressor
    p: np.ndarray | None = None
    state: np.ndarray | None = None

    def apply(self, dst: np.ndarray, sign: int = 1) -> None:
        done = 0
        try:
            for s, n in self._apply_runs(dst, sign, None):
                done = s + n
        except Exception:
            for _ in self._apply_runs(dst, -sign, done):  # those runs decoded fine a moment ago
                pass
            raise

    def _apply_runs(self, dst: np.ndarray, sign: int, limit: int | None) -> Iterator[tuple[int, int]]:
        """Adds each run as it is decoded; yields (start, words) after each. A run whose stream breaks
        raises before any of it is written (the compiled path reads all its streams first)."""
        p, state = self.p, self.state
        if not kernels.available(dst.dtype):
            for s, d in self._runs(limit):
                if p is not None:
                    d += momentum.widen(p[s : s + d.size], d.dtype)
                if state is not None:
                    momentum.record(d, state[s : s + d.size])
                _add(dst[s : s + d.size], d, sign)
                yield s, d.size
            return
        bufs = kernels.RunBuffers(0)  # zero predictions and scratch states, reused run after run
        for s, n, read in read_run_streams(self.td, self.section, self.dctx, limit):
            kernels.apply_run(
                read,
                n,
                self.td.value_tiers,
                dst[s : s + n],
                sign,
                None if p is None else p[s : s + n],
                None if state is None else state[s : s + n],
                bufs,
            )
            yield s, n

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
    _check_header(td)
    if td.encoding == "same":
        return NoPatch()
    if td.encoding == "dense":
        return DensePatch(td, section, dctx)
    if td.encoding not in ("sparse", "bitmap"):
        raise CorruptUpdate(f"{td.name}: {td.encoding!r} is not a delta encoding")
    cur = _Cursor(decompress(td, section, dctx), td.name)
    n, k = td.n_words, td.n_changed
    wide = codec.UINT[codec.word_width(td.torch_dtype)]
    if td.encoding == "bitmap":
        bitmap = cur.read((n + 7) // 8)
        pad_ok = n % 8 == 0 or int(bitmap[-1]) >> (n % 8) == 0
        if int(np.bitwise_count(bitmap).sum(dtype=np.int64)) != k or not pad_ok:
            raise CorruptUpdate(f"{td.name}: change bitmap disagrees with n_changed={k}")
        patch: Patch = BitmapPatch(codec.unzigzag(tiers.decode(cur.read, k, td.value_tiers, wide)), bitmap)
    else:
        gaps = tiers.decode_shifted(cur.read, k, td.gap_shift, td.gap_tiers, tiers.gap_wide(n), np.int64)
        if k and int(gaps.max()) >= n:  # bounds every gap, so the sums below cannot overflow
            raise CorruptUpdate(f"{td.name}: change gap beyond {n} words")
        gaps += 1
        positions = np.cumsum(gaps, out=gaps)  # in place: no second k-sized array
        positions -= 1
        if k and int(positions[-1]) >= n:
            raise CorruptUpdate(f"{td.name}: change positions run past {n} words")
        values = codec.unzigzag(tiers.decode(cur.read, k, td.value_tiers, wide))
        patch = SparsePatch(values, positions)
    cur.finish()
    return patch


def decode_full(td: TensorDelta, section: memoryview, dctx: zstd.ZstdDecompressor) -> torch.Tensor:
    """A fresh tensor rebuilt from a "planes" section (checksum verified by the caller)."""
    if td.encoding != "planes":
        raise CorruptUpdate(f"{td.name}: {td.encoding!r} is not a snapshot encoding")
    _check_header(td)
    out = torch.empty(td.shape, dtype=td.torch_dtype)
    x = codec.as_words(out)
    for s, words in read_runs(td, section, dctx):
        x[s : s + words.size] = words
    return out
