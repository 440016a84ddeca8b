"""The LoRA adapter a vllm engine serves: one PEFT directory per version, loaded with `AsyncLLM.add_lora`.

vLLM 0.32 takes adapters only as PEFT directories (adapter_config.json + adapter_model.safetensors) named by
a `LoRARequest(lora_name, lora_int_id, lora_path)`. So an adapter update (PEFT-named `...lora_A.weight` /
`...lora_B.weight` tensors, as furlong.model.lora and furlong.sync.adapter publish them) is merged into the
current tensors, written as a new directory and loaded under a fresh id and name; the old one is removed.
The fresh name matters beyond bookkeeping: vLLM keys its prefix cache by the LoRA name and path, so KV blocks
computed under an older adapter are never reused for a newer one.

Targets: vLLM puts LoRA on every linear layer of Qwen3 (q/k/v are one packed `qkv_proj`, gate/up one
`gate_up_proj`; PEFT's per-projection names are unpacked by vLLM), so furlong's defaults (q, k, v, o) and the
MLP projections are all served; DoRA, LoRA biases and `modules_to_save` are refused by vLLM at load time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from furlong.engine.base import EngineError

# vllm.config.lora.MaxLoRARanks: the engine's max_lora_rank must be one of these (an adapter may be smaller)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class ServedAdapter:
    """The adapter's current tensors and config, and the directories written for its versions."""

    def __init__(self, source: Path) -> None:
        from safetensors.torch import load_file

        self.source = source
        if not (source / CONFIG).is_file() or not (source / WEIGHTS).is_file():
            raise EngineError(f"adapter {source}: expected a PEFT adapter directory with {CONFIG} and {WEIGHTS}")
        try:
            self.config = json.loads((source / CONFIG).read_text())
            self.rank = int(self.config["r"])
        except (ValueError, KeyError, TypeError) as e:
            raise EngineError(
                f"adapter {source}/{CONFIG}: expected a PEFT LoRA config with an integer 'r' ({e!r})"
            ) from e
        self.tensors = {k: v.to(torch.float32) for k, v in load_file(source / WEIGHTS).items()}
        self._work = Path(tempfile.mkdtemp(prefix="furlong-vllm-lora-", dir=shm_dir()))

    @property
    def max_lora_rank(self) -> int:
        """The smallest rank vLLM accepts as `max_lora_rank` that holds this adapter."""
        for rank in LORA_RANKS:
            if rank >= self.rank:
                return rank
        raise EngineError(f"adapter {self.source}: rank {self.rank} is above vLLM's largest ({LORA_RANKS[-1]})")

    def checked(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The update's tensors as fp32 CPU copies, each one checked against the adapter's (nothing changes yet)."""
        out = {}
        for name, tensor in state_dict.items():
            if name not in self.tensors:
                raise EngineError(
                    f"update_weights: {name!r} is not a tensor of the adapter {self.source} (this "
                    f"engine serves a LoRA adapter and takes its lora_A/lora_B tensors only)"
                )
            if tuple(tensor.shape) != tuple(self.tensors[name].shape):
                raise EngineError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, the adapter has "
                    f"{tuple(self.tensors[name].shape)}"
                )
            out[name] = tensor.detach().to("cpu", torch.float32).contiguous()
        return out

    def write(self, tensors: Mapping[str, torch.Tensor], lora_id: int) -> str:
        """A PEFT directory for version `lora_id` (the current config with `tensors`); returns its path."""
        from safetensors.torch import save_file

        out = self._work / f"v{lora_id}"
        out.mkdir()
        (out / CONFIG).write_text(json.dumps(self.config))
        save_file(dict(tensors), str(out / WEIGHTS))
        return str(out)

    def discard(self, path: str) -> None:
        """Remove a directory `write` made (never the adapter the engine was started with)."""
        if Path(path).parent == self._work:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self._work, ignore_errors=True)


def lora_request(lora_id: int, path: str | Path):
    from vllm.lora.request import LoRARequest

    # a fresh name per version: vLLM's prefix cache and adapter cache both key on it
    return LoRARequest(lora_name=f"furlong-{lora_id}", lora_int_id=lora_id, lora_path=str(path))


def shm_dir() -> str | None:
    """/dev/shm where it can be written (a staged update then never touches a disk), else None: tempdir's."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
