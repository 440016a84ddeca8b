"""Vectorised numpy building blocks of the delta codec (no Python loop per element).

Every tensor is handled as a flat array of unsigned "words" of its element width (bf16 ->
uint16, fp32 -> uint32, int8/bool -> uint8; 16-byte dtypes as pairs of uint64), so bit-exact
comparison and modular (wrap-around) arithmetic work for any dtype.

Work is done in CHUNK-word pieces with reused buffers: that keeps the working set in cache
and avoids the page faults a fresh full-size temporary costs (on this kind of VM,
first-touching 128 MB of new memory alone takes ~100 ms).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

if sys.byteorder != "little":  # byte planes and checksums assume little-endian hosts
    raise ImportError("furlong.sync supports little-endian hosts only")

CHUNK = 1 << 20  # elements per scan step; a multiple of 8 so bitmap chunks are whole bytes
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
    return int_words(t).numpy().view(UINT[w])


def int_words(t: torch.Tensor) -> torch.Tensor:
    """The words of as_words as a 1-D signed-int torch view, on `t`'s device (torch lacks most unsigned
    ops): equal words have equal bits, which is all a comparison needs."""
    return t.detach().reshape(-1).view(_TORCH_INT[word_width(t.dtype)])


def zigzag(u: np.ndarray) -> np.ndarray:
    """Map wrap-around differences to small unsigned ints: 0,-1,1,-2.. -> 0,1,2,3.. (in place)."""
    sign = u >> (8 * u.itemsize - 1)
    np.negative(sign, out=sign)  # all-ones where the difference is negative
    np.left_shift(u, 1, out=u)
    np.bitwise_xor(u, sign, out=u)
    return u


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of zigzag (in place)."""
    sign = z & 1
    np.negative(sign, out=sign)
    np.right_shift(z, 1, out=z)
    np.bitwise_xor(z, sign, out=z)
    return z


def read_planes(raw: np.ndarray, w: int) -> np.ndarray:
    """Words of width w from their byte planes in raw (inverse of plane_parts)."""
    k = raw.size // w
    x = np.empty(k, dtype=UINT[w])
    xb = x.view(np.uint8)
    for i in range(w):
        xb[i::w] = raw[i * k : (i + 1) * k]
    return x


def plane_parts(x: np.ndarray) -> list[np.ndarray]:
    """Byte planes of x as strided views (byte i of every word, for each i)."""
    w = x.itemsize
    return [x.view(np.uint8)[i::w] for i in range(w)] if x.size else []


def add_at(dst: np.ndarray, pos: np.ndarray, vals: np.ndarray, sign: int) -> None:
    """dst[pos] += sign * vals, wrapping; positions are unique, so a gather/scatter is exact."""
    cur = np.take(dst, pos)
    if sign > 0:
        cur += vals
    else:
        cur -= vals
    np.put(dst, pos, cur)
