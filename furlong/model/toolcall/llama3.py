"""Llama 3.x JSON calls (Meta's Llama 3.1 / 3.2 templates, vLLM's llama3_json): the whole assistant turn is
`{"name": ..., "parameters": {...}}` (optionally after <|python_tag|>), several calls separated by `;` (or whitespace),
and the turn ends with <|eot_id|> (or <|eom_id|>, which Llama writes after a call it expects an answer to).

A turn is a call exactly when it starts with `{` (after <|python_tag|>): Llama writes no tag around a call,
so that is how vLLM tells them apart too. Such a turn that does not parse is a ToolCallError; an answer
that starts with `{` is one too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import Schemas, named_call, snippet, without

PYTHON_TAG = "<|python_tag|>"
_ENDS = ("<|eot_id|>", "<|eom_id|>")


@dataclass(frozen=True)
class Llama3Json:
    name: str = "llama3_json"
    turn_ends: tuple[str, ...] = ("<|eot_id|>",)
    stops: tuple[str, ...] = _ENDS
    tool_results_need_call: bool = False

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        body = without(text, _ENDS).strip()
        body = body.removeprefix(PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return []
        decoder, at, calls = json.JSONDecoder(), 0, list[ToolCall]()
        while at < len(body):
            where = f"tool call #{len(calls) + 1}"
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError as e:
                return ToolCallError(f"{where}: invalid JSON ({e.msg} at column {e.pos - at + 1})", snippet(body, at))
            if not isinstance(obj, dict):
                return ToolCallError(f"{where}: expected a JSON object, got {type(obj).__name__}", body[at:end])
            call = named_call(obj, where, body[at:end], keys=("parameters", "arguments"))
            if isinstance(call, ToolCallError):
                return call
            calls.append(call)
            at = _next_call(body, end)
            if at < 0:
                return ToolCallError(
                    f"after {where}: expected another call (after `;`) or the end of the turn", snippet(body, end)
                )
        return calls

    def answer(self, text: str) -> str:
        return without(text, (*_ENDS, PYTHON_TAG, "<|begin_of_text|>")).strip()


def _next_call(body: str, end: int) -> int:
    """Where the next call starts after one that ends at `end` (after a `;` or whitespace); len(body) at the
    end of the turn, -1 for anything else."""
    rest = body[end:].lstrip().removeprefix(";").lstrip()
    if not rest:
        return len(body)
    return len(body) - len(rest) if rest.startswith("{") else -1
