"""Models: load local Hugging Face checkpoints, build the tiny default model, render chats token-in/token-out,
read tool calls in the chat template's format.

Loading and the tiny-model factory import transformers (seconds); they load on first use, so code that only
parses tool calls or renders chats stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from furlong.model.chat import (
    ChatTemplateError,
    Message,
    ToolCall,
    ToolCallError,
    assistant_ids,
    continuation_ids,
    end_of_turn_id,
    render_prompt_ids,
)
from furlong.model.toolcall import (
    ToolCallFormat,
    format_tool_call,
    parse_tool_calls,
    tool_format,
)

if TYPE_CHECKING:
    from furlong.model.loading import ModelLoadError, load_model, load_tokenizer
    from furlong.model.tiny import TinySpec, init_tiny

_LAZY = {
    "ModelLoadError": "loading",
    "load_model": "loading",
    "load_tokenizer": "loading",
    "TinySpec": "tiny",
    "init_tiny": "tiny",
}

__all__ = [
    "ChatTemplateError",
    "Message",
    "ModelLoadError",
    "TinySpec",
    "ToolCall",
    "ToolCallError",
    "ToolCallFormat",
    "assistant_ids",
    "continuation_ids",
    "end_of_turn_id",
    "format_tool_call",
    "init_tiny",
    "load_model",
    "load_tokenizer",
    "parse_tool_calls",
    "render_prompt_ids",
    "tool_format",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"furlong.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'furlong.model' has no attribute {name!r}")
