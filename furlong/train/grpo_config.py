"""The GRPO trainer's settings (GRPOConfig: train.rl's keys of the same names, plus the run's seed and the
learning-rate decay's length) and the learning-rate schedule they give (lr_at: linear warm-up, then constant
or a cosine decay). furlong.train.trainer's LocalTrainer, and the sharded trainers built on it, read both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from furlong.config import RLConfig


@dataclass(frozen=True)
class GRPOConfig:
    """The trainer's settings: train.rl's keys of the same names (furlong.config.RLConfig holds their defaults
    and meanings), plus the run's seed and the cosine decay's length, which `of` derives."""

    lr: float
    adam_betas: tuple[float, float]
    weight_decay: float
    adam_eps: float
    grad_clip: float  # <= 0: no clipping (the norm is still reported)
    clip_low: float
    clip_high: float
    tis_cap: float
    off_policy: str  # tis | masked_is | decoupled_ppo (grpo.OffPolicy)
    mask_level: str  # masked_is: token | sequence
    is_low: float
    is_high: float
    kl_coef: float  # > 0 needs a reference model
    normalize_std: bool
    adv_eps: float
    negative_weight: float  # < 1 scales down negative advantages (see grpo.weigh_negatives)
    filter_zero_variance: bool
    micro_batch_size: int  # episodes per forward/backward
    temperature: float  # must be the rollout temperature, or every importance ratio is off
    epochs: int  # passes over the step's episodes
    minibatches: int  # optimizer steps per epoch
    bf16_autocast: bool
    warmup_steps: int  # Adam's first steps are the largest: lr ramps up linearly over these
    min_lr_ratio: float
    sft_coef: float  # > 0: plus this times the NLL of sft_batch demonstrations per optimizer step (PPO-ptx)
    sft_batch: int
    seed: int  # minibatch shuffling, the anchor's draws
    decay_steps: int  # > 0: after warm-up, lr follows a cosine to min_lr_ratio * lr over this many steps
    distill_mode: str = "off"  # train.distill.mode: opd | grpo+opd need a teacher (furlong.train.distill)
    distill_weight: float = 1.0  # grpo+opd: the distillation term's weight
    routing_replay: str = "auto"  # train.moe.routing_replay: auto | on | off (furlong.train.routing)
    moe_aux_coef: float = 0.0  # train.moe.aux_loss_coef: the router load-balancing loss's weight

    @classmethod
    def of(cls, rl: RLConfig, seed: int) -> GRPOConfig:
        """From the config's `train.rl` node: every field of that name, copied; the decay spans the
        optimizer steps after warm-up (rl.lr_decay cosine) or is off (constant)."""
        opt_steps = rl.steps * rl.minibatches * rl.epochs
        derived: dict[str, Any] = {
            "seed": seed,
            "decay_steps": max(opt_steps - rl.warmup_steps, 1) if rl.lr_decay == "cosine" else 0,
        }
        copied = {f.name: getattr(rl, f.name) for f in fields(cls) if f.name not in derived and hasattr(rl, f.name)}
        return cls(**copied, **derived)


def lr_at(cfg: GRPOConfig, step: int) -> float:
    """Linear warm-up over warmup_steps, then constant or a cosine down to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay_steps <= 0:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(cfg.decay_steps - 1, 1))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
