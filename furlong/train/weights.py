"""How each RL step's weights reach the rollout engine (`train.sync`).

* direct: the trainer copies its tensors into the in-process engine (one process, nothing to verify).
* inprocess / directory / http: the trainer *publishes* (furlong.sync.Publisher: a full snapshot, then
  bit-exact deltas, a snapshot every `full_every`); a Relay pulls, verifies every tensor's checksum and
  loads the result. With `engine: server` the engine and its relay run in their own process
  (furlong.engine.server) and pull from the directory or from an UpdateServer over HTTP, exactly as an
  engine on another host would.

Every push returns metrics for the step's log: what was sent, its size, and how long the engine was paused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import torch

from furlong.config import Config, ConfigError
from furlong.engine.factory import make_engine
from furlong.engine.hf import HFEngine
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router
from furlong.model.loading import load_model
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay
from furlong.sync.transport import DirectoryTransport, HttpTransport, InProcessTransport, Transport, UpdateServer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class DirectLink:
    """The trainer's tensors copied straight into an in-process engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        await self.engine.update_weights(weights, version)
        # an engine that measures its own update (vllm, sglang: staging, the pause) adds its sync_* parts
        return {"sync_seconds": time.perf_counter() - start, **getattr(self.engine, "last_update", {})}

    async def close(self) -> None:
        await self.engine.close()


class PublishedLink:
    """Publisher -> transport -> a relay (`pull` makes it sync and returns its SyncReport as a dict,
    dataclasses.asdict's shape)."""

    def __init__(self, engine, publisher: Publisher, pull: Callable[[], Awaitable[dict]],
                 cleanup: Callable[[], Awaitable[None]]) -> None:
        self.engine, self.publisher, self._pull, self._cleanup = engine, publisher, pull, cleanup

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        routed = self.engine.metrics() if isinstance(self.engine, Router) else {}  # per-instance counters
        if version == self.publisher.version:
            return {**routed, "sync_seconds": 0.0}  # a step that changed nothing (every group filtered)
        start = time.perf_counter()
        pub = await asyncio.to_thread(self.publisher.publish, weights, version)
        report = await self._pull()
        if report["engine_version"] != version:
            raise RuntimeError(f"relay loaded v{report['engine_version']}, expected v{version}: {report['faults']}")
        return {**routed, "sync_seconds": time.perf_counter() - start, "sync_full": float(pub.kind == "full"),
                "sync_payload_bytes": pub.payload_bytes, "sync_payload_ratio": pub.ratio,
                "sync_encode_s": pub.encode_s, "sync_put_s": pub.put_s, "sync_stage_s": report["stage_s"],
                "sync_pause_s": report["pause_s"], "sync_recovered": float(report["recovered"])}

    async def close(self) -> None:
        await self._cleanup()


def _fresh_dir(cfg: Config, run_path: Path) -> DirectoryTransport:
    # The run owns this directory: a resumed run republishes from its checkpoint's version, which may be
    # older than files the killed run left, so they go.
    root = cfg.train.sync.dir or run_path / "weights"
    shutil.rmtree(root, ignore_errors=True)
    return DirectoryTransport(root, keep=cfg.train.sync.keep)


async def open_link(cfg: Config, run_path: Path, engine_model, model_dir: Path, lora: dict | None, shared=None):
    """The rollout engine for RL and the link that keeps its weights current (`shared`: see rollout_engine)."""
    s = cfg.train.sync
    if cfg.train.engine == "sglang":
        return await _sglang_link(cfg, run_path, model_dir)
    if s.transport == "direct":
        return DirectLink(rollout_engine(engine_model, shared, cfg.train.hf.prefix_cache_mb))
    publisher_of = lambda t: Publisher(t, full_every=s.full_every, engine_dtype=DTYPES[s.engine_dtype],  # noqa: E731
                                       momentum=s.momentum)
    if s.engine == "inprocess":
        engine = rollout_engine(engine_model, shared, cfg.train.hf.prefix_cache_mb)
        transport: Transport = InProcessTransport() if s.transport == "inprocess" else _fresh_dir(cfg, run_path)
        served = UpdateServer(transport) if s.transport == "http" else None  # type: ignore[arg-type]
        relay = Relay(HttpTransport(served.url) if served else transport, engine)

        async def cleanup_local() -> None:
            await engine.close()
            if served:
                served.close()

        return PublishedLink(engine, publisher_of(transport), lambda: _local_pull(relay), cleanup_local)
    directory = _fresh_dir(cfg, run_path)
    server = UpdateServer(directory) if s.transport == "http" else None
    processes = await _start_engines(s.servers, model_dir, server.url if server else str(directory.root),
                                     run_path, cfg.train.torch_threads, lora, cfg.train.hf.prefix_cache_mb)
    # One process is served directly (as before routers existed); several sit behind a router.
    remote = RemoteEngine(processes[0].url) if len(processes) == 1 else Router([RemoteEngine(p.url) for p in processes])

    async def cleanup_remote() -> None:
        await remote.close()
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in processes))
        if server:
            server.close()

    return PublishedLink(remote, publisher_of(directory), remote.sync, cleanup_remote)


