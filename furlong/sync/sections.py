"""Per-tensor sections of a payload: how one tensor's change (or snapshot) becomes bytes.

Every non-empty section is ONE zstd frame of a raw byte layout. `n` is the tensor's length
in words (see codec.as_words), `k` its number of changed words, `w` the word width.

* values: zigzag(new_bits - old_bits mod 2**(8w)) of changed words, so a one-ulp bf16 step
  is 1 or 2; coded with tiers `value_tiers` and a w-byte remainder (see furlong.sync.tiers).
* gaps: position - previous position - 1 (previous of the first is -1), coded with tiers
  `gap_tiers` and a uint32 remainder (uint64 for tensors of >= 2**32 words); with
  `gap_shift` 8 the gaps' low bytes come first as one plain plane and the tiers code gap >> 8.
* each stream (tier, plane, bitmap) ends a zstd block, so it gets its own Huffman table.

Layouts (`|` = concatenation):
* "same":   no section; the tensor did not change (its checksum is still verified).
* "sparse": gap stream (k entries) | value stream (k entries, position order).
* "bitmap": change mask (packbits, little bit order, ceil(n/8) bytes) | value stream (k).
* "dense":  for each run of `chunk` words (the last may be shorter), the value stream of
            ALL its words (0 where unchanged): no positions at all, the fastest to encode
            and apply, and as small as "bitmap" once half the words change.
* "planes": full snapshot: for each run of `chunk` words, the byte planes of its raw words
            (byte 0 of every word, then byte 1, ...: exponent bytes compress, mantissas not).

Choice, by the density a sample of the tensor shows (sizes measured on simulated bf16 steps,
within ~2% of the best layout around each switch point): sparse below 25% changed, bitmap
below 50%, dense from 50%.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np
import torch
import zstandard as zstd

from furlong.sync import codec, kernels, scan, tiers
from furlong.sync.checksum import tensor_digest
from furlong.sync.momentum import Momentum
from furlong.sync.update import TensorDelta, dtype_name

BITMAP_FROM = 0.25  # sampled density from which the change mask beats gaps
DENSE_FROM = 0.5  # ... and from which coding every word's value is as small, and faster
SPARSE_MAX = 0.3  # the sparse scan gives up past this many changes (sample was wrong)
GROUPED_BELOW = 0.1  # see scan.changed_words
CHUNK = 1 << 20  # words per run in "dense" and "planes" sections


def section_compressor(level: int | None = None) -> zstd.ZstdCompressor:
    """zstd for sections: `level`, or by default level-1-like fast parameters.

    Section streams have little LZ structure; nearly all the gain is zstd's Huffman stage.
    A small hash table and the longest min-match cut futile match searching: same size as
    level 1 on our streams (snapshots included), ~30% faster. No worker threads: one
    encode = one core."""
    if level is not None:
        return zstd.ZstdCompressor(level=level)
    params = zstd.ZstdCompressionParameters(
        strategy=zstd.STRATEGY_FAST,
        window_log=17,
        hash_log=12,
        chain_log=6,
        search_log=1,
        min_match=7,
        target_length=0,
    )
    return zstd.ZstdCompressor(compression_params=params)


class Change(Protocol):
    """One tensor's words before and after, as the layout choice reads them. HostChange scans two host
    arrays; furlong.sync.staging's DeviceChange finds the changes on the tensors' device and brings over
    only what the chosen layout needs. Both must give the same answers: the payload is the same."""

    n: int  # words
    dtype: np.dtype  # of the words (codec.UINT)

    def density(self) -> float: ...  # as scan.estimate_density
    def sparse(self, max_sparse: int, grouped: bool) -> scan.Scan: ...  # as scan.scan_changes
    def bitmap(self) -> tuple[np.ndarray, np.ndarray]: ...  # as scan.scan_bitmap: mask, zigzag values
    def words(self) -> tuple[np.ndarray, np.ndarray]: ...  # every word: prev, new


class HostChange:
    """prev -> new words, both in host memory."""

    def __init__(self, a: np.ndarray, b: np.ndarray) -> None:
        self.a, self.b, self.n, self.dtype = a, b, a.size, a.dtype

    def density(self) -> float:
        return scan.estimate_density(self.a, self.b)

    def sparse(self, max_sparse: int, grouped: bool) -> scan.Scan:
        return scan.scan_changes(self.a, self.b, max_sparse, grouped)

    def bitmap(self) -> tuple[np.ndarray, np.ndarray]:
        if kernels.available(self.dtype):
            return kernels.bitmap_layout(self.a, self.b, CHUNK)
        bitmap, parts = scan.scan_bitmap(self.a, self.b)
        return bitmap, scan.concat(parts, self.dtype)

    def words(self) -> tuple[np.ndarray, np.ndarray]:
        return self.a, self.b


def encode_tensor_delta(
    name: str,
    prev: torch.Tensor,
    new: torch.Tensor,
    cctx: zstd.ZstdCompressor,
    algo: str,
    momentum: Momentum | None = None,
    base_version: int | None = None,
) -> tuple[TensorDelta, bytes | list[bytes]]:
    """The section carrying prev -> new for one tensor (offset is filled in by the caller), as bytes or
    as the list of its consecutive pieces. With `momentum` (recording the update made against
    `base_version`) a dense tensor is predicted from its state, if it has one, and records its own."""
    change = HostChange(codec.as_words(prev), codec.as_words(new))
    return encode_change(delta_meta(name, new, tensor_digest(new, algo)), change, cctx, momentum, base_version)


def delta_meta(name: str, new: torch.Tensor, checksum: str) -> TensorDelta:
    """A tensor's delta header before its layout is chosen ("same": nothing changed)."""
    return TensorDelta(
        name=name, shape=tuple(new.shape), dtype=dtype_name(new.dtype), encoding="same", checksum=checksum
    )


