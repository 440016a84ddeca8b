"""Training: per-token logprobs, GRPO/DAPO advantages and loss, and the local trainer."""

from furlong.train.grpo import (
    GroupFilter,
    LossMetrics,
    filter_zero_variance_groups,
    group_advantages,
    group_key,
    merge_metrics,
    policy_loss,
)
from furlong.train.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
    token_logprobs,
)
from furlong.train.trainer import GRPOConfig, MicroBatch, LocalTrainer, TrainStats, collate

__all__ = [
    "GRPOConfig",
    "GroupFilter",
    "LossMetrics",
    "MicroBatch",
    "TrainStats",
    "Trainer",
    "collate",
    "entropy_from_logits",
    "filter_zero_variance_groups",
    "group_advantages",
    "group_key",
    "logprobs_from_logits",
    "merge_metrics",
    "policy_loss",
    "token_logprobs",
]
