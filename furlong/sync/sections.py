"""Per-tensor sections of a payload: how one tensor's change (or snapshot) becomes bytes.

Every non-empty section is ONE zstd frame of a raw byte layout. `n` is the tensor's length
in words (see codec.as_words), `k` its number of changed words, `w` the word width. "Planes
of x" means byte 0 of every word of x, then byte 1, ... . Byte planes are what make zstd
effective here: its literals are Huffman-coded per block with no context, so putting all
low bytes together (and all high bytes, mostly zero) gives it skewed, uniform statistics.

Values. v = zigzag(new_bits - old_bits mod 2**(8w)): a one-ulp bf16 step is 1 or 2. Each
value is coded as a symbol byte min(v, 255) plus, for symbols 255 (escapes), v - 255 as a
w-byte word in a separate escape stream: a mostly-zero high-byte plane would cost Huffman
a full bit per value, while a rare escape symbol costs a few bits only where it occurs.
Gaps. gap = position - previous position - 1 (previous of the first is -1), coded the same
way: a `gap_width`-byte symbol min(gap, C), C = 2**(8*gap_width) - 1, and gap - C as
uint32 (uint64 for tensors of >= 2**32 words) for symbols equal to C.

* "same":   no section; the tensor did not change (its checksum is still verified).
* "sparse": planes of the k gap symbols | k value symbols | planes of the `n_escapes` gap
            escapes | planes of the `n_value_escapes` value escapes.
* "bitmap": change mask (packbits, little bit order, ceil(n/8) bytes) | k value symbols |
            planes of the value escapes. Values are in position order.
* "dense":  for each run of `chunk` words (the last may be shorter): the symbols of ALL its
            words' values (0 where unchanged) | planes of that run's value escapes (their
            count is the number of 255 symbols in the run). No positions at all: fastest to
            encode and apply, and as small as "bitmap" once nearly every word changes.
* "planes": full snapshot: for each run of `chunk` words, the planes of its raw words.

Choice (sizes measured on simulated bf16 steps, see bench/weight_sync_synthetic.py): sparse
below 12% changed, bitmap from 35%, dense when a sample says >= 85%; in 12-35% both sparse
and bitmap are compressed and the smaller kept.
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard as zstd

from furlong.sync import codec, scan
from furlong.sync.checksum import tensor_digest
from furlong.sync.update import TensorDelta, dtype_name

SPARSE_ONLY_BELOW = 0.12
SPARSE_MAX = 0.35  # past this many changes the sparse scan stops (and its memory is freed)
DENSE_ABOVE = 0.85
ONE_BYTE_GAPS_ABOVE = 1 / 400  # uint8 gaps (escapes for >= 255) beat uint16 down to ~0.3%
CHUNK = 1 << 20  # words per run in "dense" and "planes" sections


def delta_compressor(level: int | None = None) -> zstd.ZstdCompressor:
    """zstd for delta sections: `level`, or by default level-1-like fast parameters.

    Sections are byte planes with little LZ structure; nearly all the gain is zstd's Huffman
    stage. A small hash table and long min-match skip futile match searches: same size as
    level 1 here, ~30% faster. Single-threaded (no workers), so one encode = one core."""
    if level is not None:
        return zstd.ZstdCompressor(level=level)
    params = zstd.ZstdCompressionParameters(
        strategy=zstd.STRATEGY_FAST, window_log=17, hash_log=12, chain_log=6,
        search_log=1, min_match=7, target_length=0,
    )
    return zstd.ZstdCompressor(compression_params=params)


def encode_tensor_delta(
    name: str, prev: torch.Tensor, new: torch.Tensor, cctx: zstd.ZstdCompressor, algo: str
) -> tuple[TensorDelta, bytes]:
    """The section carrying prev -> new for one tensor (offset is filled in by the caller)."""
    a, b = codec.as_words(prev), codec.as_words(new)
    n = a.size
    meta = TensorDelta(name=name, shape=tuple(new.shape), dtype=dtype_name(new.dtype),
                       encoding="same", checksum=tensor_digest(new, algo))
    # A cheap sample fixes the path before the single scan; a wrong guess costs some size
    # or speed, never correctness.
    est = scan.estimate_density(a, b)
    if est >= DENSE_ABOVE:
        return _dense(meta, a, b, cctx)
    gw = 1 if est >= ONE_BYTE_GAPS_ABOVE else 2
    sc = scan.scan_changes(a, b, gw, max_sparse=int(n * SPARSE_MAX))
    if sc.count == 0:
        return meta, b""
    if sc.dense:  # the scan gave up: too many changes for gaps
        bitmap, values = scan.scan_bitmap(a, b)
        return _bitmap(_with(meta, n_changed=values.count), bitmap, values, cctx)
    meta = _with(meta, n_changed=sc.count)
    options = [_sparse(meta, sc, n, cctx)]
    if sc.count >= n * SPARSE_ONLY_BELOW:
        options.append(_bitmap(meta, scan.change_bitmap(a, b), sc.values, cctx))
    return min(options, key=lambda o: len(o[1]))


def _with(meta: TensorDelta, **fields: object) -> TensorDelta:
    return TensorDelta(**{**meta.__dict__, **fields})


def _sparse(
    meta: TensorDelta, sc: scan.Scan, n: int, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    gap_esc = np.concatenate(sc.gap_esc).astype(codec.UINT[codec.escape_width(n)]) if sc.gap_esc else None
    parts = codec.plane_views(sc.gaps) + sc.values.lo
    parts += codec.plane_views([gap_esc] if gap_esc is not None else [])
    parts += codec.plane_views(sc.values.esc)
    raw = np.concatenate(parts)  # one copy, straight from the strided views
    data = cctx.compress(raw)
    return _with(meta, encoding="sparse", length=len(data), raw_length=raw.size,
                 gap_width=sc.gap_width, n_escapes=0 if gap_esc is None else gap_esc.size,
                 n_value_escapes=sc.values.n_esc), data


def _bitmap(
    meta: TensorDelta, bitmap: np.ndarray, values: scan.Values, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    raw = np.concatenate([bitmap, *values.lo, *codec.plane_views(values.esc)])
    data = cctx.compress(raw)
    return _with(meta, encoding="bitmap", length=len(data), raw_length=raw.size,
                 n_value_escapes=values.n_esc), data


def _dense(
    meta: TensorDelta, a: np.ndarray, b: np.ndarray, cctx: zstd.ZstdCompressor
) -> tuple[TensorDelta, bytes]:
    """Stream every word's coded value through one zstd frame, run by run."""
    cobj = cctx.compressobj()
    parts, count, raw_length = [], 0, 0
    for run_parts, c in scan.dense_runs(a, b, CHUNK):
        raw = np.concatenate(run_parts) if len(run_parts) > 1 else run_parts[0]
        parts.append(cobj.compress(raw))
        count += c
        raw_length += raw.size
    if count == 0:
        return meta, b""
    parts.append(cobj.flush())
    data = b"".join(parts)
    n_esc = (raw_length - a.size) // a.itemsize
    return _with(meta, encoding="dense", n_changed=count, length=len(data),
                 raw_length=raw_length, n_value_escapes=n_esc, chunk=CHUNK), data


def encode_tensor_full(
    name: str, t: torch.Tensor, cctx: zstd.ZstdCompressor, algo: str
) -> tuple[TensorDelta, bytes]:
    """A snapshot section: byte planes per CHUNK run, streamed through one zstd frame."""
    x = codec.as_words(t)
    n, w = x.size, x.itemsize
    cobj = cctx.compressobj(size=n * w)
    buf = np.empty(min(n, CHUNK) * w, dtype=np.uint8)
    parts = []
    for s in range(0, n, CHUNK):
        end = codec.write_planes(buf, 0, x[s : s + CHUNK])
        parts.append(cobj.compress(buf[:end]))
    parts.append(cobj.flush())
    data = b"".join(parts)
    meta = TensorDelta(
        name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype), encoding="planes",
        checksum=tensor_digest(t, algo), n_changed=n, length=len(data), raw_length=n * w,
        chunk=CHUNK,
    )
    return meta, data
