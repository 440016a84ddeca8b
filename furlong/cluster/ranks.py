"""RayRanks: the RankGroup of furlong.train.ranks with each rank's worker in a Ray actor, a bundle per rank
(the run's trainer bundles, or a placement group of its own). Rank 0's actor picks the group's address on its node; every actor then joins the
torch.distributed group and builds its worker from the spec, as a LocalRanks process does."""

from __future__ import annotations

import traceback
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from furlong.cluster.session import bundle
from furlong.train.ranks import RankFailed, WorkerSpec, free_port, join_group


class RankHost:
    """One rank: joins the group when told where, then runs the worker's methods."""

    def __init__(self, spec: WorkerSpec, rank: int, world_size: int) -> None:
        self._spec, self._rank, self._world_size, self._worker = spec, rank, world_size, None

    def endpoint(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def join(self, addr: str, port: int, timeout_s: float) -> None:
        join_group(self._spec.backend, self._rank, self._world_size, addr, port, timeout_s)
        self._worker = self._spec.make(self._rank, self._world_size)

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self._worker, method)(*args)

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _reason(exc: BaseException) -> tuple[str, str]:
    """RankFailed's reason and detail for what ray.get raised."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause if isinstance(exc.cause, BaseException) else exc
        text = str(cause).strip().splitlines()
        return f"raised {type(cause).__name__}: {text[0] if text else ''}".rstrip(": "), str(exc)
    if isinstance(exc, RayActorError):
        return "died: its actor process exited", str(exc)
    return f"failed: {exc!r}", "".join(traceback.format_exception(exc))


class RayRanks:
    """`world_size` rank actors (`cpus` logical CPUs each) in a placement group of `strategy` (PACK: one
    node where it fits). `call_timeout_s` as LocalRanks: a call that takes longer fails the group."""

    def __init__(
        self,
        spec: WorkerSpec,
        world_size: int,
        *,
        cpus: float = 1.0,
        gpus: float = 0.0,
        strategy: str = "PACK",
        timeout_s: float = 300.0,
        call_timeout_s: float | None = None,
        slots: list[PlacementGroupSchedulingStrategy] | None = None,
    ) -> None:
        """`slots`: a bundle per rank in placement groups the caller owns (a run's RaySession); else the
        ranks get a group of their own, removed with them."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if slots is not None and len(slots) != world_size:
            raise ValueError(f"{len(slots)} slots for {world_size} ranks")
        self.world_size, self._call_timeout_s = world_size, call_timeout_s
        self._group = None if slots else placement_group([bundle(cpus, gpus)] * world_size, strategy=strategy)
        self._actors: list = []
        try:
            if self._group is not None:
                if not self._group.wait(timeout_s):
                    raise TimeoutError(
                        f"rank placement group ({world_size} x {cpus} CPU, {strategy}) not ready "
                        f"within {timeout_s:g} s: the cluster has {ray.cluster_resources()}"
                    )
                slots = [
                    PlacementGroupSchedulingStrategy(placement_group=self._group, placement_group_bundle_index=r)
                    for r in range(world_size)
                ]
            host = ray.remote(RankHost)
            assert slots is not None
            self._actors = [
                host.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=slots[rank]).remote(
                    spec, rank, world_size
                )
                for rank in range(world_size)
            ]
            addr, port = ray.get(self._actors[0].endpoint.remote(), timeout=timeout_s)
            self._gather([a.join.remote(addr, port, timeout_s) for a in self._actors], timeout_s)
        except BaseException:
            self._kill()
            raise

    def call(self, method: str, *args: Any) -> list:
        if not self._actors:
            raise RuntimeError("the rank group is closed")
        return self._gather([a.call.remote(method, args) for a in self._actors], self._call_timeout_s)

    def _gather(self, refs: list, timeout_s: float | None) -> list:
        """Every rank's result, or RankFailed for the first that died or raised (its peers, stuck in a
        collective, are killed with the group)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, results = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
            if not ready:
                self._fail(min(rank_of[r] for r in pending), f"did not answer within {timeout_s:g} s")
            try:
                results[rank_of[ready[0]]] = ray.get(ready[0])
            except (RayTaskError, RayActorError, GetTimeoutError) as exc:
                self._fail(rank_of[ready[0]], *_reason(exc))
        return [results[r] for r in range(len(refs))]

    def _fail(self, rank: int, reason: str, detail: str = "") -> None:
        self._kill()
        raise RankFailed(rank, reason, detail)

    def _kill(self) -> None:
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None

    def close(self) -> None:
        """Each rank leaves the group (30 s at most), then the actors and their placement group go."""
        if self._actors:
            try:
                ray.get([a.leave.remote() for a in self._actors], timeout=30)
            except Exception:  # noqa: BLE001, S110  # killed below either way
                pass
        self._kill()

    def __enter__(self) -> RayRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