def encode_change(
    meta: TensorDelta,
    change: Change,
    cctx: zstd.ZstdCompressor,
    momentum: Momentum | None = None,
    base_version: int | None = None,
) -> tuple[TensorDelta, bytes | list[bytes]]:
    """encode_tensor_delta for any Change (`meta` from delta_meta)."""
    # A cheap sample picks the layout before the single scan; a wrong guess costs a little
    # size or speed, never correctness (the sparse scan also gives up past SPARSE_MAX).
    est = change.density()
    if est >= DENSE_FROM:
        a, b = change.words()
        if momentum is None:
            return _dense(meta, a, b, cctx)
        p = momentum.prediction(meta.name, base_version)
        meta, data = _dense(replace(meta, predicted=p is not None), a, b, cctx, p, momentum.buffer(meta.name, change.n))
        if meta.encoding != "dense":  # unchanged after all: like every non-dense tensor, it records nothing
            momentum.discard(meta.name)
        return meta, data
    if est < BITMAP_FROM:
        sc = change.sparse(int(change.n * SPARSE_MAX), grouped=est < GROUPED_BELOW)
        if sc.count == 0:
            return meta, b""
        if not sc.dense:
            meta = replace(meta, n_changed=sc.count)
            return _sparse(meta, scan.concat(sc.gaps, np.int64), scan.concat(sc.values, change.dtype), cctx)
    bitmap, values = change.bitmap()
    if values.size == 0:
        return meta, b""
    return _bitmap(replace(meta, n_changed=values.size), bitmap, values, cctx)


