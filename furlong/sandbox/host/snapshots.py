"""The host API's snapshot routes (docs/sandbox-hosts.md): snapshot, fork, pause and resume a sandbox, and
the snapshot a create names.

A snapshot is restored only by a client that holds the token its snapshot call returned (X-Sandbox-Token
and the host token are not enough: a snapshot outlives its sandbox), and only over the image it was taken
over. A fork reserves its seats before any sandbox starts, so a host at capacity refuses it whole.
"""

# no `from __future__ import annotations`: FastAPI reads the routes' Annotated dependencies at definition time
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from furlong.sandbox.base import ChangeTracking, Sandbox, SnapshotRef, Snapshotting
from furlong.sandbox.host.registry import AtCapacity, Entry, Registry

MAX_FORK = 64  # sandboxes one fork call may start


class SnapshotBody(BaseModel):
    """A snapshot as POST /v1/sandboxes/{id}/snapshot answered it: its digest and its token."""

    model_config = ConfigDict(extra="forbid")
    digest: str = Field(max_length=100)
    token: str = Field(max_length=100)


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    n: int = Field(1, ge=1, le=MAX_FORK)


@dataclass
class HostSnapshots:
    """The snapshots this host's clients took, by token (expired ones are dropped as new ones come)."""

    refs: dict[str, SnapshotRef] = field(default_factory=dict)

    def add(self, ref: SnapshotRef) -> str:
        now = time.time()
        self.refs = {t: r for t, r in self.refs.items() if r.expires_at > now}
        token = secrets.token_urlsafe(32)
        self.refs[token] = ref
        return token

    def find(self, body: SnapshotBody, image_digest: str) -> SnapshotRef:
        """The snapshot `body` names, checked before anything starts: 403 without its token, 400 when it has
        expired or was taken over another image."""
        ref = next((r for t, r in self.refs.items() if hmac.compare_digest(t.encode(), body.token.encode())), None)
        if ref is None or ref.digest != body.digest:
            raise HTTPException(403, "snapshot: no snapshot on this host with that digest and token")
        if ref.expires_at < time.time():
            raise HTTPException(400, f"snapshot {ref.digest[:19]}: expired (the host's sandbox.snapshot_ttl_s)")
        if ref.image_digest != image_digest:
            raise HTTPException(400, f"snapshot {ref.digest[:19]}: taken over image {ref.image_digest}, not this one")
        return ref


def created(entry: Entry, reg: Registry) -> dict[str, Any]:
    """What a create (or a fork, per sandbox) answers: the sandbox's id, its token and who runs in it."""
    box = entry.box
    return {
        "id": entry.id,
        "token": entry.token,
        "boot": reg.boot,
        "verifier_uid": box.verifier_uid,
        "agent_uid": getattr(box, "agent_uid", 0),
        "change_tracking": isinstance(box, ChangeTracking),
    }


def _snapshotting(entry: Entry) -> Snapshotting:
    if not isinstance(entry.box, Snapshotting):
        raise HTTPException(409, "this host's sandboxes cannot be snapshotted, forked or paused")
    return entry.box


def snapshot_routes(
    app: FastAPI,
    reg: Registry,
    sandbox: Callable[..., Entry],
    guarded: Callable[[Entry, Awaitable], Awaitable],
    snaps: HostSnapshots,
) -> None:
    @app.post("/v1/sandboxes/{sid}/snapshot")
    async def snapshot(entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        ref = await guarded(entry, _snapshotting(entry).snapshot())
        return {
            "layers": list(ref.layers),
            "image_digest": ref.image_digest,
            "size_bytes": ref.size_bytes,
            "expires_at": ref.expires_at,
            "token": snaps.add(ref),
        }

    @app.post("/v1/sandboxes/{sid}/fork")
    async def fork(body: ForkBody, entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        box = _snapshotting(entry)
        taken = 0
        try:
            for _ in range(body.n):
                reg.reserve()
                taken += 1
        except AtCapacity as e:
            reg.reserved -= taken
            raise HTTPException(429, f"fork of {body.n}: {e}", headers={"Retry-After": "1"}) from e
        t = time.perf_counter()
        try:
            boxes: list[Sandbox] = await guarded(entry, box.fork(body.n))
        except BaseException:
            reg.reserved -= taken
            raise
        each = (time.perf_counter() - t) / body.n
        return {"sandboxes": [created(reg.add(b, each), reg) for b in boxes]}

    @app.post("/v1/sandboxes/{sid}/pause")
    async def pause(entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        await guarded(entry, _snapshotting(entry).pause())
        return {"ok": True}

    @app.post("/v1/sandboxes/{sid}/resume")
    async def resume(entry: Annotated[Entry, Depends(sandbox)]) -> dict:
        await guarded(entry, _snapshotting(entry).resume())
        return {"ok": True}
