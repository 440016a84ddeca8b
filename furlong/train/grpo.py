"""GRPO / DAPO pieces as pure functions: group advantages and the policy loss (the dynamic-sampling filter
is furlong.rollout.group_filter).

The loss is DAPO's: a token-level PPO clipped objective with clip-higher (asymmetric clip range), each token
weighted by an off-policy correction (OffPolicy: truncated IS by default, masked IS, or AReaL's decoupled PPO)
for the mismatch between the policy that sampled the tokens and the trainer's, plus an optional k3 KL penalty
to a reference policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_ids: Sequence[Hashable],
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-episode advantage: reward minus its group's mean, divided by (group std + eps) if `normalize_std`.

    The std is the unbiased sample std (what torch.std, TRL and verl use); a group of one has advantage 0.
    Without std normalisation this is Dr. GRPO's advantage, which does not up-weight near-unanimous groups.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(group_ids) != r.numel():
        raise ValueError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    dense: dict[Hashable, int] = {}
    index = torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)
    counts = torch.bincount(index, minlength=len(dense)).to(torch.float64)
    mean = torch.zeros(len(dense), dtype=torch.float64).index_add_(0, index, r) / counts.clamp(min=1)
    centred = r - mean[index]
    if normalize_std:
        var = torch.zeros(len(dense), dtype=torch.float64).index_add_(0, index, centred**2)
        std = (var / (counts - 1).clamp(min=1)).sqrt()
        # A zero-variance group (or a singleton) is all zeros; eps = 0 must not turn that into 0 / 0.
        spread = std[index]
        centred = torch.where(spread > 0, centred / (spread + eps), 0.0)
    return centred.to(torch.float32)


def weigh_negatives(advantages: torch.Tensor, weight: float) -> torch.Tensor:
    """Scale negative advantages by `weight` (1: plain GRPO).

    Below 1 the update leans toward reinforcing successful episodes, which sharpens the policy (lower
    entropy, higher pass@1) at the price of exploration (pass@k): the positive/negative weighting of Zhu et
    al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning". In a failed episode
    every token is pushed down, the many correct ones with it, and that mass spreads to the tail; a small
    model with a long tail of junk tokens at temperature 1 is where this matters."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"negative_weight must be in [0, 1], got {weight}")
    return torch.where(advantages < 0, advantages * weight, advantages)


@dataclass(frozen=True)
class LossMetrics:
    """Means over the masked tokens of one policy_loss call (`tokens` of them); merge with `merge_metrics`."""

    loss: float  # the returned loss value (already divided by the shared denominator)
    tokens: int
    clip_frac: float  # tokens whose clipped term won, i.e. that get no policy gradient
    ppo_kl: float  # mean(logp_old - logp_new): how far this update has moved from the pre-step policy
    tis_weight_mean: float  # the off-policy weight, whichever correction
    tis_capped_frac: float  # tokens capped (tis) or zeroed (masked_is, decoupled_ppo)
    logprob_diff_mean: float  # mean |logp_old - logp_rollout|: trainer vs engine numerics
    logprob_diff_max: float
    rollout_train_kl: float  # mean(logp_rollout - logp_old), a k1 estimate of KL(rollout || train)
    ref_kl: float  # mean k3 KL to the reference policy (0 without one)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, count: float) -> float:
    return float((x * mask).sum() / max(count, 1.0))


OFF_POLICY = ("tis", "masked_is", "decoupled_ppo")


