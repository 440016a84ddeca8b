"""The E2B control plane (X-API-KEY) and envd's file routes (E2b-Sandbox-Id + X-Access-Token) on one app."""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from connectrpc.code import Code
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from furlong.sandbox.base import (
    ImageRef,
    Limits,
    Metered,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    Snapshotting,
)
from furlong.sandbox.e2b.envd import refusal
from furlong.sandbox.e2b.filesystem import filesystem_app
from furlong.sandbox.e2b.process import process_app
from furlong.sandbox.runtime.headroom import agent_caps

ENVD_VERSION = "0.5.2"  # 0.5.2: the SDK sends close_stdin; below 0.5.7 it uploads multipart, the form served here
Resolver = Callable[[str], Awaitable[ImageRef | None]]
# where SDK versions resume a paused sandbox (2.x: /v2/.../connect; older ones: /connect, /resume)
CONNECT_ROUTES = ("/v2/sandboxes/{sid}/connect", "/sandboxes/{sid}/connect", "/sandboxes/{sid}/resume")


@dataclass(frozen=True)
class Live:
    sandbox_id: str
    template: str
    box: Sandbox
    token: str
    started: float
    end: float
    limits: Limits


def _err(code: int, message: str) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=code)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


class Registry:
    """The live sandboxes, each reaped at its end time."""

    def __init__(self, max_sandboxes: int, others: Callable[[], int] = lambda: 0) -> None:
        self.max = max_sandboxes
        self.live: dict[str, Live] = {}
        self.starting = 0  # creates under way: they hold a seat before their sandbox exists
        self.others = others  # seats the host's own API holds: one capacity for both
        self.cpu_seen: dict[str, tuple[float, float]] = {}  # sandbox -> (time, CPU seconds) at its last metrics

    def held(self) -> int:
        return len(self.live) + self.starting

    async def reap(self) -> None:
        now = time.time()
        for sid in [s for s, live in self.live.items() if live.end <= now]:
            await self.remove(sid)

    async def remove(self, sid: str) -> bool:
        live = self.live.pop(sid, None)
        self.cpu_seen.pop(sid, None)
        if live is not None:
            await live.box.close()
        return live is not None

    async def get(self, sid: str) -> Live | None:
        await self.reap()
        return self.live.get(sid)


def _answer(live: Live) -> dict:
    """What a create (or a connect) answers: the SDK's Sandbox model."""
    return {
        "templateID": live.template,
        "sandboxID": live.sandbox_id,
        "clientID": "furlong",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": live.token,
    }


def _listed(live: Live) -> dict:
    return {
        "templateID": live.template,
        "sandboxID": live.sandbox_id,
        "clientID": "furlong",
        "startedAt": _iso(live.started),
        "endAt": _iso(live.end),
        # its real limits: CPUs as its cgroup's share (at least one), memory, and what `df /` shows inside
        "cpuCount": max(1, round(live.limits.cpus)),
        "memoryMB": live.limits.memory_mb,
        "diskSizeMB": agent_caps(live.limits).layer,
        "state": "paused" if isinstance(live.box, Snapshotting) and live.box.paused else "running",
        "envdVersion": ENVD_VERSION,
        "metadata": {},
    }


async def _json_object(request: Request) -> dict | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


