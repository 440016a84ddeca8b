"""OpenEnv servers for tests: `furlong openenv serve` in a thread of this process (`ThreadServer`, its
backend inspectable) or as the command in a process of its own, the `openenv` package's own example
environment (the echo env that `openenv init` writes) on uvicorn in a process (`EchoServer`), and a
third-party environment on the package's server that lists its tools and once answers garbage
(`GarblingServer`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import json
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from host_support import free_port
from furlong.eval.openenv_app import make_app

TOKEN = "openenv-secret-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
REPO = Path(__file__).parent.parent


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never answered /health")


class ThreadServer:
    """make_app over `tasks` and `sandboxes`, served from a thread of this process."""

    def __init__(self, tasks, sandboxes, capacity: int = 4, idle_s: float = 600.0, allow_network: bool = False):
        self.app = make_app(tasks, sandboxes, TOKEN, capacity=capacity, idle_s=idle_s, allow_network=allow_network)
        sock, port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class SayAction(Action):
    """furlong's convention for a server that lists tools: a call, or `done`."""

    tool: str | None = None
    arguments: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = None
    done: bool = False


class SayObservation(Observation):
    instruction: str = ""
    tools: list[dict[str, Any]] = Field(default_factory=list)
    output: str = ""
    status: str | None = None
    seed: int | None = None  # the episode's reset seed (train instances: below 1,000,000)


SAY = {"type": "function", "function": {"name": "say", "description": "Say something.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


class SayEnv(Environment):
    """A third party's environment: one tool, `say`; the episode's reward at `done` is 1 if it was said."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state, self.seed, self.said = State(episode_id=str(uuid4()), step_count=0), None, 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SayObservation:
        self._state, self.seed, self.said = State(episode_id=episode_id or str(uuid4()), step_count=0), seed, 0
        return SayObservation(instruction="Say something with the say tool.", tools=[SAY], seed=seed)

    def step(self, action: SayAction, timeout_s: float | None = None, **kwargs: Any) -> SayObservation:
        self._state.step_count += 1
        if action.done:
            return SayObservation(done=True, reward=float(self.said > 0), status="ok", seed=self.seed)
        self.said += 1
        return SayObservation(output=f"said: {action.arguments.get('text')}", seed=self.seed)

    @property
    def state(self) -> State:
        return self._state


class GarblingServer:
    """SayEnv on the `openenv` package's server (4 sessions), served from a thread of this process. The
    package's reply that ends the first train episode (the one furlong's score reads) is replaced by
    text that is no JSON, once: `garbled` counts the replies replaced."""

    def __init__(self) -> None:
        self.inner = create_app(SayEnv, SayAction, SayObservation, env_name="say_env", max_concurrent_envs=4)
        self.garbled = 0
        sock, port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(self, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    async def __call__(self, scope, receive, send) -> None:  # ASGI: the package's app, its replies filtered
        async def garbling(message: dict) -> None:
            if self.garbled == 0 and message["type"] == "websocket.send" and _ends_train_episode(message.get("text")):
                self.garbled += 1
                message = {**message, "text": "<html><body>502 Bad Gateway</body></html>"}
            await send(message)
        await self.inner(scope, receive, garbling if scope["type"] == "websocket" else send)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _ends_train_episode(text: str | None) -> bool:
    data = json.loads(text).get("data") if text else None
    if not isinstance(data, dict) or not data.get("done"):
        return False
    seed = (data.get("observation") or {}).get("seed")
    return seed is not None and seed < 1_000_000


class Process:
    """A server command on a free loopback port, in its own process group (a test may SIGKILL it)."""

    def __init__(self, argv: list[str], port: int, cwd: Path | None = None, log: Path | None = None):
        self.url = f"http://127.0.0.1:{port}"
        out = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self.url, self.proc)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def furlong_serve(tasks: Path, token_file: Path, *extra: str, log: Path | None = None) -> Process:
    sock, port = free_port()
    sock.close()
    argv = [sys.executable, "-m", "furlong.cli", "openenv", "serve", "--tasks", str(tasks), "--port", str(port),
            "--token-file", str(token_file), *extra]
    return Process(argv, port, cwd=REPO, log=log)


def echo_env(root: Path) -> Path:
    """The echo environment the `openenv` package ships as its template (`openenv init`), with room for
    4 sessions (the template allows 1)."""
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(root)],
                   check=True, capture_output=True, timeout=120)
    app = root / "echo_env" / "server" / "app.py"
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", "max_concurrent_envs=4,"))
    return root / "echo_env"


def echo_server(env_dir: Path, log: Path | None = None) -> Process:
    sock, port = free_port()
    sock.close()
    argv = [sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1", "--port", str(port)]
    return Process(argv, port, cwd=env_dir, log=log)
