"""The one HTTP stack's shared pieces: keep-alive timings and an ASGI app served from a background thread.

Servers are FastAPI apps run by uvicorn; clients are pooled httpx clients (furlong.sync.transport,
furlong.engine.remote, furlong.engine.sglang).
"""

from __future__ import annotations

import hmac
import socket
import threading
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    from fastapi import FastAPI

# HTTP keep-alive: a client must drop an idle pooled connection before the server closes it, or a request
# sent on it just as the server closes it fails with ReadError (an infra_error in RL). Our servers keep idle
# connections SERVER_KEEPALIVE_S; clients pool them CLIENT_KEEPALIVE_S, also under uvicorn's default 5 s,
# which servers we do not configure (SGLang's) may keep.
CLIENT_KEEPALIVE_S = 2.0
SERVER_KEEPALIVE_S = 60


def bound_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port); port 0 picks a free one, read back with getsockname().

    TCP_NODELAY on every connection it accepts: asyncio sets it only on sockets whose protocol is stated
    as TCP, and without it a reply written in two parts (headers, then body) waits for the client's
    delayed ACK, about 40 ms on every request of a kept-alive connection but its first."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class BackgroundServer:
    """An ASGI app served by uvicorn on its own thread and event loop, until close().

    The socket listens before the thread starts, so a client may connect at once: the kernel queues
    the connection until uvicorn accepts it, and no start-up wait is needed."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, name: str = "furlong-http") -> None:
        import uvicorn

        self._sock = bound_socket(host, port)
        self._sock.listen(128)
        # timeout_graceful_shutdown: close() must not wait forever on a client that stopped reading.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=SERVER_KEEPALIVE_S, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=name, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def guarded_app(title: str, token: str | None, lifespan: Any = None) -> FastAPI:
    """A FastAPI app whose every route needs `Authorization: Bearer <token>` when `token` is set (else 401,
    nothing changed), and whose malformed bodies get 400 naming the first bad field (not FastAPI's 422)."""
    from fastapi import Depends, FastAPI, Header, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    expected = f"Bearer {token}".encode()

    def authorized(authorization: str = Header(default="")) -> None:
        if token is not None and not hmac.compare_digest(authorization.encode(), expected):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title=title, dependencies=[Depends(authorized)], lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return JSONResponse({"detail": f"{where}: {first['msg']}"}, status_code=400)

    return app
