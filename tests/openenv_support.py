"""OpenEnv servers for tests: `furlong openenv serve` in a thread of this process (`ThreadServer`, its
backend inspectable) or as the command in a process of its own, and the `openenv` package's own example
environment (the echo env that `openenv init` writes) on uvicorn in a process (`EchoServer`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

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
