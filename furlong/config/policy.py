"""The policy and how it is trained: the starting model, the agent loop, SFT, GRPO, LoRA, FSDP2 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from furlong.config.base import _Node

# Fixed-path families where the instruction's words pick the command: learnable by the 4M-parameter
# tiny model within the default budget (families that need names copied are not, yet). SFT shows
# demonstrations of the first two only; number-words asks for number-stats' commands in words never
# demonstrated, so RL must learn them from the verifier's reward (docs/training.md, "What RL learns from reward alone"). text-words,
# its transform-text twin, is left out: after SFT the tiny model never samples the right command for most
# of its wordings, so there is no reward to learn from. RL draws only number-words, so every group of a
# step is of the family that only reward can teach (about a third when RL drew all three families), and
# the demonstration anchor (rl.sft_coef) keeps what SFT taught of the others
# (bench/results/default_run_seeds_after_seams.json: both kinds of family gain in every seed).
DEFAULT_FAMILIES = ("number-stats", "transform-text", "number-words")
DEFAULT_SFT_FAMILIES = ("number-stats", "transform-text")
DEFAULT_RL_FAMILIES = ("number-words",)


class ModelConfig(_Node):
    path: Path | None = Field(None, description="a local Hugging Face checkpoint; null builds the tiny model")
    seed: int = Field(0, description="seed of the tiny model's initial weights (model.path null)")
    frozen_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="dtype of the frozen copies the trainer holds (the KL reference, a train.distill checkpoint "
        "teacher): bfloat16 halves their memory; their logprobs still take an fp32 log-softmax of the bf16 "
        "logits, so the KL to the reference is then near, not exactly, 0 at step 0 (docs/training.md)",
    )


DEFAULT_SYSTEM_PROMPT = (
    "You are an agent in a Linux terminal. Use the bash tool to complete the task. "
    "When the task is done, reply without a tool call."
)


class HarnessConfig(_Node):
    """An unmodified agent program trained through the gateway (docs/gateway.md#training-a-harness)."""

    command: tuple[str, ...] | None = Field(
        None,
        description="argv of a program run once per episode with OPENAI_BASE_URL/OPENAI_API_KEY, "
        "ANTHROPIC_BASE_URL/ANTHROPIC_API_KEY, FURLONG_EXEC_URL and FURLONG_INSTRUCTION set for it; "
        "null: furlong's own agent loop",
    )

    @model_validator(mode="after")
    def _argv(self) -> HarnessConfig:
        if self.command is not None and (not self.command or not all(a.strip() for a in self.command)):
            raise ValueError("train.agent.harness.command: expected a non-empty list of non-empty strings (argv)")
        return self


class AgentConfig(_Node):
    """The multi-turn agent loop (furlong.agent.episode) of training, its evals and `furlong eval --agent model`."""

    max_turns: int = Field(3, ge=1, description="model turns per episode")
    max_context_tokens: int = Field(768, ge=64, description="an episode whose tokens reach this is truncated")
    max_new_tokens: int = Field(96, ge=1, description="per model turn")
    command_timeout_s: float = Field(10.0, gt=0, description="one bash tool call")
    observation_chars: int = Field(400, ge=32, description="a tool result beyond this is cut, keeping head and tail")
    system_prompt: str = Field(
        DEFAULT_SYSTEM_PROMPT, description="the first message of every episode and SFT demonstration"
    )
    tool_schema_in_prompt: bool = Field(
        False,
        description="render the environment's tool schemas (Harbor: bash) into the prompt "
        "(tiny models do better without it; chat models trained on tools, with it)",
    )
    tool_format: Literal[
        "auto", "hermes", "qwen3_coder", "llama3_json", "harmony", "pythonic", "deepseek_v3", "glm45"
    ] = Field(
        "auto",
        description="how the model writes tool calls and ends its turns (docs/models.md#tool-call-formats); "
        "auto: read from the tokenizer's chat template, an error when it cannot tell",
    )
    harness: HarnessConfig = Field(
        HarnessConfig(), description="an agent program in place of furlong's own loop, through the gateway"
    )


class SFTConfig(_Node):
    """A short warm-start: enough to learn the tool-call format, leaving the policy noisy for RL to sharpen."""

    families: tuple[str, ...] | None = Field(
        DEFAULT_SFT_FAMILIES,
        description="the families whose oracle demonstrations SFT shows the model (each "
        "one of train.families); the others are reward-only: RL learns them from the verifier alone. "
        "null: all of train.families, which is also what setting train.families alone means",
    )
    instances_per_family: int = Field(128, ge=1, description="train instances of each family demonstrated")
    epochs: int = Field(
        4, ge=0, description="passes over the demonstrations; 0: no SFT (the anchor may still use them)"
    )
    lr: float = Field(2e-3, gt=0, description="AdamW learning rate")
    batch_size: int = Field(8, ge=1, description="demonstrations per optimizer step")
    concurrency: int = Field(16, ge=1, description="oracle solutions replayed at once, each in its own sandbox")


class RLConfig(_Node):
    families: tuple[str, ...] | None = Field(
        DEFAULT_RL_FAMILIES,
        description="the families RL draws its train tasks from (each one of "
        "train.families); null: all of them, which is also what setting train.families or train.sft.families "
        "alone means. Held-out evals always cover every family",
    )
    steps: int = Field(20, ge=0, description="RL steps (each: one batch, one or more optimizer steps)")
    tasks_per_step: int = Field(16, ge=1, description="GRPO groups per step, one task each")
    group_size: int = Field(8, ge=2, description="episodes per group (the advantage baseline is their mean)")
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature (the trainer uses it too)")
    lr: float = Field(2e-4, gt=0, description="AdamW peak learning rate")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon: coordinates whose gradient is below it move less")
    warmup_steps: int = Field(5, ge=0, description="optimizer steps of linear lr warm-up")
    lr_decay: Literal["constant", "cosine"] = Field(
        "cosine", description="after warm-up: keep lr, or follow a cosine to min_lr_ratio * lr at the last step"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay ends at this fraction of lr")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0: no clipping (the norm is logged)")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass over a step's episodes")
    epochs: int = Field(1, ge=1, description="passes over a step's episodes (PPO-style reuse of a batch)")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 (1 - clip_low)")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (1 + clip_high; DAPO's clip-higher)")
    tis_cap: float = Field(2.0, gt=0, description="tis: truncation of the train/rollout importance weight")
    kl_coef: float = Field(
        0.05,
        ge=0,
        description="k3 KL penalty to the SFT model (a frozen copy is kept); "
        "keeps the tool-call format the SFT taught while RL learns (docs/training.md#stability)",
    )
    sft_coef: float = Field(
        1.0,
        ge=0,
        description="demonstration anchor (PPO-ptx): each optimizer step adds this "
        "times the NLL of sft_batch of SFT's demonstrations, so a demonstrated skill that RL "
        "erodes is pulled back even when its groups all fail (docs/training.md#stability)",
    )
    sft_batch: int = Field(16, ge=1, description="demonstrations per optimizer step for the anchor (sft_coef)")
    negative_weight: float = Field(
        0.1,
        ge=0,
        le=1,
        description="scale of negative advantages; < 1 sharpens (1: plain GRPO; see docs/training.md#results)",
    )
    normalize_std: bool = Field(False, description="divide advantages by the group std (measured worse here)")
    adv_eps: float = Field(1e-6, gt=0, description="normalize_std: advantages are divided by (group std + this)")
    filter_zero_variance: bool = Field(
        True,
        description="drop groups whose rewards are all equal (no signal); false under train.distill, "
        "whose teacher gives those groups' tokens a signal",
    )
    micro_batch_size: int = Field(16, ge=1, description="episodes per forward/backward pass")
    bf16_autocast: bool = Field(False, description="bf16 compute in the trainer; weights stay fp32")
    concurrency: int = Field(16, ge=1, description="episodes (sandboxes) at once; the engine batches their turns")
    checkpoint_every: int = Field(5, ge=1, description="steps between checkpoints (the last step always saves)")
    time_budget_s: float | None = Field(
        None,
        gt=0,
        description="stop RL after the step whose end crosses this many seconds of RL step time "
        "(resumed runs included); null: run all `steps`",
    )
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: rollouts keep running while the trainer trains (furlong.rollout.scheduler)"
    )
    max_inflight_groups: int | None = Field(
        None,
        ge=1,
        description="async: GRPO groups running or waiting at once; null: 2 * tasks_per_step "
        "(sync always runs one step's groups)",
    )
    max_staleness: int = Field(
        2,
        ge=0,
        description="async: most weight versions between a trained episode's "
        "oldest sampled token and the version being trained",
    )
    stale_policy: Literal["drop", "requeue"] = Field(
        "requeue",
        description="a group past max_staleness: drop it (the next group of the stream runs instead) "
        "or re-run its task",
    )
    off_policy: Literal["tis", "masked_is", "decoupled_ppo"] = Field(
        "tis", description="correction for rollout/train policy mismatch (see furlong.train.grpo)"
    )
    mask_level: Literal["token", "sequence"] = Field("token", description="masked_is: drop tokens or whole episodes")
    is_low: float = Field(0.5, gt=0, description="masked_is: keep tokens whose train/rollout ratio >= this")
    is_high: float = Field(2.0, gt=0, description="masked_is: ... and <= this")

    @model_validator(mode="after")
    def _is_range(self) -> RLConfig:
        if self.is_low > self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must be <= is_high ({self.is_high})")
        return self

    def inflight_groups(self) -> int:
        """How many groups may run at once: one step's worth in sync mode (zero overlap with training)."""
        if self.mode == "sync":
            return self.tasks_per_step
        return self.max_inflight_groups or 2 * self.tasks_per_step


