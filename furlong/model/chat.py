"""Token-in/token-out (TITO) chat helpers for the agent loop, and Hermes-style tool-call parsing.

The agent keeps one growing list of token ids per episode: the rendered prompt, then alternately the ids the
engine sampled and the ids of the messages that answer them. Earlier ids are never re-tokenized from text,
because re-tokenizing sampled text can yield different ids than were sampled, and the trainer must score
exactly the tokens the policy produced. The pieces here are derived from the tokenizer's own chat template
(by rendering with and without the new messages and taking the difference), so they work for any
append-only ChatML-style template, the tiny model's and Qwen's alike.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # parsing tool calls must not cost a transformers import
    from transformers import PreTrainedTokenizerBase

END_OF_TURN = "<|im_end|>"


class ChatTemplateError(ValueError):
    """The chat template cannot be used incrementally (it rewrites earlier turns, or has no turn end)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / transformers message form that chat templates read."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallError:
    """Why the assistant's tool calls could not be parsed; the loop sends `message` back to the model."""

    message: str
    raw: str  # the offending snippet, for logs


@dataclass(frozen=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return d


MessageLike = Message | Mapping[str, Any]
# A stand-in history the incremental pieces are cut from; its content never reaches the output.
_STUB = (Message("system", "s"), Message("user", "u"), Message("assistant", "a"))


def _dicts(messages: Sequence[MessageLike]) -> list[dict[str, Any]]:
    return [m.to_dict() if isinstance(m, Message) else dict(m) for m in messages]


def render_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[MessageLike],
                tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = False) -> str:
    if not tokenizer.chat_template:
        raise ChatTemplateError("tokenizer has no chat template")
    text = tokenizer.apply_chat_template(_dicts(messages), tools=[dict(t) for t in tools] if tools else None,
                                         add_generation_prompt=add_generation_prompt, tokenize=False)
    assert isinstance(text, str)
    return text


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template already wrote every special token; the tokenizer must not add BOS/EOS of its own.
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[MessageLike],
                      tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The episode's first ids: system (+ tool schemas) and user messages, ending in the generation prompt."""
    return encode(tokenizer, render_text(tokenizer, messages, tools, add_generation_prompt=True))


def _turn_end(text: str, end_of_turn: str) -> int:
    """Index just past the last end-of-turn marker: where the sampled ids of an assistant turn stop."""
    at = text.rfind(end_of_turn)
    if at < 0:
        raise ChatTemplateError(f"chat template never writes the end-of-turn marker {end_of_turn!r}")
    return at + len(end_of_turn)


def continuation_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[MessageLike],
                      end_of_turn: str = END_OF_TURN) -> str:
    """What the template writes after an assistant turn's end marker, for `messages` (tool results or user
    turns) followed by the next generation prompt."""
    if not messages:
        raise ValueError("continuation needs at least one message")
    if any(d.get("role") == "assistant" for d in _dicts(messages)):
        raise ValueError("assistant turns are sampled, not rendered: pass only tool / user messages")
    head = render_text(tokenizer, _STUB)
    head = head[:_turn_end(head, end_of_turn)]
    full = render_text(tokenizer, [*_STUB, *messages], add_generation_prompt=True)
    if not full.startswith(head):
        raise ChatTemplateError("chat template rewrites earlier turns when later ones are added; "
                                "incremental (TITO) rendering would disagree with a full render")
    return full[len(head):]


def continuation_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[MessageLike],
                     close_turn: bool = False, end_of_turn: str = END_OF_TURN) -> list[int]:
    """Ids to append after the sampled ids of an assistant turn: the answering messages (usually role "tool")
    and the next generation prompt. `close_turn=True` first appends the end-of-turn id, for a turn that was
    cut off (finish_reason "length") before the model wrote it."""
    ids = encode(tokenizer, continuation_text(tokenizer, messages, end_of_turn))
    return [end_of_turn_id(tokenizer, end_of_turn), *ids] if close_turn else ids


def assistant_ids(tokenizer: PreTrainedTokenizerBase, message: MessageLike,
                  end_of_turn: str = END_OF_TURN) -> list[int]:
    """The ids a model would emit for `message` after the generation prompt, end-of-turn included. For SFT
    data and tests; in RL the sampled ids are used as they are."""
    prompt = render_text(tokenizer, _STUB[:2], add_generation_prompt=True)
    full = render_text(tokenizer, [*_STUB[:2], message])
    if not full.startswith(prompt):
        raise ChatTemplateError("generation prompt is not a prefix of the rendered assistant turn")
    return encode(tokenizer, full[len(prompt):_turn_end(full, end_of_turn)])


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase, end_of_turn: str = END_OF_TURN) -> int:
    ids = encode(tokenizer, end_of_turn)
    if len(ids) != 1:
        raise ChatTemplateError(f"{end_of_turn!r} is not a single token for this tokenizer: {ids}")
    return ids[0]


def format_tool_call(call: ToolCall) -> str:
    """The text form of one call, exactly as the chat template renders it (json.dumps default separators)."""
    return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments},
                                        ensure_ascii=False) + "\n</tool_call>"


_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall] | ToolCallError:
    """Every `<tool_call>{json}</tool_call>` in `text`, in order; [] when there is none (a final answer).

    Any malformed call makes the whole turn a ToolCallError (never an exception), so the loop can report
    it to the model and carry on.
    """
    calls: list[ToolCall] = []
    for i, match in enumerate(_CALL_RE.finditer(text)):
        call = _parse_one(match.group(1), i)
        if isinstance(call, ToolCallError):
            return call
        calls.append(call)
    rest = _CALL_RE.sub("", text)
    if "<tool_call>" in rest:
        return ToolCallError("unterminated <tool_call>: no closing </tool_call>", _snippet(rest, "<tool_call>"))
    if "</tool_call>" in rest:
        return ToolCallError("</tool_call> without an opening <tool_call>", _snippet(rest, "</tool_call>"))
    return calls


def _parse_one(body: str, index: int) -> ToolCall | ToolCallError:
    where = f"tool call #{index + 1}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})", body)
    if not isinstance(obj, dict):
        return ToolCallError(f"{where}: expected a JSON object, got {type(obj).__name__}", body)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(f'{where}: missing or empty "name" (a string)', body)
    if "arguments" not in obj:
        return ToolCallError(f'{where}: missing "arguments" (an object)', body)
    args = obj["arguments"]
    if isinstance(args, str):  # some models emit the arguments object as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCallError(f'{where}: "arguments" is a string but not valid JSON ({e.msg})', body)
    if not isinstance(args, dict):
        return ToolCallError(f'{where}: "arguments" must be an object, got {type(args).__name__}', body)
    return ToolCall(name=name, arguments=args)


def _snippet(text: str, marker: str, width: int = 200) -> str:
    at = text.find(marker)
    return text[at:at + width]
