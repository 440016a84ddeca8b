"""The reference scheme furlong is measured against ("Miles"): XOR of raw bytes + zstd -1.

Payload: for each tensor of `new`, in order, an 8-byte little-endian frame length and one
zstd level-1 frame of (prev bytes XOR new bytes). No names or checksums: it counts only what
the reference ships, which flatters it slightly in comparisons.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np
import torch
import zstandard as zstd

from furlong.sync.codec import as_words

_LEN = struct.Struct("<Q")
_CHUNK_BYTES = 1 << 20  # XOR through a reused buffer: no full-size temporaries


def _xor_words(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes (a writable view), as uint64 words when the size allows."""
    b = as_words(t).view(np.uint8)
    return b.view(np.uint64) if b.size % 8 == 0 else b


def xor_zstd_encode(prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], level: int = 1) -> bytes:
    cctx = zstd.ZstdCompressor(level=level)
    parts = []
    for name, t in new.items():
        a, b = _xor_words(prev[name].contiguous()), _xor_words(t.contiguous())
        step = _CHUNK_BYTES // a.itemsize
        buf = np.empty(min(a.size, step), dtype=a.dtype)
        cobj = cctx.compressobj(size=a.nbytes)
        frame = []
        for s in range(0, a.size, step):
            x = buf[: min(step, a.size - s)]
            np.bitwise_xor(a[s : s + step], b[s : s + step], out=x)
            frame.append(cobj.compress(x.data))
        frame.append(cobj.flush())
        data = b"".join(frame)
        parts += [_LEN.pack(len(data)), data]
    return b"".join(parts)


def xor_zstd_apply(base: Mapping[str, torch.Tensor], payload: bytes, names: list[str]) -> None:
    """XOR the payload into `base` in place (tensors in `names` order, as encoded)."""
    dctx = zstd.ZstdDecompressor()
    off = 0
    for name in names:
        (n,) = _LEN.unpack_from(payload, off)
        frame = memoryview(payload)[off + _LEN.size : off + _LEN.size + n]
        off += _LEN.size + n
        dst = _xor_words(base[name])
        x = np.frombuffer(dctx.decompress(frame), dtype=dst.dtype)
        np.bitwise_xor(dst, x, out=dst)
