"""Empirical entropy bound of a weight delta, the yardstick for payload sizes.

For each tensor, with k changed words: H(gaps) + H(values), where gaps are the distances
between consecutive changed positions and values the wrap-around differences new - old of
the changed words, and H(x) = sum over symbols of -count * log2(count / k), i.e. the bits an
ideal order-0 coder with the tensor's own symbol frequencies would need (model cost free).
Per-tensor frequencies give a lower (stricter) bound than pooling all tensors. It bounds
coders that code gaps and values independently and memorylessly; a context model (e.g.
conditioning a value on the old weight's exponent) could go below it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from furlong.sync import codec, scan

_BINCOUNT_MAX = 1 << 22  # beyond this, np.unique's sort is cheaper than a huge histogram


@dataclass(frozen=True)
class EntropyBound:
    n_changed: int
    gap_bits: float
    value_bits: float

    @property
    def bits(self) -> float:
        return self.gap_bits + self.value_bits

    @property
    def bytes(self) -> float:
        return self.bits / 8

    def __add__(self, other: EntropyBound) -> EntropyBound:
        return EntropyBound(
            self.n_changed + other.n_changed,
            self.gap_bits + other.gap_bits,
            self.value_bits + other.value_bits,
        )


def empirical_entropy_bits(symbols: np.ndarray) -> float:
    """Total bits to code `symbols` (non-negative ints) with their own empirical frequencies."""
    if symbols.size == 0:
        return 0.0
    if symbols.itemsize <= 2 or int(symbols.max()) < _BINCOUNT_MAX:
        counts = np.bincount(symbols.astype(np.int64, copy=False))
        counts = counts[counts > 0]
    else:
        counts = np.unique(symbols, return_counts=True)[1]
    c = counts.astype(np.float64)
    return float(-(c * np.log2(c / symbols.size)).sum())


def tensor_entropy_bound(prev: torch.Tensor, new: torch.Tensor) -> EntropyBound:
    a, b = codec.as_words(prev.contiguous()), codec.as_words(new.contiguous())
    pos, values = scan.find_changes(a, b)
    gaps = np.diff(pos, prepend=-1)
    return EntropyBound(pos.size, empirical_entropy_bits(gaps), empirical_entropy_bits(values))


def delta_entropy_bound(prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> EntropyBound:
    """Sum of per-tensor bounds over the tensors of `new` (prev must hold the same names)."""
    total = EntropyBound(0, 0.0, 0.0)
    for name, t in new.items():
        total = total + tensor_entropy_bound(prev[name], t)
    return total
