"""The host's live sandboxes: capacity, per-sandbox tokens, idle and lifetime reaping, timing metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from furlong.sandbox.base import Sandbox

log = logging.getLogger(__name__)


class AtCapacity(Exception):
    """The host already runs its maximum number of sandboxes."""


@dataclass
class Entry:
    id: str
    token: str
    box: Sandbox
    created: float
    last_used: float
    busy: int = 0  # requests in flight: a sandbox running a command is never idle


def _pct(samples: deque[float], q: float) -> float | None:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Registry:
    capacity: int
    idle_s: float
    lifetime_s: float
    entries: dict[str, Entry] = field(default_factory=dict)
    reserved: int = 0  # creates under way: they count against capacity before their sandbox exists
    starts: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    execs: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    reaped: int = 0
    created: int = 0  # sandboxes started since the host did
    boot: str = field(default_factory=lambda: secrets.token_hex(8))  # tells clients a restarted host apart
    others: Callable[[], int] = lambda: 0  # sandboxes the host runs outside this registry (its E2B API's)

    def reserve(self) -> None:
        if self.held() >= self.capacity:
            raise AtCapacity(f"host at capacity: {self.capacity} sandboxes")
        self.reserved += 1

    def held(self) -> int:
        """Seats taken on this host: live and starting sandboxes, those of the E2B API included."""
        return len(self.entries) + self.reserved + self.others()

    def add(self, box: Sandbox, start_s: float) -> Entry:
        self.reserved -= 1
        now = time.monotonic()
        entry = Entry(secrets.token_hex(8), secrets.token_urlsafe(32), box, now, now)
        self.entries[entry.id] = entry
        self.starts.append(start_s)
        self.created += 1
        return entry

    def lookup(self, sid: str, token: str) -> Entry | Literal[False] | None:
        """The entry; None where no such sandbox; False where the token is not its own."""
        entry = self.entries.get(sid)
        if entry is None:
            return None
        if not hmac.compare_digest(entry.token.encode(), token.encode()):
            return False
        entry.last_used = time.monotonic()
        return entry

    async def remove(self, sid: str) -> bool:
        entry = self.entries.pop(sid, None)
        if entry is None:
            return False
        await entry.box.close()
        return True

    def expired(self, now: float) -> list[str]:
        return [
            e.id
            for e in self.entries.values()
            if now - e.created > self.lifetime_s or (not e.busy and now - e.last_used > self.idle_s)
        ]

    async def reap(self) -> int:
        count = 0
        for sid in self.expired(time.monotonic()):
            entry = self.entries.pop(sid, None)
            if entry is None:  # killed meanwhile
                continue
            # counted as it leaves the registry, not after its close: a caller seeing it gone sees it counted
            self.reaped += 1
            count += 1
            await entry.box.close()
        return count

    async def reap_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reap()
            except Exception:  # one sandbox failing to close must not end reaping for the host's lifetime
                log.exception("reaping idle sandboxes failed; retrying in %.1fs", every_s)

    async def close_all(self) -> None:
        for sid in list(self.entries):
            await self.remove(sid)

    def metrics(self) -> dict:
        return {
            "active": len(self.entries) + self.others(),
            "capacity": self.capacity,
            "created": self.created,
            "reaped": self.reaped,
            "start_s": {"p50": _pct(self.starts, 0.5), "p95": _pct(self.starts, 0.95)},
            "exec_s": {"p50": _pct(self.execs, 0.5), "p95": _pct(self.execs, 0.95)},
        }
