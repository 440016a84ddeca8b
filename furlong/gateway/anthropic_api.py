"""The Anthropic messages shape: a request body into a ChatRequest (system, text / tool_use / tool_result
blocks, tools with input schemas), a Reply into a message or its streaming events."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from furlong.gateway.reply import Reply
from furlong.gateway.request import (
    ChatRequest,
    RequestError,
    _get,
    _number,
    _positive,
    _refuse,
    _stops,
    _text,
    check_tool_results,
)


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(where, f"expected a string or a list of content blocks, got {type(content).__name__}")
    for i, b in enumerate(content):
        if not isinstance(b, Mapping) or b.get("type") not in ("text", "tool_use", "tool_result"):
            kind = b.get("type") if isinstance(b, Mapping) else type(b).__name__
            raise RequestError(f"{where}[{i}]", f"expected a text, tool_use or tool_result block, got {kind!r}")
    return content


def _user(blocks: list[Mapping[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: each tool_result becomes a tool message (in order), the text a user message after them."""
    out: list[dict[str, Any]] = []
    text = []
    for i, b in enumerate(blocks):
        if b["type"] == "tool_use":
            raise RequestError(f"{where}[{i}]", "tool_use blocks belong to assistant turns")
        if b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise RequestError(f"{where}[{i}].tool_use_id", "expected the id of the tool_use it answers")
            result = _text(b.get("content"), f"{where}[{i}].content")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b["tool_use_id"],
                    "content": f"Error: {result}" if b.get("is_error") else result,
                }
            )
        else:
            text.append(_text(b.get("text"), f"{where}[{i}].text"))
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[Mapping[str, Any]], where: str) -> dict[str, Any]:
    calls, text = [], []
    for i, b in enumerate(blocks):
        if b["type"] == "tool_result":
            raise RequestError(f"{where}[{i}]", "tool_result blocks belong to user turns")
        if b["type"] == "tool_use":
            if (
                not isinstance(b.get("id"), str)
                or not isinstance(b.get("name"), str)
                or not isinstance(b.get("input"), Mapping)
            ):
                raise RequestError(f"{where}[{i}]", "a tool_use block needs id, name and input (an object)")
            calls.append(
                {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": dict(b["input"])}}
            )
        else:
            text.append(_text(b.get("text"), f"{where}[{i}].text"))
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:  # no empty list: a template may read its presence as a call (Llama 3's raises on it)
        out["tool_calls"] = calls
    return out


def _tools(tools: Any) -> tuple[Mapping[str, Any], ...]:
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError("tools", f"expected a list, got {type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or t.get("type") not in (None, "custom"):
            raise RequestError(f"tools[{i}]", "expected a custom tool: name, description, input_schema")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
        )
    return tuple(out)


def parse_messages(body: Mapping[str, Any]) -> ChatRequest:
    _refuse(
        body,
        {
            "thinking": lambda v: isinstance(v, Mapping) and v.get("type") == "disabled",
            "mcp_servers": lambda v: not v,
            "container": lambda v: False,
        },
    )
    raw = _get(body, "messages", list)
    if not raw:
        raise RequestError("messages", "expected a non-empty list of messages")
    system = _text(body.get("system"), "system")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where}.role", "expected user or assistant")
        blocks = _blocks(m.get("content"), f"{where}.content")
        messages += (
            _user(blocks, f"{where}.content") if m["role"] == "user" else [_assistant(blocks, f"{where}.content")]
        )
    check_tool_results(messages, "messages")
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "none"):
        raise RequestError(
            "tool_choice",
            'expected {"type": "auto"} or {"type": "none"} ("any" and a named '
            "tool cannot be enforced on what the model samples)",
        )
    max_tokens = _positive(body, "max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens", "required (a positive integer)")
    return ChatRequest(
        messages=tuple(messages),
        tools=_tools(body.get("tools")),
        temperature=_number(body, "temperature", 1.0, 0.0, 1.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=int(_get(body, "top_k", int, 0)),
        max_tokens=max_tokens,
        stop=_stops(body, "stop_sequences"),
        stream=bool(_get(body, "stream", bool, False)),
        tool_choice=choice["type"],
        model=str(_get(body, "model", str, "")),
    )


def _content(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    return blocks + [
        {"type": "tool_use", "id": cid, "name": c.name, "input": c.arguments}
        for cid, c in zip(reply.call_ids, reply.tool_calls, strict=True)
    ]


def _stop_reason(reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_use"
    if reply.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if reply.finish_reason == "length" else "end_turn"


def message(reply: Reply, req: ChatRequest, rid: str) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": _content(reply),
        "stop_reason": _stop_reason(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
    }


def events(reply: Reply, req: ChatRequest, rid: str) -> Iterator[str]:
    """The message as Anthropic's streaming events, one content block at a time."""

    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    head = {
        **message(reply, req, rid),
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 0},
    }
    yield event("message_start", {"message": head})
    for i, block in enumerate(_content(reply)):
        if block["type"] == "text":
            yield event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": i, "delta": {"type": "text_delta", "text": block["text"]}})
        else:
            yield event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
            yield event(
                "content_block_delta",
                {"index": i, "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
            )
        yield event("content_block_stop", {"index": i})
    yield event(
        "message_delta",
        {
            "delta": {"stop_reason": _stop_reason(reply), "stop_sequence": reply.stop_sequence},
            "usage": {"output_tokens": reply.completion_tokens},
        },
    )
    yield event("message_stop", {})
