"""The engine server's end of a handover (furlong.sync.handover), in SGLang's route and shape:

* POST /update_weights_from_tensor {serialized_named_tensors, weight_version, load_format, flush_cache,
  abort_all_requests} opens the one entry of `serialized_named_tensors` (a tensor-parallel size of 1) as
  views of the trainer's shared memory on this host and loads them into the engine at `weight_version`
  (the hf engine pauses only for the copy, as for any update).

Replies are SGLang's {"success", "message"}, plus the version loaded and `load_s`. A body that is not a
list of torch tensor handles (furlong.sync.handover's allow-list), names a tensor the model lacks or has
another shape, lacks weight_version or has one that is not a non-negative integer gets 400 and changes
nothing.
"""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from furlong.engine.base import EngineError
from furlong.engine.distributed import Refused, answer
from furlong.sync.handover import HandoverRefused, load_named_tensors


class TensorBody(BaseModel):
    serialized_named_tensors: list[str]
    weight_version: str | None = None
    load_format: str | None = None
    flush_cache: bool = True  # the hf engine always empties its prefix cache on an update
    abort_all_requests: bool = False  # running requests continue on recomputed KV instead


def _opened(body: TensorBody, engine) -> tuple[dict, int]:
    """The tensors (views of the sender's memory) and the version, once everything is checked."""
    if len(body.serialized_named_tensors) != 1:
        raise Refused(
            400,
            f"serialized_named_tensors: expected one entry (this engine has no tensor parallelism), "
            f"got {len(body.serialized_named_tensors)}",
        )
    if body.load_format is not None:
        raise Refused(400, f"load_format: only null (a list of named tensors) is served, got {body.load_format!r}")
    try:
        version = int(body.weight_version) if body.weight_version is not None else -1
    except ValueError:
        version = -1
    if version < 0:
        raise Refused(400, f"weight_version: expected a non-negative integer, got {body.weight_version!r}")
    try:
        named = dict(load_named_tensors(body.serialized_named_tensors[0]))
        check = getattr(engine, "check_weights", None)  # the hf engine's: names and shapes, before any copy
        if check is not None:
            check({k: tuple(v.shape) for k, v in named.items()})
    except (HandoverRefused, EngineError) as e:
        raise Refused(400, str(e)) from None
    return named, version


async def _load(body: TensorBody, engine) -> dict:
    named, version = _opened(body, engine)
    start = time.perf_counter()
    await engine.update_weights(named, version)
    count = len(named)
    del named  # the views: the trainer's memory is released here as soon as it is copied
    return {
        "success": True,
        "message": f"loaded {count} tensors at version {version}",
        "weight_version": str(version),
        "load_s": time.perf_counter() - start,
    }


def add_tensor_route(app: FastAPI, engine) -> None:
    @app.post("/update_weights_from_tensor", response_model=None)
    async def update_weights_from_tensor(body: TensorBody) -> dict | JSONResponse:
        return await answer(_load(body, engine))
