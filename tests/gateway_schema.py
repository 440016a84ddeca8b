"""An OpenAPI description of the gateway's harness-facing routes, for tests/test_gateway_fuzz.py (the gateway
serves no schema of its own: it reads bodies itself, to refuse what it cannot honour with the field's name).

It says what the OpenAI and Anthropic SDKs send: schemathesis's positive mode then makes requests a harness
could send (most still refused: a tool result for a call never made, n > 1), its negative mode breaks them.
The integers that size the work (max_tokens) are kept small so that an accepted request samples a few tokens.
"""

from __future__ import annotations

from typing import Any

_STR: dict[str, Any] = {"type": "string", "maxLength": 40}
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["text", "image_url"]}, "text": _STR},
}
_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"enum": ["call_1", "call_2"]},
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"enum": ["bash"]}, "arguments": {"enum": ['{"command": "ls"}', "{}", "{"]}},
        },
    },
}
_CONTENT = {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART, "maxItems": 2}, {"type": "null"}]}


def _role(roles: list[str], required: list[str], **fields: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["role", "content", *required],
        "properties": {"role": {"enum": roles}, "content": _CONTENT, **fields},
        "additionalProperties": False,
    }


# one shape per role, as a client sends them: most conversations get past the checks, a tool result
# answering a call no assistant turn made is still refused
_OPENAI_MESSAGE = {
    "oneOf": [
        _role(["system", "developer", "user"], []),
        _role(["assistant"], [], tool_calls={"type": "array", "items": _CALL, "maxItems": 2}),
        _role(["tool"], ["tool_call_id"], tool_call_id={"enum": ["call_1", "call_2"]}),
    ]
}
_FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"enum": ["bash", "read"]}, "description": _STR, "parameters": {"type": "object"}},
        },
    },
}
_FEW_TOKENS = {"type": "integer", "minimum": 1, "maximum": 4}

CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": _STR,
        "messages": {"type": "array", "items": _OPENAI_MESSAGE, "minItems": 1, "maxItems": 4},
        "tools": {"type": "array", "items": _FUNCTION_TOOL, "maxItems": 2},
        "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "max_tokens": _FEW_TOKENS,
        "max_completion_tokens": _FEW_TOKENS,
        "stop": {"anyOf": [_STR, {"type": "array", "items": _STR, "maxItems": 2}]},
        "seed": {"type": "integer"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "n": {"type": "integer", "minimum": 1, "maximum": 3},
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    },
}
_BLOCK = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["text", "tool_use", "tool_result", "image"]},
        "text": _STR,
        "id": {"enum": ["toolu_1", "toolu_2"]},
        "name": {"enum": ["bash"]},
        "input": {"type": "object"},
        "tool_use_id": {"enum": ["toolu_1", "toolu_2"]},
        "content": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART, "maxItems": 2}]},
        "is_error": {"type": "boolean"},
    },
}
MESSAGES = {
    "type": "object",
    "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": _STR,
        "max_tokens": _FEW_TOKENS,
        "messages": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["user", "assistant"]},
                    "content": {"anyOf": [_STR, {"type": "array", "items": _BLOCK, "maxItems": 3}]},
                },
            },
        },
        "system": {"anyOf": [_STR, {"type": "array", "items": _TEXT_PART, "maxItems": 2}]},
        "tools": {
            "type": "array",
            "maxItems": 2,
            "items": {
                "type": "object",
                "required": ["name", "input_schema"],
                "properties": {"name": {"enum": ["bash", "read"]}, "description": _STR, "input_schema": {"type": "object"}},
            },
        },
        "tool_choice": {"type": "object", "properties": {"type": {"enum": ["auto", "none", "any", "tool"]}}},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": 50},
        "stop_sequences": {"type": "array", "items": _STR, "maxItems": 2},
        "stream": {"type": "boolean"},
    },
}
EXEC = {
    "type": "object",
    "required": ["command"],
    "properties": {"command": {"type": "string", "maxLength": 60}, "timeout_s": {"type": "number"}},
}


def _post(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "ok"}},
        }
    }


SCHEMA: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "furlong gateway (harness routes)", "version": "1"},
    "paths": {
        "/v1/chat/completions": _post(CHAT),
        "/v1/messages": _post(MESSAGES),
        "/v1/models": {"get": {"responses": {"200": {"description": "ok"}}}},
        "/furlong/v1/exec": _post(EXEC),
    },
}
