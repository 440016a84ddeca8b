"""The `furlong openenv serve` app: the `openenv` package's own server (create_fastapi_app over
TaskSession, so routes and WebSocket messages are the package's), behind a bearer token.

Production mode: /ws (sessions), /health, /schema, /metadata, /mcp, and the task API
(/list_environments, /furlong/splits, /furlong/tasks...). The stateless HTTP /reset, /step and /state
of simulation mode are not served: an episode lives in a sandbox across many steps, so it lives in a
session. Every route but /health needs `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import functools
import hmac
import json
from collections.abc import Callable, Sequence

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.types import ConcurrencyConfig, ServerMode

from furlong.agent.runner import SandboxSource
from furlong.envs.base import Environment
from furlong.eval.openenv_server import TaskAction, TaskBook, TaskObservation, TaskSession, TaskState
from furlong.tasks.model import Task

ENV_NAME = "furlong"
OPEN_PATHS = ("/health",)


class BearerToken:
    """ASGI middleware: a request or WebSocket handshake without the token is refused before any route
    runs (HTTP 401; a WebSocket is closed before it is accepted, which the client sees as HTTP 403)."""

    def __init__(self, app, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"detail": "Authorization: expected 'Bearer <token>'"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope) -> bool:
        given = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


def make_app(
    tasks: Sequence[Task],
    sandboxes: Environment | SandboxSource,
    token: str,
    *,
    capacity: int,
    idle_s: float,
    allow_network: bool = False,
):
    """`capacity` sessions at most (past it, the package's CAPACITY_REACHED error); one idle `idle_s`
    is reaped by the package's reaper, which closes it and so its sandbox."""
    if not tasks:
        raise ValueError("no tasks to serve")
    book = TaskBook(tasks, sandboxes, allow_network)
    app = create_fastapi_app(
        functools.partial(TaskSession, book),
        TaskAction,
        TaskObservation,
        concurrency_config=ConcurrencyConfig(max_concurrent_envs=capacity, session_timeout=idle_s),
        env_name=ENV_NAME,
        state_cls=TaskState,
        mode=ServerMode.PRODUCTION,
    )
    return BearerToken(app, token)


def serve(
    tasks: Sequence[Task],
    sandboxes: Environment | SandboxSource,
    token: str,
    *,
    host: str,
    port: int,
    capacity: int,
    idle_s: float,
    allow_network: bool,
    say: Callable[[str], None],
) -> None:
    import uvicorn

    app = make_app(tasks, sandboxes, token, capacity=capacity, idle_s=idle_s, allow_network=allow_network)
    say(
        f"OpenEnv server on http://{host}:{port} (WebSocket sessions at /ws): {len(tasks)} tasks, capacity "
        f"{capacity}, idle sessions reaped after {idle_s:g} s, network "
        f"{'for tasks that declare it' if allow_network else 'never'}"
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", ws_max_size=16 * 2**20)
