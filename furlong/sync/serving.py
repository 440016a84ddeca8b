"""The one HTTP stack's shared pieces: keep-alive timings and an ASGI app served from a background thread.

Servers are FastAPI apps run by uvicorn; clients are pooled httpx clients (furlong.sync.transport,
furlong.engine.remote, furlong.engine.sglang).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from furlong.paths import read_secret

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
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=SERVER_KEEPALIVE_S,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name=name, daemon=True
        )
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


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token(token: str, where: str) -> str:
    """`token`, if clients can send it as an HTTP header (printable ASCII, no spaces), else a ValueError naming
    `where`: a token no client can send would lock every client out."""
    if not (token.isascii() and token.isprintable() and " " not in token):
        raise ValueError(f"{where}: expected a token of printable ASCII characters without spaces")
    return token


def require_token_off_loopback(host: str, token: str | None, flag: str) -> None:
    """A server bound off loopback must ask for a token: anyone who reaches it could otherwise drive it."""
    if not token and not is_loopback(host):
        raise ValueError(f"--host {host} is not loopback: give {flag} (a file holding the bearer token)")


def read_token_file(path: Path) -> str:
    """The bearer token --token-file `path` holds (at least 16 characters, printable ASCII)."""
    return check_token(read_secret(path, "--token-file", "token"), f"--token-file {path}")


def write_token(generated: Path, say: Callable[[str], None], clients: str) -> str:
    """A fresh token, written (mode 0600) to `generated` for local clients to read; `clients`: where a
    client's settings name that file (for the line `say` prints)."""
    token = secrets.token_urlsafe(32)
    generated.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(generated, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    say(f"no --token-file: generated a token in {generated} (clients: {clients})")
    return token


def server_token(token_file: Path | None, host: str, generated: Path, say: Callable[[str], None], clients: str) -> str:
    """The bearer token of a server bound to `host`: read from token_file (--token-file); without one, only a
    loopback host may start, with a fresh token written to `generated`, so nobody reachable over a network
    meets an open server."""
    if token_file is not None:
        return read_token_file(token_file)
    require_token_off_loopback(host, None, "--token-file")
    return write_token(generated, say, clients)


def guarded_app(
    title: str, token: str | None, lifespan: Any = None, open_paths: frozenset[str] = frozenset()
) -> FastAPI:
    """A FastAPI app whose every route but those in `open_paths` needs `Authorization: Bearer <token>` when
    `token` is set (else 401, nothing changed: the check runs before the route), and whose malformed bodies
    get 400 naming the first bad field (not FastAPI's 422)."""
    from fastapi import Depends, FastAPI, Header, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    expected = f"Bearer {token}".encode()

    def authorized(request: Request, authorization: str = Header(default="")) -> None:
        # bytes compared in constant time; a header of non-ASCII bytes (latin-1 to Starlette) just differs
        if (
            token is not None
            and request.url.path not in open_paths
            and not hmac.compare_digest(authorization.encode(), expected)
        ):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    # FastAPI resolves a string annotation in the module's globals, where Request (imported here, lazily) is not
    authorized.__annotations__["request"] = Request
    app = FastAPI(
        title=title,
        dependencies=[Depends(authorized)],
        lifespan=lifespan,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return JSONResponse({"detail": f"{where}: {first['msg']}"}, status_code=400)

    return app