def _sparse(
    meta: TensorDelta, gaps: np.ndarray, values: np.ndarray, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    vt = tiers.value_tiers(values)
    wide = tiers.gap_wide(meta.n_words)
    shift, gt = _gap_coding(gaps, wide, cctx)
    parts = tiers.encode_shifted(gaps, shift, gt, wide) + tiers.encode(values, vt, values.dtype.type)
    data, raw_length = compress_streams(cctx, parts)
    return replace(
        meta,
        encoding="sparse",
        length=len(data),
        raw_length=raw_length,
        gap_shift=shift,
        gap_tiers=gt,
        value_tiers=vt,
    ), data


def _gap_coding(gaps: np.ndarray, wide: type, cctx: zstd.ZstdCompressor) -> tuple[int, tuple[int, ...]]:
    """Byte tiers for small gaps; for sparse tensors (mean gap >= 100, so few changes and
    cheap to try) whichever shifted coding compresses smallest."""
    if gaps.size == 0 or gaps.mean() < 100:
        return 0, tiers.GAP_TIERS
    options = [(0, tiers.GAP_TIERS)] + [(8, t) for t in tiers.VALUE_TIER_CHOICES]

    def size(option: tuple[int, tuple[int, ...]]) -> int:
        return len(compress_streams(cctx, tiers.encode_shifted(gaps, option[0], option[1], wide))[0])

    return min(options, key=size)


def _bitmap(
    meta: TensorDelta, bitmap: np.ndarray, values: np.ndarray, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    vt = tiers.value_tiers(values)
    if kernels.available(values.dtype):
        streams = kernels.encode_values(values, vt, kernels.RunBuffers(values.size))
    else:
        streams = tiers.encode(values, vt, values.dtype.type)
    data, raw_length = compress_streams(cctx, [bitmap, *streams])
    return replace(meta, encoding="bitmap", length=len(data), raw_length=raw_length, value_tiers=vt), data


def _dense(
    meta: TensorDelta,
    a: np.ndarray,
    b: np.ndarray,
    cctx: zstd.ZstdCompressor,
    p: np.ndarray | None = None,
    state: np.ndarray | None = None,
) -> tuple[TensorDelta, bytes | list[bytes]]:
    """Stream every word's coded value (its change minus its prediction `p`) through one zstd frame, run by
    run; `state` records the changes (furlong.sync.momentum)."""
    cobj = cctx.compressobj()
    parts: list[bytes] = []
    count, raw_length, vt = 0, 0, None
    for streams, c, vt in _dense_runs(a, b, p, state):  # noqa: B007  # vt is read after the loop; the first run's values choose the tensor's tiers
        raw_length += _feed(cobj, streams, parts)
        count += c
    if count == 0 or vt is None:
        return replace(meta, predicted=False), b""
    parts.append(cobj.flush())
    # The frame's pieces, not joined: the payload joins every section once (a join here copied a
    # dense section twice, and at 1B parameters that copy cost more than zstd itself).
    return replace(
        meta,
        encoding="dense",
        n_changed=count,
        length=sum(len(p) for p in parts),
        raw_length=raw_length,
        value_tiers=vt,
        chunk=CHUNK,
    ), parts


def _dense_runs(a: np.ndarray, b: np.ndarray, p: np.ndarray | None, state: np.ndarray | None):
    """(coded streams, changes, value tiers) per CHUNK run; compiled kernels when there are some."""
    vt = None
    if kernels.available(a.dtype):
        bufs = kernels.RunBuffers(min(a.size, CHUNK))
        for s in range(0, a.size, CHUNK):
            part = slice(s, s + CHUNK)
            vt, streams, c = kernels.encode_run(
                a[part], b[part], bufs, vt, None if p is None else p[part], None if state is None else state[part]
            )
            yield streams, c, vt
        return
    for z, c in scan.dense_runs(a, b, CHUNK, p, state):
        vt = vt or tiers.value_tiers(z)
        yield tiers.encode(z, vt, z.dtype.type), c, vt


def compress_streams(cctx: zstd.ZstdCompressor, streams: list[np.ndarray]) -> tuple[bytes, int]:
    """One zstd frame of the concatenated streams, and its raw length.

    Each stream ends a zstd block, so each gets its own Huffman table: mixing e.g. gap and
    value symbols in one block costs up to ~1 bit per change on small tensors."""
    cobj = cctx.compressobj(size=sum(s.size for s in streams))
    out: list[bytes] = []
    raw_length = _feed(cobj, streams, out)
    out.append(cobj.flush())
    return b"".join(out), raw_length


def _feed(cobj: zstd.ZstdCompressionObj, streams: list[np.ndarray], out: list[bytes]) -> int:
    for s in streams:
        if s.size:
            out.append(cobj.compress(np.ascontiguousarray(s).data))
            out.append(cobj.flush(zstd.COMPRESSOBJ_FLUSH_BLOCK))
    return sum(s.size for s in streams)


def encode_tensor_full(name: str, t: torch.Tensor, cctx: zstd.ZstdCompressor, algo: str) -> tuple[TensorDelta, bytes]:
    """A snapshot section: byte planes per CHUNK run, streamed through one zstd frame."""
    x = codec.as_words(t)
    cobj = cctx.compressobj(size=x.nbytes)
    parts: list[bytes] = []
    for s in range(0, x.size, CHUNK):
        _feed(cobj, codec.plane_parts(x[s : s + CHUNK]), parts)
    parts.append(cobj.flush())
    data = b"".join(parts)
    meta = TensorDelta(
        name=name,
        shape=tuple(t.shape),
        dtype=dtype_name(t.dtype),
        encoding="planes",
        checksum=tensor_digest(t, algo),
        n_changed=x.size,
        length=len(data),
        raw_length=x.nbytes,
        chunk=CHUNK,
    )
    return meta, data
