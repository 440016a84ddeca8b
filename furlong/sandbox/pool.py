"""Where episodes get their sandboxes: started on demand, or from warm pools started ahead of need.

Each sandbox is still fresh (handed out once, never reused); a pool only moves start-up off the
episode's critical path, the way microVM services keep restored VMs ready. Both sources implement
furlong.agent.runner.SandboxSource: `image(task)` and `acquire(spec)` -> a started sandbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from furlong.sandbox.base import (
    ImageRef,
    ImageSource,
    Sandbox,
    SandboxError,
    SandboxSpec,
)
from furlong.sandbox.images.toolchain import stack, verifier_offline

if TYPE_CHECKING:
    from furlong.tasks.model import Task  # the tasks layer builds on this one

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0  # for a new sandbox to answer its first command
MAX_START_FAILURES = 3  # in a row, for one acquire, before it gives up (the episode is then infra_error)

ImageLookup = Callable[[object], Awaitable[ImageRef]]  # task -> its built image


def sandbox_spec(task: Task, image: ImageRef, control: bool = False) -> SandboxSpec:
    """The one place a task's sandbox is specified (also the warm pools' key): it starts with the agent
    phase's network and can switch to every other its phases use; a `control` run's (the tests in a sandbox
    no agent touched) has the verifier phase's from the start."""
    if user := getattr(task, "agent_user", None):  # task.toml [agent] user wins over the image's USER, as in Harbor
        image = dataclasses.replace(image, user=user)
    if control:
        return SandboxSpec(image=image, network=task.verifier_network, limits=task.limits, syscalls=task.syscalls)
    # every policy a later phase (a multi-step task's next steps too) may switch to
    phases = tuple(p for p in task.network_policies() if p != task.agent_network)
    return SandboxSpec(
        image=image, network=task.agent_network, limits=task.limits, syscalls=task.syscalls, network_phases=phases
    )


async def start_sandbox(backend, spec: SandboxSpec, timeout_s: float = READY_TIMEOUT_S) -> Sandbox:
    """A new sandbox that has answered a first command: that is what "started" means."""
    box = await asyncio.wait_for(backend.create(spec), timeout_s)
    try:
        await box.exec("true", timeout_s=timeout_s)
    except BaseException:
        await box.close()
        raise
    return box


class StoreImages:
    """Task -> image through an ImageStore, remembering failures so a broken Dockerfile (or an image that
    cannot be had) is tried once."""

    def __init__(self, store, backend):
        self.store, self.backend = store, backend
        self._failed: dict[ImageSource, str] = {}

    async def __call__(self, task) -> ImageRef:
        source = task.image_source
        if source in self._failed:
            raise SandboxError(self._failed[source])
        try:
            image = await self.store.image(source, self.backend)
            if getattr(task, "verifier_toolchain", False):  # uv/uvx/pytest on top (furlong.sandbox.images.toolchain)
                image = stack(image, await self.store.toolchain(self.backend), verifier_offline(task))
            return image
        except Exception as exc:
            self._failed[source] = f"image build failed: {exc}"
            raise


def fixed_image(image: ImageRef) -> ImageLookup:
    async def lookup(task) -> ImageRef:
        return image

    return lookup


class FreshSandboxes:
    """A sandbox started on demand for each episode (`furlong eval`)."""

    def __init__(self, backend, images: ImageLookup):
        self.backend, self._images = backend, images

    async def image(self, task) -> ImageRef:
        return await self._images(task)

    def reserve(self, task) -> None:
        """Nothing is started ahead here."""

    async def acquire(self, spec: SandboxSpec) -> Sandbox:
        return await start_sandbox(self.backend, spec)

    async def close(self) -> None:
        pass


