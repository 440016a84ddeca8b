"""The RL trainer in a Ray actor, behind the Trainer protocol (furlong.train.protocol): the driver, the
weight link and the checkpoints call it exactly as they call a LocalTrainer. Paths (checkpoints, exports)
are the run directory's, which the trainer's node must see (one host, or a shared filesystem)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import ray
import torch

from furlong.agent.episode import Episode
from furlong.cluster.session import RaySession
from furlong.train.protocol import Trainer
from furlong.train.stats import TrainStats


class TrainerHost:
    """The actor: a trainer built in its process by `make` (picklable: a builder and its arguments)."""

    def __init__(self, make: Callable[[], Trainer], threads: int) -> None:
        torch.set_num_threads(threads)
        self._trainer = make()

    def call(self, method: str, *args):
        return getattr(self._trainer, method)(*args), self._trainer.version

    def engine_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        # copies: the live tensors move on with the next step, and the reply is pickled after this returns
        return ({k: v.detach().to("cpu", copy=True) for k, v in self._trainer.engine_weights().items()},
                self._trainer.version)

    def device(self) -> str:
        return str(self._trainer.device)


class RayTrainer:
    """A Trainer whose state lives in a Ray actor in the session's trainer bundle."""

    def __init__(self, session: RaySession, make: Callable[[], Trainer], *, threads: int = 1) -> None:
        self._actor = ray.remote(TrainerHost).options(num_cpus=session.roles.trainer_cpus,
                                                      num_gpus=session.roles.trainer_gpus, max_restarts=0,
                                                      scheduling_strategy=session.slot("trainer")).remote(make, threads)
        self._device = torch.device(ray.get(self._actor.device.remote(), timeout=session.timeout_s))
        self.version = 0

    def _call(self, method: str, *args):
        result, self.version = ray.get(self._actor.call.remote(method, *args))
        return result

    @property
    def device(self) -> torch.device:
        return self._device

    def train_step(self, episodes: Sequence[Episode]) -> TrainStats:
        return self._call("train_step", list(episodes))

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        weights, self.version = ray.get(self._actor.engine_weights.remote())
        return weights

    def save(self, path: Path) -> None:
        self._call("save", path)

    def load(self, path: Path) -> None:
        self._call("load", path)

    def export_hf(self, out: Path, tokenizer, base_model: Path | None = None) -> Path:
        return self._call("export_hf", out, tokenizer, base_model)

    def close(self) -> None:
        ray.kill(self._actor, no_restart=True)
