"""A Ray head of its own (`ray start --head --block`: own port, temp dir and token), for checks of
`train.ray.address` (a run joining a cluster it did not start): scripts/train_check.py and the tests.

    with ray_head(num_cpus=3) as head: ...   # head.address; RAY_AUTH_MODE/RAY_AUTH_TOKEN set meanwhile

Ray 2.60 clusters check a token: the head gets a fresh one, given to this process's environment (so its
children, a `furlong train` joining, have it, as a user joining a cluster would) until the block ends.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Head:
    address: str  # HOST:PORT, for train.ray.address
    temp: Path  # its sessions and logs
    proc: subprocess.Popen

    def up(self) -> bool:
        return self.proc.poll() is None and subprocess.run(
            ["ray", "status", f"--address={self.address}"], capture_output=True, timeout=60).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_head(num_cpus: int, num_gpus: int = 0, timeout_s: float = 120.0) -> Iterator[Head]:
    """The head, up; stopped at the end with its whole process group (its raylet, GCS and workers)."""
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    temp = Path(f"/tmp/rh-{secrets.token_hex(3)}")  # short: Ray's socket paths have 107 bytes
    port = _free_port()
    cmd = ["ray", "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
           f"--num-gpus={num_gpus}", f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats",
           "--node-ip-address=127.0.0.1"]
    log = temp.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = Head(f"127.0.0.1:{port}", temp, proc)
    try:
        deadline = time.monotonic() + timeout_s
        while not head.up():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head not up within {timeout_s:g} s (exit {proc.poll()}): "
                                   f"{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        yield head
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)
        log.unlink(missing_ok=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
