"""Hermes-style calls (Qwen2.5, Qwen3, the tiny model): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
inside a ChatML turn that ends with <|im_end|>."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import (
    ChatMLFormat,
    Schemas,
    json_object,
    named_call,
    unpaired,
)

CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Hermes(ChatMLFormat):
    name: str = "hermes"

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        return parse_tool_calls(text)


def format_tool_call(call: ToolCall) -> str:
    """The text form of one call, exactly as the chat template renders it (json.dumps default separators)."""
    return (
        "<tool_call>\n"
        + json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


def parse_tool_calls(text: str) -> list[ToolCall] | ToolCallError:
    """Every `<tool_call>{json}</tool_call>` in `text`, in order; [] when there is none (a final answer).

    Any malformed call makes the whole turn a ToolCallError (never an exception), so the loop can report
    it to the model and carry on.
    """
    calls: list[ToolCall] = []
    for i, match in enumerate(CALL_RE.finditer(text)):
        where = f"tool call #{i + 1}"
        obj = json_object(match.group(1), where)
        call = obj if isinstance(obj, ToolCallError) else named_call(obj, where, match.group(1))
        if isinstance(call, ToolCallError):
            return call
        calls.append(call)
    return unpaired(CALL_RE.sub("", text), "<tool_call>", "</tool_call>") or calls
