"""The OpenAI chat-completions shape: a request body into a ChatRequest, a Reply into a completion or its
server-sent-event chunks (the last carrying usage when the client asked for it)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from furlong.gateway.reply import Reply
from furlong.gateway.request import (
    ROLES,
    ChatRequest,
    RequestError,
    _arguments,
    _get,
    _number,
    _positive,
    _refuse,
    _stops,
    _text,
    _tool_schemas,
    check_tool_results,
)


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise RequestError(where, f"expected an object, got {type(m).__name__}")
    role = m.get("role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "assistant" and m.get("tool_calls"):
        if not isinstance(m["tool_calls"], list):
            raise RequestError(f"{where}.tool_calls", "expected a list")
        out["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise RequestError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
        raise RequestError(where, 'expected {"id": ..., "type": "function", "function": {"name", "arguments"}}')
    return {
        "id": c["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", {}), f"{where}.arguments")},
    }


def parse_chat(body: Mapping[str, Any]) -> ChatRequest:
    _refuse(
        body,
        {
            "n": lambda v: v == 1,
            "audio": lambda v: False,
            "modalities": lambda v: v == ["text"],
            "top_logprobs": lambda v: v == 0,
            "prediction": lambda v: False,
            "response_format": lambda v: isinstance(v, Mapping) and v.get("type") == "text",
            "logit_bias": lambda v: not v,
            "parallel_tool_calls": lambda v: True,
        },
    )
    messages = _get(body, "messages", list)
    if not messages:
        raise RequestError("messages", "expected a non-empty list of messages")
    parsed = tuple(_message(m, i) for i, m in enumerate(messages))
    check_tool_results(parsed, "messages")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise RequestError(
            "tool_choice",
            "expected auto or none (required and a named function cannot be enforced on what the model samples)",
        )
    options = _get(body, "stream_options", Mapping, {})
    return ChatRequest(
        messages=parsed,
        tools=_tool_schemas(body.get("tools")),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        max_tokens=_positive(body, "max_completion_tokens", "max_tokens"),
        stop=_stops(body, "stop"),
        seed=_get(body, "seed", int),
        logprobs=bool(_get(body, "logprobs", bool, False)),
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=bool(options.get("include_usage", False)),
        tool_choice=choice,
        model=str(_get(body, "model", str, "")),
    )


def _tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [
        {
            "id": cid,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
        }
        for cid, call in zip(reply.call_ids, reply.tool_calls, strict=True)
    ]


def _finish(reply: Reply) -> str:
    return "tool_calls" if reply.tool_calls else ("length" if reply.finish_reason == "length" else "stop")


def _logprobs(reply: Reply) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(reply.token_texts, reply.logprobs, strict=True)
        ]
    }


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def completion(reply: Reply, req: ChatRequest, rid: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls(reply)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": _finish(reply),
        "logprobs": _logprobs(reply) if req.logprobs else None,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": _usage(reply),
    }


def chunks(reply: Reply, req: ChatRequest, rid: str) -> Iterator[str]:
    """The completion as SSE `data:` lines: role, content, tool calls, the finish, usage, [DONE]."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model}

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return (
            "data: "
            + json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]})
            + "\n\n"
        )

    yield event({"role": "assistant", "content": ""})
    if reply.content:
        yield event({"content": reply.content}, logprobs=_logprobs(reply) if req.logprobs else None)
    if reply.tool_calls:
        yield event({"tool_calls": [{"index": i, **c} for i, c in enumerate(_tool_calls(reply))]})
    yield event({}, _finish(reply))
    if req.include_usage:
        yield "data: " + json.dumps({**head, "choices": [], "usage": _usage(reply)}) + "\n\n"
    yield "data: [DONE]\n\n"
