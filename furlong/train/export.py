"""The policy as a Hugging Face directory that plain `transformers` (and vLLM, and `furlong eval --agent
model`) load directly, written beside every RL checkpoint and the SFT checkpoint.

Layout of an export directory (`checkpoints/rl-N/hf`):

    config.json, model.safetensors, generation_config.json   the full model (`save_pretrained`)
    tokenizer.json, tokenizer_config.json, chat_template.jinja
    adapter/                                                  LoRA runs only: the PEFT adapter

With LoRA the top level holds the adapter merged into the base, so `AutoModelForCausalLM.from_pretrained`
gives the trained policy without PEFT; `adapter/` is for `PeftModel.from_pretrained(base, adapter/)` over
the run's SFT checkpoint (its `base_model_name_or_path`). Written in a temporary directory beside the
target, fsynced, then renamed into place: a crash never leaves a half-written export under its name.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import uuid
from pathlib import Path

from transformers import PreTrainedModel

from furlong.train.atomic import fsync_dir, replace_dir

HF_DIR = "hf"
ADAPTER_DIR = "adapter"


def is_peft(model: object) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def write_hf(model: PreTrainedModel, tokenizer, out: Path | str, *, base_model: Path | str | None = None) -> Path:
    """Export `model` (a causal LM, or a PeftModel: merged at the top, adapter in `adapter/`) with
    `tokenizer` to directory `out`, atomically. `base_model`: the directory the adapter applies to
    (recorded in adapter_config.json; default: what the base was loaded from)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        if is_peft(model):
            # A copy is merged: merging in place and unmerging would leave rounding error in the live policy.
            copy.deepcopy(model).merge_and_unload().save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]  # a PeftModel
            _save_adapter(model, tmp / ADAPTER_DIR, base_model)
        else:
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only if something failed before the rename
    return out


def _save_adapter(peft, directory: Path, base_model: Path | str | None) -> None:
    peft.save_pretrained(directory, safe_serialization=True)
    if base_model is not None:  # an absolute path, so the adapter finds its base from any working directory
        config_path = directory / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = str(Path(base_model).resolve())
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
