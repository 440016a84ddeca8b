"""The E2B control plane (X-API-KEY) and envd's file routes (E2b-Sandbox-Id + X-Access-Token) on one app."""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from furlong.sandbox.base import (
    ImageRef,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
)
from furlong.sandbox.e2b.filesystem import filesystem_app
from furlong.sandbox.e2b.process import process_app

ENVD_VERSION = "0.2.0"  # below 0.5.7 the SDK uploads multipart, the one upload form served here
Resolver = Callable[[str], Awaitable[ImageRef | None]]


@dataclass(frozen=True)
class Live:
    sandbox_id: str
    template: str
    box: Sandbox
    token: str
    started: float
    end: float


def _err(code: int, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=code)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class Registry:
    """The live sandboxes, each reaped at its end time."""

    def __init__(self, backend: SandboxBackend, resolve: Resolver, max_sandboxes: int) -> None:
        self.backend, self.resolve, self.max = backend, resolve, max_sandboxes
        self.live: dict[str, Live] = {}

    async def reap(self) -> None:
        now = time.time()
        for sid in [s for s, live in self.live.items() if live.end <= now]:
            await self.remove(sid)

    async def remove(self, sid: str) -> bool:
        live = self.live.pop(sid, None)
        if live is not None:
            await live.box.close()
        return live is not None

    async def get(self, sid: str) -> Live | None:
        await self.reap()
        return self.live.get(sid)


def _listed(live: Live) -> dict:
    return {"templateID": live.template, "sandboxID": live.sandbox_id, "clientID": "furlong",
            "startedAt": _iso(live.started), "endAt": _iso(live.end), "cpuCount": 1, "memoryMB": 2048,
            "diskSizeMB": 1024, "state": "running", "envdVersion": ENVD_VERSION, "metadata": {}}


def e2b_app(backend: SandboxBackend, resolve: Resolver, api_key: str, max_sandboxes: int = 16,
            max_timeout_s: int = 3600) -> Starlette:
    """The app: `resolve` maps a template id to a furlong image (None: unknown template)."""
    reg = Registry(backend, resolve, max_sandboxes)

    def authed(request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("x-api-key", ""), api_key)

    async def create(request: Request) -> Response:
        if not authed(request):
            return _err(401, "invalid X-API-KEY")
        try:
            body = await request.json()
        except ValueError:
            return _err(400, "body: expected a JSON object")
        if not isinstance(body, dict):
            return _err(400, "body: expected a JSON object")
        template, timeout = body.get("templateID"), body.get("timeout", 300)
        if not isinstance(template, str) or not template:
            return _err(400, "templateID: expected a non-empty string")
        if not isinstance(timeout, int) or not 0 < timeout <= max_timeout_s:
            return _err(400, f"timeout: expected an integer of seconds in 1..{max_timeout_s}")
        await reg.reap()
        if len(reg.live) >= reg.max:
            return _err(429, f"at most {reg.max} sandboxes at once")
        image = await resolve(template)
        if image is None:
            return _err(404, f"templateID: unknown template {template!r}")
        box = await backend.create(SandboxSpec(image=image))
        now = time.time()
        live = Live(secrets.token_hex(10), template, box, secrets.token_urlsafe(24), now, now + timeout)
        reg.live[live.sandbox_id] = live
        return JSONResponse({"templateID": template, "sandboxID": live.sandbox_id, "clientID": "furlong",
                             "envdVersion": ENVD_VERSION, "envdAccessToken": live.token}, status_code=201)

    async def one(request: Request) -> Response:
        if not authed(request):
            return _err(401, "invalid X-API-KEY")
        sid = request.path_params["sid"]
        if request.method == "DELETE":
            return Response(status_code=204) if await reg.remove(sid) else _err(404, f"sandbox {sid} not found")
        live = await reg.get(sid)
        return JSONResponse(_listed(live)) if live else _err(404, f"sandbox {sid} not found")

    async def listing(request: Request) -> Response:
        if not authed(request):
            return _err(401, "invalid X-API-KEY")
        await reg.reap()
        return JSONResponse([_listed(live) for live in reg.live.values()])

    async def set_timeout(request: Request) -> Response:
        if not authed(request):
            return _err(401, "invalid X-API-KEY")
        sid = request.path_params["sid"]
        timeout = (await request.json()).get("timeout")
        if not isinstance(timeout, int) or not 0 < timeout <= max_timeout_s:
            return _err(400, f"timeout: expected an integer of seconds in 1..{max_timeout_s}")
        live = await reg.get(sid)
        if live is None:
            return _err(404, f"sandbox {sid} not found")
        reg.live[sid] = replace(live, end=time.time() + timeout)
        return Response(status_code=204)

    async def envd(request: Request) -> Live | Response:
        live = await reg.get(request.headers.get("e2b-sandbox-id", ""))
        if live is None:
            return _err(404, "E2b-Sandbox-Id: no such sandbox")
        if not hmac.compare_digest(request.headers.get("x-access-token", ""), live.token):
            return _err(401, "X-Access-Token: missing or wrong for this sandbox")
        return live

    async def health(request: Request) -> Response:
        return Response(status_code=204)

    async def files(request: Request) -> Response:
        live = await envd(request)
        if isinstance(live, Response):
            return live
        path = request.query_params.get("path", "")
        if request.method == "GET":
            try:
                return Response(await live.box.read_file(path), media_type="application/octet-stream")
            except (OSError, SandboxError) as e:  # a missing or unreadable file
                return _err(404, f"path: {path!r} could not be read: {e}")
        form = await request.form()
        written = []
        for _, part in form.multi_items():
            target = path or getattr(part, "filename", "")
            if not target.startswith("/") or not hasattr(part, "read"):
                return _err(400, "path: expected an absolute path per file")
            await live.box.write_file(target, await part.read())
            written.append({"name": target.rsplit("/", 1)[-1], "type": "file", "path": target})
        return JSONResponse(written)

    routes = [Route("/sandboxes", create, methods=["POST"]), Route("/v2/sandboxes", listing, methods=["GET"]),
              Route("/v2/sandboxes", create, methods=["POST"]),  # the SDK 2.x creates here
              Route("/sandboxes/{sid}", one, methods=["GET", "DELETE"]),
              Route("/sandboxes/{sid}/timeout", set_timeout, methods=["POST"]),
              Route("/health", health, methods=["GET"]), Route("/files", files, methods=["GET", "POST"]),
              Mount("/process.Process", app=process_app(reg.get)),
              Mount("/filesystem.Filesystem", app=filesystem_app(reg.get))]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for sid in list(reg.live):  # sandboxes end with the app, never outlive it
            await reg.remove(sid)

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.registry = reg
    return app