class _Routes:
    """The REST handlers: the control plane (X-API-KEY) and envd's health and files."""

    def __init__(
        self,
        reg: Registry,
        backend: SandboxBackend,
        resolve: Resolver,
        api_key: str,
        max_timeout_s: int,
        limits: Limits,
    ) -> None:
        self.reg, self.backend, self.resolve = reg, backend, resolve
        self.api_key, self.max_timeout_s, self.limits = api_key, max_timeout_s, limits

    def _authed(self, request: Request) -> bool:
        # as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500 for a bad key)
        return hmac.compare_digest(request.headers.get("x-api-key", "").encode(), self.api_key.encode())

    def _bad_timeout(self, timeout: object) -> JSONResponse | None:
        if isinstance(timeout, int) and 0 < timeout <= self.max_timeout_s:
            return None
        return _err(400, f"timeout: expected an integer of seconds in 1..{self.max_timeout_s}")

    async def create(self, request: Request) -> Response:
        if not self._authed(request):
            return _err(401, "invalid X-API-KEY")
        body = await _json_object(request)
        if body is None:
            return _err(400, "body: expected a JSON object")
        template, timeout = body.get("templateID"), body.get("timeout", 300)
        if not isinstance(template, str) or not template:
            return _err(400, "templateID: expected a non-empty string")
        if refused := self._bad_timeout(timeout):
            return refused
        await self.reg.reap()
        if self.reg.held() + self.reg.others() >= self.reg.max:
            return _err(429, f"at most {self.reg.max} sandboxes at once")
        image = await self.resolve(template)
        if image is None:
            return _err(404, f"templateID: unknown template {template!r}")
        self.reg.starting += 1
        try:
            box = await self.backend.create(SandboxSpec(image=image, limits=self.limits))
        finally:
            self.reg.starting -= 1
        now = time.time()
        live = Live(secrets.token_hex(10), template, box, secrets.token_urlsafe(24), now, now + timeout, self.limits)
        self.reg.live[live.sandbox_id] = live
        return JSONResponse(_answer(live), status_code=201)

    async def one(self, request: Request) -> Response:
        if not self._authed(request):
            return _err(401, "invalid X-API-KEY")
        sid = request.path_params["sid"]
        if request.method == "DELETE":
            return Response(status_code=204) if await self.reg.remove(sid) else _err(404, f"sandbox {sid} not found")
        live = await self.reg.get(sid)
        return JSONResponse(_listed(live)) if live else _err(404, f"sandbox {sid} not found")

    async def listing(self, request: Request) -> Response:
        if not self._authed(request):
            return _err(401, "invalid X-API-KEY")
        await self.reg.reap()
        return JSONResponse([_listed(live) for live in self.reg.live.values()])

    async def _live(self, request: Request) -> Live | JSONResponse:
        """The sandbox a control-plane route names, once the key is checked; else the error to answer."""
        if not self._authed(request):
            return _err(401, "invalid X-API-KEY")
        sid = request.path_params["sid"]
        live = await self.reg.get(sid)
        return _err(404, f"sandbox {sid} not found") if live is None else live

    async def _snapshotting(self, request: Request) -> tuple[Live, Snapshotting] | JSONResponse:
        live = await self._live(request)
        if isinstance(live, JSONResponse):
            return live
        if not isinstance(live.box, Snapshotting):
            return _err(501, "pause and resume: not supported by this host's sandboxes")
        return live, live.box

    async def pause(self, request: Request) -> Response:
        """The cgroup freezer: processes and memory kept, whatever `memory` asks (docs/e2b.md); 409 when paused."""
        found = await self._snapshotting(request)
        if isinstance(found, JSONResponse):
            return found
        live, box = found
        if box.paused:
            return _err(409, f"sandbox {live.sandbox_id} is already paused")
        try:
            await box.pause()
        except SandboxError as e:
            return _err(409, f"pause: {e}")
        return Response(status_code=204)

    async def connect(self, request: Request) -> Response:
        """Resumes a paused sandbox (201) or answers a running one (200), moving its end by `timeout`."""
        found = await self._snapshotting(request)
        if isinstance(found, JSONResponse):
            return found
        live, box = found
        body = await _json_object(request) or {}
        timeout = body.get("timeout")
        if timeout is not None and (refused := self._bad_timeout(timeout)):
            return refused
        resumed = box.paused
        await box.resume()
        if timeout is not None:
            live = self.reg.live[live.sandbox_id] = replace(live, end=time.time() + timeout)
        return JSONResponse(_answer(live), status_code=201 if resumed else 200)

    async def metrics(self, request: Request) -> Response:
        """One sample, now: CPU use since the last sample (or the start) and memory, from the sandbox's cgroup."""
        live = await self._live(request)
        if isinstance(live, JSONResponse):
            return live
        sid = live.sandbox_id
        used = live.box.usage() if isinstance(live.box, Metered) else None
        if used is None:
            return JSONResponse([])
        now = time.time()
        since, cpu_before = self.reg.cpu_seen.get(sid, (live.started, 0.0))
        self.reg.cpu_seen[sid] = (now, used.cpu_s)
        pct = max(0.0, used.cpu_s - cpu_before) / max(now - since, 1e-3) / used.limits.cpus * 100
        sample = {
            "timestamp": _iso(now),
            "timestampUnix": int(now),
            "cpuCount": max(1, round(used.limits.cpus)),
            "cpuUsedPct": round(min(pct, 100.0), 2),
            "memUsed": used.memory_bytes,
            "memTotal": used.limits.memory_mb << 20,
            "memCache": 0,
            "diskUsed": 0,
            "diskTotal": agent_caps(used.limits).layer << 20,  # the writable layer's size: `df /` in the sandbox
        }
        return JSONResponse([sample])

    async def unsupported(self, request: Request) -> Response:
        """What the SDK can ask for and furlong does not do (pause, resume, connect, fork, snapshots,
        metrics, logs, network, refreshes): one JSON error it can read, after the key check."""
        if not self._authed(request):
            return _err(401, "invalid X-API-KEY")
        what = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        return _err(
            501,
            f"{what}: not supported by furlong's E2B-compatible host (sandboxes run until killed "
            "or timed out; see docs/e2b.md)",
        )

    async def set_timeout(self, request: Request) -> Response:
        if not self._authed(request):
            return _err(401, "invalid X-API-KEY")
        sid = request.path_params["sid"]
        body = await _json_object(request)
        if body is None:
            return _err(400, "body: expected a JSON object")
        if refused := self._bad_timeout(body.get("timeout")):
            return refused
        live = await self.reg.get(sid)
        if live is None:
            return _err(404, f"sandbox {sid} not found")
        self.reg.live[sid] = replace(live, end=time.time() + body["timeout"])
        return Response(status_code=204)

    async def health(self, request: Request) -> Response:
        return Response(status_code=204)

    async def files(self, request: Request) -> Response:
        live = await self.reg.get(request.headers.get("e2b-sandbox-id", ""))
        if refused := refusal(live, request.headers.get("x-access-token", "")):
            return _err(404 if refused[0] == Code.NOT_FOUND else 401, refused[1])
        assert live is not None, "refusal() refuses a missing sandbox"
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


