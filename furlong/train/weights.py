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
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from furlong.engine.base import EngineRefused, EngineUnavailable
from furlong.engine.remote import EngineProcess
from furlong.engine.router import Router
from furlong.model.fp8 import Fp8Spec, quantize_state
from furlong.sync.broadcast import FLAT, GROUP_NAME, GroupSpec, Manifest, WeightGroup, buckets, distinct, host_store
from furlong.sync.checksum import quantized_digest, verify_fp8
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay

log = logging.getLogger(__name__)


class WeightLink(Protocol):
    """The rollout engine and how each trainer version reaches it; `push` returns the step's sync metrics."""

    engine: object

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]: ...

    async def close(self) -> None: ...


class DirectLink:
    """The trainer's tensors copied straight into an in-process engine (`fp8`: spec's weights as e4m3 + scales,
    furlong.model.fp8, checked by checksum after each push)."""

    def __init__(self, engine, fp8: Fp8Spec | None = None) -> None:
        self.engine, self.fp8 = engine, fp8

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.fp8 is not None:
            weights = quantize_state(weights, self.fp8)
        await self.engine.update_weights(weights, version)
        # an engine that measures its own update (vllm, sglang: staging, the pause) adds its sync_* parts
        out = {"sync_seconds": time.perf_counter() - start, **getattr(self.engine, "last_update", {})}
        if self.fp8 is not None:
            out |= verify_fp8(self.engine, quantized_digest(weights, self.fp8.tensor_names()), version)
        return out

    async def close(self) -> None:
        await self.engine.close()


class PublishedLink:
    """Publisher -> transport -> a relay (`pull` makes it sync and returns its SyncReport as a dict,
    dataclasses.asdict's shape)."""

    def __init__(
        self, engine, publisher: Publisher, pull: Callable[[], Awaitable[dict]], cleanup: Callable[[], Awaitable[None]]
    ) -> None:
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
        fp8 = {} if self.publisher.fp8 is None else verify_fp8(self.engine, self.publisher.fp8_digest(), version)
        return {
            **fp8,
            **routed,
            "sync_seconds": time.perf_counter() - start,
            "sync_full": float(pub.kind == "full"),
            "sync_payload_bytes": pub.payload_bytes,
            "sync_payload_ratio": pub.ratio,
            "sync_encode_s": pub.encode_s,
            "sync_put_s": pub.put_s,
            "sync_host_bytes": pub.host_bytes,
            "sync_stage_s": report["stage_s"],
            "sync_pause_s": report["pause_s"],
            "sync_recovered": float(report["recovered"]),
        }

    async def close(self) -> None:
        await self._cleanup()


class BroadcastMember(Protocol):
    """An engine client that speaks SGLang's distributed-update routes (RemoteEngine, SGLangEngine)."""

    async def init_weights_update_group(self, body: dict) -> dict: ...

    async def update_weights_from_distributed(self, body: dict) -> dict: ...

    async def destroy_weights_update_group(self, group_name: str) -> dict: ...

    async def health(self) -> Any: ...


