"""How many of the machine's cores were busy over a window of wall-clock time, from /proc/stat (Linux),
sampled once a second by a background thread while a bench runs its `furlong train` subprocesses.

Busy = every jiffy but idle and iowait, over all CPUs; a window's figure is the busy share between the
samples nearest its ends, times the number of CPUs. Overlapping training with rollouts can only pay while
this is below the core count: at the core count, the overlap has no spare CPU left to use."""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

STAT = Path("/proc/stat")


def _jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs since boot."""
    fields = [int(x) for x in STAT.read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


class CpuMeter:
    """`with CpuMeter() as meter: ...; meter.cores_busy(start, end)` (unix seconds)."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s, self.samples = every_s, []  # (unix time, busy, total)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        if not STAT.exists():
            raise RuntimeError(f"{STAT} is missing: CpuMeter reads Linux's CPU counters")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *_jiffies()))
            self._stop.wait(self.every_s)

    def cores_busy(self, start: float, end: float) -> float | None:
        """Mean busy cores over [start, end]; None when fewer than two samples fall in it."""
        times = [s[0] for s in self.samples]
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if hi - lo < 1:
            return None
        (_, b0, t0), (_, b1, t1) = self.samples[lo], self.samples[hi]
        return round((os.cpu_count() or 1) * (b1 - b0) / max(t1 - t0, 1), 2)