async def _start_engines(n: int, model_dir: Path, updates: str, run_path: Path, threads: int,
                         lora: dict | None, prefix_cache_mb: float) -> list[EngineProcess]:
    """`n` engine server processes started at once (logs: engine-server.log, or engine-server-I.log for
    several); if one fails to start, the others are stopped before the error is raised."""
    logs = [run_path / "engine-server.log"] if n == 1 else [run_path / f"engine-server-{i}.log" for i in range(n)]
    started = await asyncio.gather(*(asyncio.to_thread(EngineProcess, model_dir, updates=updates, log=log,
                                                       threads=threads, lora=lora,
                                                       prefix_cache_mb=prefix_cache_mb) for log in logs),
                                   return_exceptions=True)
    failed = [r for r in started if isinstance(r, BaseException)]
    if failed:
        for r in started:
            if isinstance(r, EngineProcess):
                r.stop()
        raise failed[0]
    return started  # type: ignore[return-value]


async def _sglang_link(cfg: Config, run_path: Path, model_dir: Path) -> DirectLink:
    """An SGLang server (started or attached, `train.sglang`) that loads each step's full weights itself."""
    if cfg.train.lora.enabled or cfg.train.sync.transport != "direct":
        raise ConfigError("train.engine=sglang supports full-weight updates only: set train.lora.enabled=false "
                          "and train.sync.transport=direct (the server loads each step's checkpoint)")
    engine = await asyncio.to_thread(make_engine, "sglang", model_dir, seed=cfg.train.seed, sglang=cfg.train.sglang,
                                     work_dir=run_path / "sglang")
    return DirectLink(engine)  # type: ignore[arg-type]  # any Engine with update_weights


class Borrowed:
    """An engine lent to one phase: everything passes through, but close() leaves it running for the next."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def close(self) -> None:
        pass


def shared_vllm(cfg: Config, sft_dir: Path, run_path: Path):
    """train.engine=vllm: the run's one vLLM engine over the SFT model. With LoRA it runs an adapter of the
    run's spec from the start, a fresh one (lora_B = 0: the identity, so eval_before sees the SFT model);
    RL's adapter-only pushes replace its tensors."""
    adapter = None
    if cfg.train.lora.enabled:
        from furlong.model.lora import LoraSpec, save_adapter, wrap_lora

        lo = cfg.train.lora
        fresh = wrap_lora(load_model(sft_dir), LoraSpec(rank=lo.rank, alpha=lo.alpha, targets=lo.targets))
        adapter = save_adapter(fresh, run_path / "vllm-adapter")
    return make_engine("vllm", sft_dir, seed=cfg.train.seed, adapter=adapter)


def rollout_engine(model, shared=None, prefix_cache_mb: float = 256):
    """A phase's engine: a new hf engine over the in-memory `model`, or the run's `shared` one (train.engine=vllm:
    one vLLM for the whole run, lent to each phase, its weights pushed by the link or the driver)."""
    if shared is not None:
        return Borrowed(shared)
    # episodes stop on end-of-turn, never on a bare EOS
    return HFEngine(model, eos_token_ids=(), prefix_cache_mb=prefix_cache_mb)


async def _local_pull(relay: Relay) -> dict:
    # The same dict the engine server's POST /sync returns, so both links read one shape.
    return dataclasses.asdict(await relay.sync_once())
