"""Engine actors: each hosts today's engine server (furlong.engine.server's app, its relay beside it) on a
port fixed when the run placed it, so a restarted actor (Ray's max_restarts) comes back at the same URL and
the router readmits it once its relay holds the live weight version.

The app serves the engine `train.engine` names, built as local mode builds it (furlong.engine.factory):
hf in the actor itself; vllm as furlong's VLLMEngine, whose vLLM engine-core process is the actor's child;
sglang as an SGLang server process the actor starts (furlong.engine.sglang_launch) and drives over HTTP.
Each published update reaches that engine the way local mode's does (vLLM's worker extension, SGLang's
/update_weights_from_disk), through the actor's relay. A ChildGuard ties those processes to the actor."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from furlong.cluster.reaper import Watchdog
from furlong.cluster.session import RaySession
from furlong.config import SGLangConfig, VLLMConfig
from furlong.engine.base import Engine
from furlong.engine.factory import make_engine
from furlong.engine.serve_args import add_serve_arguments
from furlong.engine.server import build_app, load_engine, open_transport
from furlong.sync.relay import Relay
from furlong.sync.serving import BackgroundServer, require_token_off_loopback
from furlong.sync.transport import UPDATES_TOKEN_ENV

CHILD_ENV = "FURLONG_ENGINE_ACTOR"  # the tag of the processes one engine actor started


@dataclass(frozen=True)
class EngineSpec:
    """One engine server's flags (those of `furlong engine serve`) and the secret its relay pulls with."""

    model: Path
    updates: str | None  # None: no relay (weights are handed over in shared memory instead)
    threads: int = 1
    prefix_cache_mb: float = 256
    lora: dict | None = None
    updates_token: str | None = None
    # every route of the engine server but /health needs it (the router sends it): one per spec, so actors
    # bound to node addresses are never open, even where a caller forgot to give one
    engine_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    device: str = "cpu"  # cuda: the actor's bundle holds a GPU (train.ray.engine_gpus)
    kind: str = "hf"  # train.engine: hf | vllm | sglang
    seed: int = 0  # vllm, sglang: seeds the requests that bring none
    sglang: SGLangConfig | None = None  # kind sglang: how to start its server (never `url`: each actor owns one)
    vllm: VLLMConfig | None = None  # kind vllm: its memory (train.vllm)

    def argv(self, host: str, port: int) -> list[str]:
        out = [
            "--model",
            str(self.model),
            "--host",
            host,
            "--port",
            str(port),
            "--threads",
            str(self.threads),
            "--prefix-cache-mb",
            str(self.prefix_cache_mb),
            "--device",
            self.device,
        ]
        out += ["--updates", self.updates] if self.updates else []
        return out + (["--lora", json.dumps(self.lora)] if self.lora else [])


class ChildGuard:
    """Tags every process this actor starts from now on (CHILD_ENV, inherited by their own children) and
    starts a watchdog (furlong.cluster.reaper) that stops them all once the actor is gone, even SIGKILLed:
    a vLLM engine core or an SGLang server (its own session) would otherwise outlive a killed actor. They
    also carry the run's tag, so the run's watchdog stops them if the driver dies first."""

    def __init__(self) -> None:
        self.tag = f"engine-{os.getpid()}-{secrets.token_hex(4)}"
        os.environ[CHILD_ENV] = self.tag
        self._watchdog: Watchdog | None = Watchdog(self.tag, var=CHILD_ENV)

    def close(self) -> None:
        """Stop the tagged processes now (SIGTERM, then SIGKILL), waiting for the sweep."""
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None


def open_engine(spec: EngineSpec, args: argparse.Namespace, work_dir: Path) -> Engine:
    """The actor's engine, built as local mode builds it (furlong.engine.factory; hf: the server's flags)."""
    if spec.kind == "hf":
        return load_engine(args)
    if spec.kind not in ("vllm", "sglang"):
        raise ValueError(f"engine kind: expected hf, vllm or sglang, got {spec.kind!r}")
    # sglang: its log and staged updates in work_dir (the run directory's engine-I/)
    return make_engine(spec.kind, spec.model, seed=spec.seed, sglang=spec.sglang, work_dir=work_dir, vllm=spec.vllm)


class EngineHost:
    """The actor: the engine server on a thread of its own, until the actor dies."""

    def __init__(self, spec: EngineSpec, port: int, loopback: bool, work_dir: Path | None = None) -> None:
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        require_token_off_loopback(host, spec.engine_token, "EngineSpec.engine_token")
        ap = argparse.ArgumentParser()
        add_serve_arguments(ap)
        args = ap.parse_args(spec.argv(host, port))
        torch.set_num_threads(args.threads)
        if spec.updates_token:  # where open_transport reads it, as an engine server process does
            os.environ[UPDATES_TOKEN_ENV] = spec.updates_token
        self._guard = ChildGuard() if spec.kind != "hf" else None  # hf starts no process
        try:
            engine = open_engine(spec, args, work_dir or Path.cwd() / "engine")
            relay = Relay(open_transport(args.updates), engine) if args.updates else None
            # build_app serves any Engine with update_weights (its docstring), though typed for the hf engine
            self._server = BackgroundServer(
                build_app(engine, relay, token=spec.engine_token),  # type: ignore[arg-type]
                host,
                port,
                name="furlong-engine",
            )
        except BaseException:
            self.close()
            raise

    def url(self) -> str:
        return self._server.url

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Stop serving and stop the processes the engine started (vLLM's engine core, an SGLang server)."""
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()
        if self._guard is not None:
            self._guard.close()


def free_port() -> int:
    """A port free on this host now; the engine keeps it across restarts (on another node: free there too,
    most likely, and a clash fails the actor's start with the address in the error)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class EngineActors:
    """`count` engine actors in the session's `role` bundles (engine, or teacher: a distillation teacher's
    engine, train.distill.teacher.engine); `urls` once every one is serving."""

    def __init__(
        self,
        session: RaySession,
        spec: EngineSpec,
        count: int,
        *,
        cpus: float,
        max_restarts: int,
        gpus: float = 0.0,
        work_root: Path | None = None,
        role: str = "engine",
    ) -> None:
        """`work_root`: engine I keeps what it writes (an SGLang server's log, its staged updates) in
        work_root/<role>-I; it must be a path the actor's node sees (the run directory is)."""
        actor = ray.remote(EngineHost)
        # Any: ray's types give an actor handle's methods no .remote()
        self.handles: list[Any] = [
            actor.options(
                num_cpus=cpus, num_gpus=gpus, max_restarts=max_restarts, scheduling_strategy=session.slot(role, i)
            ).remote(spec, free_port(), session.local, work_root / f"{role}-{i}" if work_root else None)
            for i in range(count)
        ]
        try:
            self.urls: list[str] = ray.get([h.url.remote() for h in self.handles], timeout=session.timeout_s)
        except BaseException:
            self.stop()
            raise

    def pids(self) -> list[int]:
        return ray.get([h.pid.remote() for h in self.handles], timeout=60)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Each actor stops its server and what it started, then is killed (one that does not answer in
        `timeout_s` is killed anyway: its ChildGuard's watchdog stops its processes)."""
        closing = [h.close.remote() for h in self.handles]
        ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
        for h in self.handles:
            ray.kill(h, no_restart=True)