class BroadcastLink:
    """The trainer as rank 0 of a weight-update group with `members` (ranks 1..n): each push announces every
    bucket of tensors to all of them and broadcasts it once. The last bucket carries the version, so an engine
    switches to it at once.

    Losing an engine does not end the run. A member that dies or refuses mid-push is taken out of the router
    (its requests go elsewhere) and out of the group; the trainer forms a new group (new name, new store) with
    the others and sends them the same version again, so every live engine holds it. At each later push, a
    lost engine that answers again (restarted at its address) is taken into a new group, receives that push's
    full weights, and only then is put back into the router: it never serves an older version. When no engine
    is left, the push raises and later pushes refuse."""

    def __init__(
        self,
        engine,
        members: Sequence[BroadcastMember],
        group: WeightGroup,
        *,
        dtype: torch.dtype | None,
        bucket_bytes: int,
        cleanup: Callable[[], Awaitable[None]],
        timeout_s: float = 300.0,
        secret: str | None = None,
    ) -> None:
        self.engine, self._members, self._cleanup = engine, list(members), cleanup
        self._group: WeightGroup | None = group
        self._address, self._backend = group.spec.master_address, group.spec.backend
        self._joined = list(members)  # the group's ranks 1..n, in order
        self._dtype, self._bucket_bytes, self._timeout_s, self._secret = dtype, bucket_bytes, timeout_s, secret
        self._version: int | None = None
        self._broken: BaseException | None = None
        self._reasons: dict[int, str] = {}  # why each lost member (by index in `members`) is out
        self.regroups = 0

    @classmethod
    async def open(
        cls,
        engine,
        members: Sequence[BroadcastMember],
        *,
        address: str = "127.0.0.1",
        backend: str = "gloo",
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 256 << 20,
        cleanup: Callable[[], Awaitable[None]],
        timeout_s: float = 300.0,
        secret: str | None = None,
    ) -> BroadcastLink:
        """Host the group's store on a free port of `address` (which the engines must reach) and join it with
        every member; `cleanup` stops the engines (also when joining fails). With `secret` (the engines' token)
        every member of this and every later group must prove it before a weight is sent
        (furlong.sync.group_auth): a stranger that took a rank fails the open with RendezvousNotAuthenticated,
        or a member's refusal naming it. Without it (SGLang servers, which do not run the handshake) the
        rendezvous is not authenticated."""
        try:
            group, failed = await _form_group(members, address, backend, GROUP_NAME, timeout_s, secret)
            if group is None:
                raise next(iter(failed.values()))
        except BaseException:
            await cleanup()
            raise
        return cls(
            engine,
            members,
            group,
            dtype=dtype,
            bucket_bytes=bucket_bytes,
            cleanup=cleanup,
            timeout_s=timeout_s,
            secret=secret,
        )

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        if version == self._version:  # a step that changed nothing (every group filtered)
            return {**(self.engine.metrics() if isinstance(self.engine, Router) else {}), "sync_seconds": 0.0}
        if self._broken is not None:
            raise RuntimeError(f"the weight broadcast group failed earlier: {self._broken}")
        start = time.perf_counter()
        tensors = {
            k: v.detach() if self._dtype is None else v.detach().to(self._dtype) for k, v in distinct(weights).items()
        }
        parts = buckets(tensors, self._bucket_bytes)
        wanted = [m for m in self._members if await self._wanted(m)]
        if wanted != self._joined:  # a lost engine answers again, or one the router took out does not
            await self._regroup(wanted, {i: "does not answer" for i, m in enumerate(self._joined) if m not in wanted})
        while True:
            try:
                sent, sending, replies = await self._send(parts, version)
                break
            except _PushFailed as failed:
                await self._regroup([m for i, m in enumerate(self._joined) if i not in failed.lost], failed.lost)
        for m in self._joined:  # now at `version`: a member the router holds out goes back in
            if isinstance(self.engine, Router):
                await self.engine.readmit(m)
        self._version = version
        routed = self.engine.metrics() if isinstance(self.engine, Router) else {}
        return {
            **routed,
            "sync_seconds": time.perf_counter() - start,
            "sync_full": 1.0,
            "sync_payload_bytes": float(sent),
            "sync_buckets": float(len(parts)),
            "sync_broadcast_s": sending,
            "sync_pause_s": max(float(r.get("load_s", 0.0)) for r in replies),
            "sync_regroups": float(self.regroups),
            "sync_engines_live": float(len(self._joined)),
        }

    async def _wanted(self, member: BroadcastMember) -> bool:
        """Whether `member` belongs in this push's group: a joined one unless the router took it out and it
        does not answer; a lost one once it answers again."""
        held_out = isinstance(self.engine, Router) and not self.engine.is_live(member)
        if member in self._joined and not held_out:
            return True
        return await answers(member)

    async def _send(self, parts: list[dict[str, torch.Tensor]], version: int) -> tuple[int, float, list[dict]]:
        """One attempt at the whole push over the current group: bytes per engine, seconds broadcasting and
        the last bucket's replies; _PushFailed names the members to drop when it fails."""
        assert self._group is not None  # push refuses once no group could be formed
        sent, sending, replies = 0, 0.0, []
        name = self._group.spec.group_name
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            manifest = Manifest.of(
                part, group_name=name, weight_version=str(version) if last else None, load_format=FLAT
            )
            began = time.perf_counter()
            out = await _settle(
                [
                    _threaded(self._group.send, manifest, list(part.values())),
                    *(m.update_weights_from_distributed(manifest.body()) for m in self._joined),
                ]
            )
            errors = [o for o in out if isinstance(o, BaseException)]
            if errors:
                lost = await _culprits(self._joined, out[1:])
                if not lost:  # nobody to blame (the trainer's own end failed): retrying would fail the same way
                    self._broken = errors[0]
                    raise errors[0]
                raise _PushFailed(lost)
            sending += time.perf_counter() - began
            sent += manifest.nbytes
            replies = out[1:]
        return sent, sending, replies

    async def _regroup(self, members: list[BroadcastMember], lost: dict[int, str]) -> None:
        """Take the `lost` members (by rank - 1) out of the router, leave the current group and form a new one
        with `members`, dropping any that fail to join, until one forms; raise (and refuse every later push)
        when none is left or the trainer's own end fails."""
        for i, reason in lost.items():
            self._lose(self._joined[i], reason)
        await _leave(self._joined, self._group)
        self._group, self._joined = None, []
        try:
            while members:
                self.regroups += 1
                name = f"{GROUP_NAME}_{self.regroups}"
                log.warning(
                    "weight broadcast: regroup %d as %r with %d engine(s); out: %s",
                    self.regroups,
                    name,
                    len(members),
                    "; ".join(f"{member_name(m)}: {r}" for m, r in self._lost()) or "none",
                )
                group, failed = await _form_group(
                    members, self._address, self._backend, name, self._timeout_s, self._secret
                )
                if group is not None:
                    self._group, self._joined = group, members
                    for m in members:
                        self._reasons.pop(self._members.index(m), None)
                    return
                for i, e in failed.items():
                    self._lose(members[i], f"could not join: {e}")
                members = [m for i, m in enumerate(members) if i not in failed]
            raise RuntimeError("every engine is lost: " + "; ".join(f"{member_name(m)}: {r}" for m, r in self._lost()))
        except BaseException as e:
            self._broken = e
            raise

    def _lose(self, member: BroadcastMember, reason: str) -> None:
        reason = " ".join(reason.split())[:300]  # one line in the log and in the final error
        self._reasons[self._members.index(member)] = reason
        if isinstance(self.engine, Router):
            self.engine.take_out(member, f"weight broadcast: {reason}")

    def _lost(self) -> list[tuple[BroadcastMember, str]]:
        return [(self._members[i], r) for i, r in sorted(self._reasons.items())]

    async def close(self) -> None:
        """Leave the group at every engine that still answers (one that died needs no telling), then clean up."""
        await _leave(self._joined, self._group)
        await self._cleanup()


