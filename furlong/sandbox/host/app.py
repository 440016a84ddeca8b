"""furlong's sandbox host API (/v1): a FastAPI app over one local SandboxBackend.

Every route but /v1/health needs the host's bearer token; a sandbox's routes also need the token its
create returned (X-Sandbox-Token), so one client cannot drive another's sandbox. A refused request
changes nothing: auth, size and path checks all run before any sandbox is touched.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' Annotated dependencies, which name
# closures of make_app, at definition time
import asyncio
import base64
import dataclasses
import hmac
import json
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, nullcontext
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.applications import Starlette

from furlong.sandbox import listing
from furlong.sandbox.base import (
    ChangeTracking,
    ImageRef,
    Limits,
    NetworkSwitching,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)
from furlong.sandbox.e2b import e2b_app
from furlong.sandbox.host.bodies import (
    ABSOLUTE,
    CreateBody,
    ExecBody,
    ListBody,
    PathBody,
    RootsBody,
    SwitchBody,
    WriteBody,
    create_spec,
    inside_path,
)
from furlong.sandbox.host.images import MAX_CONTEXT_BYTES, image_routes
from furlong.sandbox.host.registry import AtCapacity, Entry, Registry
from furlong.sandbox.host.snapshots import HostSnapshots, created, snapshot_routes
from furlong.sandbox.images.store import ImageStore

MAX_BODY = 64 << 20  # bytes of any one request body (a file write, a tar)
# put_tar reads its body itself, so the schema says what it takes (clients and schemathesis read it)
TAR_BODY = {
    "requestBody": {
        "required": True,
        "description": "a tar archive (plain, gzip, bzip2 or xz)",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


async def guarded(entry: Entry, call: Awaitable):
    """Awaits a sandbox call, keeping the sandbox from being reaped meanwhile; its errors as HTTP ones."""
    entry.busy += 1
    try:
        return await call
    except SandboxError as e:
        raise HTTPException(409 if entry.box.alive else 410, f"{type(e).__name__}: {e}") from e
    finally:
        entry.busy -= 1
        entry.last_used = time.monotonic()


def _exec(entry: Entry, body: ExecBody, on_output: Callable[[str, bytes], None] | None = None) -> Awaitable:
    return entry.box.exec(
        body.cmd,
        timeout_s=body.timeout_s,
        cwd=body.cwd,
        env=body.env,
        as_verifier=body.as_verifier,
        on_output=on_output,
    )


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _streamed_exec(entry: Entry, body: ExecBody, reg: Registry, running: set[asyncio.Task]) -> StreamingResponse:
    """The exec as NDJSON lines: {"stdout"|"stderr": base64} as the command writes, then {"result": {...}} or
    {"error": {"status", "detail"}}. The command runs in a task of its own, so it ends as it would have
    whether or not the client stays to read; the lines waiting are bounded by the sandbox's output cap."""
    lines: asyncio.Queue[dict | None] = asyncio.Queue()
    entry.busy += 1  # now, not once the answer starts: the reaper never sees the sandbox idle in between

    async def run() -> dict:
        t = time.perf_counter()
        try:
            r = await guarded(
                entry,
                _exec(entry, body, lambda stream, data: lines.put_nowait({stream: base64.b64encode(data).decode()})),
            )
            reg.execs.append(time.perf_counter() - t)
            return {"result": dataclasses.asdict(r)}
        except HTTPException as e:
            return {"error": {"status": e.status_code, "detail": e.detail}}
        finally:
            entry.busy -= 1
            lines.put_nowait(None)

    task = asyncio.create_task(run())
    running.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(running.discard)

    async def answer() -> AsyncIterator[bytes]:
        while (line := await lines.get()) is not None:
            yield _line(line)
        yield _line(await task)

    return StreamingResponse(answer(), media_type="application/x-ndjson")


def _auth(token: str, reg: Registry) -> tuple[Callable, Callable]:
    """The host-token check, and the dependency that finds a sandbox by id and its own token."""

    def host_auth(authorization: Annotated[str, Header()] = "") -> None:
        given = authorization.removeprefix("Bearer ").encode()
        if not authorization.startswith("Bearer ") or not hmac.compare_digest(given, token.encode()):
            raise HTTPException(
                401, "Authorization: expected 'Bearer <host token>'", headers={"WWW-Authenticate": "Bearer"}
            )

    def sandbox(
        sid: str, _: Annotated[None, Depends(host_auth)], x_sandbox_token: Annotated[str, Header()] = ""
    ) -> Entry:
        entry = reg.lookup(sid, x_sandbox_token)
        if entry is None:
            raise HTTPException(404, f"no sandbox {sid!r} on this host")
        if entry is False:
            raise HTTPException(403, "X-Sandbox-Token: not this sandbox's token")
        return entry

    return host_auth, sandbox


