"""Token-in/token-out (TITO) chat helpers for the agent loop, and the messages and tool calls they render.

The agent keeps one growing list of token ids per episode: the rendered prompt, then alternately the ids the
engine sampled and the ids of the messages that answer them. Earlier ids are never re-tokenized from text,
because re-tokenizing sampled text can yield different ids than were sampled, and the trainer must score
exactly the tokens the policy produced. The pieces here are derived from the tokenizer's own chat template
(by rendering with and without the new messages and taking the difference), so they work for any
append-only template: ChatML (the tiny model's, Qwen's), Llama 3's, GPT-OSS harmony's. Where an assistant
turn ends is the tool-call format's business (furlong.model.toolcall): `end_of_turn` is one marker or the
format's several (harmony ends a turn with <|call|>, <|return|> or, in history, <|end|>).
"""

from __future__ import annotations

import datetime
import json
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # parsing tool calls must not cost a transformers import
    from transformers import PreTrainedTokenizerBase

END_OF_TURN = "<|im_end|>"
# Templates that print today's date (Llama 3.1's "Today Date", gpt-oss's "Current date") would render another
# prompt each day: a run would not reproduce the next day, and a conversation re-rendered after midnight would
# no longer match the ids it sampled. Every render uses this one date instead (FURLONG_TEMPLATE_DATE,
# YYYY-MM-DD, overrides it; docs/models.md "The date a template prints").
TEMPLATE_DATE = datetime.date(2026, 12, 7)


class ChatTemplateError(ValueError):
    """The chat template cannot be used incrementally (it rewrites earlier turns, or has no turn end)."""


class ToolArguments(dict[str, Any]):
    """A call's arguments as templates read them: a mapping (transformers' form: `| tojson`, `.items()`), which
    joined to a string with `+` is its JSON text (OpenAI's form, which DeepSeek's own templates concatenate)."""

    def _json(self) -> str:
        return json.dumps(self, ensure_ascii=False)  # as transformers' tojson writes it

    def __add__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return self._json() + other

    def __radd__(self, other: object) -> str:
        if not isinstance(other, str):
            return NotImplemented
        return other + self._json()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / transformers message form that chat templates read."""
        return {"type": "function", "function": {"name": self.name, "arguments": ToolArguments(self.arguments)}}


@dataclass(frozen=True)
class ToolCallError:
    """Why the assistant's tool calls could not be parsed; the loop sends `message` back to the model."""

    message: str
    raw: str  # the offending snippet, for logs
    name: str | None = None  # the tool the model addressed, when the format could read it


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
EndOfTurn = str | Sequence[str]  # one marker, or a format's several (the first closes a cut-off turn)
# A stand-in history the incremental pieces are cut from; its content never reaches the output.
_STUB = (Message("system", "s"), Message("user", "u"), Message("assistant", "a"))
_REASONING = ("reasoning_content", "reasoning")  # a message's own reasoning, as templates read it
_PROBE = "\x00"  # prepended to a message's content to find where a render writes that content