class WarmPool:
    """Started sandboxes of one spec. With `refill`, `size` are kept started: each one taken starts its
    replacement. Without, it holds what `size` and `add(n)` started, and an acquire finding nothing
    ready or coming starts one on demand.

    A start that fails is handed to a waiting acquire as its exception, so acquires never wait on a
    start that will not come; one acquire retries `max_failures` times, then raises SandboxError.
    """

    def __init__(
        self, backend, spec: SandboxSpec, size: int, refill: bool = True, max_failures: int = MAX_START_FAILURES
    ):
        if size < (1 if refill else 0):
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.backend, self.spec, self.size, self.refill = backend, spec, size, refill
        self.max_failures = max_failures
        self._results: asyncio.Queue = asyncio.Queue()  # started sandboxes, or the exceptions of failed starts
        self._starting: set[asyncio.Task] = set()
        self._waiting = 0
        self._filled = False
        self._closed = False

    @property
    def idle(self) -> bool:
        """Nothing ready, starting or waiting."""
        return self._results.empty() and not self._starting and not self._waiting

    @property
    def spare(self) -> int:
        """Sandboxes ready or starting beyond those the waiting acquires will take: > 0 means the next
        acquire gets one whose start began before it asked."""
        return self._results.qsize() + len(self._starting) - self._waiting

    async def start(self) -> None:
        """Fills the pool and waits until every sandbox answers (or failed)."""
        self._fill()
        await asyncio.gather(*list(self._starting), return_exceptions=True)

    def add(self, n: int = 1) -> None:
        """Starts `n` more in the background."""
        for _ in range(n if not self._closed else 0):
            self._refill()

    def _fill(self) -> None:
        if not self._filled:
            self._filled = True
            self.add(self.size)

    def _refill(self) -> None:
        task = asyncio.get_running_loop().create_task(self._start_one())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        try:
            item: Sandbox | Exception = await start_sandbox(self.backend, self.spec)
        except Exception as exc:  # noqa: BLE001  # the failure is handed to the waiting episode
            log.warning("warm pool: a sandbox failed to start: %s", exc)
            item = exc
        self._starting.discard(asyncio.current_task())  # now, so ready + starting never counts it twice
        if self._closed and not isinstance(item, BaseException):
            await item.close()
        else:
            self._results.put_nowait(item)

    async def acquire(self) -> Sandbox:
        """A fresh, started sandbox, never handed out before."""
        failures = 0
        while True:
            if self._closed:
                raise SandboxError("the warm pool is closed")
            self._fill()
            if self.spare <= 0:
                self._refill()  # every waiting acquire has a start of its own coming
            self._waiting += 1
            try:
                item = await self._results.get()
            finally:
                self._waiting -= 1
            if self.refill and not self._closed:
                self._refill()  # keep `size` started or starting
            if not isinstance(item, BaseException):
                if item.alive:
                    return item
                await item.close()  # expired or died while waiting in the pool
                item = SandboxError("a pooled sandbox died before it was handed out")
            failures += 1
            if failures >= self.max_failures or self._closed:
                raise SandboxError(f"warm pool: {failures} sandboxes in a row did not start or died; last: {item}")

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*list(self._starting), return_exceptions=True)
        while not self._results.empty():
            item = self._results.get_nowait()
            if not isinstance(item, BaseException):
                await item.close()
        for _ in range(self._waiting):  # wake acquires still waiting: they raise "closed"
            self._results.put_nowait(SandboxError("the warm pool is closed"))


class WarmPools:
    """Sandboxes started ahead of the episodes that will use them, for `furlong train`.

    A sandbox's image is fixed when it starts, and task-family instances each have their own image (their
    data is COPY'd in), so a refilling pool per image would start sandboxes no episode asks for. Instead
    the caller `reserve`s one sandbox per episode it is about to run, a window of them as wide as its
    concurrency; each starts in the background in a pool for its spec (image + network + limits +
    syscalls) and is handed to the first acquire of that spec. An acquire with nothing reserved starts
    one on demand. Unclaimed sandboxes are closed by `close` at the end of the phase.
    """

    def __init__(self, backend, images: ImageLookup):
        self.backend, self._images = backend, images
        self.pools: dict[SandboxSpec, WarmPool] = {}
        self._reserving: set[asyncio.Task] = set()
        self._closed = False

    async def image(self, task) -> ImageRef:
        return await self._images(task)

    def reserve(self, task) -> None:
        """Starts, in the background, one sandbox for an episode of `task` that is coming."""
        if not self._closed:
            job = asyncio.get_running_loop().create_task(self._reserve(task))
            self._reserving.add(job)
            job.add_done_callback(self._reserving.discard)

    async def _reserve(self, task) -> None:
        try:
            image = await self.image(task)
        except Exception:  # noqa: BLE001  # any failure to get the image
            return  # the episode reports it as its own infra_error
        if not self._closed:
            self._pool(sandbox_spec(task, image)).add(1)

    def _pool(self, spec: SandboxSpec) -> WarmPool:
        if spec not in self.pools:
            self.pools[spec] = WarmPool(self.backend, spec, size=0, refill=False)
        return self.pools[spec]

    async def acquire(self, spec: SandboxSpec) -> Sandbox:
        if self._closed:
            raise SandboxError("the warm pools are closed")
        pool = self._pool(spec)
        try:
            return await pool.acquire()
        finally:
            if pool.idle and self.pools.get(spec) is pool:
                del self.pools[spec]  # drained: a pool per task seen would otherwise pile up

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*list(self._reserving), return_exceptions=True)
        await asyncio.gather(*(pool.close() for pool in self.pools.values()), return_exceptions=True)
        self.pools.clear()

    async def __aenter__(self) -> WarmPools:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
