"""Training: per-token logprobs, GRPO/DAPO advantages and loss, and the local trainer."""

from furlong.train.batch import MicroBatch, collate
from furlong.train.grpo import (
    LossMetrics,
    group_advantages,
    merge_metrics,
    policy_loss,
)
from furlong.train.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
    token_logprobs,
)
from furlong.train.trainer import GRPOConfig, LocalTrainer, TrainStats

__all__ = [
    "GRPOConfig",
    "LocalTrainer",
    "LossMetrics",
    "MicroBatch",
    "TrainStats",
    "collate",
    "entropy_from_logits",
    "group_advantages",
    "logprobs_from_logits",
    "merge_metrics",
    "policy_loss",
    "token_logprobs",
]
