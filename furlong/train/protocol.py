"""The Trainer seam: what the driver, the weight link and the checkpoints need from a trainer.

`LocalTrainer` (furlong.train.trainer: one process) is the first implementation; a distributed one (ranks
behind a rank-0 facade) implements the same methods. The driver never reaches into a trainer's model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from furlong.agent.episode import Episode
from furlong.train.distill import TeacherPass
from furlong.train.stats import TrainStats


@runtime_checkable
class Trainer(Protocol):
    version: int  # weight updates taken so far: the engine's weight_version after a push

    @property
    def device(self) -> torch.device: ...

    def train_step(self, episodes: Sequence[Episode]) -> TrainStats: ...

    def score_teacher(self, episodes: Sequence[Episode]) -> TeacherPass:
        """train.distill: the teacher's per-token logprobs on the episodes (the teacher lives with the policy)."""
        ...

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        """What a push sends the rollout engine: every tensor, or only the adapters of a LoRA policy (the
        engine's frozen base is already the same). Live tensors: the link copies them before the next step."""
        ...

    def save(self, path: Path) -> None: ...  # the whole training state, atomically

    def load(self, path: Path) -> None: ...

    def export_hf(self, out: Path, tokenizer, base_model: Path | None = None) -> Path:
        """The policy as a Hugging Face directory (LoRA: merged, plus adapter/ over `base_model`)."""
        ...

    def close(self) -> None: ...  # processes it started (a distributed trainer's ranks) stop
