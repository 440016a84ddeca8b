"""Tiered escape coding of non-negative integer streams (gaps, values) into zstd-friendly bytes.

Tier i holds one symbol per entry that the previous tier escaped (every entry for tier 0):
the entry's rest r as min(r, C), C = 2**bits - 1, bits in {2, 4, 8}, packed 8 // bits
symbols per byte (first symbol in the lowest bits, last byte padded with 0). Entries whose
symbol is C go on to the next tier with r - C; what is left after the last tier is written
as byte planes of a wide unsigned type. Symbol counts of later tiers follow from the C's in
earlier ones, so a stream is self-describing given its entry count.

Why: zstd codes literals with per-block Huffman (never below 1 bit per byte) and, at fast
settings, takes any repeat of >= 7 bytes. A mostly-zero high-byte plane wastes ~1 bit per
value; a low-entropy byte stream (e.g. +-1 steps, one bit each) is full of short, costly
matches (1.5 bits per +-1 value, and zstd slows to ~300 MB/s). Small symbols packed
several per byte carry 3-5 bits per byte, where both effects fade: -20% on typical bf16
value streams versus plain bytes, and +-1 streams cost 1.0 bit per value at GB/s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from furlong.sync.codec import UINT, plane_parts, read_planes
from furlong.sync.errors import CorruptUpdate

GAP_TIERS = (8, 8)  # gaps (near-geometric) of mean < 256: bytes, then bytes again
SIGN_VALUE_TIERS = (2, 4, 8)  # almost only +-1 ulp steps (fp32 masters with a residual)
NIBBLE_VALUE_TIERS = (4, 8)  # bf16 steps of a few ulps: mostly < 15
BYTE_VALUE_TIERS = (8,)  # wide value spread (large steps, fp32): nibbles would mostly escape
VALUE_TIER_CHOICES = (SIGN_VALUE_TIERS, NIBBLE_VALUE_TIERS, BYTE_VALUE_TIERS)
ALLOWED_BITS = (2, 4, 8)

Reader = Callable[[int], np.ndarray]  # returns exactly n bytes, or raises CorruptUpdate


def value_tiers(z: np.ndarray) -> tuple[int, ...]:
    """The narrowest first tier that few zigzag values escape (thresholds measured)."""
    return tiers_for_counts(z.size, int(np.count_nonzero(z >= 3)), int(np.count_nonzero(z >= 15)))


def tiers_for_counts(n: int, ge3: int, ge15: int) -> tuple[int, ...]:
    """value_tiers from the counts of values >= 3 and >= 15 among n."""
    if ge3 < 0.03 * n:
        return SIGN_VALUE_TIERS
    if ge15 < 0.5 * n:
        return NIBBLE_VALUE_TIERS
    return BYTE_VALUE_TIERS


def gap_wide(n_words: int) -> type:
    """Wide type for what is left of a gap after its tiers."""
    return np.uint32 if n_words < (1 << 32) else np.uint64


def encode(x: np.ndarray, bits: tuple[int, ...], wide: type) -> list[np.ndarray]:
    """Byte arrays (some strided views) whose concatenation is the coded stream of x."""
    out, rest = [], x
    for b in bits:
        cap = (1 << b) - 1
        big = np.flatnonzero(rest >= cap)  # rare: cheap to find, and only these go on
        sym = rest.astype(np.uint8)  # truncating; entries < cap <= 255 are exact
        sym[big] = cap
        out.append(pack(sym, b) if b < 8 else sym)
        rest = rest[big] - rest.dtype.type(cap)
    return out + plane_parts(rest.astype(wide, copy=False))


def decode(read: Reader, count: int, bits: tuple[int, ...], wide: type, dtype: type | None = None) -> np.ndarray:
    """Inverse of encode for `count` entries read through `read`, as `dtype` (default wide)."""
    symbols = []
    n = count
    for b in bits:
        per = 8 // b
        raw = read((n + per - 1) // per)
        if n % per and int(raw[-1]) >> (b * (n % per)):  # the encoder pads with 0: anything else is damage
            raise CorruptUpdate(f"nonzero padding after the last of {n} {b}-bit symbols")
        sym = _unpack(raw, b, n) if b < 8 else raw
        symbols.append(sym)
        n = int(np.count_nonzero(sym == (1 << b) - 1))
    width = np.dtype(wide).itemsize
    dtype = dtype or wide
    rest: np.ndarray = read_planes(read(n * width), width).astype(dtype, copy=False)
    for b, sym in zip(reversed(bits), reversed(symbols)):
        x = sym.astype(dtype)
        x[np.flatnonzero(sym == (1 << b) - 1)] += rest
        rest = x
    return rest


def encode_shifted(x: np.ndarray, shift: int, bits: tuple[int, ...], wide: type) -> list[np.ndarray]:
    """With shift 8: the low bytes of x as one plane, then x >> 8 through the tiers.

    For large gaps (mean >> 256) the low byte is near-uniform and independent of the rest,
    so it is cheapest as a plain plane, leaving a small-integer stream for the tiers."""
    if not shift:
        return encode(x, bits, wide)
    return [(x & 0xFF).astype(np.uint8), *encode(x >> 8, bits, wide)]


def decode_shifted(read: Reader, count: int, shift: int, bits: tuple[int, ...], wide: type, dtype: type) -> np.ndarray:
    lo = read(count) if shift else None
    x = decode(read, count, bits, wide, dtype)
    if lo is not None:
        x <<= 8
        x |= lo
    return x


def pack(sym: np.ndarray, bits: int) -> np.ndarray:
    """8 // bits symbols per byte, first symbol in the lowest bits; tail padded with 0."""
    per = 8 // bits
    if sym.size % per:
        sym = np.concatenate([sym, np.zeros(per - sym.size % per, dtype=np.uint8)])
    words = np.ascontiguousarray(sym).view(UINT[per])  # little-endian: symbol j at bit 8j
    packed = words & ((1 << bits) - 1)
    for j in range(1, per):  # move symbol j from bit 8j down to bit bits*j
        packed |= (words >> ((8 - bits) * j)) & (((1 << bits) - 1) << (bits * j))
    return packed.astype(np.uint8)


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    per = 8 // bits
    p = packed.astype(UINT[per])
    words = p & ((1 << bits) - 1)
    for j in range(1, per):
        words |= (p & (((1 << bits) - 1) << (bits * j))) << ((8 - bits) * j)
    return words.view(np.uint8)[:count]
