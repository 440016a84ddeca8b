"""Models: load local Hugging Face checkpoints, build the tiny default model, render chats token-in/token-out."""

from furlong.model.chat import (
    ChatTemplateError,
    Message,
    ToolCall,
    ToolCallError,
    assistant_ids,
    continuation_ids,
    end_of_turn_id,
    format_tool_call,
    parse_tool_calls,
    render_prompt_ids,
)
from furlong.model.loading import ModelLoadError, load_model, load_tokenizer
from furlong.model.tiny import TinySpec, init_tiny

__all__ = [
    "ChatTemplateError",
    "Message",
    "ModelLoadError",
    "TinySpec",
    "ToolCall",
    "ToolCallError",
    "assistant_ids",
    "continuation_ids",
    "end_of_turn_id",
    "format_tool_call",
    "init_tiny",
    "load_model",
    "load_tokenizer",
    "parse_tool_calls",
    "render_prompt_ids",
]
