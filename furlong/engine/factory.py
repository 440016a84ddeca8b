"""One place that turns (backend name, local checkpoint) into an Engine.

`make_engine("hf", DIR)` builds the in-process continuous-batching engine; `make_engine("vllm", DIR)`
imports furlong.engine.vllm only then, so furlong without the vllm extra never imports vLLM;
`make_engine("sglang", DIR, sglang=...)` starts (or attaches to) an SGLang server. Either way
the engine stops a request only on that request's stop ids (the agent passes its end-of-turn id), never
on a bare EOS, as the training loop's engines do.
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from pathlib import Path
from typing import Any, Literal

from furlong.config import SGLangConfig, VLLMConfig
from furlong.engine.base import Engine, EngineUnavailable

EngineKind = Literal["hf", "vllm", "sglang"]
ENGINE_KINDS: tuple[str, ...] = ("hf", "vllm", "sglang")
DTYPES = ("float32", "bfloat16", "float16")


def check_checkpoint(path: Path | str, what: str = "model", needs: str = "config.json") -> Path:
    """`path` as a local checkpoint directory holding `needs`, or one clear error naming `what` and the path.
    (Only local directories: furlong never resolves hub names.)"""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise EngineUnavailable(f"{what} {p}: not a directory (expected a local Hugging Face checkpoint directory)")
    if not (p / needs).is_file():
        raise EngineUnavailable(
            f"{what} {p}: no {needs} in it (expected a Hugging Face "
            f"{'PEFT adapter' if needs == 'adapter_config.json' else 'checkpoint'} directory)"
        )
    return p


def make_engine(
    kind: str,
    model_dir: Path | str,
    *,
    adapter: Path | str | None = None,
    dtype: str = "float32",
    seed: int = 0,
    sglang: SGLangConfig | None = None,
    work_dir: Path | None = None,
    vllm: VLLMConfig | None = None,
) -> Engine:
    """An engine serving the checkpoint at `model_dir`, with the PEFT adapter at `adapter` applied if given.
    `dtype` is the weights' dtype (float32 keeps logprobs equal to the trainer's); `seed` seeds the requests
    that bring no seed of their own. sglang: `sglang` settings (default: start `python -m
    sglang.launch_server`), its log and staged updates under `work_dir` (default a temp dir). vllm: `vllm`'s
    memory settings (default: vLLM's own)."""
    if dtype not in DTYPES:
        raise EngineUnavailable(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    model_dir = check_checkpoint(model_dir, "model")
    adapter = check_checkpoint(adapter, "adapter", "adapter_config.json") if adapter is not None else None
    if kind == "hf":
        return _hf_engine(model_dir, adapter, dtype, seed)
    if kind == "vllm":
        return _vllm_engine(model_dir, adapter, dtype, seed, vllm or VLLMConfig())
    if kind == "sglang":
        return _sglang_engine(model_dir, adapter, dtype, seed, sglang, work_dir)
    raise EngineUnavailable(f"engine {kind!r}: expected one of {', '.join(ENGINE_KINDS)}")


def _hf_engine(model_dir: Path, adapter: Path | None, dtype: str, seed: int) -> Engine:
    import torch

    from furlong.engine.hf import HFEngine
    from furlong.model.loading import load_model

    model: Any = load_model(model_dir, dtype=getattr(torch, dtype))  # or the PeftModel over it: HFEngine runs either
    if adapter is not None:
        from peft import PeftModel

        # Kept unmerged: the same modules the trainer's LoRA policy runs, so logprobs match it.
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=False).eval()
    return HFEngine(model, eos_token_ids=(), seed=seed)


def _vllm_engine(model_dir: Path, adapter: Path | None, dtype: str, seed: int, memory: VLLMConfig) -> Engine:
    if importlib.util.find_spec("vllm") is None:
        raise EngineUnavailable(
            "engine 'vllm': vllm is not installed (the furlong[vllm] extra: bash install.sh --vllm; docs/engines.md)"
        )
    try:
        module = importlib.import_module("furlong.engine.vllm")
    except ModuleNotFoundError as exc:  # vllm is there, but this furlong has no backend for it (or a dep is missing)
        raise EngineUnavailable(f"engine 'vllm': furlong.engine.vllm could not be imported ({exc})") from None
    # episodes stop on end-of-turn, never on a bare EOS; an adapter runs as a vLLM LoRA on every request
    return module.VLLMEngine.start(
        model_dir,
        dtype=dtype,
        seed=seed,
        eos_token_ids=(),
        adapter=adapter,
        gpu_memory_utilization=memory.gpu_memory_utilization,
        kv_cache_gib=memory.kv_cache_gib,
    )


def _sglang_engine(
    model_dir: Path, adapter: Path | None, dtype: str, seed: int, sglang: SGLangConfig | None, work_dir: Path | None
) -> Engine:
    from furlong.engine.sglang_launch import open_sglang

    s = sglang or SGLangConfig()
    return open_sglang(
        model_dir,
        work_dir=work_dir or Path(tempfile.mkdtemp(prefix="furlong-sglang-")),
        adapter=adapter,
        dtype=dtype,
        seed=seed,
        url=s.url,
        python=s.python,
        module=s.launch_module,
        port=s.port,
        extra_args=s.extra_args,
        start_timeout_s=s.start_timeout_s,
        weights_via=s.weights_via,
    )