class LoraConfig(_Node):
    """Train only low-rank adapters (PEFT); the base stays frozen and only adapters go to the engine."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    rank: int = Field(8, ge=1, description="adapter rank")
    alpha: int = Field(16, ge=1, description="adapter scale numerator (scale = alpha / rank)")
    targets: tuple[str, ...] = Field(
        ("q_proj", "k_proj", "v_proj", "o_proj"), description="module names that get adapters"
    )


class FSDP2Config(_Node):
    """`train.trainer: fsdp2`: the policy sharded over rank processes (furlong.train.fsdp2; docs/training.md,
    "FSDP2")."""

    world_size: int = Field(2, ge=1, description="rank processes (train.device=cuda: one GPU each)")
    timeout_s: float = Field(
        600.0, gt=0, description="a rank's start, and a collective whose peer is gone, fail after this long"
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="MoE experts split by expert over this many ranks (the ep of a (dp, ep) mesh; dp = "
        "world_size / expert_parallel); must divide world_size and the number of experts; 1: none",
    )

    @model_validator(mode="after")
    def _divides(self) -> FSDP2Config:
        if self.world_size % self.expert_parallel:
            raise ValueError(
                f"train.fsdp2.expert_parallel={self.expert_parallel} must divide train.fsdp2.world_size "
                f"({self.world_size})"
            )
        return self


class MoEConfig(_Node):
    """Mixture-of-experts training (furlong.train.routing; docs/models.md#moe-routing-replay)."""

    routing_replay: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the trainer's forwards use the experts the rollout engine chose per token (gate weights "
        "still from the trainer's router); auto: on for an MoE model when the engine records routes (the "
        "in-process hf engine with the local trainer), off otherwise; on: refuse a dense model or an engine "
        "that records none",
    )
    aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the router load-balancing loss (transformers' Switch-Transformer loss, "
        "as models' router_aux_loss_coef; qwen3_moe and gpt_oss) in the policy loss; 0: none",
    )

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: object) -> object:
        # YAML 1.1 reads a bare on/off as a boolean: take it as the word that was written
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
