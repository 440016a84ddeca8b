"""LoRA adapter-only training: wrap a causal LM with PEFT LoRA (base frozen), read and save the adapter.

`wrap_lora` injects LoRA layers into the model *in place* and returns the PeftModel around it. Train the
injected model (`trainable_model(peft)`, a plain PreTrainedModel whose only trainable parameters are the
adapters): the Trainer's fast logprob path reaches the decoder through `base_model_prefix`, which a PeftModel
does not resolve. The PeftModel shares those same parameters, so `adapter_state_dict(peft)` and
`save_adapter(peft, dir)` always see the trained adapter.

Adapter tensor names are the ones PEFT saves (`base_model.model.<module>.lora_A.weight`, no adapter name), so
`PeftModel.from_pretrained(base, dir)` loads what `save_adapter` wrote, and an engine holding a PeftModel of
the same spec loads published adapters by name (HFEngine maps them onto its live `...lora_A.<adapter>.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from peft import (
    LoraConfig,
    PeftModel,
    TaskType,
    get_peft_model,
    get_peft_model_state_dict,
)
from transformers import PreTrainedModel


@dataclass(frozen=True)
class LoraSpec:
    rank: int = 8
    alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def peft_config(self) -> LoraConfig:
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            lora_dropout=self.dropout,
            bias="none",
            task_type=TaskType.CAUSAL_LM,
        )


def wrap_lora(model: PreTrainedModel, spec: LoraSpec = LoraSpec(), *, seed: int | None = 0) -> PeftModel:
    """Inject LoRA layers into `model` (in place) and freeze every base parameter.

    `seed`: the adapters' random init (lora_A; lora_B starts at zero) is drawn under this seed without
    touching the global RNG, so two wraps of the same base with the same seed start identical. None: draw
    from the global RNG."""
    if seed is None:
        peft = get_peft_model(model, spec.peft_config())
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft = get_peft_model(model, spec.peft_config())
    for name, p in peft.named_parameters():  # PEFT already does this; make the contract explicit
        p.requires_grad_("lora_" in name)
    return peft


def trainable_model(peft: PeftModel) -> PreTrainedModel:
    """The injected model to hand to `LocalTrainer` (same parameters as `peft`; only adapters require grad)."""
    return cast(PreTrainedModel, peft.get_base_model())  # the PreTrainedModel that `peft` wraps


def adapter_state_dict(peft: PeftModel) -> dict[str, torch.Tensor]:
    """Only the adapter tensors, named as PEFT saves them (live tensors, detached; copy before mutating)."""
    return {k: v.detach() for k, v in get_peft_model_state_dict(peft).items()}


def base_state_dict(peft: PeftModel) -> dict[str, torch.Tensor]:
    """The frozen base tensors (named as in the PeftModel's state dict), for checks and size accounting."""
    return {k: v.detach() for k, v in peft.state_dict().items() if "lora_" not in k}


def save_adapter(peft: PeftModel, directory: Path | str) -> Path:
    """Write the adapter in PEFT format (adapter_config.json + adapter_model.safetensors)."""
    directory = Path(directory)
    peft.save_pretrained(str(directory), safe_serialization=True)
    return directory


def load_adapter(base: PreTrainedModel, directory: Path | str, *, trainable: bool = False) -> PeftModel:
    """`PeftModel.from_pretrained(base, directory)` (injects into `base` in place)."""
    return PeftModel.from_pretrained(base, str(directory), is_trainable=trainable)