def e2b_app(
    backend: SandboxBackend,
    resolve: Resolver,
    api_key: str,
    max_sandboxes: int = 16,
    max_timeout_s: int = 3600,
    others: Callable[[], int] = lambda: 0,
    limits: Limits | None = None,
) -> Starlette:
    """The app: `resolve` maps a template id to a furlong image (None: unknown template); `others` counts the
    seats of `max_sandboxes` that something else on the same host holds; every sandbox gets `limits`
    (furlong's defaults where None), which get_info and list report."""
    reg = Registry(max_sandboxes, others)
    r = _Routes(reg, backend, resolve, api_key, max_timeout_s, limits or Limits())
    routes = [
        Route("/sandboxes", r.create, methods=["POST"]),
        Route("/v2/sandboxes", r.listing, methods=["GET"]),
        Route("/v2/sandboxes", r.create, methods=["POST"]),  # the SDK 2.x creates here
        Route("/sandboxes/metrics", r.unsupported, methods=["GET"]),  # before {sid}, which would take it
        Route("/sandboxes/{sid}", r.one, methods=["GET", "DELETE"]),
        Route("/sandboxes/{sid}/timeout", r.set_timeout, methods=["POST"]),
        Route("/sandboxes/{sid}/pause", r.pause, methods=["POST"]),
        Route("/sandboxes/{sid}/metrics", r.metrics, methods=["GET"]),
        *(Route(path, r.connect, methods=["POST"]) for path in CONNECT_ROUTES),
        *(
            Route(f"{base}/{{sid}}/{what}", r.unsupported, methods=["GET", "POST", "PUT"])
            for base in ("/sandboxes", "/v2/sandboxes")
            for what in ("pause", "resume", "connect", "fork", "snapshots", "metrics", "logs", "network", "refreshes")
            if f"{base}/{{sid}}/{what}" not in (*CONNECT_ROUTES, "/sandboxes/{sid}/pause", "/sandboxes/{sid}/metrics")
        ),
        Route("/health", r.health, methods=["GET"]),
        Route("/files", r.files, methods=["GET", "POST"]),
        Mount("/process.Process", app=process_app(reg.get)),
        Mount("/filesystem.Filesystem", app=filesystem_app(reg.get)),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        for sid in list(reg.live):  # sandboxes end with the app, never outlive it
            await reg.remove(sid)

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.registry = reg
    return app
