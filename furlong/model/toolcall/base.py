"""What every tool-call format shares: the protocol the agent loop reads, and the JSON checks of a call."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from furlong.model.chat import ToolCall, ToolCallError

Schemas = Sequence[Mapping[str, Any]]  # the episode's tool schemas (OpenAI function form)


class ToolCallFormat(Protocol):
    """How one family of chat templates writes tool calls and ends an assistant turn.

    `parse` never raises: a malformed call is a ToolCallError the loop shows the model, so a model that
    writes garbage loses a turn, never the episode or the run."""

    # read-only properties: the formats are frozen dataclasses
    @property
    def name(self) -> str: ...
    # What the template writes at the end of an assistant turn (the first also closes a cut-off turn).
    @property
    def turn_ends(self) -> tuple[str, ...]: ...
    # The markers whose tokens end sampling: a turn is over when the model writes one.
    @property
    def stops(self) -> tuple[str, ...]: ...
    # Tool results are addressed from the tool that was called (harmony): an error whose tool is
    # unknown goes back as a user message instead.
    @property
    def tool_results_need_call(self) -> bool: ...

    def parse(self, text: str, tools: Schemas = ()) -> list[ToolCall] | ToolCallError:
        """The calls in one sampled turn (decoded with special tokens), in order; [] for an answer."""
        ...

    def answer(self, text: str) -> str:
        """The answer a turn without a tool call gives, for an environment that replies to it."""
        ...


@dataclass(frozen=True)
class ChatMLFormat:
    """What the formats written inside ChatML turns (`<|im_start|>ROLE ... <|im_end|>`) share."""

    name: str = "chatml"
    turn_ends: tuple[str, ...] = ("<|im_end|>",)
    stops: tuple[str, ...] = ("<|im_end|>",)
    tool_results_need_call: bool = False

    def answer(self, text: str) -> str:
        return without(text, CHATML_CONTROL)


CHATML_CONTROL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def snippet(text: str, at: int = 0, width: int = 200) -> str:
    return text[max(at, 0) : max(at, 0) + width]


def without(text: str, markers: Sequence[str]) -> str:
    for marker in markers:
        text = text.replace(marker, "")
    return text


def json_object(
    body: str, where: str, name: str | None = None, raw: str | None = None
) -> dict[str, Any] | ToolCallError:
    """`body` as a JSON object, or the error the model is shown (`raw`: the snippet logged, else `body`)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})", raw or body, name)
    if not isinstance(obj, dict):
        return ToolCallError(f"{where}: expected a JSON object, got {type(obj).__name__}", raw or body, name)
    return obj


def named_call(
    obj: dict[str, Any], where: str, raw: str, keys: Sequence[str] = ("arguments",)
) -> ToolCall | ToolCallError:
    """A call from `{"name": ..., KEY: {...}}` for the first of `keys` present; the arguments may also be
    a JSON string holding the object (some models write them so)."""
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(f'{where}: missing or empty "name" (a string)', raw)
    key = next((k for k in keys if k in obj), None)
    if key is None:
        return ToolCallError(f'{where}: missing "{keys[0]}" (an object)', raw, name)
    args = obj[key]
    if isinstance(args, str):
        args = json_object(args, f'{where}: "{key}" (a string of JSON)', name, raw)
    if isinstance(args, ToolCallError):
        return args
    if not isinstance(args, dict):
        return ToolCallError(f'{where}: "{key}" must be an object, got {type(args).__name__}', raw, name)
    return ToolCall(name=name, arguments=args)


def unpaired(rest: str, opening: str, closing: str) -> ToolCallError | None:
    """The error for a tag left over once every complete `opening ... closing` pair is taken out."""
    if opening in rest:
        return ToolCallError(f"unterminated {opening}: no closing {closing}", snippet(rest, rest.find(opening)))
    if closing in rest:
        return ToolCallError(f"{closing} without an opening {opening}", snippet(rest, rest.find(closing)))
    return None
