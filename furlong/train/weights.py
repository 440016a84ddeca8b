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
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from furlong.engine.remote import EngineProcess
from furlong.engine.router import Router
from furlong.model.loading import load_model
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay


class WeightLink(Protocol):
    """The rollout engine and how each trainer version reaches it; `push` returns the step's sync metrics."""

    engine: object

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]: ...

    async def close(self) -> None: ...


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


async def start_engines(n: int, model_dir: Path, updates: str, run_path: Path, threads: int,
                        lora: dict | None, prefix_cache_mb: float, updates_token: str | None = None) -> list[EngineProcess]:
    """`n` engine server processes started at once (logs: engine-server.log, or engine-server-I.log for
    several); if one fails to start, the others are stopped before the error is raised."""
    logs = [run_path / "engine-server.log"] if n == 1 else [run_path / f"engine-server-{i}.log" for i in range(n)]
    started = await asyncio.gather(*(asyncio.to_thread(EngineProcess, model_dir, updates=updates, log=log,
                                                       threads=threads, lora=lora,
                                                       prefix_cache_mb=prefix_cache_mb, updates_token=updates_token)
                                   for log in logs),
                                   return_exceptions=True)
    failed = [r for r in started if isinstance(r, BaseException)]
    if failed:
        for r in started:
            if isinstance(r, EngineProcess):
                r.stop()
        raise failed[0]
    return started  # type: ignore[return-value]


class Borrowed:
    """An engine lent to one phase: everything passes through, but close() leaves it running for the next."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def close(self) -> None:
        pass


async def local_pull(relay: Relay) -> dict:
    # The same dict the engine server's POST /sync returns, so both links read one shape.
    return dataclasses.asdict(await relay.sync_once())
