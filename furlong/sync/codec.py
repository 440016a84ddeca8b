"""Vectorised numpy building blocks of the delta codec (no Python loop per element).

Every tensor is handled as a flat array of unsigned "words" of its element width (bf16 ->
uint16, fp32 -> uint32, int8/bool -> uint8; 16-byte dtypes as pairs of uint64), so bit-exact
comparison and modular (wrap-around) arithmetic work for any dtype.

Scans walk the tensors in CHUNK-element pieces with one reused mask buffer: that keeps the
working set in L2 and avoids the page faults a fresh full-size temporary costs (on this kind
of VM, first-touching 128 MB of new memory alone takes ~100 ms).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

if sys.byteorder != "little":  # byte planes and checksums assume little-endian hosts
    raise ImportError("furlong.sync supports little-endian hosts only")

CHUNK = 1 << 18  # elements per scan step; a multiple of 8 so bitmap chunks are whole bytes
UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_width(dtype: torch.dtype) -> int:
    """Bytes per word for `dtype`: its itemsize, or 8 for wider types (complex128)."""
    size = dtype.itemsize
    return size if size in UINT else 8


def as_words(t: torch.Tensor) -> np.ndarray:
    """1-D unsigned-int numpy view sharing `t`'s memory (`t` must be contiguous and on CPU)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"need a contiguous CPU tensor, got device={t.device} strides={t.stride()}")
    w = word_width(t.dtype)
    if t.numel() == 0:
        return np.empty(0, dtype=UINT[w])
    return t.detach().reshape(-1).view(_TORCH_INT[w]).numpy().view(UINT[w])


def zigzag(u: np.ndarray) -> np.ndarray:
    """Map wrap-around differences to small unsigned ints: 0,-1,1,-2.. -> 0,1,2,3.. (in place)."""
    sign = np.negative(u >> (8 * u.itemsize - 1))  # all-ones where the difference is negative
    np.left_shift(u, 1, out=u)
    np.bitwise_xor(u, sign, out=u)
    return u


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of zigzag (in place)."""
    sign = np.negative(z & 1)
    np.right_shift(z, 1, out=z)
    np.bitwise_xor(z, sign, out=z)
    return z


def write_planes(out: np.ndarray, offset: int, x: np.ndarray) -> int:
    """Write byte i of every word of `x` as plane i at out[offset:]; returns the end offset.

    Splitting high and low bytes is what lets zstd's Huffman stage see the skewed byte
    distributions (high bytes of small diffs are almost all zero)."""
    k, w = x.size, x.itemsize
    xb = x.view(np.uint8)
    for i in range(w):
        out[offset + i * k : offset + (i + 1) * k] = xb[i::w]
    return offset + k * w


def read_planes(
    raw: np.ndarray, offset: int, k: int, w: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of write_planes: k words of width w from the planes at raw[offset:]."""
    x = np.empty(k, dtype=UINT[w]) if out is None else out
    xb = x.view(np.uint8)
    for i in range(w):
        xb[i::w] = raw[offset + i * k : offset + (i + 1) * k]
    return x


@dataclass
class Changes:
    """Where `new` differs from `prev` and by how much (wrap-around new - prev, per word)."""

    count: int
    values: np.ndarray
    gaps: np.ndarray | None  # (position gap - 1) per change, int64; None if over max_sparse
    bitmap: np.ndarray  # packbits(change mask, little bit order), ceil(n / 8) bytes


def scan_changes(a: np.ndarray, b: np.ndarray, max_sparse: int) -> Changes:
    """Compare two word arrays chunk by chunk; gaps are kept while count <= max_sparse."""
    n = a.size
    mask = np.empty(min(n, CHUNK), dtype=bool)
    bitmaps, values, gaps = [], [], []
    last, count, keep_gaps = -1, 0, True
    for s in range(0, n, CHUNK):
        ac, bc = a[s : s + CHUNK], b[s : s + CHUNK]
        m = mask[: ac.size]
        np.not_equal(ac, bc, out=m)
        bitmaps.append(np.packbits(m, bitorder="little"))
        local = np.flatnonzero(m)
        if local.size == 0:
            continue
        values.append(np.take(bc, local) - np.take(ac, local))  # unsigned: wraps mod 2^bits
        count += local.size
        if keep_gaps:
            g = np.empty_like(local)
            g[0] = local[0] + s - last - 1
            np.subtract(local[1:], local[:-1], out=g[1:])
            g[1:] -= 1
            gaps.append(g)
            last = int(local[-1]) + s
            keep_gaps = count <= max_sparse
    return Changes(
        count=count,
        values=_concat(values, a.dtype),
        gaps=_concat(gaps, np.int64) if keep_gaps else None,
        bitmap=_concat(bitmaps, np.uint8),
    )


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def escape_width(n: int) -> int:
    """Bytes per escaped gap: 4 unless the tensor has >= 2**32 words."""
    return 4 if n < (1 << 32) else 8


def split_gaps(gaps: np.ndarray, gap_width: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Primary symbols (gap capped at 2**(8*gap_width)-1) and the escape stream of excesses."""
    cap = (1 << (8 * gap_width)) - 1
    prim = np.minimum(gaps, cap).astype(UINT[gap_width])
    big = gaps[gaps >= cap]
    return prim, (big - cap).astype(UINT[escape_width(n)])


def join_gaps(prim: np.ndarray, esc: np.ndarray) -> np.ndarray:
    """Inverse of split_gaps; the caller checks the escape count matches the header."""
    gaps = prim.astype(np.int64)
    cap = (1 << (8 * prim.itemsize)) - 1
    gaps[gaps == cap] += esc.astype(np.int64)
    return gaps


def gaps_to_positions(gaps: np.ndarray) -> np.ndarray:
    """Absolute word positions from (gap - 1) values (consumes `gaps`); strictly increasing."""
    gaps += 1
    pos = np.cumsum(gaps, out=gaps)
    pos -= 1
    return pos


def add_at(dst: np.ndarray, pos: np.ndarray, vals: np.ndarray, sign: int) -> None:
    """dst[pos] += sign * vals, wrapping; positions are unique, so a gather/scatter is exact."""
    cur = np.take(dst, pos)
    if sign > 0:
        cur += vals
    else:
        cur -= vals
    np.put(dst, pos, cur)
