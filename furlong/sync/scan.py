"""Encoder-side scans: find what changed between two word arrays, already in coded form.

Each scan walks CHUNK words at a time with a reused mask buffer and turns the chunk's
changes into section parts while the chunk is in cache, so nothing full-size is allocated.

The expensive step is finding the changed words: np.flatnonzero on a sparse mask costs
~15 ns per hit (it searches hit by hit, mispredicting a branch each time). `changed_words`
therefore compares 8-byte groups first (4 bf16 at once): a quarter of the mask, and at a
few % density dense enough that numpy switches to its branchless loop; the lanes of the
few differing groups are then resolved on small gathered arrays. ~2x faster at 5% changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from furlong.sync.codec import CHUNK, UINT, split_escapes, zigzag


@dataclass
class Values:
    """zigzag(new - old) of changed words, coded as one byte each plus escapes (>= 255)."""

    lo: list[np.ndarray] = field(default_factory=list)  # uint8 symbols, 255 = escaped
    esc: list[np.ndarray] = field(default_factory=list)  # value - 255 of escaped, word dtype

    def add(self, z: np.ndarray) -> None:
        lo, esc = split_escapes(z, 1)
        self.lo.append(lo)
        if esc.size:
            self.esc.append(esc)

    @property
    def count(self) -> int:
        return sum(p.size for p in self.lo)

    @property
    def n_esc(self) -> int:
        return sum(p.size for p in self.esc)


@dataclass
class Scan:
    """Changes from prev to new as per-chunk parts of a "sparse" section."""

    gap_width: int
    count: int = 0
    gaps: list[np.ndarray] = field(default_factory=list)  # capped gap symbols, UINT[gap_width]
    gap_esc: list[np.ndarray] = field(default_factory=list)  # gap - cap where capped, int64
    values: Values = field(default_factory=Values)
    dense: bool = False  # more than max_sparse changes: the scan stopped, parts incomplete


def estimate_density(a: np.ndarray, b: np.ndarray, blocks: int = 32, block: int = 8192) -> float:
    """Fraction of differing words in evenly spaced sample blocks (exact for small arrays)."""
    n = a.size
    if n <= blocks * block:
        return float(np.count_nonzero(a != b)) / max(n, 1)
    starts = np.linspace(0, n - block, blocks).astype(np.int64)
    diff = sum(int(np.count_nonzero(a[s : s + block] != b[s : s + block])) for s in starts)
    return diff / (blocks * block)


def changed_words(
    ac: np.ndarray, bc: np.ndarray, group_mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Chunk-local positions where ac != bc (int64, increasing), and ac, bc there.

    `group_mask` is a reused bool buffer of >= ac.size // (8 // ac.itemsize) entries."""
    lanes = 8 // ac.itemsize
    ng = ac.size // lanes if lanes > 1 else 0
    if ng == 0:
        local = np.flatnonzero(ac != bc)
        return local, np.take(ac, local), np.take(bc, local)
    a64, b64 = ac[: ng * lanes].view(np.uint64), bc[: ng * lanes].view(np.uint64)
    m = group_mask[:ng]
    np.not_equal(a64, b64, out=m)
    groups = np.flatnonzero(m)
    ag, bg = np.take(a64, groups).view(ac.dtype), np.take(b64, groups).view(bc.dtype)
    lane = np.flatnonzero(ag != bg)
    local = groups[lane // lanes] * lanes + lane % lanes  # lanes is a power of 2: cheap
    old, new = np.take(ag, lane), np.take(bg, lane)
    if ng * lanes < ac.size:  # a tail shorter than one group (last chunk only)
        tail = np.flatnonzero(ac[ng * lanes :] != bc[ng * lanes :]) + ng * lanes
        local = np.concatenate([local, tail])
        old, new = np.concatenate([old, ac[tail]]), np.concatenate([new, bc[tail]])
    return local, old, new


def scan_changes(a: np.ndarray, b: np.ndarray, gap_width: int, max_sparse: int) -> Scan:
    """One pass: positions become capped gap symbols, values zigzag differences.

    Stops early (dense=True) once more than max_sparse words changed."""
    mask = np.empty(min(a.size, CHUNK), dtype=bool)
    sc = Scan(gap_width=gap_width)
    last = -1  # position of the previous change
    for s in range(0, a.size, CHUNK):
        local, old, new = changed_words(a[s : s + CHUNK], b[s : s + CHUNK], mask)
        if local.size == 0:
            continue
        sc.count += local.size
        if sc.count > max_sparse:
            return Scan(gap_width=gap_width, count=sc.count, dense=True)
        np.subtract(new, old, out=new)  # unsigned: wraps mod 2**bits
        sc.values.add(zigzag(new))
        g = np.empty_like(local)
        g[0] = local[0] + s - last - 1
        np.subtract(local[1:], local[:-1], out=g[1:])
        g[1:] -= 1
        prim, esc = split_escapes(g, gap_width)
        sc.gaps.append(prim)
        if esc.size:
            sc.gap_esc.append(esc)
        last = s + int(local[-1])
    return sc


def _values_at(ac: np.ndarray, bc: np.ndarray, local: np.ndarray) -> np.ndarray:
    v = np.take(bc, local)
    np.subtract(v, np.take(ac, local), out=v)  # unsigned: wraps mod 2**bits
    return zigzag(v)


def scan_bitmap(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, Values]:
    """The change bitmap (packbits, little bit order) and the values in position order."""
    mask = np.empty(min(a.size, CHUNK), dtype=bool)
    bitmaps, values = [], Values()
    for s in range(0, a.size, CHUNK):
        ac, bc = a[s : s + CHUNK], b[s : s + CHUNK]
        m = mask[: ac.size]
        np.not_equal(ac, bc, out=m)
        bitmaps.append(np.packbits(m, bitorder="little"))
        values.add(_values_at(ac, bc, np.flatnonzero(m)))
    return _concat(bitmaps), values


def change_bitmap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Just the bitmap of scan_bitmap (when the values are already known)."""
    mask = np.empty(min(a.size, CHUNK), dtype=bool)
    parts = []
    for s in range(0, a.size, CHUNK):
        m = mask[: a[s : s + CHUNK].size]
        np.not_equal(a[s : s + CHUNK], b[s : s + CHUNK], out=m)
        parts.append(np.packbits(m, bitorder="little"))
    return _concat(parts)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=np.uint8)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def dense_runs(a: np.ndarray, b: np.ndarray, run: int) -> Iterator[tuple[list[np.ndarray], int]]:
    """Per run of `run` words: the coded values of ALL its words, and its count of changes.

    The parts are only valid until the next run (the difference buffer is reused)."""
    diff = np.empty(min(a.size, run), dtype=a.dtype)
    for s in range(0, a.size, run):
        d = diff[: a[s : s + run].size]
        np.subtract(b[s : s + run], a[s : s + run], out=d)
        count = int(np.count_nonzero(d))
        lo, esc = split_escapes(zigzag(d), 1)
        yield [lo, *plane_parts(esc)], count


def plane_parts(x: np.ndarray) -> list[np.ndarray]:
    """Byte planes of x as strided views (byte i of every word, for each i)."""
    w = x.itemsize
    return [x.view(np.uint8)[i::w] for i in range(w)] if x.size else []


def find_changes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64) and wrap-around differences new - old of all changed words."""
    mask = np.empty(min(a.size, CHUNK), dtype=bool)
    pos, val = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=UINT[a.itemsize])]
    for s in range(0, a.size, CHUNK):
        local, old, new = changed_words(a[s : s + CHUNK], b[s : s + CHUNK], mask)
        pos.append(local + s)
        val.append(new - old)
    return np.concatenate(pos), np.concatenate(val)
