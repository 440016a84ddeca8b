"""train.model.frozen_dtype: the frozen copies the trainer holds (the KL reference, a checkpoint distillation
teacher) in bf16, at half the memory; their logprobs are still an fp32 log-softmax of the bf16 logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp2_support import fixed_episodes
from tests_support import grpo

from furlong.build.training import grpo_config, local_trainer, teacher_spec
from furlong.config.load import ConfigError, load_config
from furlong.model.loading import frozen_model, load_model
from furlong.train import LocalTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Measured on the small test model (tests_support.SMALL), 3 groups of fsdp2_support.fixed_episodes: the KL to
# a bf16 reference at step 0, where the policy is the reference's fp32 original (docs/training.md, KL reference).
STEP0_BF16_REF_KL = 1e-5  # measured 4.6e-7


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_a_bf16_frozen_copy_holds_half_the_bytes_and_no_gradients(small_dir: Path) -> None:
    full, half = frozen_model(small_dir), frozen_model(small_dir, "bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert _bytes(half) * 2 == _bytes(full) == _bytes(load_model(small_dir))
    assert not any(p.requires_grad for p in half.parameters())
    with pytest.raises(ValueError, match="train.model.frozen_dtype"):
        frozen_model(small_dir, "float16")


def test_step0_kl_to_a_bf16_reference_is_small_not_zero_and_training_runs(small_dir: Path) -> None:
    batch = fixed_episodes()
    fp32 = LocalTrainer(load_model(small_dir), grpo(kl_coef=0.1), ref_model=frozen_model(small_dir))
    assert fp32.train_step(batch).ref_kl == 0.0  # the default: the reference is the policy, bit for bit
    bf16 = LocalTrainer(load_model(small_dir), grpo(lr=3e-3, kl_coef=0.1), ref_model=frozen_model(small_dir, "bfloat16"))
    first = bf16.train_step(batch)
    print(f"step-0 KL to a bf16 reference: {first.ref_kl:.3e}")
    assert first.updated and 0 < abs(first.ref_kl) < STEP0_BF16_REF_KL
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # the policy keeps fp32 masters
    assert bf16.train_step(batch).ref_kl > abs(first.ref_kl)  # the policy moving dominates the rounding


def _config(tmp_path: Path, model: Path, **keys: str) -> Path:
    lines = [f"train:\n  model: {{path: {model}, frozen_dtype: {keys.get('frozen', 'bfloat16')}}}",
             "  rl: {kl_coef: 0.05, sft_coef: 0.0}", f"  distill: {{mode: opd, teacher: {{path: {model}}}}}"]
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_key_reaches_the_reference_and_a_checkpoint_teacher(small_dir: Path, tmp_path: Path) -> None:
    t = load_config(_config(tmp_path, small_dir)).train
    trainer = local_trainer(t, small_dir, grpo_config(t), [])
    assert trainer.ref_model is not None and {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    spec = teacher_spec(t, small_dir, {})
    assert spec is not None and spec.dtype == "bfloat16"
    assert trainer.teacher is not None and trainer.teacher.model is not None
    assert {p.dtype for p in trainer.teacher.model.parameters()} == {torch.bfloat16}
    with pytest.raises(ConfigError, match="frozen_dtype"):
        load_config(_config(tmp_path, small_dir, frozen="float16"))
