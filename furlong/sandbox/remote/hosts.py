"""The sandbox hosts a `remote` backend spreads its sandboxes over (furlong sandbox serve, docs/sandbox-hosts.md).

One `Host` per URL: its HTTP client (one per event loop: furlong runs several loops in one process), the
sandboxes this process runs there, its capacity, and whether it is down. A host that does not answer is
left out for `DOWN_S`, then tried again; `boot` (a random id each host process draws at start) tells a
restarted host from the one a sandbox was created on.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from furlong import paths
from furlong.sandbox.base import SandboxError

DOWN_S = 5.0  # a host that failed is not picked for this long
HEALTH_TIMEOUT_S = 3.0
CONNECT_TIMEOUT_S = 5.0


@dataclass
class Host:
    url: str
    token: str
    active: int = 0  # sandboxes this process runs there
    started: int = 0  # sandboxes this process has started there, ever
    capacity: int | None = None  # the host's own, read at first use
    down_until: float = 0.0
    # by loop, weakly: an AsyncClient's connections belong to the loop that opened them, and a finished
    # asyncio.run's loop must not hand its client to a later loop that happens to reuse its id
    _clients: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def client(self) -> httpx.AsyncClient:
        """This loop's client."""
        loop = asyncio.get_running_loop()
        c = self._clients.get(loop)
        if c is None or c.is_closed:
            c = self._clients[loop] = httpx.AsyncClient(
                base_url=self.url,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=httpx.Timeout(60.0, connect=CONNECT_TIMEOUT_S),
            )
        return c

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_S

    def load(self) -> float:
        return self.active / (self.capacity or 1)

    async def boot(self) -> str | None:
        """The host process's boot id; None where it does not answer (a fresh connection, short timeout)."""
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=HEALTH_TIMEOUT_S) as c:
                r = await c.get("/v1/health")
            return r.json().get("boot") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def ensure_capacity(self) -> None:
        if self.capacity is None:
            r = await self.client().get("/v1/metrics")
            check(r, self.url)
            self.capacity = int(r.json()["capacity"])


def check(r: httpx.Response, where: str) -> None:
    """A host's refusal as a SandboxError with its own words (FastAPI puts them in `detail`)."""
    if r.status_code < 400:
        return
    try:
        detail = r.json().get("detail", r.text)
    except ValueError:
        detail = r.text
    if r.status_code == 401:
        detail = f"{detail} (sandbox.host_token_file: is it this host's token?)"
    raise SandboxError(f"{where}: {r.status_code} {detail}")


class Hosts:
    """The hosts of one backend, and the choice of where the next sandbox goes."""

    def __init__(self, urls: list[str], token: str):
        if not urls:
            raise SandboxError("sandbox.hosts: the remote backend needs at least one host URL")
        self.hosts = [Host(u.rstrip("/"), token) for u in urls]

    def ranked(self) -> list[Host]:
        """Hosts that are up, least loaded first, then fewest started (so episodes that run one at a time
        take the hosts in turn), then the order configured; every host if none is up."""
        up = [h for h in self.hosts if h.up] or list(self.hosts)
        return sorted(up, key=lambda h: (h.load(), h.started))

    async def lost(self, host: Host, boot: str) -> bool:
        """Whether `host` is gone or is no longer the process that had `boot` (restarted)."""
        now = await host.boot()
        if now != boot:
            host.mark_down()
            return True
        return False


def read_secret(path: Path, flag: str, what: str) -> str:
    """furlong.paths.read_secret, failing as a SandboxError (what the sandbox hosts' callers handle)."""
    try:
        return paths.read_secret(path, flag, what)
    except ValueError as e:
        raise SandboxError(str(e)) from None
