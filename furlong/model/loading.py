"""Load Hugging Face causal-LM checkpoints from local directories (never from a hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


class ModelLoadError(ValueError):
    """A checkpoint directory is missing or incomplete; the message names the path and what is wrong.
    A ValueError: it is bad input, which the CLI reports in one line."""


def _local_dir(path: Path | str, needs: tuple[str, ...]) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"{p}: not a directory (furlong only loads local checkpoints, not hub names)")
    missing = [name for name in needs if not (p / name).is_file()]
    if missing:
        raise ModelLoadError(f"{p}: missing {', '.join(missing)}")
    return p


def load_model(
    path: Path | str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """A causal LM in eval mode. fp32 by default: the engine's logprobs must match the trainer's exactly."""
    p = _local_dir(path, ("config.json",))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, dtype=dtype, local_files_only=True, attn_implementation=attn_implementation
        )
    except ValueError as e:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(e):
            raise
        # GPT-OSS's attention sinks have no SDPA kernel in transformers: its eager attention is the reference one.
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, local_files_only=True, attn_implementation="eager")
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() loosely


def frozen_model(path: Path | str, dtype: str = "float32") -> PreTrainedModel:
    """A copy the trainer holds but never trains (the KL reference, a distillation teacher), in `dtype`
    (train.model.frozen_dtype: "float32" or "bfloat16"), without gradients. A bf16 copy's logits are still
    turned into logprobs in fp32 (furlong.train.logprobs), so only its forward is rounded."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"frozen dtype {dtype!r}: expected float32 or bfloat16 (train.model.frozen_dtype)")
    return load_model(path, dtype=getattr(torch, dtype)).requires_grad_(False)


def load_tokenizer(path: Path | str, require_chat_template: bool = True) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; by default it must carry a chat template (the agent loop renders with it)."""
    p = _local_dir(path, ())
    tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    if require_chat_template and not tokenizer.chat_template:
        raise ModelLoadError(f"{p}: tokenizer has no chat template (pass require_chat_template=False for a base model)")
    return tokenizer
