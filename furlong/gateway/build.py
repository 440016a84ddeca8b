"""A gateway Policy from a checkpoint directory and an engine (a local kind, or an engine server's URL)."""

from __future__ import annotations

from pathlib import Path

from furlong.engine.base import Engine
from furlong.engine.factory import make_engine
from furlong.engine.remote import RemoteEngine
from furlong.gateway.policy import Policy
from furlong.model.loading import load_tokenizer
from furlong.model.toolcall import tool_format


def make_engine_for(model_dir: Path, engine: str, *, seed: int = 0, token: str | None = None) -> Engine:
    """`engine`: hf | vllm | sglang, or the URL of a `furlong engine serve` (sending `token` if given)."""
    if engine.startswith(("http://", "https://")):
        return RemoteEngine(engine, token=token)
    return make_engine(engine, model_dir, seed=seed)


def make_policy(
    model_dir: Path,
    engine: Engine,
    *,
    name: str | None = None,
    tool_format_name: str = "auto",
    max_context: int | None = None,
    default_max_tokens: int = 512,
) -> Policy:
    tokenizer = load_tokenizer(model_dir)
    context = max_context or int(getattr(engine, "max_context", 0) or tokenizer.model_max_length)
    return Policy(
        engine=engine,
        tokenizer=tokenizer,
        fmt=tool_format(tokenizer, tool_format_name),
        name=name or Path(model_dir).name,
        max_context=context,
        default_max_tokens=default_max_tokens,
    )
