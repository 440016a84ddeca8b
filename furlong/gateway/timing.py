"""Where a gateway request's time goes, phase by phase, as an HTTP `Server-Timing` header (opt-in:
`make_app(..., server_timing=True)`; bench/gateway_overhead.py reads it).

Phases, in order: `receive` (the key looked up, the body read off the connection: waiting for the client's
bytes and for the event loop), `parse` (the body decoded and checked), `queue` (waiting for the episode's
previous request), `render` (the chat template and tokenizing the new messages), `engine` (sampling),
`decode` (detokenizing, stop strings, tool-call parsing), `record` (the turn stored on the trajectory),
`serialize` (the API's response built and encoded). Each is the time since the previous mark, so they add up to the handler's time;
what is outside (the HTTP server, routing, the client) is the client's latency less their sum. Each phase also
has its event-loop thread's CPU time, `PHASE-cpu`: for the phases that never wait (all but receive, queue and
engine) that is the phase's own work, free of the waits to be scheduled that a loaded machine adds to its
wall time.
"""

from __future__ import annotations

import time

PHASES = ("receive", "parse", "queue", "render", "engine", "decode", "record", "serialize")


class Phases:
    """perf_counter marks of one request; a few hundred nanoseconds each, so always taken."""

    __slots__ = ("_last", "_last_cpu", "spent", "spent_cpu")

    def __init__(self) -> None:
        self._last, self._last_cpu = time.perf_counter(), time.thread_time()
        self.spent: dict[str, float] = {}
        self.spent_cpu: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or the start) counts to `phase`."""
        now, cpu = time.perf_counter(), time.thread_time()
        self.spent[phase] = self.spent.get(phase, 0.0) + now - self._last
        self.spent_cpu[phase] = self.spent_cpu.get(phase, 0.0) + cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu

    def header(self) -> str:
        """`Server-Timing` syntax: `parse;dur=0.123, parse-cpu;dur=0.101, ...` in milliseconds."""
        return ", ".join(
            f"{k};dur={v * 1e3:.3f}, {k}-cpu;dur={self.spent_cpu[k] * 1e3:.3f}" for k, v in self.spent.items()
        )


def parse_header(value: str) -> dict[str, float]:
    """A `Server-Timing` header back into {phase: milliseconds}."""
    out: dict[str, float] = {}
    for item in value.split(","):
        name, _, dur = item.strip().partition(";dur=")
        if name and dur:
            out[name] = float(dur)
    return out
