"""Compiled kernels (numba) for bf16/fp16 deltas in the "dense" and "bitmap" layouts: the bytes are the
numpy path's.

The numpy path makes ~12 passes over each run (difference, zigzag, counts, tier symbols, escape search,
packing; the reverse on apply), and its escape and change searches cost ~1 ns per word in branch
mispredictions. Here one pass computes the zigzag differences and the counts that choose the tiers, one
packs the first tier (unrolled per symbol width, so it vectorises), and one branch-free pass collects the
escaped (or, for "bitmap", the changed) entries; on apply, one vectorised pass unpacks, un-zigzags and adds
every symbol into the tensor, and one corrects the escaped entries, found 64 bits of symbols at a time.
Later tiers (few entries) stay numpy.

Only 2-byte words, the engine weights' dtype; the arithmetic is done in uint64 and masked to 16 bits, so
wrap-around is exact. Without numba `available()` is False and callers use the numpy path; tests check
that both give the same bytes. Compiled on first use (about a second) and cached beside the module.
"""

from __future__ import annotations

import numpy as np

from furlong.sync import tiers
from furlong.sync.errors import CorruptUpdate

try:
    from numba import njit
    from numba.cpython.unsafe.numbers import trailing_zeros
except ImportError:  # optional: the numpy path is complete without it
    njit = None


def available(dtype: np.dtype) -> bool:
    return njit is not None and np.dtype(dtype) == np.uint16