class _PushFailed(Exception):
    """A push attempt failed; `lost` maps the members to drop (by rank - 1) to why."""

    def __init__(self, lost: dict[int, str]) -> None:
        super().__init__("; ".join(lost.values()))
        self.lost = lost


class _NoAnswer(Exception):
    """A call still running when the others' outcome was clear: cancelled, so neither success nor a fault."""


async def _form_group(
    members: Sequence[BroadcastMember], address: str, backend: str, name: str, timeout_s: float, secret: str | None
) -> tuple[WeightGroup | None, dict[int, BaseException]]:
    """Host a fresh store on a free port of `address` and join group `name` with every member: the
    trainer's end (None if it did not form) and the members that failed to join, by index."""
    world = len(members) + 1
    store = host_store(address, world, timeout_s)
    nonce = None if secret is None else secrets.token_hex(16)  # fresh per group: no MAC is ever reused
    specs = [GroupSpec(address, store.port, rank, world, name, backend, nonce) for rank in range(world)]
    out = await _settle(
        [
            _threaded(WeightGroup, specs[0], 0, timeout_s, store, secret),
            *(m.init_weights_update_group(spec.body()) for m, spec in zip(members, specs[1:])),
        ]
    )
    failed = {i: e for i, e in enumerate(out[1:]) if isinstance(e, BaseException) and not isinstance(e, _NoAnswer)}
    if isinstance(out[0], BaseException) and not failed:
        raise out[0]
    return (None if isinstance(out[0], BaseException) else out[0]), failed


