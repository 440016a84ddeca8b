"""A warm pool: sandboxes started ahead of need, so an episode never waits for bwrap and the daemon.

Each sandbox is still fresh (handed out once, never reused); the pool only moves start-up off the
episode's critical path, the way microVM services keep restored VMs ready.
"""

from __future__ import annotations

import asyncio
import logging

from furlong.sandbox.base import SandboxSpec

log = logging.getLogger(__name__)


class WarmPool:
    def __init__(self, backend, spec: SandboxSpec, size: int):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.backend, self.spec, self.size = backend, spec, size
        self._ready: asyncio.Queue = asyncio.Queue()
        self._starting: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Fills the pool and waits until every sandbox answers."""
        for _ in range(self.size):
            self._refill()
        await asyncio.gather(*list(self._starting), return_exceptions=True)

    def _refill(self) -> None:
        task = asyncio.get_running_loop().create_task(self._start_one())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        box = await self.backend.create(self.spec)
        try:
            await box.exec("true", timeout_s=30)  # only a sandbox that answers counts as ready
        except Exception as exc:
            log.warning("warm pool: a sandbox failed to start: %s", exc)
            await box.close()
            return
        if self._closed:
            await box.close()
        else:
            self._ready.put_nowait(box)

    async def acquire(self):
        """A fresh, started sandbox; a replacement starts in the background."""
        if self._closed:
            raise RuntimeError("pool is closed")
        if self._ready.empty() and not self._starting:
            self._refill()
        box = await self._ready.get()
        self._refill()
        if not box.alive:  # expired or died while waiting in the pool
            await box.close()
            return await self.acquire()
        return box

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        while not self._ready.empty():
            await self._ready.get_nowait().close()
