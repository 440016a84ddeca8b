"""One place that builds an engine of a given kind for a local Hugging Face directory (`train.engine`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from furlong.engine.base import Engine, EngineError

EngineKind = Literal["hf", "vllm"]


def make_engine(kind: str, model_dir: Path | str, *, adapter: Path | str | None = None, dtype: str = "float32",
                seed: int = 0) -> Engine:
    """An engine over `model_dir`. Episodes stop on end-of-turn, never on a bare EOS, so neither kind adds
    the model's EOS ids as stop tokens (as the driver has always built its hf engine)."""
    if adapter is not None:
        raise EngineError("make_engine: adapters are not supported yet (merge them into the model directory)")
    if kind == "hf":
        import torch

        from furlong.engine.hf import HFEngine

        return HFEngine.from_pretrained(model_dir, dtype=getattr(torch, dtype), seed=seed, eos_token_ids=())
    if kind == "vllm":
        from furlong.engine.vllm import VLLMEngine

        return VLLMEngine.start(model_dir, dtype=dtype, seed=seed, eos_token_ids=())
    raise EngineError(f"engine kind {kind!r}: expected 'hf' or 'vllm'")
