"""`train.sync.transport=shared`: each push hands the engines on the trainer's host a handle to the weights in
shared memory, and each engine copies them into its model from there (furlong.sync.handover).

The weights are a Ray trainer actor's `SharedWeights` (its own arena: the driver never holds a copy), or
any tensors, which the link copies into an arena of its own first (local mode's trainer, the FSDP2 facade).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from furlong.engine.router import Router
from furlong.sync.handover import Arena, SharedWeights
from furlong.train.weights import answers, member_name

log = logging.getLogger(__name__)


class HandoverMember(Protocol):
    """An engine client with SGLang's /update_weights_from_tensor (RemoteEngine)."""

    async def update_weights_from_tensor(self, body: dict) -> dict: ...

    async def health(self) -> Any: ...


class HandoverLink:
    """Every push hands each engine its own handle to the version's weights (torch counts CUDA handles per
    receiver) and waits until every engine has loaded them.

    Losing an engine does not end the run. One that fails to load (it died, refused, or could not open the
    memory) is taken out of the router, whose requests then go to the others. At each later push, a lost
    engine that answers /health again (restarted at its address) is handed that push's weights and only
    then put back, so it never serves an older version. With no engine left the push raises."""

    def __init__(
        self, engine, members: Sequence[HandoverMember], *, arena: Arena, cleanup: Callable[[], Awaitable[None]]
    ) -> None:
        self.engine, self._members, self._arena, self._cleanup = engine, list(members), arena, cleanup
        self._version: int | None = None
        self._reasons: dict[int, str] = {}  # why each lost member (by index in `members`) is out

    async def push(self, weights: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        if version == self._version:  # a step that changed nothing (every group filtered)
            return {**self._routed(), "sync_seconds": 0.0}
        start = time.perf_counter()
        wanted = [m for i, m in enumerate(self._members) if await self._wanted(i, m)]
        if not wanted:
            raise RuntimeError(f"every engine is lost: {self._lost()}")
        handles, nbytes = await asyncio.to_thread(self._share, weights, len(wanted))
        shared = time.perf_counter()
        replies = await asyncio.gather(
            *(
                m.update_weights_from_tensor(
                    {
                        "serialized_named_tensors": [h],
                        "weight_version": str(version),
                        "flush_cache": True,
                        "abort_all_requests": False,
                    }
                )
                for m, h in zip(wanted, handles)
            ),
            return_exceptions=True,
        )
        loaded = [await self._settle(m, r) for m, r in zip(wanted, replies)]
        loads = [float(r["load_s"]) for r in loaded if r is not None]
        if not loads:
            raise RuntimeError(f"every engine is lost: {self._lost()}")
        self._version = version
        return {
            **self._routed(),
            "sync_seconds": time.perf_counter() - start,
            "sync_full": 1.0,
            "sync_payload_bytes": float(len(handles[0])),
            "sync_shared_bytes": float(nbytes),
            "sync_share_s": shared - start,
            "sync_pause_s": max(loads),
            "sync_engines_live": float(len(loads)),
        }

    async def _wanted(self, index: int, member: HandoverMember) -> bool:
        """Whether this push goes to `member`: one in service, or a lost one (or one the router's health
        checks took out) that answers now."""
        held_out = isinstance(self.engine, Router) and not self.engine.is_live(member)
        return (index not in self._reasons and not held_out) or await answers(member)

    def _share(self, weights: Mapping[str, torch.Tensor], copies: int) -> tuple[list[str], int]:
        if isinstance(weights, SharedWeights):
            return weights.handles(copies), weights.nbytes
        self._arena.fill(weights)
        return self._arena.handles(copies), self._arena.nbytes

    async def _settle(self, member: HandoverMember, reply: Any) -> dict | None:
        """The member's reply once it loaded (put back into the router if it was out), else None (out)."""
        index = self._members.index(member)
        if isinstance(reply, BaseException):
            if not isinstance(reply, Exception):
                raise reply  # cancelled, interrupted: not the engine's doing
            reason = " ".join(str(reply).split())[:300] or type(reply).__name__
            self._reasons[index] = reason
            log.warning("weight handover: %s is out: %s", member_name(member), reason)
            if isinstance(self.engine, Router):
                self.engine.take_out(member, f"weight handover: {reason}")
            return None
        self._reasons.pop(index, None)
        if isinstance(self.engine, Router):
            await self.engine.readmit(member)
        return reply

    def _routed(self) -> dict[str, float]:
        return self.engine.metrics() if isinstance(self.engine, Router) else {}

    def _lost(self) -> str:
        return "; ".join(f"{member_name(self._members[i])}: {r}" for i, r in sorted(self._reasons.items()))

    async def close(self) -> None:
        try:
            await self._cleanup()
        finally:
            self._arena.close()
