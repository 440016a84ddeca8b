"""Build an Engine of a named kind for a local model directory (the one place backends are chosen)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.engine.base import Engine, EngineError

if TYPE_CHECKING:
    from furlong.config import SGLangConfig


def make_engine(kind: str, model_dir: Path, *, adapter: Path | None = None, dtype: str = "float32", seed: int = 0,
                sglang: SGLangConfig | None = None, work_dir: Path | None = None) -> Engine:
    """`hf`: in-process; `vllm`: furlong.engine.vllm; `sglang`: an SGLang server (`sglang` settings, default:
    start `python -m sglang.launch_server`; its log and staged updates go under `work_dir`, default a temp dir)."""
    if kind == "hf":
        import torch

        from furlong.engine.hf import HFEngine
        from furlong.model.loading import load_model

        model = load_model(model_dir, dtype=getattr(torch, dtype))
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        return HFEngine(model, seed=seed, eos_token_ids=())
    if kind == "vllm":
        try:
            from furlong.engine.vllm import VLLMEngine  # type: ignore[import-not-found]
        except ImportError as e:
            raise EngineError(f"engine 'vllm' is not available here ({e}); install furlong[vllm]") from None
        return VLLMEngine(model_dir, adapter=adapter, dtype=dtype, seed=seed)
    if kind == "sglang":
        from furlong.config import SGLangConfig
        from furlong.engine.sglang_launch import open_sglang

        s = sglang or SGLangConfig()
        return open_sglang(Path(model_dir), work_dir=work_dir or Path(tempfile.mkdtemp(prefix="furlong-sglang-")),
                           adapter=adapter, dtype=dtype, seed=seed, url=s.url, python=s.python,
                           module=s.launch_module, port=s.port, extra_args=s.extra_args,
                           start_timeout_s=s.start_timeout_s, weights_via=s.weights_via)
    raise EngineError(f"unknown engine {kind!r}: expected hf, vllm or sglang")