def common_prefix_len(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share: os.path.commonprefix's answer, by slice comparisons
    (C speed; a conversation's render is compared every request) instead of a loop over characters."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n - 1  # a[:low] == b[:low] holds, a[:high + 1] != b[:high + 1]
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


# Facts of a tokenizer and its template that every request would otherwise recompute (a render or an encode
# each): per tokenizer, keyed by its chat template as well, since a caller may swap the template.
_FACTS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def _fact(tokenizer: PreTrainedTokenizerBase, key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
    facts = _FACTS.setdefault(tokenizer, {})
    key = (tokenizer.chat_template, *key)
    if key not in facts:
        facts[key] = compute()
    return facts[key]


def _dicts(messages: Sequence[MessageLike]) -> list[dict[str, Any]]:
    return [m.to_dict() if isinstance(m, Message) else dict(m) for m in messages]


def render_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    if not tokenizer.chat_template:
        raise ChatTemplateError("tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        _dicts(messages),
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        strftime_now=template_clock(),  # a render-time variable: it shadows transformers' global of that name
    )
    assert isinstance(text, str)
    return text


def template_date() -> datetime.date:
    """The date every chat template renders as today: FURLONG_TEMPLATE_DATE (YYYY-MM-DD) or TEMPLATE_DATE."""
    raw = os.environ.get("FURLONG_TEMPLATE_DATE")
    if not raw:
        return TEMPLATE_DATE
    try:
        return datetime.date.fromisoformat(raw)
    except ValueError:
        raise ChatTemplateError(f"FURLONG_TEMPLATE_DATE={raw!r}: expected a date as YYYY-MM-DD") from None


def template_clock() -> Callable[[str], str]:
    """transformers' `strftime_now(fmt)` for templates, at template_date() instead of the wall clock."""
    day = template_date()
    return lambda fmt: day.strftime(fmt)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # The template already wrote every special token; the tokenizer must not add BOS/EOS of its own.
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The episode's first ids: system (+ tool schemas) and user messages, ending in the generation prompt."""
    return encode(tokenizer, render_text(tokenizer, messages, tools, add_generation_prompt=True))


def _markers(end_of_turn: EndOfTurn) -> tuple[str, ...]:
    return (end_of_turn,) if isinstance(end_of_turn, str) else tuple(end_of_turn)


def _last_marker(text: str, end_of_turn: EndOfTurn) -> tuple[int, str]:
    """Where the last end-of-turn marker in `text` starts, and which it is."""
    ends = _markers(end_of_turn)
    at, marker = max((text.rfind(m), m) for m in ends)
    if at < 0:
        raise ChatTemplateError(f"chat template never writes an end-of-turn marker {' / '.join(ends)}")
    return at, marker


def _turn_end(text: str, end_of_turn: EndOfTurn) -> int:
    """Index just past the last end-of-turn marker: where the sampled ids of an assistant turn stop."""
    at, marker = _last_marker(text, end_of_turn)
    return at + len(marker)


def continuation_text(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    end_of_turn: EndOfTurn = END_OF_TURN,
    answered: MessageLike = _STUB[2],
    history: Sequence[MessageLike] = _STUB[:2],
) -> str:
    """What the template writes after an assistant turn's end marker, for `messages` (tool results or user
    turns) followed by the next generation prompt. `answered` stands for the turn they answer: a template
    may read it (harmony names a tool result after the call it answers); `history`, for what came before it
    (a stand-in by default: an append-only template writes the same continuation after any history).

    The answered turn's end marker may become another of the format's markers once the conversation goes
    on (harmony writes <|return|> after a conversation's last answer, <|end|> in history): the sampled
    marker stays in the episode's ids, and the continuation starts after either. A template that writes no
    end marker after an assistant turn (GLM-4.5's: the model ends its turn by writing the next turn's role,
    <|observation|> or <|user|>) has its markers open the next message: the continuation starts after the
    one the template writes there. The answered turn itself
    may be written otherwise too, where the template changes only what it writes around the turn's content
    (Qwen3's template gives a conversation's last assistant turn an empty think block and drops it once the
    conversation goes on): its sampled ids stay, and the continuation is what the template writes after its
    end marker in the longer render. Any other difference between the rendered history and a longer render
    (a turn before the answered one, or the answered turn's own text, as Qwen3's reasoning at a new user
    query) is a ChatTemplateError."""
    return _continuation(tokenizer, messages, end_of_turn, answered, history)[1]


def _continuation(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    end_of_turn: EndOfTurn,
    answered: MessageLike,
    history: Sequence[MessageLike],
) -> tuple[str, str]:
    """continuation_text's marker and what follows it."""
    if not messages:
        raise ValueError("continuation needs at least one message")
    if any(d.get("role") == "assistant" for d in _dicts(messages)):
        raise ValueError("assistant turns are sampled, not rendered: pass only tool / user messages")
    stub = [*history, answered]
    head = render_text(tokenizer, stub)
    body = head[: _answered_end(head, render_text(tokenizer, history), end_of_turn)]  # to its end marker
    full = render_text(tokenizer, [*stub, *messages], add_generation_prompt=True)
    if full.startswith(body):
        rest = full[len(body) :]
    else:  # the template may write the answered turn itself otherwise now that it is no longer the last
        rest = _after_rerendered_turn(tokenizer, history, answered, messages, end_of_turn)
    marker = next((m for m in _markers(end_of_turn) if rest.startswith(m)), None)
    if marker is None:
        raise ChatTemplateError(
            "chat template rewrites earlier turns when later ones are added; "
            "incremental (TITO) rendering would disagree with a full render"
        )
    return marker, rest[len(marker) :]


def _answered_end(head: str, before: str, end_of_turn: EndOfTurn) -> int:
    """Where the answered turn, the last of `head` (the render of `before` and that turn), ends: at its end
    marker, or at the end of `head` for a template that writes none after an assistant turn (its last
    marker is then in the history before the turn)."""
    at = _last_marker(head, end_of_turn)[0]
    return at if at >= common_prefix_len(head, before) else len(head)


def opens_next_turn(tokenizer: PreTrainedTokenizerBase, end_of_turn: EndOfTurn) -> bool:
    """Whether the template writes no end marker after an assistant turn, so that the format's markers are
    the next message's role (GLM-4.5): the model ends its turn by writing the role of what answers it."""

    def compute() -> bool:
        before, stub = render_text(tokenizer, _STUB[:2]), render_text(tokenizer, _STUB)
        return _answered_end(stub, before, end_of_turn) == len(stub)

    return bool(_fact(tokenizer, ("opens_next_turn", *_markers(end_of_turn)), compute))


def _after_rerendered_turn(
    tokenizer: PreTrainedTokenizerBase,
    history: Sequence[MessageLike],
    answered: MessageLike,
    messages: Sequence[MessageLike],
    end_of_turn: EndOfTurn,
) -> str:
    """The longer render from the answered turn's end marker on, for a template that writes the answered
    turn otherwise once messages follow it; "" where it changes anything else. The template may change only
    what it writes around a turn's content, as it does for the same turn with empty content (Qwen3's empty
    think block), or change the turn's last-turn form in a way that keeps everything the model said in it:
    a turn whose own text it drops (Qwen3 drops reasoning at a new user query) is a rewrite."""
    real = _answered_turn(tokenizer, history, answered, messages, end_of_turn)
    empty = {k: v for k, v in _dicts([answered])[0].items() if k not in _REASONING} | {"content": ""}
    empty_turn = _answered_turn(tokenizer, history, empty, messages, end_of_turn)
    if real is None or empty_turn is None:
        return ""
    (last, kept, rest), (last_empty, kept_empty, _) = real, empty_turn
    said = [v for k, v in _dicts([answered])[0].items() if k in ("content", *_REASONING) and isinstance(v, str)]
    if _same_edit(last, kept, last_empty, kept_empty) or _keeps(kept, kept_empty, said):
        return rest
    return ""


def _keeps(kept: str, kept_empty: str, said: Sequence[str]) -> bool:
    """Whether the turn as the template writes it in history still holds everything the model said in it
    (where the template's last-turn form changed it otherwise: Qwen3's strips leading newlines), in what it
    adds to the same turn with nothing said."""
    head = common_prefix_len(kept, kept_empty)
    tail = common_prefix_len(kept[head:][::-1], kept_empty[head:][::-1])
    added = kept[head : len(kept) - tail]
    return all(text in added for text in said)


def _same_edit(last: str, kept: str, last_empty: str, kept_empty: str) -> bool:
    """Whether `kept` is `last` with the one edit that turns `last_empty` into `kept_empty`. Where that edit
    starts is ambiguous when its text begins as what follows it does ("<think>" before "<tool_call>"): each
    start up to the common prefix is tried."""
    agree = common_prefix_len(last_empty, kept_empty)
    for head in range(agree, -1, -1):
        tail = common_prefix_len(last_empty[head:][::-1], kept_empty[head:][::-1])
        written = last_empty[head : len(last_empty) - tail]
        if written and last.replace(written, kept_empty[head : len(kept_empty) - tail], 1) == kept:
            return True
    return False


def _answered_turn(
    tokenizer: PreTrainedTokenizerBase,
    history: Sequence[MessageLike],
    answered: MessageLike,
    messages: Sequence[MessageLike],
    end_of_turn: EndOfTurn,
) -> tuple[str, str, str] | None:
    """The answered turn as the template writes it last (to its end marker), as it writes it followed by
    `messages`, and the longer render from there on; None where the text before the turn changes or the
    turn's end cannot be found. The turn ends at the last marker before the first new message's content,
    which starts where the longer render stops agreeing with one whose first new message has a probe
    character prepended (what precedes the content in both is the same: the message's role and header)."""
    before = render_text(tokenizer, history)
    head = render_text(tokenizer, [*history, answered])
    full = render_text(tokenizer, [*history, answered, *messages], add_generation_prompt=True)
    first = _dicts(messages)
    content = first[0].get("content")
    if not (head.startswith(before) and full.startswith(before)) or not isinstance(content, str):
        return None
    first[0]["content"] = _PROBE + content
    probe = render_text(tokenizer, [*history, answered, *first], add_generation_prompt=True)
    agree = common_prefix_len(full, probe)
    at = max(full.rfind(m, len(before), agree) for m in _markers(end_of_turn))
    if at <= len(before):
        return None
    return head[len(before) : _answered_end(head, before, end_of_turn)], full[len(before) : at], full[at:]


def continuation_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[MessageLike],
    close_turn: bool = False,
    end_of_turn: EndOfTurn = END_OF_TURN,
    answered: MessageLike = _STUB[2],
    history: Sequence[MessageLike] = _STUB[:2],
) -> list[int]:
    """Ids to append after the sampled ids of an assistant turn: the answering messages (usually role "tool")
    and the next generation prompt. `close_turn=True` first appends the end-of-turn id, for a turn that was
    cut off (finish_reason "length") before the model wrote it: where the markers open the next message
    (GLM-4.5), the one the template writes for `messages`. `answered`, `history`: continuation_text's."""
    marker, text = _continuation(tokenizer, messages, end_of_turn, answered, history)
    if not close_turn:
        return encode(tokenizer, text)
    if opens_next_turn(tokenizer, end_of_turn):
        return [end_of_turn_id(tokenizer, marker), *encode(tokenizer, text)]
    return [end_of_turn_id(tokenizer, end_of_turn), *encode(tokenizer, text)]


def assistant_ids(
    tokenizer: PreTrainedTokenizerBase, message: MessageLike, end_of_turn: EndOfTurn = END_OF_TURN
) -> list[int]:
    """The ids a model would emit for `message` after the generation prompt, end-of-turn included (where the
    markers open the next message, GLM-4.5's, the one that answers it: a tool result after a call, else a
    user turn). For SFT data and tests; in RL the sampled ids are used as they are."""
    prompt = render_text(tokenizer, _STUB[:2], add_generation_prompt=True)
    full = render_text(tokenizer, [*_STUB[:2], message])
    if not full.startswith(prompt):
        raise ChatTemplateError("generation prompt is not a prefix of the rendered assistant turn")
    if opens_next_turn(tokenizer, end_of_turn):
        said = _dicts([message])[0]
        reply = Message("tool" if said.get("tool_calls") else "user", "x")
        marker = _continuation(tokenizer, [reply], end_of_turn, message, _STUB[:2])[0]
        return encode(tokenizer, full[len(prompt) :] + marker)
    return encode(tokenizer, full[len(prompt) : _turn_end(full, end_of_turn)])


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase, end_of_turn: EndOfTurn = END_OF_TURN) -> int:
    """The id of `end_of_turn` (of a format's several markers, the first)."""
    marker = _markers(end_of_turn)[0]
    ids = _fact(tokenizer, ("end_of_turn_id", marker), lambda: encode(tokenizer, marker))
    if len(ids) != 1:
        raise ChatTemplateError(f"{marker!r} is not a single token for this tokenizer: {ids}")
    return ids[0]
