"""What one trainer step reports (every trainer implementation returns it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainStats:
    loss: float
    reward_mean: float  # over scored episodes, before filtering: what the rollouts achieved
    pass_rate: float  # fraction with reward >= 1
    groups_used: int
    groups_filtered: int
    episodes_dropped: int  # infra errors (reward None), never trained on
    logprob_diff_mean: float
    logprob_diff_max: float
    rollout_train_kl: float
    ppo_kl: float
    clip_frac: float
    entropy: float
    grad_norm: float  # before clipping, mean over optimizer steps
    grad_norm_rl: float  # the same, of the policy loss alone (without the demonstration anchor)
    sft_nll: float  # mean NLL of the anchor's demonstrations (0: no anchor, sft_coef 0)
    response_len_mean: float
    tokens: int  # non-pad tokens of the trained episodes (per epoch)
    loss_tokens: int  # of which sampled (loss-masked)
    seconds: float
    tokens_per_s: float
    tis_weight_mean: float
    tis_capped_frac: float
    ref_kl: float
    updated: bool  # False when no group survived filtering: the weights and the version are unchanged
    version: int  # the trainer's weight version after this step
    # MoE routing (furlong.train.routing; 0 for a dense model): fractions of (token, MoE layer) pairs and of
    # tokens whose trainer top-k differed from the engine's recorded one (before replay), expert load from the
    # recorded routes (busiest expert / mean; count entropy / log(experts)), the mean load-balancing loss.
    moe_route_mismatch: float = 0.0
    moe_token_mismatch: float = 0.0
    moe_load_max_ratio: float = 0.0
    moe_load_entropy: float = 0.0
    moe_aux_loss: float = 0.0
