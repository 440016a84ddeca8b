"""The engine server's end of a weight broadcast (furlong.sync.broadcast), in SGLang's routes and shapes:

* POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend,
  auth_nonce} joins the trainer's group as rank `rank_offset` (returns once every member has joined and,
  with auth_nonce, proved the run's secret: furlong.sync.group_auth). An engine started with a token
  (FURLONG_ENGINE_TOKEN, the routes' bearer token) proves that token and joins only groups that carry
  auth_nonce: a body without one gets 400; an engine without a token refuses a body with one (it could not
  prove anything).
* POST /update_weights_from_distributed {names, dtypes, shapes, group_name, weight_version, load_format, ...}
  receives the announced tensors while the engine keeps generating, then loads them at `weight_version`
  (the engine pauses only for the copy). A request without weight_version stages its tensors for the next
  one that has it, so a model sent in several buckets switches version at once.
* POST /destroy_weights_update_group {group_name}

Replies are SGLang's {"success", "message"}; a bad body (unknown group or tensor, wrong shape or dtype, a
version that is not an integer) gets 400 before anything is received, and changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from furlong.engine.base import EngineError
from furlong.engine.hf import HFEngine
from furlong.sync.broadcast import GROUP_NAME, GroupSpec, Manifest, WeightGroup

GROUP_TIMEOUT_S = 300.0  # joining, and each receive: how long a member waits for the others


class InitGroupBody(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP_NAME
    backend: str = "gloo"
    auth_nonce: str | None = None  # furlong's extra field; SGLang's body has none


class UpdateBody(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = GROUP_NAME
    flush_cache: bool = True  # the hf engine always empties its prefix cache on an update
    abort_all_requests: bool = False  # running requests continue on recomputed KV instead
    weight_version: str | None = None
    load_format: str | None = None


class DestroyGroupBody(BaseModel):
    group_name: str = GROUP_NAME


class Refused(Exception):
    """A request that changes nothing: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DistributedReceiver:
    """The groups this engine belongs to, and tensors staged for the next versioned update."""

    def __init__(self, engine: HFEngine, timeout_s: float = GROUP_TIMEOUT_S, secret: str | None = None) -> None:
        """`secret`: the routes' bearer token, which every group this engine joins must then prove."""
        self.engine, self.timeout_s, self._secret = engine, timeout_s, secret
        self.groups: dict[str, WeightGroup] = {}
        self._staged: dict[str, dict] = {}  # per group: a receive that fails clears only its own group's
        # One update at a time per group: broadcasts arrive in announcement order. Per group, because a
        # receive stuck in a group the trainer abandoned (a peer died mid-broadcast) holds its lock until
        # the timeout, while the trainer's next group must be served at once.
        self._locks: dict[str, asyncio.Lock] = {}

    async def init_group(self, body: InitGroupBody) -> dict:
        try:
            spec = GroupSpec(**body.model_dump())
        except ValueError as e:
            raise Refused(400, str(e)) from None
        if spec.rank_offset == 0:
            raise Refused(400, "rank_offset must be >= 1: rank 0 is the trainer that broadcasts")
        if spec.group_name in self.groups:
            raise Refused(400, f"group {spec.group_name!r} exists; destroy it first")
        if self._secret is not None and spec.auth_nonce is None:
            raise Refused(
                400,
                "auth_nonce: this engine has a token, so it joins only an authenticated group "
                "(anyone who reaches the store could otherwise take a rank)",
            )
        if self._secret is None and spec.auth_nonce is not None:
            raise Refused(
                400,
                "auth_nonce: this engine was started without a token (FURLONG_ENGINE_TOKEN), so it "
                "cannot prove the run's secret",
            )
        try:
            self.groups[spec.group_name] = await asyncio.to_thread(
                WeightGroup, spec, spec.rank_offset, self.timeout_s, None, self._secret
            )
        except RuntimeError as e:  # the rendezvous failed or timed out, or a member did not prove the secret
            raise Refused(500, f"could not join group {spec.group_name!r}: {e}") from None
        return {
            "success": True,
            "message": f"joined {spec.group_name!r} as rank {spec.rank_offset} of {spec.world_size}",
        }

    def _check(self, body: UpdateBody) -> tuple[WeightGroup, Manifest, int | None]:
        group = self.groups.get(body.group_name)
        if group is None:
            raise Refused(400, f"group_name: no group {body.group_name!r} (POST /init_weights_update_group first)")
        try:
            manifest = Manifest(
                names=tuple(body.names),
                dtypes=tuple(body.dtypes),
                shapes=tuple(tuple(s) for s in body.shapes),
                group_name=body.group_name,
                weight_version=body.weight_version,
                load_format=body.load_format,
            )
            version = None if body.weight_version is None else int(body.weight_version)
        except ValueError as e:
            raise Refused(400, str(e)) from None
        if version is not None and version < 0:
            raise Refused(400, f"weight_version must be a non-negative integer, got {body.weight_version!r}")
        try:
            self.engine.check_weights(dict(zip(manifest.names, manifest.shapes)))
        except EngineError as e:
            raise Refused(400, str(e)) from None
        return group, manifest, version

    async def update(self, body: UpdateBody) -> dict:
        group, manifest, version = self._check(body)
        name = body.group_name
        async with self._locks.setdefault(name, asyncio.Lock()):
            start = time.perf_counter()
            try:
                tensors = await asyncio.to_thread(group.receive, manifest)
            except RuntimeError as e:  # a member died or timed out: the group's broadcasts are out of step
                if self.groups.get(name) is group:
                    del self.groups[name]
                self._staged.pop(name, None)
                raise Refused(500, f"receive failed, group {name!r} dropped: {e}") from None
            received = time.perf_counter()
            self._staged.setdefault(name, {}).update(tensors)
            if version is None:
                return {"success": True, "message": f"staged {len(tensors)} tensors", "receive_s": received - start}
            staged = self._staged.pop(name)
            await self.engine.update_weights(staged, version)
        return {
            "success": True,
            "message": f"loaded {len(staged)} tensors at version {version}",
            "weight_version": str(version),
            "receive_s": received - start,
            "load_s": time.perf_counter() - received,
        }

    async def destroy(self, body: DestroyGroupBody) -> dict:
        group = self.groups.pop(body.group_name, None)
        if group is None:
            raise Refused(400, f"group_name: no group {body.group_name!r}")
        self._staged.pop(body.group_name, None)
        self._locks.pop(body.group_name, None)
        group.close()
        return {"success": True, "message": f"left {body.group_name!r}"}


async def answer(call: Awaitable[dict]) -> dict | JSONResponse:
    """The call's reply, or a refusal in SGLang's shape ({"success": false, "message"}) with its status."""
    try:
        return await call
    except Refused as e:
        return JSONResponse({"success": False, "message": str(e)}, status_code=e.status)


def add_distributed_routes(app: FastAPI, receiver: DistributedReceiver) -> None:
    @app.post("/init_weights_update_group", response_model=None)
    async def init_group(body: InitGroupBody) -> dict | JSONResponse:
        return await answer(receiver.init_group(body))

    @app.post("/update_weights_from_distributed", response_model=None)
    async def update(body: UpdateBody) -> dict | JSONResponse:
        return await answer(receiver.update(body))

    @app.post("/destroy_weights_update_group", response_model=None)
    async def destroy(body: DestroyGroupBody) -> dict | JSONResponse:
        return await answer(receiver.destroy(body))
