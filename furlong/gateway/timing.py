"""Where a gateway request's time goes, phase by phase, as an HTTP `Server-Timing` header (opt-in:
`make_app(..., server_timing=True)`; bench/gateway_overhead.py reads it).

Phases, in order: `receive` (the key looked up, the body read off the connection: waiting for the client's
bytes and for the event loop), `parse` (the body decoded and checked), `queue` (waiting for the episode's
previous request), `render` (the chat template and tokenizing the new messages), `engine` (sampling),
`decode` (detokenizing, stop strings, tool-call parsing), `record` (the turn stored on the trajectory),
`serialize` (the API's response built and encoded). Each is the time since the previous mark, so they add up to the handler's time;
what is outside (the HTTP server, routing, the client) is the client's latency less their sum.
"""

from __future__ import annotations

import time

PHASES = ("receive", "parse", "queue", "render", "engine", "decode", "record", "serialize")


class Phases:
    """perf_counter marks of one request; a few hundred nanoseconds each, so always taken."""

    __slots__ = ("_last", "spent")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.spent: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or the start) counts to `phase`."""
        now = time.perf_counter()
        self.spent[phase] = self.spent.get(phase, 0.0) + now - self._last
        self._last = now

    def header(self) -> str:
        """`Server-Timing` syntax: `parse;dur=0.123, render;dur=...` in milliseconds."""
        return ", ".join(f"{k};dur={v * 1e3:.3f}" for k, v in self.spent.items())


def parse_header(value: str) -> dict[str, float]:
    """A `Server-Timing` header back into {phase: milliseconds}."""
    out: dict[str, float] = {}
    for item in value.split(","):
        name, _, dur = item.strip().partition(";dur=")
        if name and dur:
            out[name] = float(dur)
    return out
