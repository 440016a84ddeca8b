"""Engine actors: each hosts today's engine server (furlong.engine.server's app, its relay beside it) on a
port fixed when the run placed it, so a restarted actor (Ray's max_restarts) comes back at the same URL and
the router readmits it once its relay holds the live weight version."""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from furlong.cluster.session import RaySession
from furlong.engine.serve_args import add_serve_arguments
from furlong.engine.server import build_app, load_engine, open_transport
from furlong.sync.relay import Relay
from furlong.sync.serving import BackgroundServer
from furlong.sync.transport import UPDATES_TOKEN_ENV


@dataclass(frozen=True)
class EngineSpec:
    """One engine server's flags (those of `furlong engine serve`) and the secret its relay pulls with."""

    model: Path
    updates: str
    threads: int = 1
    prefix_cache_mb: float = 256
    lora: dict | None = None
    updates_token: str | None = None
    engine_token: str | None = None  # every route of the engine server then needs it (the router sends it)
    device: str = "cpu"  # cuda: the actor's bundle holds a GPU (train.ray.engine_gpus)

    def argv(self, host: str, port: int) -> list[str]:
        out = ["--model", str(self.model), "--updates", self.updates, "--host", host, "--port", str(port),
               "--threads", str(self.threads), "--prefix-cache-mb", str(self.prefix_cache_mb), "--device", self.device]
        return out + (["--lora", json.dumps(self.lora)] if self.lora else [])


class EngineHost:
    """The actor: the engine server on a thread of its own, until the actor dies."""

    def __init__(self, spec: EngineSpec, port: int, loopback: bool) -> None:
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        ap = argparse.ArgumentParser()
        add_serve_arguments(ap)
        args = ap.parse_args(spec.argv(host, port))
        torch.set_num_threads(args.threads)
        if spec.updates_token:  # where open_transport reads it, as an engine server process does
            os.environ[UPDATES_TOKEN_ENV] = spec.updates_token
        engine = load_engine(args)
        self._server = BackgroundServer(build_app(engine, Relay(open_transport(args.updates), engine),
                                                  token=spec.engine_token),
                                        host, port, name="furlong-engine")

    def url(self) -> str:
        return self._server.url

    def pid(self) -> int:
        return os.getpid()


def free_port() -> int:
    """A port free on this host now; the engine keeps it across restarts (on another node: free there too,
    most likely, and a clash fails the actor's start with the address in the error)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class EngineActors:
    """`count` engine actors in the session's engine bundles; `urls` once every one is serving."""

    def __init__(self, session: RaySession, spec: EngineSpec, count: int, *, cpus: float, max_restarts: int,
                 gpus: float = 0.0) -> None:
        actor = ray.remote(EngineHost)
        self.handles = [actor.options(num_cpus=cpus, num_gpus=gpus, max_restarts=max_restarts,
                                      scheduling_strategy=session.slot("engine", i)).remote(
                            spec, free_port(), session.local)
                        for i in range(count)]
        try:
            self.urls: list[str] = ray.get([h.url.remote() for h in self.handles], timeout=session.timeout_s)
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return ray.get([h.pid.remote() for h in self.handles], timeout=60)

    def stop(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)