@dataclass(frozen=True)
class OffPolicy:
    """How tokens sampled by another policy (the engine's numerics, or older weights in async mode) are
    weighted. The ratio is train/rollout = exp(logp_old - logp_rollout), logp_old being the trainer's
    policy at the start of the step (the proximal policy):

    * tis: truncated IS, weight min(ratio, cap) (Yao et al. 2025).
    * masked_is: weight ratio inside [low, high], 0 outside; `level` sequence judges each episode by the
      geometric mean of its tokens' ratios (length-normalised, so long episodes are not all dropped).
    * decoupled_ppo: AReaL's decoupled objective; the clip is centred on the proximal policy and the
      behaviour ratio is an importance weight, zeroed (not capped) where it exceeds cap.
    """

    kind: str = "tis"
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0
    level: str = "token"

    def __post_init__(self) -> None:
        if self.kind not in OFF_POLICY or self.level not in ("token", "sequence"):
            raise ValueError(
                f"off-policy correction {self.kind!r} at level {self.level!r}: expected one of "
                f"{OFF_POLICY} at token or sequence level"
            )

    def weights(self, log_ratio: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token weights and which tokens were cut (capped for tis, zeroed for the others)."""
        ratio = log_ratio.exp()
        if self.kind == "tis":
            return ratio.clamp(max=self.cap), ratio > self.cap
        if self.kind == "decoupled_ppo":
            cut = ratio > self.cap
            return torch.where(cut, 0.0, ratio), cut
        judged = ratio
        if self.level == "sequence":
            k = keep.to(log_ratio.dtype)
            judged = ((log_ratio * k).sum(-1, keepdim=True) / k.sum(-1, keepdim=True).clamp(min=1)).exp()
            judged = judged.expand_as(ratio)
        cut = (judged < self.low) | (judged > self.high)
        return torch.where(cut, 0.0, ratio), cut


def policy_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float = 2.0,
    kl_coef: float = 0.0,
    logp_ref: torch.Tensor | None = None,
    denominator: float | None = None,
    off_policy: OffPolicy | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """Token-level DAPO loss over [B, T] tensors (advantages [B] or [B, T]); only `mask` = 1 tokens count.

    `denominator` is the number of masked tokens in the whole minibatch when it is split into micro-batches
    whose losses are summed by gradient accumulation (default: this call's mask sum): token-level aggregation
    means every token in the minibatch weighs the same, whichever micro-batch it landed in.
    """
    keep = mask > 0
    weights = keep.to(logp_new.dtype)
    count = float(weights.sum())
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    # Differences are zeroed off the mask *before* exp: pad/prompt positions may hold anything, and
    # inf * 0 would poison the sum (and the gradient) with NaN.
    log_ratio = torch.where(keep, logp_new - logp_old.detach(), 0.0)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    ppo = torch.maximum(unclipped, clipped)
    tis_log = torch.where(keep, logp_old - logp_rollout, 0.0).detach()
    tis, cut = (off_policy or OffPolicy(cap=tis_cap)).weights(tis_log, keep)
    per_token = tis * ppo
    ref_kl = torch.zeros_like(per_token)
    if logp_ref is not None:
        diff = torch.where(keep, logp_ref.detach() - logp_new, 0.0)
        ref_kl = diff.exp() - diff - 1.0  # k3: unbiased, always >= 0, low variance
        per_token = per_token + kl_coef * ref_kl
    loss = (per_token * weights).sum() / max(denominator if denominator is not None else count, 1.0)
    with torch.no_grad():
        gap = tis_log.abs()
        metrics = LossMetrics(
            loss=float(loss),
            tokens=int(count),
            clip_frac=_masked_mean((clipped > unclipped).float(), weights, count),
            ppo_kl=_masked_mean(-log_ratio, weights, count),
            tis_weight_mean=_masked_mean(tis, weights, count),
            tis_capped_frac=_masked_mean(cut.float(), weights, count),
            logprob_diff_mean=_masked_mean(gap, weights, count),
            logprob_diff_max=float((gap * weights).max()) if count else 0.0,
            rollout_train_kl=_masked_mean(-tis_log, weights, count),
            ref_kl=_masked_mean(ref_kl.detach(), weights, count),
        )
    return loss, metrics


def merge_metrics(parts: Sequence[LossMetrics]) -> LossMetrics:
    """Token-weighted means (max for the max, sum for the loss) of several calls' metrics."""
    if not parts:
        raise ValueError("no metrics to merge")
    total = sum(p.tokens for p in parts)

    def mean(name: str) -> float:
        return sum(getattr(p, name) * p.tokens for p in parts) / max(total, 1)

    return LossMetrics(
        loss=sum(p.loss for p in parts),
        tokens=total,
        clip_frac=mean("clip_frac"),
        ppo_kl=mean("ppo_kl"),
        tis_weight_mean=mean("tis_weight_mean"),
        tis_capped_frac=mean("tis_capped_frac"),
        logprob_diff_mean=mean("logprob_diff_mean"),
        logprob_diff_max=max(p.logprob_diff_max for p in parts),
        rollout_train_kl=mean("rollout_train_kl"),
        ref_kl=mean("ref_kl"),
    )