def _sandbox_routes(app: FastAPI, reg: Registry, sandbox: Callable) -> None:
    running: set[asyncio.Task] = set()  # streamed execs

    @app.post("/v1/sandboxes/{sid}/exec", response_model=None)
    async def exec_(body: ExecBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict | StreamingResponse:
        if body.stream:
            return _streamed_exec(entry, body, reg, running)
        t = time.perf_counter()
        r = await guarded(entry, _exec(entry, body))
        reg.execs.append(time.perf_counter() - t)
        return dataclasses.asdict(r)

    @app.post("/v1/sandboxes/{sid}/network")
    async def network(body: SwitchBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        if not isinstance(entry.box, NetworkSwitching):
            raise HTTPException(409, "this host's sandboxes cannot change their network")
        # a sandbox that started without network refuses any other policy itself: it has no way out
        await guarded(entry, entry.box.set_network(body.network.policy(), verifier_only=body.verifier_only))
        return {"ok": True}

    @app.post("/v1/sandboxes/{sid}/changes")
    async def changes(body: RootsBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        if not isinstance(entry.box, ChangeTracking):
            return {"changes": None}
        found = await guarded(entry, entry.box.changes(body.paths))
        return {"changes": None if found is None else [dataclasses.asdict(c) for c in found]}

    @app.post("/v1/sandboxes/{sid}/image_has")
    async def image_has(body: RootsBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        if not isinstance(entry.box, ChangeTracking):
            return {"paths": None}
        found = await guarded(entry, entry.box.image_has(body.paths))
        return {"paths": None if found is None else sorted(found)}

    @app.delete("/v1/sandboxes/{sid}")
    async def close(entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        await reg.remove(entry.id)
        return {"ok": True}


def _file_routes(app: FastAPI, sandbox: Callable) -> None:
    @app.post("/v1/sandboxes/{sid}/files/read")
    async def read(body: PathBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        data = await guarded(entry, entry.box.read_file(body.path, as_verifier=body.as_verifier))
        return {"data_b64": base64.b64encode(data).decode()}

    @app.post("/v1/sandboxes/{sid}/files/list")
    async def list_files(body: ListBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        found = await guarded(entry, listing.list_dir(entry.box, body.path, body.depth, body.as_verifier))
        return {"entries": [dataclasses.asdict(e) for e in found]}

    @app.post("/v1/sandboxes/{sid}/files/write")
    async def write(body: WriteBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        try:
            data = base64.b64decode(body.data_b64, validate=True)
        except ValueError as e:
            raise HTTPException(400, f"data_b64: expected base64 ({e})") from e
        await guarded(entry, entry.box.write_file(body.path, data, mode=body.mode, as_verifier=body.as_verifier))
        return {"ok": True}

    @app.post("/v1/sandboxes/{sid}/put_tar", openapi_extra=TAR_BODY)
    async def put_tar(
        request: Request,
        dest: Annotated[str, Query(json_schema_extra=ABSOLUTE)],
        entry: Annotated[Entry, Depends(sandbox)],
        as_verifier: bool = False,
    ) -> dict:
        try:
            dest = inside_path(dest)
        except ValueError as e:
            raise HTTPException(400, f"dest: {e}") from e
        data = await request.body()
        try:
            await guarded(entry, entry.box.put_tar(data, dest, as_verifier=as_verifier))
        except (tarfile.TarError, ValueError) as e:  # read whole before the sandbox is sent any of it: nothing changed
            raise HTTPException(400, f"body: not a tar of files, directories and symlinks inside dest ({e})") from e
        return {"ok": True}


def _host_routes(app: FastAPI, reg: Registry, host_auth: Callable) -> None:
    @app.get("/v1/health")
    async def health() -> dict:
        return {"ok": True, "boot": reg.boot}

    @app.get("/v1/metrics", dependencies=[Depends(host_auth)])
    async def metrics() -> dict:
        return reg.metrics()

    @app.get("/v1/sandboxes", dependencies=[Depends(host_auth)])
    async def sandboxes() -> dict:
        return {"sandboxes": [{"id": e.id, "age_s": time.monotonic() - e.created} for e in reg.entries.values()]}

    @app.get("/v1/openapi.json", dependencies=[Depends(host_auth)], include_in_schema=False)
    async def schema() -> dict:
        return app.openapi()


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Refuses a body over `max_body` bytes with 413 before any route sees it: by its Content-Length when it
    states one, else (a chunked upload: the e2b SDK's Connect-RPC streams) by counting while it arrives."""

    def __init__(self, app, max_body: int):
        self.app, self.max_body = app, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await self._refuse(send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise _TooLarge
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if started:
                raise
            await self._refuse(send)

    async def _refuse(self, send) -> None:
        await JSONResponse({"detail": f"request body over {self.max_body} bytes"}, status_code=413)(
            {"type": "http"},
            None,  # type: ignore[arg-type]  # the response never reads a request
            send,
        )


def _create_route(
    app: FastAPI,
    reg: Registry,
    backend: SandboxBackend,
    host_auth: Callable,
    spec_of: Callable[[CreateBody], SandboxSpec],
    snaps: HostSnapshots,
) -> None:
    @app.post("/v1/sandboxes", dependencies=[Depends(host_auth)])
    async def create(body: CreateBody) -> dict:
        spec = spec_of(body)
        ref = snaps.find(body.snapshot, spec.image.digest) if body.snapshot else None
        try:
            reg.reserve()
        except AtCapacity as e:
            raise HTTPException(429, str(e), headers={"Retry-After": "1"}) from e
        t = time.perf_counter()
        try:
            box = await (backend.create(spec, from_snapshot=ref) if ref else backend.create(spec))
        except SandboxError as e:
            reg.reserved -= 1
            if ref is None:
                raise
            raise HTTPException(409, f"snapshot: {e}") from e
        except BaseException:
            reg.reserved -= 1
            raise
        return created(reg.add(box, time.perf_counter() - t), reg)


def _e2b(
    backend: SandboxBackend,
    resolved: dict[str, ImageRef],
    api_key: str | None,
    capacity: int,
    reg: Registry,
    limits: Limits,
) -> Starlette | None:
    """With `api_key`, the E2B-compatible API (docs/e2b.md) over the same backend: its templates are the images
    this host serves (`resolved`, filled when the host's lifespan starts), it shares the host's capacity, and
    each of its sandboxes gets `limits` (which its get_info and list report)."""
    if api_key is None:
        return None

    async def template(name: str) -> ImageRef | None:
        return resolved.get(name)

    e2b = e2b_app(
        backend,
        template,
        api_key,
        max_sandboxes=capacity,
        others=lambda: len(reg.entries) + reg.reserved,
        limits=limits,
    )
    reg.others = e2b.state.registry.held  # one capacity for both APIs
    return e2b


def make_app(
    backend: SandboxBackend,
    images: Callable[[], Awaitable[dict[str, ImageRef]]],
    token: str,
    *,
    capacity: int = 8,
    idle_s: float = 600.0,
    lifetime_s: float = 3600.0,
    reap_every_s: float = 1.0,
    max_body: int = MAX_BODY,
    allow_network: bool = False,
    e2b_api_key: str | None = None,
    store: ImageStore | None = None,
    max_context_bytes: int = MAX_CONTEXT_BYTES,
    e2b_limits: Limits | None = None,
) -> FastAPI:
    """`images` resolves (building or pulling, then caching) the images this host serves, by name. With
        `e2b_api_key`, the E2B-compatible API (docs/e2b.md) is served on the same port, its templates being
        these image names, each of its sandboxes getting `e2b_limits` (furlong's defaults, the host's `lifetime_s`,
    where None; a /v1 create names its own). With `store`, clients may also name images by content (its
    layers), and build them here first (POST /v1/images, furlong.sandbox.host.images)."""
    reg = Registry(capacity=capacity, idle_s=idle_s, lifetime_s=lifetime_s)
    resolved: dict[str, ImageRef] = {}
    limits = e2b_limits or Limits(lifetime_s=lifetime_s)
    e2b = _e2b(backend, resolved, e2b_api_key, capacity, reg, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        resolved.update(await images())
        reaper = asyncio.create_task(reg.reap_forever(reap_every_s))
        try:
            async with e2b.router.lifespan_context(e2b) if e2b is not None else nullcontext():
                yield  # a mounted app's own lifespan is not run by Starlette: its sandboxes end here
        finally:
            reaper.cancel()
            await reg.close_all()

    # no open /docs, /redoc or /openapi.json: the schema is served below, to the host token's holder only
    app = FastAPI(title="furlong sandbox host", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = reg

    app.add_middleware(BodyLimit, max_body=max_body)
    host_auth, sandbox = _auth(token, reg)

    _host_routes(app, reg, host_auth)

    snaps = HostSnapshots()

    def spec_of(body: CreateBody) -> SandboxSpec:
        return create_spec(body, resolved, lifetime_s, store, allow_network)

    _create_route(app, reg, backend, host_auth, spec_of, snaps)
    _sandbox_routes(app, reg, sandbox)
    snapshot_routes(app, reg, sandbox, guarded, snaps)
    _file_routes(app, sandbox)
    if store is not None:
        image_routes(app, store, backend, host_auth, max_context_bytes)
    if e2b is not None:
        app.mount("/", e2b)  # after every /v1 route, so those match first
    return app
