"""What a harness asks the gateway for, read from an OpenAI chat-completions or Anthropic messages body.

Both APIs become one `ChatRequest`: messages in the form chat templates read (role, text content, tool calls
with their arguments as objects, the id of the call a tool result answers), the tools as OpenAI function
schemas, and the sampling settings. Everything a body carries is either honoured or refused with a
`RequestError` naming the field: a harness that asks for n > 1, images or top-k logprobs learns it at once
instead of training on something other than what it asked for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the gateway refuses (HTTP 400): `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Mapping[str, Any], ...]  # template form: role, content (str), tool_calls, tool_call_id
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI function schemas: {"type": "function", "function": ...}
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter (Anthropic's top_k; OpenAI has none)
    max_tokens: int | None = None  # None: as much as the context leaves
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    tool_choice: str = "auto"  # auto | none (required and a named function are refused: nothing forces them)
    model: str = ""


def _get(body: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise RequestError(key, f"expected {_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise RequestError(key, f"expected {_names(kinds)}, got {type(value).__name__}")
    return value


def _names(kinds: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = float(_get(body, key, (int, float), default))
    if not low <= value <= high:
        raise RequestError(key, f"expected a number in [{low}, {high}], got {value}")
    return value


def _positive(body: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = _get(body, key, int)
        if value is not None:
            if value < 1:
                raise RequestError(key, f"expected a positive integer, got {value}")
            return int(value)
    return None


def _stops(body: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = body.get(key)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise RequestError(key, "expected a non-empty string or a list of them")
    return tuple(items)


def _refuse(body: Mapping[str, Any], fields: Mapping[str, Any]) -> None:
    """Fields that would change what is sampled in ways the gateway cannot record: refused, never ignored."""
    for key, ok in fields.items():
        if key in body and body[key] is not None and not ok(body[key]):
            raise RequestError(key, f"not supported by furlong's gateway (got {json.dumps(body[key])[:80]})")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts; any other part (image, audio) is refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"expected a string or a list of content parts, got {type(content).__name__}")
    parts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestError(f"{where}[{i}]", f"only text parts are supported, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def _arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(where, f"not JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise RequestError(where, f"expected a JSON object, got {type(raw).__name__}")
    return raw


def check_tool_results(messages: Sequence[Mapping[str, Any]], where: str) -> None:
    """Every tool result answers a call an earlier assistant turn made (by id), or the request is refused."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            made.add(call["id"])
        if m["role"] == "tool" and m.get("tool_call_id") not in made:
            raise RequestError(
                f"{where}[{i}].tool_call_id",
                f"{m.get('tool_call_id')!r} answers no tool call made earlier in the conversation",
            )


def _tool_schemas(tools: Any, key: str = "tools") -> tuple[Mapping[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError(key, f"expected a list, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(fn, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise RequestError(f"{key}[{i}]", 'expected {"type": "function", "function": {"name": ..., ...}}')
        out.append({"type": "function", "function": dict(fn)})
    return tuple(out)
