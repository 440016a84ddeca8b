"""Runs inside vLLM's worker process (`worker_extension_cls`): loads a weight update from a file in place.

vLLM's `collective_rpc` serializes its arguments without type hints, so tensors nested in a list arrive as
plain lists; a safetensors file (in /dev/shm where there is one) moves them without that problem and
without pickling. `reload_weights` is vLLM's in-place reload: it takes checkpoint names (q/k/v are stacked
into qkv_proj by the model's own loader) and redoes the post-load processing (e.g. CPU weight packing), so
the kernels see the new values. It rebuilds whole layers, so the file holds every tensor (see VLLMEngine.update_weights).
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file


class FurlongWorkerExtension:
    """Mixed into vLLM's worker class by name; `self` is the worker (it has model_runner, vllm_config)."""

    def furlong_load_weights(self, path: str) -> int:
        from vllm.config import set_current_vllm_config

        tensors = load_file(path)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            self.model_runner.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=iter(tensors.items()),
                is_checkpoint_format=True,
            )
        _retie(self.model_runner.get_model(), self.vllm_config)  # type: ignore[attr-defined]
        return len(tensors)

    def furlong_weight_sums(self) -> dict[str, float]:
        """Each parameter's sum as vLLM holds it (vLLM's names): for tests and debugging."""
        return _sums(self.model_runner.get_model())  # type: ignore[attr-defined]


def _retie(model: torch.nn.Module, vllm_config) -> None:
    """With tied embeddings the checkpoint has no lm_head, so the reload skips vLLM's lm_head layer (it logs
    "ParallelLMHead: Failed to load weights"): its weight is the new embedding (or is copied in here), but
    the kernel's copy made after loading (the CPU build packs it for its GEMM) is stale until redone."""
    if not getattr(vllm_config.model_config.hf_config, "tie_word_embeddings", False):
        return
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None:
        return
    with torch.no_grad():
        if head.weight.data_ptr() != embed.weight.data_ptr():
            head.weight.copy_(embed.weight)
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)


def _sums(model: torch.nn.Module) -> dict[str, float]:
    return {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