if njit is not None:
    # numba widens small integers: arithmetic is uint64, masked to 16 bits where it must wrap.
    _M, _ONE, _ZERO, _LOW = np.uint64(0xFFFF), np.uint64(1), np.uint64(0), np.uint64(0xFF)
    _P1, _P2 = np.uint64(0x5555555555555555), np.uint64(0x3333333333333333)
    _P4, _P8 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0101010101010101)

    @njit(cache=True, nogil=True)
    def _unzigzag(v):  # pragma: no cover - compiled
        return (v >> _ONE) ^ ((_ZERO - (v & _ONE)) & _M)

    @njit(cache=True, nogil=True)
    def zigzag_diff(a, b, p, out, state):  # pragma: no cover - compiled
        """out = zigzag(b - a - p mod 2**16) (p: int8 predictions), state = the low byte of b - a (uint8);
        returns (changed words, entries >= 3, entries >= 15)."""
        changed = 0
        ge3 = 0
        ge15 = 0
        for i in range(a.size):
            d = (np.uint64(b[i]) - np.uint64(a[i])) & _M
            state[i] = np.uint8(d & _LOW)
            r = (d - np.uint64(np.int64(p[i]))) & _M
            z = ((r << _ONE) & _M) ^ ((_ZERO - (r >> np.uint64(15))) & _M)
            out[i] = z
            changed += d != _ZERO
            ge3 += z >= np.uint64(3)
            ge15 += z >= np.uint64(15)
        return changed, ge3, ge15

    @njit(cache=True, nogil=True)
    def _pack2(z, packed):  # pragma: no cover - compiled
        c = np.uint16(3)
        for j in range(z.size >> 2):
            i = j << 2
            packed[j] = min(z[i], c) | (min(z[i + 1], c) << 2) | (min(z[i + 2], c) << 4) | (min(z[i + 3], c) << 6)

    @njit(cache=True, nogil=True)
    def _pack4(z, packed):  # pragma: no cover - compiled
        c = np.uint16(15)
        for j in range(z.size >> 1):
            packed[j] = min(z[2 * j], c) | (min(z[2 * j + 1], c) << 4)

    @njit(cache=True, nogil=True)
    def _pack8(z, packed):  # pragma: no cover - compiled
        c = np.uint16(255)
        for j in range(z.size):
            packed[j] = min(z[j], c)

    @njit(cache=True, nogil=True)
    def _escapes(z, cap, out):  # pragma: no cover - compiled
        """z - cap of the entries >= cap, in order, into out (size >= z.size + 1). Branch-free: every
        entry is written at out[k] and k advances only past escaped ones (a branch mispredicts)."""
        k = 0
        for i in range(z.size):
            v = z[i]
            out[k] = v - cap
            k += v >= cap
        return k

    def _lowest_bits(bits):
        """In a uint64 of packed symbols, the lowest bit of every symbol: AND-ing a symbol's bits into it
        marks exactly the capped (escaped) symbols."""
        return np.uint64(int("".join(["0" * (bits - 1) + "1"] * (64 // bits)), 2))

    def _counter(bits):
        """Compiled count of the capped symbols for one symbol width."""
        lowest = _lowest_bits(bits)

        @njit(cache=True, nogil=True)
        def count(packed64, packed):  # pragma: no cover - compiled
            """How many symbols are the cap (escaped), by the same bit trick as fix, plus a popcount."""
            k = 0
            for w in range(packed64.size + (packed.size - packed64.size * 8)):
                x = packed64[w] if w < packed64.size else np.uint64(packed[packed64.size * 8 + w - packed64.size])
                m = x
                for shift in range(1, bits):
                    m &= x >> np.uint64(shift)
                m &= lowest
                m = m - ((m >> np.uint64(1)) & _P1)  # popcount, the classic SWAR way
                m = (m & _P2) + ((m >> np.uint64(2)) & _P2)
                m = (m + (m >> np.uint64(4))) & _P4
                k += (m * _P8) >> np.uint64(56)
            return k

        return count

    def _adder(bits):
        """Compiled (add, fix) for one symbol width; constant shifts let numba vectorise `add`."""
        per, c = 8 // bits, (1 << bits) - 1
        cap, wrong = np.uint64(c), np.uint64((c >> 1) ^ (-(c & 1) & 0xFFFF))  # wrong = unzigzag(cap)
        lowest = _lowest_bits(bits)

        @njit(cache=True, nogil=True)
        def add(packed, dst, p, state, sign):  # pragma: no cover - compiled
            """dst +-= unzigzag(symbol) + p for every word, state = the change's low byte (escaped entries
            get unzigzag(cap) for now)."""
            for j in range(dst.size // per):
                byte = np.uint64(packed[j])
                for lane in range(per):
                    i = j * per + lane
                    d = (_unzigzag((byte >> np.uint64(bits * lane)) & cap) + np.uint64(np.int64(p[i]))) & _M
                    state[i] = np.uint8(d & _LOW)
                    dst[i] = ((np.uint64(dst[i]) + d) if sign > 0 else (np.uint64(dst[i]) - d)) & _M
            for i in range(dst.size // per * per, dst.size):  # the last, partly filled byte
                d = _unzigzag((np.uint64(packed[i // per]) >> np.uint64(bits * (i % per))) & cap)
                d = (d + np.uint64(np.int64(p[i]))) & _M
                state[i] = np.uint8(d & _LOW)
                dst[i] = ((np.uint64(dst[i]) + d) if sign > 0 else (np.uint64(dst[i]) - d)) & _M

        @njit(cache=True, nogil=True)
        def fix(packed64, packed, rests, dst, p, state, sign):  # pragma: no cover - compiled
            """After add: escaped entries need unzigzag(cap + rest), not unzigzag(cap). Visits only those:
            8 bytes of symbols at a time, escapes found as set bits (a branch per symbol would mispredict
            when many escape). `packed64` views the whole 8-byte groups of `packed`; returns escapes seen."""
            k = 0
            for w in range(packed64.size + (packed.size - packed64.size * 8)):
                if w < packed64.size:
                    x = packed64[w]
                    base = w * (64 // bits)
                else:  # the remaining bytes, one at a time
                    x = np.uint64(packed[packed64.size * 8 + w - packed64.size])
                    base = (packed64.size * 8 + w - packed64.size) * per
                m = x
                for shift in range(1, bits):
                    m &= x >> np.uint64(shift)
                m &= lowest
                while m:
                    i = base + trailing_zeros(m) // bits
                    full = _unzigzag(cap + np.uint64(rests[k]))
                    state[i] = np.uint8((full + np.uint64(np.int64(p[i]))) & _LOW)
                    d = (full - wrong) & _M
                    k += 1
                    dst[i] = ((np.uint64(dst[i]) + d) if sign > 0 else (np.uint64(dst[i]) - d)) & _M
                    m &= m - np.uint64(1)
            return k

        return add, fix

    @njit(cache=True, nogil=True)
    def _nonzero_values(z, values):  # pragma: no cover - compiled
        """The nonzero entries of z, in order, into values (size >= z.size + 1, written branch-free)."""
        k = 0
        for i in range(z.size):
            v = z[i]
            values[k] = v
            k += v != 0
        return k

    @njit(cache=True, nogil=True)
    def _bitmap_add(bitmap, diffs, dst, sign):  # pragma: no cover - compiled
        """dst +-= the next difference at every set bit (diffs has a spare slot: no branch)."""
        k = 0
        for i in range(dst.size):
            bit = np.uint64((bitmap[i >> 3] >> (i & 7)) & 1)
            d = np.uint64(diffs[k]) * bit
            k += bit
            dst[i] = ((np.uint64(dst[i]) + d) if sign > 0 else (np.uint64(dst[i]) - d)) & _M

    _PACK = {2: _pack2, 4: _pack4, 8: _pack8}
    _ADDERS = {bits: (*_adder(bits), _counter(bits)) for bits in (2, 4, 8)}


def encode_run(
    a: np.ndarray,
    b: np.ndarray,
    bufs: RunBuffers,
    vt: tuple[int, ...] | None,
    p: np.ndarray | None = None,
    state: np.ndarray | None = None,
) -> tuple[tuple[int, ...], list[np.ndarray], int]:
    """One dense run: its value tiers (`vt`, or chosen from this run), its coded streams (as
    tiers.encode(zigzag(b - a - p), vt); views of `bufs`, valid until the next run) and its changed words.
    `p`: int8 predictions (None: 0); `state`: gets the changes' low bytes (None: scratch)."""
    z = bufs.z[: a.size]
    changed, ge3, ge15 = zigzag_diff(a, b, bufs.predictions(p, a.size), z, bufs.states(state, a.size).view(np.uint8))
    vt = vt or tiers.tiers_for_counts(a.size, ge3, ge15)
    return vt, encode_values(z, vt, bufs, {2: ge3, 4: ge15}.get(vt[0])), int(changed)


class RunBuffers:
    """Scratch arrays reused run after run: a fresh large array costs page faults on first touch (on this
    kind of VM ~100 ms per 128 MB), more than the kernels themselves."""

    def __init__(self, n: int) -> None:
        self.z = np.empty(n, dtype=np.uint16)
        self.escapes = np.empty(n + 1, dtype=np.uint16)
        self.packed = np.empty(n, dtype=np.uint8)
        self._zeros: np.ndarray | None = None  # made on first use
        self._scratch: np.ndarray | None = None

    def predictions(self, p: np.ndarray | None, n: int) -> np.ndarray:
        """`p`, or n zero predictions."""
        return p if p is not None else self._spare("_zeros", n, np.zeros)

    def states(self, state: np.ndarray | None, n: int) -> np.ndarray:
        """`state`, or n bytes of scratch to record into."""
        return state if state is not None else self._spare("_scratch", n, np.empty)

    def _spare(self, attr: str, n: int, make) -> np.ndarray:
        buf = getattr(self, attr)
        if buf is None or buf.size < n:
            buf = make(max(n, self.z.size), dtype=np.int8)
            setattr(self, attr, buf)
        return buf[:n]


def encode_values(z: np.ndarray, vt: tuple[int, ...], bufs: RunBuffers, escaped: int | None = None) -> list[np.ndarray]:
    """tiers.encode(z, vt, uint16): the first tier compiled, later ones (few entries) numpy.
    `escaped`: how many entries reach the second tier, if known (0 skips the search)."""
    bits = vt[0]
    per = 8 // bits
    full = z.size // per
    packed = bufs.packed[: -(-z.size // per)]
    _PACK[bits](z[: full * per], packed[:full])
    if full < packed.size:  # the last, partly filled byte
        tail = np.minimum(z[full * per :], (1 << bits) - 1).astype(np.uint8)
        packed[full:] = tiers.pack(tail, bits) if bits < 8 else tail
    k = 0 if escaped == 0 else _escapes(z, np.uint16((1 << bits) - 1), bufs.escapes)
    return [packed, *tiers.encode(bufs.escapes[:k], vt[1:], np.uint16)]  # encode does not modify its input


def bitmap_layout(a: np.ndarray, b: np.ndarray, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """As scan.scan_bitmap: the change bitmap and the zigzag values of the changed words (chunk by chunk,
    `chunk` a multiple of 8)."""
    bufs = RunBuffers(min(a.size, chunk))
    bitmaps, values = [], []
    for s in range(0, a.size, chunk):
        n = a[s : s + chunk].size
        z = bufs.z[:n]
        zigzag_diff(
            a[s : s + chunk], b[s : s + chunk], bufs.predictions(None, n), z, bufs.states(None, n).view(np.uint8)
        )
        k = _nonzero_values(z, bufs.escapes)
        bitmaps.append(np.packbits(z != 0, bitorder="little"))
        values.append(bufs.escapes[:k].copy())
    return np.concatenate(bitmaps), np.concatenate(values)


def bitmap_apply(bitmap: np.ndarray, diffs: np.ndarray, dst: np.ndarray, sign: int) -> None:
    """dst +-= diffs at the set bits of bitmap, in order (diffs: the un-zigzagged differences)."""
    _bitmap_add(bitmap, np.append(diffs, np.uint16(0)), dst, sign)


def apply_run(
    read: tiers.Reader,
    n: int,
    vt: tuple[int, ...],
    dst: np.ndarray,
    sign: int,
    p: np.ndarray | None = None,
    state: np.ndarray | None = None,
    bufs: RunBuffers | None = None,
) -> None:
    """Read one dense run's streams through `read`, then add (sign > 0) or subtract its differences
    (the decoded residuals plus the int8 predictions `p`; None: 0), writing the changes' low bytes to
    `state` (None: scratch): nothing is written unless every stream of the run decoded."""
    bits = vt[0]
    packed = read(-(-n // (8 // bits)))
    if n % (8 // bits) and int(packed[-1]) >> (bits * (n % (8 // bits))):
        raise CorruptUpdate(f"dense run: symbols in the padding of its last byte (n={n})")
    add, fix, count = _ADDERS[bits]
    packed64 = packed[: packed.size // 8 * 8].view(np.uint64)
    rests = tiers.decode(read, int(count(packed64, packed)), vt[1:], np.uint16)
    bufs = bufs or RunBuffers(0)
    p, state = bufs.predictions(p, n), bufs.states(state, n).view(np.uint8)
    # Two passes beat one branch-free pass (~1 ns per word) even when a fifth of the entries escape: a
    # vectorised add of every symbol (~0.12 ns per word), then the escaped entries alone.
    add(packed, dst, p, state, sign)
    if rests.size:
        fix(packed64, packed, rests, dst, p, state, sign)
