"""Means with 90% percentile-bootstrap intervals (numpy, fixed seed, so a report is reproducible)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
LEVEL = 0.90
SEED = 0
_CHUNK = 4_000_000  # resampled values held at once: bounds memory on runs with many episodes


@dataclass(frozen=True)
class Estimate:
    value: float
    lo: float
    hi: float
    n: int

    def text(self, digits: int = 3) -> str:
        if self.n == 0:
            return "n/a"
        if math.isnan(self.lo):  # a single logged value: no interval to give
            return f"{self.value:.{digits}g}"
        return f"{self.value:.{digits}g} [{self.lo:.{digits}g}, {self.hi:.{digits}g}]"


NONE = Estimate(math.nan, math.nan, math.nan, 0)


def point(value: float) -> Estimate:
    """A value shown without an interval (e.g. a per-step mean logged by an older run)."""
    return Estimate(float(value), math.nan, math.nan, 1)


def _resampled_means(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    rows = max(1, _CHUNK // max(len(x), 1))
    parts = [
        x[rng.integers(0, len(x), size=(min(rows, resamples - done), len(x)))].mean(axis=1)
        for done in range(0, resamples, rows)
    ]
    return np.concatenate(parts)


def _interval(value: float, draws: np.ndarray, n: int, level: float) -> Estimate:
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return Estimate(float(value), float(lo), float(hi), n)


def bootstrap_mean(
    values: Sequence[float] | np.ndarray, resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> Estimate:
    """The mean of `values` and its percentile-bootstrap interval (NONE for no values)."""
    x = np.asarray(values, dtype=float)
    if len(x) == 0:
        return NONE
    draws = _resampled_means(x, np.random.default_rng(seed), resamples)
    return _interval(x.mean(), draws, len(x), level)


def bootstrap_ratio(
    a: Sequence[float], b: Sequence[float], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> Estimate:
    """mean(a) / mean(b), the two samples resampled independently (two runs' episodes)."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) == 0 or len(y) == 0 or y.mean() == 0:
        return NONE
    rng = np.random.default_rng(seed)
    num, den = _resampled_means(x, rng, resamples), _resampled_means(y, rng, resamples)
    ok = den != 0
    return _interval(x.mean() / y.mean(), num[ok] / den[ok], min(len(x), len(y)), level)


def bootstrap_diff(
    a: Sequence[float], b: Sequence[float], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> Estimate:
    """mean(a) - mean(b), the two samples resampled independently."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) == 0 or len(y) == 0:
        return NONE
    rng = np.random.default_rng(seed)
    draws = _resampled_means(x, rng, resamples) - _resampled_means(y, rng, resamples)
    return _interval(x.mean() - y.mean(), draws, min(len(x), len(y)), level)


def bootstrap_paired_diff(
    after: Sequence[float], before: Sequence[float], resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED
) -> Estimate:
    """mean(after - before) over matched pairs (the same held-out instances scored twice), pairs
    resampled together: much tighter than independent resampling when the two are correlated."""
    x, y = np.asarray(after, dtype=float), np.asarray(before, dtype=float)
    if len(x) != len(y):
        raise ValueError(f"paired samples differ in length: {len(x)} vs {len(y)}")
    return bootstrap_mean(x - y, resamples, level, seed)
