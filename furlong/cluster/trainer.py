"""The RL trainer in a Ray actor, behind the Trainer protocol (furlong.train.protocol): the driver, the
weight link and the checkpoints call it exactly as they call a LocalTrainer. Paths (checkpoints, exports)
are the run directory's, which the trainer's node must see (one host, or a shared filesystem)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import ray
import torch

from furlong.agent.episode import Episode
from furlong.cluster.session import RaySession
from furlong.sync.handover import Arena, SharedWeights
from furlong.train.distill import TeacherPass
from furlong.train.protocol import Trainer
from furlong.train.stats import TrainStats


class TrainerHost:
    """The actor: a trainer built in its process by `make` (picklable: a builder and its arguments)."""

    def __init__(self, make: Callable[[], Trainer], threads: int, arena: Arena | None = None) -> None:
        """`arena` (empty): engine_weights are handed over from it, in this process's shared memory."""
        torch.set_num_threads(threads)
        self._trainer = make()
        self._arena = arena

    def call(self, method: str, *args):
        return getattr(self._trainer, method)(*args), self._trainer.version

    def engine_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        # copies: the live tensors move on with the next step, and the reply is pickled after this returns
        return (
            {k: v.detach().to("cpu", copy=True) for k, v in self._trainer.engine_weights().items()},
            self._trainer.version,
        )

    def share_weights(self) -> tuple[tuple[str, ...], int, int]:
        """The current engine weights copied into the arena: their names, bytes and version."""
        assert self._arena is not None, "the trainer actor was started without an arena"
        self._arena.fill(self._trainer.engine_weights())
        return self._arena.names, self._arena.nbytes, self._trainer.version

    def handles(self, copies: int) -> list[str]:
        assert self._arena is not None, "the trainer actor was started without an arena"
        return self._arena.handles(copies)

    def device(self) -> str:
        return str(self._trainer.device)

    def close_arena(self) -> None:
        if self._arena is not None:
            self._arena.close()


class RayTrainer:
    """A Trainer whose state lives in a Ray actor in the session's trainer bundle. With `arena` its
    engine_weights are SharedWeights: the actor's copy in shared memory, which engines on its node open in
    place (furlong.sync.handover); without, a copy sent to the driver."""

    def __init__(
        self, session: RaySession, make: Callable[[], Trainer], *, threads: int = 1, arena: Arena | None = None
    ) -> None:
        # Any: ray's types give an actor handle's methods no .remote()
        self._actor = cast(
            Any,
            ray.remote(TrainerHost)
            .options(
                num_cpus=session.roles.trainer_cpus,
                num_gpus=session.roles.trainer_gpus,
                max_restarts=0,
                scheduling_strategy=session.slot("trainer"),
            )
            .remote(make, threads, arena),
        )
        self._device = torch.device(ray.get(self._actor.device.remote(), timeout=session.timeout_s))
        self._shared = arena is not None
        self.version = 0

    def _call(self, method: str, *args):
        result, self.version = ray.get(self._actor.call.remote(method, *args))
        return result

    @property
    def device(self) -> torch.device:
        return self._device

    def train_step(self, episodes: Sequence[Episode]) -> TrainStats:
        return self._call("train_step", list(episodes))

    def score_teacher(self, episodes: Sequence[Episode]) -> TeacherPass:
        return self._call("score_teacher", list(episodes))  # the teacher is the actor's, beside the policy

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        if self._shared:
            names, nbytes, self.version = ray.get(self._actor.share_weights.remote())
            return SharedWeights(lambda copies: ray.get(self._actor.handles.remote(copies)), names, nbytes)
        weights, self.version = ray.get(self._actor.engine_weights.remote())
        return weights

    def save(self, path: Path) -> None:
        self._call("save", path)

    def load(self, path: Path) -> None:
        self._call("load", path)

    def export_hf(self, out: Path, tokenizer, base_model: Path | None = None) -> Path:
        return self._call("export_hf", out, tokenizer, base_model)

    def close(self) -> None:
        """Kill the actor; its arena's file first (a killed actor's is deleted by the next arena on its
        host, or by the run's watchdog)."""
        if self._shared:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(self._actor.close_arena.remote(), timeout=30)
        ray.kill(self._actor, no_restart=True)
