"""`python -m furlong.engine.server` starts and serves on its own: the engine server never imports the CLI
(they used to import each other)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from furlong.sync.serving import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S
from furlong.engine.remote import EngineProcess
from furlong.engine.server import ENGINE_TOKEN_ENV, READY_PREFIX


def _post(url: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_importing_the_engine_server_does_not_import_the_cli():
    code = "import sys, furlong.engine.server; print(sorted(m for m in sys.modules if m.startswith('furlong.cli')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_engine_server_module_serves_alone_and_stops_cleanly(tiny_dir: Path, tmp_path: Path):
    # -X importtime lists every module the process imports (on stderr, to a file: far more than a pipe
    # holds, and an unread full pipe would block the server): the CLI must not be among them
    cmd = [sys.executable, "-X", "importtime", "-m", "furlong.engine.server", "--model", str(tiny_dir), "--port", "0"]
    log = open(tmp_path / "server.log", "w")
    # no token given: on loopback the server makes one, in the cache (mode 0600), and asks for it
    env = {k: v for k, v in os.environ.items() if k != ENGINE_TOKEN_ENV} | {"FURLONG_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()  # the server prints its URL once it listens
        assert line.startswith(READY_PREFIX), line
        url = line[len(READY_PREFIX):]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{url}/health", timeout=60) as resp:
            health = json.load(resp)
        assert {k: health[k] for k in ("weight_version", "paused", "relay")} == {"weight_version": 0, "paused": False,
                                                                                "relay": False}
        assert health["prefix_cache"]["prompt_tokens"] == 0
        generated = tmp_path / "cache" / "engine-token"
        assert generated.stat().st_mode & 0o777 == 0o600
        body = {"input_ids": [5, 17, 99], "sampling": {"max_new_tokens": 4, "seed": 3}}
        with pytest.raises(urllib.error.HTTPError, match="401"):
            _post(f"{url}/generate", body, "a-guess")
        gen = _post(f"{url}/generate", body, generated.read_text().strip())
        assert len(gen["output_ids"]) == len(gen["logprobs"]) == 4 and gen["prompt_len"] == 3
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
        log.close()
    stderr = (tmp_path / "server.log").read_text()
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal it caught: -15, not a crash
    assert proc.returncode in (0, -15) and "Traceback" not in stderr, stderr[-2000:]
    imported = {row.rsplit("|", 1)[-1].strip() for row in stderr.splitlines() if row.startswith("import time:")}
    assert "furlong.engine.server" in imported or "furlong.engine.hf" in imported  # the listing is real
    assert not {m for m in imported if m == "furlong.cli" or m.startswith("furlong.cli.")}


def test_engine_server_help_needs_no_cli():
    res = subprocess.run([sys.executable, "-m", "furlong.engine.server", "--help"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "--model" in res.stdout and "--updates" in res.stdout


def _get_health(sock: socket.socket) -> bytes:
    """One keep-alive GET /health on an open connection; the status line (b"" if the server closed it)."""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                return b""
            head += chunk
    except (BrokenPipeError, ConnectionResetError):
        return b""
    header, body = head.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return header.split(b"\r\n")[0]


def test_the_engine_server_keeps_an_idle_connection_longer_than_clients_pool_it(tiny_dir: Path, tmp_path: Path):
    """A request sent on a pooled connection just as the server drops it for idleness fails (ReadError, an
    infra_error in RL). With uvicorn's default the server dropped connections idle 5 s, the very time httpx
    pools them; now it keeps them past that, and our clients pool them for less."""
    assert CLIENT_KEEPALIVE_S < 5 < SERVER_KEEPALIVE_S
    server = EngineProcess(tiny_dir, updates=None, log=tmp_path / "server.log")
    try:
        url = urlsplit(server.url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            assert _get_health(sock) == b"HTTP/1.1 200 OK"
            time.sleep(6.0)  # idle past uvicorn's default keep-alive
            assert _get_health(sock) == b"HTTP/1.1 200 OK", "the server closed a connection idle 6 s"
    finally:
        server.stop()
