"""Rank workers for tests/test_ranks.py: importable by module name, so spawned rank processes rebuild them."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SumSpec:
    """Each rank holds `rank + offset`; `fail_rank` raises while building its worker."""

    offset: float = 0.0
    fail_rank: int = -1
    backend: str = "gloo"

    def make(self, rank: int, world_size: int) -> SumWorker:
        if rank == self.fail_rank:
            raise ValueError(f"rank {rank} refuses to start\nsecond line")
        return SumWorker(rank + self.offset)


class SumWorker:
    def __init__(self, value: float) -> None:
        self.value = value

    def all_sum(self, scale: float) -> tuple[int, float]:
        t = torch.tensor([self.value * scale])
        dist.all_reduce(t)
        return dist.get_rank(), float(t)

    def pid(self) -> int:
        return os.getpid()

    def explode(self, rank: int) -> None:
        if dist.get_rank() == rank:
            raise KeyError("boom")

    def unpicklable(self) -> object:
        return lambda: None
