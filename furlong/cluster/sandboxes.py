"""Sandbox host actors (`train.ray.sandbox_hosts`): each runs `furlong sandbox serve` on its node, in a bundle
of the run's `sandboxes` placement group (SPREAD: on different nodes where there are), so episodes' sandboxes
run beside neither the trainer nor the engines; the driver reaches them with the `remote` backend, exactly as
it reaches hosts started by hand (docs/sandbox-hosts.md).

The host is a process of the actor's (a ChildGuard ties it to the actor: it goes when the actor dies, even
SIGKILLed), started with the run's `sandbox.*` and `images.*` settings, a token the driver drew, and the
network for tasks that declare it, as local mode gives it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
import yaml

from furlong.cluster.engines import ChildGuard, free_port
from furlong.cluster.session import RaySession


@dataclass(frozen=True)
class HostSpec:
    """One host's flags: its capacity, the run's sandbox/images settings (a recipe's two sections), its token."""

    capacity: int
    settings: dict  # {"sandbox": {...}, "images": {...}}, as a recipe holds them
    token: str
    start_timeout_s: float = 600.0  # the first start may build the base image


class SandboxHost:
    """The actor: `furlong sandbox serve` on this node, until the actor dies."""

    def __init__(self, spec: HostSpec, loopback: bool) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="furlong-host-"))
        token_file, recipe = self._dir / "token", self._dir / "host.yaml"
        with os.fdopen(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(spec.token + "\n")
        recipe.write_text(yaml.safe_dump(spec.settings))
        host, port = "127.0.0.1" if loopback else ray.util.get_node_ip_address(), free_port()
        self.url = f"http://{host}:{port}"
        self._guard = ChildGuard()
        with (self._dir / "serve.log").open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "furlong.cli",
                    "sandbox",
                    "serve",
                    "--config",
                    str(recipe),
                    "--host",
                    host,
                    "--port",
                    str(port),
                    "--token-file",
                    str(token_file),
                    "--capacity",
                    str(spec.capacity),
                    "--allow-network",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait(spec.start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"furlong sandbox serve exited {self._proc.returncode} on {self.url}: "
                    f"{(self._dir / 'serve.log').read_text(errors='replace')[-2000:]}"
                )
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"furlong sandbox serve on {self.url} not healthy within {timeout_s:g} s")
            time.sleep(0.2)

    def address(self) -> str:
        return self.url

    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        """Stop the host (SIGTERM: it closes its sandboxes), then anything it left."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._guard.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class SandboxHosts:
    """`count` host actors in the session's sandbox bundles; `urls` once every one answers its health check."""

    def __init__(self, session: RaySession, spec: HostSpec, count: int, *, cpus: float) -> None:
        actor = ray.remote(SandboxHost)
        self.token = spec.token
        # Any: ray's types give an actor handle's methods no .remote()
        self.handles: list[Any] = [
            actor.options(num_cpus=cpus, max_restarts=0, scheduling_strategy=session.slot("sandbox", i)).remote(
                spec, session.local
            )
            for i in range(count)
        ]
        try:
            self.urls: list[str] = ray.get(
                [h.address.remote() for h in self.handles], timeout=spec.start_timeout_s + session.timeout_s
            )
        except BaseException:
            self.stop()
            raise

    def metrics(self) -> list[dict]:
        """Each host's own counts and timings (GET /v1/metrics), for the run's records; a host that does not
        answer is recorded with the error."""
        out = []
        for url in self.urls:
            try:
                r = httpx.get(
                    f"{url}/v1/metrics", headers={"Authorization": f"Bearer {self.token}"}, timeout=10, trust_env=False
                )
                out.append({"url": url, **r.raise_for_status().json()})
            except httpx.HTTPError as exc:
                out.append({"url": url, "error": repr(exc)})
        return out

    def stop(self, timeout_s: float = 60.0) -> None:
        closing = [h.close.remote() for h in self.handles]
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
        for h in self.handles:
            ray.kill(h, no_restart=True)
