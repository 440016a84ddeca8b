"""`furlong sandbox serve`: the host API on uvicorn, with its token rule and start-up lines."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from furlong.sandbox import cgroups
from furlong.sandbox.base import SandboxBackend, SandboxError
from furlong.sandbox.host.app import make_app
from furlong.sandbox.hosts import read_secret
from furlong.sandbox.images import ImageStore


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_token(token_file: Path | None, host: str, generated: Path, say: Callable[[str], None]) -> str:
    """The bearer token: read from token_file; without one, only a loopback host may start, with a fresh
    token written (mode 0600) to `generated`, so nobody reachable over a network meets an open host."""
    if token_file is not None:
        return read_secret(token_file, "--token-file", "token")
    if not _loopback(host):
        raise SandboxError(f"--host {host} is not loopback: give --token-file (a file holding the bearer token)")
    token = secrets.token_urlsafe(32)
    generated.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(generated, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    say(f"no --token-file: generated a token in {generated} (clients: sandbox.host_token_file)")
    return token


def serve(backend: SandboxBackend, store: ImageStore, token: str, *, host: str, port: int, capacity: int,
          idle_s: float, lifetime_s: float, say: Callable[[str], None], e2b_api_key: str | None = None,
          allow_network: bool = False) -> None:
    import uvicorn

    async def images():
        say("resolving the base image (built on first use, then cached)")
        return {"base": await asyncio.to_thread(store.base)}

    # A host killed before it could close its sandboxes leaves their cgroups (their processes end with
    # their init, which exits when the host's end of its channel closes): removed before any new sandbox.
    if removed := cgroups.sweep_dead():
        say(f"removed {removed} sandbox cgroups that dead furlong processes left")
    app = make_app(backend, images, token, capacity=capacity, idle_s=idle_s, lifetime_s=lifetime_s,
                   e2b_api_key=e2b_api_key, store=store, allow_network=allow_network)
    say(f"sandbox host on http://{host}:{port}/v1 ({backend.name}, capacity {capacity}, idle {idle_s:g} s, "
        f"lifetime {lifetime_s:g} s, network {'for tasks that declare it' if allow_network else 'never'})")
    if e2b_api_key is not None:
        say(f"E2B-compatible API on http://{host}:{port} (E2B_API_URL and E2B_SANDBOX_URL; template 'base')")
    uvicorn.run(app, host=host, port=port, log_level="warning")


def e2b_key(key_file: Path) -> str:
    """The API key E2B clients send (X-API-KEY, the SDK's E2B_API_KEY), read from `key_file`."""
    return read_secret(key_file, "--e2b-key-file", "key")
