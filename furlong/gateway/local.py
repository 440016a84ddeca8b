"""The gateway inside a run (`train.agent.harness`): the app on a free loopback port, served by the run's own
event loop, its Policy on the run's engine (so the weight versions and logprobs it records are those of the
engines the trainer syncs), under a random token only this process knows. Episodes are minted and ended
in-process; no route is needed for that."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import Iterator

import uvicorn

from furlong.gateway.app import make_app
from furlong.gateway.exec import EXEC_ROUTE, EpisodeTools
from furlong.gateway.policy import Policy
from furlong.gateway.serving import gateway_config
from furlong.gateway.sessions import Session, Sessions


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the run owns SIGINT/SIGTERM: Ctrl-C must stop the run, not only its gateway


class LocalGateway:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        app = make_app(policy, secrets.token_urlsafe(32))
        self.sessions: Sessions = app.state.sessions
        self._server = _Server(gateway_config(app, lifespan="off", timeout_graceful_shutdown=5))
        self._task: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        self.url = ""

    @property
    def exec_url(self) -> str:
        return self.url + EXEC_ROUTE

    async def start(self) -> str:
        """Listening (started on first use, in the caller's loop); its base URL."""
        async with self._starting:
            if self._task is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.bind(("127.0.0.1", 0))
                self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
                self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            while not self._server.started:
                if self._task.done():
                    self._task.result()  # its exception, if it raised one
                    raise RuntimeError("the run's gateway stopped before it listened")
                await asyncio.sleep(0.02)
        return self.url

    def mint(self, tools: EpisodeTools) -> tuple[str, Session]:
        """A new episode: its key, and its session (the trajectory its requests are recorded on)."""
        episode_id, key = self.sessions.mint(tools=tools)
        session = self.sessions.get(episode_id)
        assert session is not None
        return key, session

    async def end(self, episode_id: str) -> None:
        """Its key is refused from now on; a request in flight is recorded first."""
        await self.sessions.end(episode_id)

    async def close(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
