"""How many of the machine's cores were busy over a window of wall-clock time, and which processes used
them, from /proc (Linux), sampled once a second by a background thread while a bench runs its `furlong
train` subprocesses.

Busy = every jiffy but idle and iowait, over all CPUs. A named process (found by a substring of its command
line) is split into its main thread and the rest of its threads: `furlong train`'s main thread runs the
event loop that drives every episode, its other threads the trainer. "other" is what no named process
used (sandboxes and their commands, short-lived, are most of it). Overlapping training with rollouts can
only pay while the busy total is below the core count."""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

PROC = Path("/proc")


def _jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs since boot."""
    fields = [int(x) for x in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _cpu_ticks(stat: Path) -> int:
    """utime + stime of a /proc/PID/stat or /proc/PID/task/TID/stat (a process's include its ended threads)."""
    text = stat.read_text()
    fields = text[text.rfind(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def _named_ticks(names: dict[str, str]) -> dict[tuple[str, int], tuple[int, int]]:
    """(label, pid) -> (main thread ticks, all threads ticks) for each process whose command line holds a
    named substring."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            label = next((k for k, sub in names.items() if sub in cmd), None)
            if label is not None:
                out[(label, int(entry.name))] = (_cpu_ticks(entry / "task" / entry.name / "stat"),
                                                 _cpu_ticks(entry / "stat"))
        except (OSError, ValueError):
            continue  # it exited while we read it
    return out


class CpuMeter:
    """`with CpuMeter(names) as meter: ...; meter.cores_busy(start, end)` (unix seconds)."""

    def __init__(self, names: dict[str, str] | None = None, every_s: float = 1.0) -> None:
        self.names, self.every_s = names or {}, every_s
        self.samples: list[tuple[float, int, int, dict]] = []  # (unix time, busy, total, named ticks)
        self._hz = os.sysconf("SC_CLK_TCK")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)

    def __enter__(self) -> CpuMeter:
        if not (PROC / "stat").exists():
            raise RuntimeError(f"{PROC / 'stat'} is missing: CpuMeter reads Linux's CPU counters")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), *_jiffies(), _named_ticks(self.names)))
            self._stop.wait(self.every_s)

    def _window(self, start: float, end: float) -> list[tuple]:
        """The samples in [start, end]."""
        times = [s[0] for s in self.samples]
        return self.samples[bisect.bisect_left(times, start): bisect.bisect_right(times, end)]

    def cores_busy(self, start: float, end: float) -> float | None:
        """Mean busy cores over [start, end]; None when fewer than two samples fall in it."""
        window = self._window(start, end)
        if len(window) < 2:
            return None
        (_, b0, t0, _), (_, b1, t1, _) = window[0], window[-1]
        return round((os.cpu_count() or 1) * (b1 - b0) / max(t1 - t0, 1), 2)

    def cores_by_process(self, start: float, end: float) -> dict[str, float] | None:
        """Mean cores over [start, end] of each named process's main thread ("LABEL main thread") and other
        threads ("LABEL other threads"), and "other" for the rest of the busy total."""
        window, busy = self._window(start, end), self.cores_busy(start, end)
        if busy is None:
            return None
        first: dict = {}
        last: dict = {}
        for i, (_, _, _, named) in enumerate(window):
            for key, ticks in named.items():
                # a process started inside the window counts from zero; one that ended, to its last sample
                first.setdefault(key, ticks if i == 0 else (0, 0))
                last[key] = ticks
        seconds, used = window[-1][0] - window[0][0], {}
        for (label, pid), (main, total) in last.items():
            main0, total0 = first[(label, pid)]
            for part, ticks in (("main thread", main - main0), ("other threads", total - total0 - main + main0)):
                key = f"{label} {part}"
                used[key] = used.get(key, 0.0) + ticks / self._hz / seconds
        out = {k: round(v, 2) for k, v in sorted(used.items())}
        out["other"] = round(max(busy - sum(used.values()), 0.0), 2)
        return out
