"""`furlong sandbox serve`: the host API on uvicorn, with its start-up lines (its token rule, shared with the
engine and OpenEnv servers: furlong.sync.serving.server_token)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from furlong.sandbox.base import Limits, SandboxBackend, SandboxError
from furlong.sandbox.host.app import make_app
from furlong.sandbox.host.bodies import CreateBody
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.remote.hosts import read_secret
from furlong.sandbox.runtime import cgroups


def serve(
    backend: SandboxBackend,
    store: ImageStore,
    token: str,
    *,
    host: str,
    port: int,
    capacity: int,
    idle_s: float,
    lifetime_s: float,
    say: Callable[[str], None],
    e2b_api_key: str | None = None,
    allow_network: bool = False,
    e2b_limits: Limits | None = None,
) -> None:
    """`e2b_limits`: each E2B sandbox's (furlong's defaults, `lifetime_s`, where None)."""
    import uvicorn

    async def images():
        say("resolving the base image (built on first use, then cached)")
        return {"base": await asyncio.to_thread(store.base)}

    # A host killed before it could close its sandboxes leaves their cgroups (their processes end with
    # their init, which exits when the host's end of its channel closes): removed before any new sandbox.
    if removed := cgroups.sweep_dead():
        say(f"removed {removed} sandbox cgroups that dead furlong processes left")
    lim = e2b_limits or Limits(lifetime_s=lifetime_s)
    app = make_app(
        backend,
        images,
        token,
        capacity=capacity,
        idle_s=idle_s,
        lifetime_s=lifetime_s,
        e2b_api_key=e2b_api_key,
        store=store,
        allow_network=allow_network,
        e2b_limits=lim,
    )
    say(
        f"sandbox host on http://{host}:{port}/v1 ({backend.name}, capacity {capacity}, idle {idle_s:g} s, "
        f"lifetime {lifetime_s:g} s, network {'for tasks that declare it' if allow_network else 'never'})"
    )
    if e2b_api_key is not None:
        say(
            f"E2B-compatible API on http://{host}:{port} (E2B_API_URL and E2B_SANDBOX_URL; template 'base'; "
            f"each sandbox {lim.cpus:g} CPUs, {lim.memory_mb} MB memory, {lim.disk_mb} MB disk, {lim.pids} pids)"
        )
    uvicorn.run(app, host=host, port=port, log_level="warning")


def e2b_key(key_file: Path) -> str:
    """The API key E2B clients send (X-API-KEY, the SDK's E2B_API_KEY), read from `key_file`."""
    return read_secret(key_file, "--e2b-key-file", "key")


def e2b_limits(*, cpus: float, memory_mb: int, disk_mb: int, pids: int, lifetime_s: float) -> Limits:
    """The E2B sandboxes' limits from serve's --e2b-* flags, held to the bounds a /v1 create is (CreateBody's
    fields); a value out of them is an error naming its flag."""
    given = {"cpus": cpus, "memory_mb": memory_mb, "disk_mb": disk_mb, "pids": pids}
    try:
        CreateBody(**given)  # the limit fields only: the rest keep their defaults
    except ValidationError as e:
        err = e.errors()[0]
        flag = "--e2b-" + str(err["loc"][0]).replace("_", "-")
        raise SandboxError(f"{flag}: {err['msg']}, got {given[str(err['loc'][0])]}") from e
    return Limits(cpus=cpus, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, lifetime_s=lifetime_s)
