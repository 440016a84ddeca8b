"""Engine side of weight sync: pull, verify and rebuild an update while the engine generates.

A relay sits beside one engine and keeps a staging copy of the weights in the publisher's
engine dtype (a WeightReceiver; bf16 by default). `sync_once()`:

1. asks the transport for the newest version;
2. pulls the chain it needs, walking back from the newest version along `base_version` until
   it reaches the version it holds or a full snapshot; every payload's digest is checked as
   it arrives;
3. applies the chain to the staging copy (each tensor checksum-verified) and casts the
   tensors that changed to the engine model's dtype. Steps 1-3 run in a worker thread, so
   the engine keeps generating meanwhile (as Miles does: pull before pausing);
4. only then pauses the engine, pushes the tensors with `update_weights`, and resumes.

The HF engine holds fp32 weights by default; the relay rebuilds in the publisher's dtype and
casts up when pushing (exact: every bf16 value is an fp32 value), so engine weights equal the
publisher's bf16 copy bit for bit after casting back, which is what the checksums guarantee.

Faults (damaged or truncated payload, wrong tensor checksum, missing base, a payload that is
not the version asked for, a relay copy that drifted) never reach the engine: a failed update
is rolled back in the staging copy. The relay then retries from the newest full snapshot
(see `_recover`) and pushes the newest version it could verify. Whenever it falls short of
the newest version it asks the publisher for a fresh snapshot (`Transport.request_full`); if
it got nothing newer than the engine's version it raises SyncFailed. Either way the engine
keeps serving a verified version, and the sync after the next publish recovers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from furlong.model.fp8 import is_quantized
from furlong.sync.delta import WeightReceiver, read_update
from furlong.sync.errors import (
    BaseVersionMismatch,
    ChecksumMismatch,
    CorruptUpdate,
    IncompatibleBase,
    SyncError,
)
from furlong.sync.transport import Payload, Transport
from furlong.sync.update import WeightUpdate


class SyncFailed(SyncError):
    """No newer version could be staged; the engine was not touched. `faults` says why."""

    def __init__(self, message: str, faults: tuple[str, ...]) -> None:
        super().__init__(message + ": " + "; ".join(faults))
        self.faults = faults


class SyncableEngine(Protocol):
    @property
    def weight_version(self) -> int: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None: ...


@dataclass(frozen=True)
class SyncReport:
    """One sync_once(); sizes in bytes, times in seconds."""

    engine_version_before: int
    engine_version: int  # after the sync
    applied: tuple[int, ...]  # versions applied to the staging copy, oldest first
    bytes_pulled: int
    pushed_tensors: int
    stage_s: float  # fetch + verify + rebuild + cast, overlapped with generation
    drain_s: float  # pause(): waiting for the engine's step in progress to finish
    pause_s: float  # engine paused: weights copied in, until resume() returned
    recovered: bool  # faults were met (see `faults`), yet a newer version was staged
    faults: tuple[str, ...] = ()

    @property
    def updated(self) -> bool:
        return self.engine_version != self.engine_version_before


@dataclass(frozen=True)
class _Fetched:
    update: WeightUpdate
    payload: Payload


@dataclass(frozen=True)
class _Staged:
    version: int
    state_dict: dict[str, torch.Tensor]
    applied: tuple[int, ...]
    bytes_pulled: int
    recovered: bool
    faults: tuple[str, ...] = field(default=())


class Relay:
    """Keeps one engine at the transport's newest version (see the module doc).

    `target_dtype`: dtype of the tensors handed to the engine; default: the dtype of the
    engine model's first parameter if it has a `.model`, else the staging dtype."""

    def __init__(
        self,
        transport: Transport,
        engine: SyncableEngine,
        *,
        target_dtype: torch.dtype | None = None,
    ) -> None:
        self.transport = transport
        self.engine = engine
        self.target_dtype = target_dtype if target_dtype is not None else _model_dtype(engine)
        self._receiver = WeightReceiver()
        # Staged tensors not yet in the engine; None = all of them (after a snapshot).
        self._dirty: set[str] | None = None
        self._pushed: int | None = None  # the version this relay last pushed
        self._lock = asyncio.Lock()
        self._bytes = 0  # pulled during the current sync
        self._cache: dict[int, _Fetched] = {}  # verified payloads of the current sync

    @property
    def staged_version(self) -> int | None:
        return self._receiver.version

    @property
    def staged(self) -> Mapping[str, torch.Tensor]:
        return self._receiver.tensors

    async def sync_once(self) -> SyncReport:
        """Bring the engine to the newest version; raises SyncFailed (engine untouched)."""
        async with self._lock:
            before = self.engine.weight_version
            t0 = time.perf_counter()
            try:
                staged = await asyncio.to_thread(self._stage, before)
            finally:
                self._cache = {}  # do not hold pulled payloads between syncs
            stage_s = time.perf_counter() - t0
            if staged is None:
                return SyncReport(before, before, (), 0, 0, stage_s, 0.0, 0.0, False)
            drain_s, pause_s = await self._push(staged)
            return SyncReport(
                before,
                self.engine.weight_version,
                staged.applied,
                staged.bytes_pulled,
                len(staged.state_dict),
                stage_s,
                drain_s,
                pause_s,
                staged.recovered,
                staged.faults,
            )

    async def _push(self, staged: _Staged) -> tuple[float, float]:
        t0 = time.perf_counter()
        await self.engine.pause()
        t1 = time.perf_counter()
        try:
            await self.engine.update_weights(staged.state_dict, staged.version)
        finally:
            await self.engine.resume()
        # Reached only if the engine took the update; otherwise _dirty keeps it pending.
        self._pushed, self._dirty = staged.version, set()
        return t1 - t0, time.perf_counter() - t1

    def _stage(self, engine_version: int) -> _Staged | None:
        """Worker thread: pull and apply what the engine lacks; None when up to date."""
        self._bytes, self._cache = 0, {}
        if self._pushed is not None and engine_version != self._pushed:
            self._reset()  # someone else changed the engine's weights: our diff base is gone
        latest = self.transport.latest()
        held = self._receiver.version
        if latest is None or (held is not None and latest <= held and self._dirty == set()):
            return None  # nothing published, or nothing newer (a re-announced version is a no-op)
        faults: list[str] = []
        applied: list[int] = []
        drift = False  # a fault the relay's own copy may have caused
        if held is not None and latest > held:
            try:
                self._apply_chain(self._walk(latest, stop_at=held), applied)
            except SyncError as e:
                faults.append(_describe(e))
                drift = isinstance(e, (ChecksumMismatch, IncompatibleBase))
        if self._receiver.version is None or self._receiver.version < latest:
            self._recover(latest, applied, faults, rebuild=drift)
        if self._receiver.version is None or self._receiver.version < latest:
            self._request_full(faults)  # a broken chain heals only with a newer snapshot
        if self._receiver.version is None or self._receiver.version == self._pushed:
            raise SyncFailed(f"engine stays at v{engine_version}; requested a full snapshot", tuple(faults))
        return _Staged(
            self._receiver.version, self._to_push(), tuple(applied), self._bytes, bool(faults), tuple(faults)
        )

    def _recover(self, latest: int, applied: list[int], faults: list[str], *, rebuild: bool) -> None:
        """Restart from the newest full snapshot; adopt it only if it gets further than now.

        A snapshot no newer than the staged version only helps when the staging copy itself
        may be wrong (`rebuild`: a checksum or layout mismatch on an intact payload); for a
        damaged or missing payload its chain runs into the same bad version, and pulling a
        whole snapshot on every poll until a new one is published would waste bandwidth.
        Payloads already pulled in this sync come from the cache, not the transport."""
        full = self.transport.latest_full_at_or_before(latest)
        if full is None:
            faults.append(f"no full snapshot at or before v{latest}")
            return
        held, old = self._receiver.version, (self._receiver, self._dirty)
        if held is not None and full <= held and not rebuild:
            faults.append(f"newest full snapshot v{full} is not newer than staged v{held}")
            return
        self._receiver, self._dirty = WeightReceiver(), None
        progress: list[int] = []
        try:
            chain = [self._fetch(full)] + (self._walk(latest, stop_at=full) if latest > full else [])
            self._apply_chain(chain, progress)
        except SyncError as e:
            faults.append(f"from full v{full}: {_describe(e)}")
        got = self._receiver.version
        if got is None or (held is not None and got <= held):
            self._receiver, self._dirty = old  # the previous staging copy got as far
        else:
            applied[:] = progress

    def _request_full(self, faults: list[str]) -> None:
        try:
            self.transport.request_full()
        except SyncError as e:
            faults.append(f"could not request a full snapshot: {_describe(e)}")

    def _walk(self, latest: int, *, stop_at: int) -> list[_Fetched]:
        """Payloads after `stop_at` up to `latest`, oldest first (see the module doc)."""
        chain: list[_Fetched] = []
        version = latest
        while True:
            fetched = self._fetch(version)
            chain.append(fetched)
            upd = fetched.update
            if upd.kind != "delta" or upd.base_version == stop_at:
                return chain[::-1]
            assert upd.base_version is not None  # WeightUpdate validation guarantees it
            if upd.base_version < stop_at:
                raise BaseVersionMismatch(
                    f"v{upd.version} is a delta against v{upd.base_version}, older than the held v{stop_at}"
                )
            version = upd.base_version

    def _fetch(self, version: int) -> _Fetched:
        if version in self._cache:
            return self._cache[version]
        payload = self.transport.get(version)
        self._bytes += len(payload)
        upd = read_update(memoryview(payload))  # digest checked: damage is caught on arrival
        if upd.version != version:
            raise BaseVersionMismatch(
                f"asked for v{version}, got v{upd.version}: out-of-order, misfiled or replayed update"
            )
        if upd.base_version is not None and upd.base_version >= upd.version:
            raise CorruptUpdate(f"v{upd.version} claims base v{upd.base_version}: not older")
        self._cache[version] = fetched = _Fetched(upd, payload)
        return fetched

    def _apply_chain(self, chain: list[_Fetched], applied: list[int]) -> None:
        """Apply in order; a failure leaves the staging copy at the last good version."""
        for f in chain:
            if f.update.kind == "full" and self._receiver.version is not None:
                # A snapshot replaces everything; decode into a fresh receiver so a bad one
                # leaves the current copy as it was.
                fresh = WeightReceiver()
                fresh.apply(memoryview(f.payload))
                self._receiver, self._dirty = fresh, None
            else:
                self._receiver.apply(memoryview(f.payload))
                self._mark_dirty(f.update)
            applied.append(f.update.version)

    def _mark_dirty(self, upd: WeightUpdate) -> None:
        if upd.kind == "full":
            self._dirty = None
        elif self._dirty is not None:
            self._dirty |= {t.name for t in upd.tensors if t.encoding != "same"}

    def _to_push(self) -> dict[str, torch.Tensor]:
        """Engine-dtype copies of the tensors the engine lacks (copies: the staging copy is
        patched in place by the next delta, and an engine may keep references)."""
        tensors = self._receiver.tensors
        names = sorted(tensors) if self._dirty is None else sorted(self._dirty)
        return {n: _cast(n, tensors[n], self.target_dtype) for n in names}

    def _reset(self) -> None:
        self._receiver, self._dirty, self._pushed = WeightReceiver(), None, None


def _model_dtype(engine: object) -> torch.dtype | None:
    model = getattr(engine, "model", None)
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    first = next(iter(params()), None)
    return None if first is None else first.dtype


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not t.is_floating_point() or is_quantized(name, t):  # fp8 weights stay as sent
        return t.clone()
    return t.to(dtype, copy=True)


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"
