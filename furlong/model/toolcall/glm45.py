"""GLM-4.5's XML calls (zai-org's template, vLLM's glm45 parser): after the think block and any text,

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

(the published template, as transformers renders it, writes no newline between NAME and the first
<arg_key> or before </tool_call>: both forms are read). A string value is written as it is, anything else
as JSON, so a value's type comes from the tool's JSON schema as for Qwen3-Coder (a string stays text).

The template writes no end marker after an assistant turn: the model ends its turn by writing the role of
the message that answers it, <|observation|> after a call (the tool results' role), <|user|> after an
answer. Those are the turn's markers; continuation_text starts the next message after the one sampled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import Schemas, snippet, unpaired, without
from furlong.model.toolcall.hermes import CALL_RE
from furlong.model.toolcall.qwen3_coder import each_call, parameter_types, typed_call

OBSERVATION, USER = "<|observation|>", "<|user|>"
_CONTROL = (OBSERVATION, USER, "<|assistant|>", "<|system|>", "<|endoftext|>", "[gMASK]", "<sop>")
_NAME_RE = re.compile(r"\s*([^<\n]*)")  # the call's first line, up to its first tag
_ARG_RE = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)


@dataclass(frozen=True)
class Glm45:
    name: str = "glm45"
    turn_ends: tuple[str, ...] = (OBSERVATION, USER)
    stops: tuple[str, ...] = (OBSERVATION, USER)
    tool_results_need_call: bool = False

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        types = parameter_types(tools)
        calls = each_call(text, lambda body, where: _parse_call(body, where, types))
        if isinstance(calls, ToolCallError):
            return calls
        rest = CALL_RE.sub("", text)
        unclosed = unpaired(rest, "<tool_call>", "</tool_call>")
        if unclosed is None and "<arg_key>" in rest:
            return ToolCallError("<arg_key> outside <tool_call>...</tool_call>", snippet(rest, rest.find("<arg_key>")))
        return unclosed or calls

    def answer(self, text: str) -> str:
        """The turn's text without the role the model ended it with. The think block stays, as Hermes keeps
        Qwen3's: the template reads it back from a resent answer and writes the turn as it was sampled."""
        return without(text, _CONTROL).strip()

    def outside_calls(self, text: str) -> str:
        """The content beside a turn's calls (the gateway's reply): the text around them."""
        return CALL_RE.sub("", text).strip()


def _parse_call(body: str, where: str, types: dict[str, dict[str, Any]]) -> ToolCall | ToolCallError:
    head = _NAME_RE.match(body)
    name = head.group(1).strip() if head else ""
    if not head or not name:
        return ToolCallError(f"{where}: expected the function's name right after <tool_call>", body)
    inner = body[head.end() :]
    stray = _ARG_RE.sub("", inner).strip()
    if stray:
        return ToolCallError(
            f"{where}: text outside <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>: {stray[:80]!r}", body, name
        )
    pairs = ((arg.group(1), arg.group(2)) for arg in _ARG_RE.finditer(inner))
    return typed_call(name, pairs, types, "argument", where, body)
