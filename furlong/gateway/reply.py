"""One sampled assistant turn as both APIs answer it: the text, the tool calls parsed from it, and the
per-token facts a harness may ask for (logprobs)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from furlong.model.chat import ToolCall

# The call markup of the formats written inside the text (Hermes, Qwen3-Coder); what is outside is content.
_TAGGED_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Reply:
    content: str  # the text outside tool calls (the whole text when a call was malformed)
    tool_calls: tuple[ToolCall, ...]
    call_ids: tuple[str, ...]  # one per tool call: what the harness's tool results answer
    finish_reason: str  # stop | length
    logprobs: tuple[float, ...]  # of the sampled tokens, as the engine computed them
    token_texts: tuple[str, ...]  # each sampled token's text, where the request asked for logprobs; else ()
    prompt_tokens: int
    completion_tokens: int
    malformed_call: bool = False  # the model tried to call a tool and wrote it wrong: returned as text
    stop_sequence: str | None = None  # the request's stop string that ended the turn


def content_outside_calls(text: str, has_calls: bool, fmt: object = None) -> str:
    """The content to return beside parsed calls: text around tagged calls, or what the format's own
    `outside_calls` gives (pythonic, DeepSeek-V3, GLM-4.5); nothing for formats whose whole turn is the call
    (Llama 3 JSON, harmony's commentary channel)."""
    if not has_calls:
        return text
    outside = getattr(fmt, "outside_calls", None)
    if outside is not None:
        return str(outside(text))
    return _TAGGED_CALL.sub("", text).strip() if "<tool_call>" in text else ""
