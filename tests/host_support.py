"""Sandbox hosts for tests: the real host app on a real uvicorn, in a thread (`ThreadHost`) or as the
`furlong sandbox serve` command in a process of its own (`ProcessHost`, which a test may SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from furlong.sandbox.host.app import make_app
from furlong.sandbox.remote.images import HostImages
from furlong.sandbox.remote.hosts import Hosts
from furlong.sandbox.remote.backend import RemoteBackend

TOKEN = "host-secret-token"
REPO = Path(__file__).parent.parent


def free_port() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def serve_in_thread(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    """`app` on a real uvicorn on a free loopback port, in a daemon thread (a blocking client, such as the
    e2b SDK, cannot share the test's event loop); returns once it listens."""
    sock, port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the app did not start on loopback")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@contextmanager
def on_loopback(app) -> Iterator[str]:
    """serve_in_thread as a context: yields the base URL, stops the server on exit."""
    server, thread, url = serve_in_thread(app)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


class ThreadHost:
    """make_app over `backend` (and, given one, the image `store` remote clients build in), served from a
    thread of this process."""

    def __init__(self, backend, base_image, store=None, **kw):
        async def images():
            return {"base": base_image}

        self.app = make_app(backend, images, TOKEN, store=store, **kw)
        self.server, self.thread, self.url = serve_in_thread(self.app)
        self.c = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)

    @property
    def reg(self):
        return self.app.state.registry

    def create(self) -> tuple[str, dict]:
        """A base sandbox through /v1: its id and the header with its token."""
        r = self.c.post("/v1/sandboxes", json={})
        assert r.status_code == 200, r.text
        body = r.json()
        return body["id"], {"X-Sandbox-Token": body["token"]}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class ProcessHost:
    """`furlong sandbox serve` on a free loopback port, in its own process."""

    def __init__(self, tmp: Path, capacity: int = 4, allow_network: bool = False, flags: tuple[str, ...] = ()):
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "tok").write_text(TOKEN + "\n")
        sock, port = free_port()
        sock.close()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "furlong.cli", "sandbox", "serve", "--port", str(port),
                                      "--token-file", str(tmp / "tok"), "--capacity", str(capacity),
                                      *(["--allow-network"] if allow_network else []), *flags],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.c = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.c.get("/v1/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"host did not start: {self.proc.stdout.read()}")

    def metrics(self) -> dict:
        return self.c.get("/v1/metrics").json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def remote(urls: list[str], local=None) -> tuple[RemoteBackend, HostImages]:
    """The remote backend over `urls` and the image lookup that builds on those hosts."""
    images = HostImages(Hosts(urls, TOKEN))
    return RemoteBackend(images.hosts, images.provide, local=local), images
