"""How each RL step's weights reach the rollout engine (`train.sync`).

* direct: the trainer copies its tensors into the in-process engine (one process, nothing to verify).
* broadcast: the trainer is rank 0 of a torch.distributed group with every engine server; each push
  announces the tensors to every engine over HTTP and broadcasts them once (furlong.sync.broadcast).
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
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from furlong.engine.remote import EngineProcess
from furlong.engine.router import Router
from furlong.sync.broadcast import GROUP_NAME, FLAT, GroupSpec, Manifest, WeightGroup, buckets, distinct, host_store
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


class BroadcastMember(Protocol):
    """An engine client that speaks SGLang's distributed-update routes (RemoteEngine, SGLangEngine)."""

    async def init_weights_update_group(self, body: dict) -> dict: ...

    async def update_weights_from_distributed(self, body: dict) -> dict: ...

    async def destroy_weights_update_group(self, group_name: str) -> dict: ...


class BroadcastLink:
    """The trainer as rank 0 of a weight-update group with `members` (ranks 1..n): each push announces every
    bucket of tensors to all of them and broadcasts it once. The last bucket carries the version, so an engine
    switches to it at once. After a failed push the group is out of step: later pushes raise."""

    def __init__(self, engine, members: Sequence[BroadcastMember], group: WeightGroup, *, dtype: torch.dtype | None,
                 bucket_bytes: int, cleanup: Callable[[], Awaitable[None]]) -> None:
        self.engine, self._members, self._group, self._cleanup = engine, list(members), group, cleanup
        self._dtype, self._bucket_bytes = dtype, bucket_bytes
        self._version: int | None = None
        self._broken: BaseException | None = None

    @classmethod
    async def open(cls, engine, members: Sequence[BroadcastMember], *, address: str = "127.0.0.1",
                   backend: str = "gloo", dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20,
                   cleanup: Callable[[], Awaitable[None]], timeout_s: float = 300.0,
                   secret: str | None = None) -> BroadcastLink:
        """Host the group's store on a free port of `address` (which the engines must reach) and join it with
        every member; `cleanup` stops the engines (also when joining fails). With `secret` (the engines' token)
        every member must prove it before the link opens (furlong.sync.group_auth): a stranger that took a rank
        fails the open with RendezvousNotAuthenticated, or a member's refusal naming it, and nothing is sent.
        Without it (SGLang servers, which do not run the handshake) the rendezvous is not authenticated."""
        world = len(members) + 1
        store = host_store(address, world, timeout_s)
        nonce = None if secret is None else secrets.token_hex(16)  # fresh per group: no MAC is ever reused
        specs = [GroupSpec(address, store.port, rank, world, GROUP_NAME, backend, nonce) for rank in range(world)]
        try:
            joined = await _all_or_first_error([_threaded(WeightGroup, specs[0], 0, timeout_s, store, secret),
                                                *(m.init_weights_update_group(spec.body())
                                                  for m, spec in zip(members, specs[1:]))])
        except BaseException:
            await cleanup()
            raise
        return cls(engine, members, joined[0], dtype=dtype, bucket_bytes=bucket_bytes, cleanup=cleanup)

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        routed = self.engine.metrics() if isinstance(self.engine, Router) else {}
        if version == self._version:
            return {**routed, "sync_seconds": 0.0}  # a step that changed nothing (every group filtered)
        if self._broken is not None:
            raise RuntimeError(f"the weight broadcast group failed earlier: {self._broken!r}")
        start = time.perf_counter()
        tensors = {k: v.detach() if self._dtype is None else v.detach().to(self._dtype)
                   for k, v in distinct(weights).items()}
        sent, sending, replies = 0, 0.0, []
        parts = buckets(tensors, self._bucket_bytes)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            manifest = Manifest.of(part, weight_version=str(version) if last else None, load_format=FLAT)
            began = time.perf_counter()
            try:
                out = await _all_or_first_error([_threaded(self._group.send, manifest, list(part.values())),
                                                 *(m.update_weights_from_distributed(manifest.body())
                                                   for m in self._members)])
            except BaseException as e:
                self._broken = e
                raise
            sending += time.perf_counter() - began
            sent += manifest.nbytes
            replies = out[1:]
        self._version = version
        return {**routed, "sync_seconds": time.perf_counter() - start, "sync_full": 1.0,
                "sync_payload_bytes": float(sent), "sync_buckets": float(len(parts)), "sync_broadcast_s": sending,
                "sync_pause_s": max(float(r.get("load_s", 0.0)) for r in replies)}

    async def close(self) -> None:
        """Leave the group at every engine that still answers (one that died needs no telling), then clean up."""
        await asyncio.gather(*(m.destroy_weights_update_group(GROUP_NAME) for m in self._members),
                             return_exceptions=True)
        await self._cleanup()
        self._group.close()


async def _all_or_first_error(calls: Sequence[Awaitable[Any]], *, grace_s: float = 5.0) -> list[Any]:
    """Every call's result in order, or the first failure at once: a member that refused an update never
    receives its broadcast, so waiting for the others would wait for the group's timeout. When the first
    call (the trainer's own collective) fails first, the members get `grace_s` to answer: a member's refusal
    names the cause, where the collective only sees its peer hang up."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if failed == [tasks[0]] and pending:
        done, pending = await asyncio.wait(pending, timeout=grace_s, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks[1:] if t in done and not t.cancelled() and t.exception() is not None] or failed
    if failed:
        for t in pending:
            t.cancel()
        raise failed[0].exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


def _threaded(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` on a daemon thread: a collective stuck until its timeout must not hold up the process's
    exit, as a pool thread (asyncio.to_thread) would."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: nobody waits for this result any more
            pass

    threading.Thread(target=run, name="furlong-broadcast", daemon=True).start()
    return future


async def start_engines(n: int, model_dir: Path, updates: str | None, run_path: Path, threads: int,
                        lora: dict | None, prefix_cache_mb: float, updates_token: str | None = None,
                        engine_token: str | None = None) -> list[EngineProcess]:
    """`n` engine server processes started at once (logs: engine-server.log, or engine-server-I.log for
    several); if one fails to start, the others are stopped before the error is raised."""
    logs = [run_path / "engine-server.log"] if n == 1 else [run_path / f"engine-server-{i}.log" for i in range(n)]
    started = await asyncio.gather(*(asyncio.to_thread(EngineProcess, model_dir, updates=updates, log=log,
                                                       threads=threads, lora=lora,
                                                       prefix_cache_mb=prefix_cache_mb, updates_token=updates_token,
                                                       engine_token=engine_token)
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
