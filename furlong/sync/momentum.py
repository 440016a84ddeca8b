"""Momentum prediction of dense deltas: code each word's change minus its change in the previous update.

Adam moves a weight by about the same amount step after step (its first moment decays by 0.9 a step),
so in a chain of deltas a bf16 word's change in ulps repeats: on the tiny model's real GRPO steps,
coding `d - d_prev` instead of `d` makes dense payloads 12-22% smaller once the learning rate is past
warm-up (bench/weight_sync.py). Only the "dense" layout is predicted; it is a plain subtraction per
word, so its kernels stay vectorised.

Both ends keep the same state: for each tensor whose last update was "dense", that update's change per
word, in ulps: its low byte, as int8 (one byte per word, half a bf16 tensor's size). A change beyond
+-127 ulps (rare) is predicted wrongly, which costs a little size, never exactness: the residual is
coded modulo 2**16 like any change (a narrowing store, unlike saturation, keeps the kernels vectorised).
Rules, applied identically by `encode_delta` and `apply_delta`:

* an update with `momentum` set records, once it is applied (sender: once published), the state of
  its dense tensors; every other tensor's state is dropped. A snapshot or an update without the flag
  clears it all.
* a dense tensor marked `predicted` is coded against the state recorded by the update that produced
  the base version. A receiver without that state refuses the update with `MomentumMismatch`, before
  writing anything, and resyncs from a snapshot like after any other fault. The Publisher clears its
  state at every snapshot, so the first delta after one is not predicted and a receiver starting
  from any snapshot follows the chain.

New states go to a second set of buffers and replace the old ones only when the whole update is
applied: a rolled-back update leaves the old states, which its rollback needs, untouched. The replaced
buffers are kept for the next update (fresh memory costs page faults on first touch, ~100 ms per 128 MB
here), so an end holds up to 2 bytes per word of its dense tensors.
"""

from __future__ import annotations

import numpy as np

from furlong.sync.errors import SyncError


class MomentumMismatch(SyncError):
    """A predicted tensor needs the previous update's state, which this receiver does not hold."""


class Momentum:
    """The recorded state of one end of a delta chain (see the module doc)."""

    def __init__(self) -> None:
        self.version: int | None = None  # the version whose update recorded `state`
        self.state: dict[str, np.ndarray] = {}  # name -> int8 change per word
        self._pending: dict[str, np.ndarray] = {}
        self._pending_version: int | None = None
        self._spare: dict[str, np.ndarray] = {}  # buffers of replaced states, reused (no page faults)

    def prediction(self, name: str, base_version: int | None) -> np.ndarray | None:
        """The state to predict `name` with in a delta against `base_version`, if there is one."""
        if base_version is None or base_version != self.version:
            return None
        return self.state.get(name)

    def begin(self, version: int) -> None:
        """Start recording the states of the update that makes `version`."""
        self._spare.update(self._pending)
        self._pending, self._pending_version = {}, version

    def buffer(self, name: str, n_words: int) -> np.ndarray:
        """A buffer for `name`'s new state in the update being recorded (filled by the caller)."""
        buf = self._spare.pop(name, None)
        if buf is None or buf.size != n_words:
            buf = np.empty(n_words, dtype=np.int8)
        self._pending[name] = buf
        return buf

    def discard(self, name: str) -> None:
        """`name` turned out not to be dense in the update being recorded: it records nothing."""
        buf = self._pending.pop(name, None)
        if buf is not None:
            self._spare[name] = buf

    def commit(self) -> None:
        """The recorded update is applied (or published): its states become the prediction."""
        self._spare.update(self.state)
        self.state, self._pending = self._pending, {}
        self.version, self._pending_version = self._pending_version, None

    def clear(self, version: int | None = None) -> None:
        """After a snapshot (or an update that records nothing): no state until the next record."""
        self._spare.update(self.state)
        self._spare.update(self._pending)
        self.state, self._pending, self.version = {}, {}, version


def record(d: np.ndarray, out: np.ndarray) -> None:
    """out (int8) = the low bytes of the wrap-around changes d: the recorded state."""
    np.copyto(out.view(np.uint8), d, casting="unsafe")


def widen(p: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A state as unsigned words of `dtype` (sign-extended: adding it wraps like adding the change)."""
    return p.astype(np.dtype(f"i{np.dtype(dtype).itemsize}")).view(dtype)