async def _leave(members: Sequence[BroadcastMember], group: WeightGroup | None, timeout_s: float = 10.0) -> None:
    """Ask every member that still answers to leave `group` (one that died needs no telling), then close the
    trainer's end; a member stuck in a receive of it is freed by its own timeout (furlong.engine.distributed
    serves its other groups meanwhile)."""
    if group is None:
        return
    await asyncio.gather(
        *(asyncio.wait_for(m.destroy_weights_update_group(group.spec.group_name), timeout_s) for m in members),
        return_exceptions=True,
    )
    group.close()


class Answering(Protocol):
    """What `answers` asks of an engine client (a BroadcastMember, a handover member)."""

    async def health(self) -> Any: ...


async def answers(member: Answering, timeout_s: float = 3.0) -> bool:
    try:
        return await asyncio.wait_for(member.health(), timeout_s) is not False  # SGLangEngine's is a bool
    except Exception:  # noqa: BLE001 - any failure to answer is the answer
        return False


async def _culprits(members: Sequence[BroadcastMember], outcomes: Sequence[Any]) -> dict[int, str]:
    """The members (by index) that failed an attempt by themselves: unreachable, refusing (EngineRefused: a
    furlong engine's HTTP 4xx, SGLang's `"success": false`; it received nothing), or not answering health
    now. One whose receive failed because a peer died (HTTP 5xx) or that was still receiving, but answers,
    is a victim: it stays for the next group."""
    lost = {}
    for i, (member, out) in enumerate(zip(members, outcomes)):
        if not isinstance(out, BaseException):
            continue
        if isinstance(out, EngineUnavailable | EngineRefused) or not await answers(member):
            lost[i] = str(out) or type(out).__name__
    return lost


def member_name(member: object) -> str:
    return getattr(member, "url", None) or type(member).__name__


async def _settle(calls: Sequence[Awaitable[Any]], *, grace_s: float = 5.0) -> list[Any]:
    """Every call's result or exception, in order, without waiting for a group's timeout: once one fails,
    the others get `grace_s` to answer (a member's refusal names the cause, where the trainer's collective
    only sees its peer hang up), and those still running then are cancelled and reported as _NoAnswer. The
    wait ends sooner once the trainer's own call (the first) and a member have both failed: the members
    still receiving are stuck on the broken group."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    deadline = time.monotonic() + grace_s
    while pending and any(_failed(t) for t in tasks) and time.monotonic() < deadline:
        if _failed(tasks[0]) and any(_failed(t) for t in tasks[1:]):
            break
        _, pending = await asyncio.wait(
            pending, timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_EXCEPTION
        )
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [_NoAnswer() if t in pending else t.exception() or t.result() for t in tasks]


def _failed(task: asyncio.Future) -> bool:
    return task.done() and not task.cancelled() and task.exception() is not None


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


async def start_engines(
    n: int,
    model_dir: Path,
    updates: str | None,
    run_path: Path,
    threads: int,
    lora: dict | None,
    prefix_cache_mb: float,
    updates_token: str | None = None,
    engine_token: str | None = None,
) -> list[EngineProcess]:
    """`n` engine server processes started at once (logs: engine-server.log, or engine-server-I.log for
    several); if one fails to start, the others are stopped before the error is raised."""
    logs = [run_path / "engine-server.log"] if n == 1 else [run_path / f"engine-server-{i}.log" for i in range(n)]
    started = await asyncio.gather(
        *(
            asyncio.to_thread(
                EngineProcess,
                model_dir,
                updates=updates,
                log=log,
                threads=threads,
                lora=lora,
                prefix_cache_mb=prefix_cache_mb,
                updates_token=updates_token,
                engine_token=engine_token,
            )
            for log in logs
        ),
        return_exceptions=True,
    )
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
