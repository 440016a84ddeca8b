"""GPT-OSS harmony: an assistant turn is one or more messages, each a header, <|message|>, the text and an
end marker. A call is a message to a function:

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the published template writes the recipient before the channel instead: `assistant to=functions.NAME
<|channel|>commentary json`; both are read). Sampling stops at <|call|> (a call: one per turn) or
<|return|> (the final answer); <|end|> ends a message inside a turn, and in history also the final answer,
which the template writes with <|return|> only as a conversation's last message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from furlong.model.chat import ToolCall, ToolCallError
from furlong.model.toolcall.base import Schemas, json_object, snippet

START, MESSAGE, END, CALL, RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_RE = re.compile(r"<\|channel\|>\s*(\w+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Harmony:
    name: str = "harmony"
    turn_ends: tuple[str, ...] = (END, CALL, RETURN)
    stops: tuple[str, ...] = (CALL, RETURN)
    tool_results_need_call: bool = True

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        calls: list[ToolCall] = []
        for header, body, end in messages(text):
            recipient = _RECIPIENT_RE.search(header)
            if recipient is None:
                if end == CALL:
                    return ToolCallError(
                        "a message ends with <|call|> but names no recipient (to=functions.NAME in its header)",
                        snippet(header + body),
                    )
                continue
            to = recipient.group(1)
            if not to.startswith(FUNCTIONS) or not to[len(FUNCTIONS) :]:
                return ToolCallError(
                    f"unknown recipient {to!r}: tools are called as to=functions.NAME", snippet(header + body)
                )
            name, where = to[len(FUNCTIONS) :], f"call to {to}"
            if end is None:
                return ToolCallError(f"{where}: cut off (no <|call|> after its arguments)", snippet(body), name)
            args = json_object(body.strip() or "{}", where, name)
            if isinstance(args, ToolCallError):
                return args
            calls.append(ToolCall(name=name, arguments=args))
        return calls

    def answer(self, text: str) -> str:
        """The final channel's text (else the last message's): the analysis is not the answer."""
        found = [(_channel(header), body) for header, body, _ in messages(text)]
        finals = [body for channel, body in found if channel == "final"]
        return (finals or [body for _, body in found] or [""])[-1].strip()


def messages(text: str) -> list[tuple[str, str, str | None]]:
    """(header, text, end marker or None when cut off) of each message in a sampled turn. The first header
    continues the generation prompt's `<|start|>assistant`; a part without <|message|> is a header cut off."""
    found: list[tuple[str, str, str | None]] = []
    for part in text.split(START):
        if not part.strip():
            continue
        header, sep, rest = part.partition(MESSAGE)
        if not sep:
            found.append((header, "", None))
            continue
        ends = [(rest.find(m), m) for m in (END, CALL, RETURN) if m in rest]
        at, marker = min(ends) if ends else (len(rest), None)
        found.append((header, rest[:at], marker))
    return found


def _channel(header: str) -> str | None:
    match = _CHANNEL_RE.search(header)
    return match.group(1) if match else None
