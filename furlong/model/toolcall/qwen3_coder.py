"""Qwen3-Coder's XML calls, in a ChatML turn that ends with <|im_end|>:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

The template writes a string value as it is, an object or a list as JSON, anything else with Python's str()
(True, 3, 1.5, None). So a value's type comes from the tool's JSON schema: a string stays text (a command
such as `42` or `[ -f x ]` is not a number or a list), integer/number/boolean/object/array/null are read back.
A parameter the schema does not type is text, unless it is a JSON object or array.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import ChatMLFormat, Schemas, snippet, unpaired
from furlong.model.toolcall.hermes import CALL_RE

_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]*)>(.*?)</function>\s*", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_NONE = ("None", "null")


@dataclass(frozen=True)
class Qwen3Coder(ChatMLFormat):
    name: str = "qwen3_coder"

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        types = parameter_types(tools)
        calls = each_call(text, lambda body, where: _parse_call(body, where, types))
        if isinstance(calls, ToolCallError):
            return calls
        rest = CALL_RE.sub("", text)
        if "<function=" in rest and "<tool_call>" not in rest:
            return ToolCallError(
                "<function=...> outside <tool_call>...</tool_call>", snippet(rest, rest.find("<function="))
            )
        return unpaired(rest, "<tool_call>", "</tool_call>") or calls


def each_call(text: str, parse_one: Callable[[str, str], ToolCall | ToolCallError]) -> list[ToolCall] | ToolCallError:
    """Every <tool_call>...</tool_call> body in `text` read by `parse_one(body, where)`; the first error."""
    calls: list[ToolCall] = []
    for i, match in enumerate(CALL_RE.finditer(text)):
        call = parse_one(match.group(1), f"tool call #{i + 1}")
        if isinstance(call, ToolCallError):
            return call
        calls.append(call)
    return calls


def parameter_types(tools: Schemas) -> dict[str, dict[str, Any]]:
    """tool name -> parameter name -> its JSON-schema type (a string, or a list of them)."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        params = function.get("parameters") if isinstance(function, Mapping) else None
        props = params.get("properties") if isinstance(params, Mapping) else None
        if isinstance(props, Mapping):
            types[str(function.get("name"))] = {k: v.get("type") for k, v in props.items() if isinstance(v, Mapping)}
    return types


def _parse_call(body: str, where: str, types: dict[str, dict[str, Any]]) -> ToolCall | ToolCallError:
    function = _FUNCTION_RE.fullmatch(body)
    if function is None:
        return ToolCallError(f"{where}: expected <function=NAME>...</function> inside <tool_call>", body)
    name, inner = function.group(1).strip(), function.group(2)
    if not name:
        return ToolCallError(f"{where}: <function=> names no function", body)
    stray = _PARAM_RE.sub("", inner).strip()
    if stray:
        return ToolCallError(f"{where}: text outside <parameter=KEY>...</parameter>: {stray[:80]!r}", body, name)
    pairs = ((p.group(1), _unwrap(p.group(2))) for p in _PARAM_RE.finditer(inner))
    return typed_call(name, pairs, types, "parameter", where, body)


def typed_call(
    name: str, pairs: Iterable[tuple[str, str]], types: dict[str, dict[str, Any]], noun: str, where: str, body: str
) -> ToolCall | ToolCallError:
    """The call `name` with each (key, text) pair's value typed by the tool's schema; a nameless or repeated key,
    or a value its schema refuses, is the error (`noun`: what the format calls an argument)."""
    args: dict[str, Any] = {}
    for raw, text in pairs:
        key = raw.strip()
        if not key or key in args:
            article = "an" if noun[0] in "aeiou" else "a"
            problem = f"{article} {noun} without a name" if not key else f"{noun} {key!r} given twice"
            return ToolCallError(f"{where}: {problem}", body, name)
        try:
            args[key] = schema_value(text, types.get(name, {}).get(key))
        except ValueError as e:
            return ToolCallError(f"{where}: {noun} {key!r}: {e}", body, name)
    return ToolCall(name=name, arguments=args)


def _unwrap(value: str) -> str:
    """The template writes one newline on either side of a value; the value's own whitespace stays."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _kinds(kind: Any) -> list[str]:
    """A schema's `type` as a list: "integer", ["string", "null"], or nothing known."""
    if isinstance(kind, str):
        return [kind]
    return [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []


def schema_value(text: str, kind: Any) -> Any:
    """`text` read as JSON-schema type `kind`; ValueError says why it cannot be."""
    kinds = _kinds(kind)
    if "null" in kinds and text.strip() in _NONE:
        return None
    real = [k for k in kinds if k != "null"]
    if "string" in real:
        return text
    if not real:
        return _untyped(text)
    value = text.strip()
    try:
        if real[0] == "integer":
            return int(value)
        if real[0] == "number":
            return int(value) if re.fullmatch(r"-?\d+", value) else float(value)
        if real[0] == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if real[0] in ("object", "array"):
            parsed = json.loads(value)
            if isinstance(parsed, dict if real[0] == "object" else list):
                return parsed
        elif real[0] != "boolean":
            return _untyped(text)  # a type this reader does not know: as if untyped
    except ValueError:  # int(), float() and json.loads (JSONDecodeError is one)
        pass
    raise ValueError(f"expected {real[0]}, got {text[:80]!r}")


def _untyped(text: str) -> Any:
    if text.strip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text
