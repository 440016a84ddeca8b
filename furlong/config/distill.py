"""`train.distill`: on-policy distillation (docs/distill.md): a teacher scores every token the student sampled,
and the per-token reverse KL to it is an advantage, alone or beside GRPO's."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from furlong.config.base import _Node


class TeacherConfig(_Node):
    """Who scores the student's tokens: another local checkpoint (`path`), or the student's own current weights
    under another system prompt (`system_prompt`: self-distillation). Exactly one of the two."""

    path: Path | None = Field(
        None,
        description="a local Hugging Face checkpoint with the student's tokenizer (same ids for the same "
        "text), any family furlong loads; a frozen copy is kept beside the policy",
    )
    system_prompt: str | None = Field(
        None,
        description="self-distillation: the student's current weights score its tokens with this system "
        "prompt in place of train.agent.system_prompt (e.g. a brevity instruction); never trained through",
    )
    frozen: bool = Field(
        False,
        description="with system_prompt: score with a frozen copy of the policy as RL starts (the SFT "
        "checkpoint, held beside it) instead of its current weights, so the target holds still",
    )
    engine: Literal["trainer", "hf", "vllm"] = Field(
        "trainer",
        description="where the teacher runs: trainer (beside the policy, as above); hf or vllm: one more engine "
        "of that kind, in the driver, loaded with `path` (or, with frozen, the SFT checkpoint), scoring each "
        "episode with Engine.score (prefill only); vllm scores at temperature 1 only",
    )
    hint: Literal["none", "solution"] = Field(
        "none",
        description="solution: the task's oracle solution (solution/solve.sh) is appended to the teacher's "
        "system message, a privileged hint the student never sees (tasks without one are scored without it)",
    )


class DistillConfig(_Node):
    """On-policy distillation (docs/distill.md): a teacher scores each token the student sampled (prefill only),
    and -(logp_rollout - logp_teacher) per token is an advantage. Under it train.rl.filter_zero_variance is
    false: a group whose rewards are equal still carries the teacher's signal."""

    mode: Literal["off", "opd", "grpo+opd"] = Field(
        "off",
        description="opd: the per-token reverse KL to the teacher is the advantage (GRPO's is not used); "
        "grpo+opd: GRPO's advantage plus `weight` times it; off: no teacher",
    )
    weight: float = Field(1.0, gt=0, description="grpo+opd: the distillation term's weight beside GRPO's advantage")
    teacher: TeacherConfig = Field(TeacherConfig(), description="the teacher (train.distill.mode other than off)")

    @model_validator(mode="after")
    def _teacher_given(self) -> DistillConfig:
        t = self.teacher
        if self.mode != "off" and t.path is None and t.system_prompt is None:
            raise ValueError(
                f"train.distill.teacher: mode {self.mode} needs train.distill.teacher.path (a checkpoint) or "
                "train.distill.teacher.system_prompt (self-distillation); neither is set"
            )
        if t.path is not None and t.system_prompt is not None:
            raise ValueError(
                "train.distill.teacher: set path (another checkpoint) or system_prompt (the student under "
                "another prompt), not both"
            )
        if t.frozen and t.system_prompt is None:
            raise ValueError(
                "train.distill.teacher.frozen: freezes a self-distillation teacher (system_prompt); a path "
                "teacher is frozen already"
            )
        if t.engine != "trainer" and t.system_prompt is not None and not t.frozen:
            raise ValueError(
                f"train.distill.teacher.engine={t.engine}: a self-distillation teacher scores with the policy's "
                "current weights, which a separate engine does not follow; set train.distill.teacher.frozen=true "
                "(the SFT checkpoint on the engine) or engine=trainer"
            )
        if self.mode == "off" and (t.path is not None or t.system_prompt is not None):
            raise ValueError("train.distill.teacher is set but train.distill.mode is off: set mode opd or grpo+opd")
        return self

    @property
    def on(self) -> bool:
        return self.mode != "off"
