"""Client side of furlong.engine.server: the Engine protocol over HTTP, and a launcher for the process.

Weights never travel through this client: a remote engine gets them from its own relay, which
`sync()` asks to pull the newest published version, or over a torch.distributed group that this client
only announces (init_weights_update_group, update_weights_from_distributed; see furlong.engine.server).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from furlong.engine.base import (
    EngineError,
    EngineRefused,
    EngineTimedOut,
    EngineUnavailable,
    Generation,
    SamplingParams,
)
from furlong.engine.server import ENGINE_TOKEN_ENV, READY_PREFIX
from furlong.sync.serving import CLIENT_KEEPALIVE_S
from furlong.sync.transport import UPDATES_TOKEN_ENV


class RemoteEngine:
    """An engine served by `python -m furlong.engine.server` at `url`."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, token: str | None = None) -> None:
        """`token`: the server's bearer token (its --token-file's or FURLONG_ENGINE_TOKEN; EngineProcess.token),
        sent with every request: every route but /health refuses a request without it (401)."""
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        # Many episodes generate at once; the server batches them, so do not cap connections below that.
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=timeout_s,
            trust_env=False,
            headers=headers,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=CLIENT_KEEPALIVE_S),
        )
        self._version = 0

    @property
    def weight_version(self) -> int:
        """The version the engine last reported (health, sync or a generation)."""
        return self._version

    async def _post(self, route: str, body: dict | None = None) -> Any:
        try:
            resp = await self._client.post(route, json=body)
        except httpx.HTTPError as e:
            raise _unreachable(f"{self.url}{route}", e) from e
        _check_status(resp, f"{self.url}{route}")
        return resp.json()

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None) -> Generation:
        s = sampling or SamplingParams()
        body = {
            "input_ids": [int(t) for t in input_ids],
            "sampling": {
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "max_new_tokens": s.max_new_tokens,
                "stop_token_ids": list(s.stop_token_ids),
                "seed": s.seed,
            },
        }
        out = await self._post("/generate", body)
        gen = Generation(
            output_ids=tuple(out["output_ids"]),
            logprobs=tuple(out["logprobs"]),
            finish_reason=out["finish_reason"],
            weight_version=out["weight_version"],
            token_weight_versions=tuple(out["token_weight_versions"]),
            prompt_len=out["prompt_len"],
        )
        self._version = max(self._version, gen.weight_version)
        return gen

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """POST /score: the engine's logprobs of input_ids[start:] (Engine.score)."""
        body = {"input_ids": [int(t) for t in input_ids], "start": int(start), "temperature": float(temperature)}
        return [float(x) for x in (await self._post("/score", body))["logprobs"]]

    async def sync(self) -> dict:
        """Have the engine's relay pull, verify and load the newest published version; its SyncReport."""
        report = await self._post("/sync")
        self._version = int(report["engine_version"])
        return report

    async def init_weights_update_group(self, body: dict) -> dict:
        """POST /init_weights_update_group (furlong.sync.broadcast.GroupSpec.body()); returns once joined."""
        return await self._post("/init_weights_update_group", body)

    async def update_weights_from_distributed(self, body: dict) -> dict:
        """POST /update_weights_from_distributed (a Manifest's body) while rank 0 broadcasts its tensors."""
        out = await self._post("/update_weights_from_distributed", body)
        if "weight_version" in out:
            self._version = int(out["weight_version"])
        return out

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        return await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_tensor(self, body: dict) -> dict:
        """POST /update_weights_from_tensor (SGLang's body: a handle to weights in this host's shared memory)."""
        out = await self._post("/update_weights_from_tensor", body)
        self._version = int(out["weight_version"])
        return out

    async def health(self, timeout_s: float | None = None) -> dict:
        """GET /health (within `timeout_s` when given, else the client's timeout)."""
        try:
            timeout: dict[str, Any] = {"timeout": timeout_s} if timeout_s else {}
            resp = await self._client.get("/health", **timeout)
        except httpx.HTTPError as e:
            raise _unreachable(f"{self.url}/health", e) from e
        _check_status(resp, f"{self.url}/health")
        out = resp.json()
        self._version = int(out["weight_version"])
        return out

    async def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        raise EngineError("a remote engine loads weights through its relay: publish the update, then sync()")

    async def pause(self) -> None:
        await self._post("/pause")

    async def resume(self) -> None:
        await self._post("/resume")

    async def close(self) -> None:
        await self._client.aclose()


def _unreachable(where: str, e: httpx.HTTPError) -> EngineUnavailable:
    """EngineTimedOut when the answer was slow (a read or write timeout: the server took the connection; a
    pool timeout: this client's own requests held every connection), else EngineUnavailable: refused,
    reset, or a connect timeout (nothing accepted the connection)."""
    slow = isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout)
    return (EngineTimedOut if slow else EngineUnavailable)(f"{where}: {e!r}")


def _check_status(resp: httpx.Response, where: str) -> None:
    if resp.status_code == 401:  # say which setting holds the token, not just that it was refused
        raise EngineRefused(
            f"{where}: HTTP 401: {resp.text[:500]} (RemoteEngine(url, token=...): the server's "
            "--token-file or $FURLONG_ENGINE_TOKEN)"
        )
    if resp.status_code != 200:
        error = EngineRefused if 400 <= resp.status_code < 500 else EngineError
        raise error(f"{where}: HTTP {resp.status_code}: {resp.text[:500]}")


class EngineProcess:
    """Starts `python -m furlong.engine.server` and stops it; its stderr goes to `log`."""

    def __init__(
        self,
        model: Path,
        *,
        updates: str | None,
        log: Path,
        threads: int = 1,
        lora: dict | None = None,
        start_timeout_s: float = 120.0,
        prefix_cache_mb: float = 256,
        updates_token: str | None = None,
        engine_token: str | None = None,
        port: int = 0,
    ) -> None:
        """`engine_token`: the bearer token the server asks of every request but /health (FURLONG_ENGINE_TOKEN);
        None: a fresh one, so the server is never open (`token`: the one its clients must send);
        `port`: 0 for any free one, or a given one (a server restarted at its predecessor's address)."""
        cmd = [
            sys.executable,
            "-m",
            "furlong.engine.server",
            "--model",
            str(model),
            "--threads",
            str(threads),
            "--prefix-cache-mb",
            str(prefix_cache_mb),
            "--port",
            str(port),
        ]
        if updates:
            cmd += ["--updates", updates]
        if lora:
            cmd += ["--lora", json.dumps(lora)]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._log_file = open(log, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if updates_token:  # in the environment, not argv: other users can read a process's command line
            env[UPDATES_TOKEN_ENV] = updates_token
        self.token = engine_token or secrets.token_urlsafe(24)
        env[ENGINE_TOKEN_ENV] = self.token
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log_file, env=env)
        self.url = self._wait_ready(start_timeout_s)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _wait_ready(self, timeout_s: float) -> str:
        found: list[str] = []

        def read() -> None:  # a thread: readline() on a pipe cannot time out by itself
            assert self._proc.stdout is not None
            for raw in self._proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith(READY_PREFIX):
                    found.append(line[len(READY_PREFIX) :])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.stop()
            raise EngineError(
                f"engine server did not start within {timeout_s:.0f} s "
                f"(exit code {self._proc.returncode}); see {self.log}"
            )
        return found[0]

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log_file.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
