"""The report's plots: each a PNG (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen
import numpy as np

from furlong.metrics.stats import Estimate

SIZE = (7.0, 3.4)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def lines(x: Sequence[float], series: Mapping[str, Sequence[Estimate]], title: str, ylabel: str) -> bytes:
    """One line per series; a shaded band where the series has intervals (n > 1)."""
    fig, ax = plt.subplots(figsize=SIZE)
    for label, ests in series.items():
        y = np.array([e.value for e in ests])
        ax.plot(x, y, marker="o", markersize=3, label=label)
        lo, hi = np.array([e.lo for e in ests]), np.array([e.hi for e in ests])
        if np.isfinite(lo).any():
            ax.fill_between(x, lo, hi, alpha=0.2)
    ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    ax.legend(fontsize=8)
    return _png(fig)


def grouped_bars(labels: Sequence[str], series: Mapping[str, Sequence[Estimate]], title: str, ylabel: str) -> bytes:
    """Bars per label, one per series, with 90% interval whiskers."""
    fig, ax = plt.subplots(figsize=SIZE)
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(labels))
    for i, (name, ests) in enumerate(series.items()):
        y = np.array([e.value for e in ests])
        err = np.array([[e.value - e.lo for e in ests], [e.hi - e.value for e in ests]])
        ax.bar(x + i * width, np.nan_to_num(y), width, label=name, yerr=np.nan_to_num(err), capsize=3)
    ax.set_xticks(x + width * (len(series) - 1) / 2, labels, fontsize=8)
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize=8)
    return _png(fig)


def stacked_bars(
    labels: Sequence[str], parts: dict[str, Sequence[float]], totals: Sequence[Estimate], title: str
) -> bytes:
    """Mean seconds per component stacked per label, the total's interval as a whisker on top."""
    fig, ax = plt.subplots(figsize=SIZE)
    bottom = np.zeros(len(labels))
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom += np.asarray(values, dtype=float)
    err = np.array([[max(t.value - t.lo, 0) for t in totals], [max(t.hi - t.value, 0) for t in totals]])
    ax.errorbar(labels, bottom, yerr=np.nan_to_num(err), fmt="none", ecolor="black", capsize=4)
    ax.set(title=title, ylabel="seconds per episode (mean)")
    ax.legend(fontsize=8)
    return _png(fig)


def histogram(values: Sequence[float], title: str, xlabel: str) -> bytes:
    fig, ax = plt.subplots(figsize=SIZE)
    v = np.asarray(values, dtype=float)
    edges = np.arange(v.min() - 0.5, v.max() + 1.5) if len(v) and np.all(v == np.round(v)) else 20
    ax.hist(v, bins=edges)  # type: ignore[arg-type]  # an array of bin edges is what hist takes
    ax.set(title=title, xlabel=xlabel, ylabel="episodes")
    return _png(fig)
