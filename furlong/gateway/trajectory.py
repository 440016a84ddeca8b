"""An episode's token-in/token-out trajectory, stitched from the harness's chat requests.

The harness resends the whole conversation with every request. When a request extends the previous one (the
same messages, the assistant turn exactly as the gateway returned it, then new tool results or user turns),
the stored ids are reused and only the new messages are rendered (furlong.model.chat.continuation_ids, after
the real history): text the model produced is never tokenized again, so the trainer scores exactly the sampled
tokens. When it does not (the harness summarised, truncated or edited its history), or the template would
write earlier turns otherwise (Qwen3 drops reasoning at a new user query), a new segment starts from a full
render and `history_rewrites` counts it; each segment trains with its own prompt.

`tito_mismatch_tokens` checks the stitching independently of how it was done: the final conversation is
rendered from text in one piece (assistant turns as the raw sampled text), the sampled spans are located in
that render in order, and the text between them is tokenized; every token where that differs from the stored
ids counts (turn by turn where a sampled turn's text is not in that render). It is 0 for an append-only
template; a template that rewrites history within a segment would show up here. `retokenize_drift_tokens` is what a naive proxy would have trained on instead: the whole render
tokenized from text, sampled spans included.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from furlong.engine.base import Generation
from furlong.model.chat import (
    ChatTemplateError,
    common_prefix_len,
    continuation_ids,
    encode,
    render_prompt_ids,
    render_text,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from furlong.model.toolcall.base import ToolCallFormat


@dataclass(frozen=True)
class GatewayStats:
    """What an episode's trajectory says about how its harness talked to the gateway (docs/gateway.md)."""

    requests: int = 0
    tito_mismatch_tokens: int = 0
    gateway_history_rewrites: int = 0
    malformed_calls: int = 0

    @classmethod
    def of(cls, records: Sequence[Mapping[str, Any]]) -> GatewayStats:
        """Summed over the record_dict()s of an episode's trajectories (one per agent phase)."""
        return cls(**{f: sum(int(r[f]) for r in records) for f in cls.__dataclass_fields__})


def canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a resent message to count as the same turn: whitespace around content and the
    JSON spelling of arguments are the harness's business, not a new conversation."""
    calls = tuple(
        (c["function"]["name"], repr(sorted(c["function"]["arguments"].items())))
        for c in message.get("tool_calls") or ()
    )
    return message["role"], (message.get("content") or "").strip(), calls, message.get("tool_call_id")


@dataclass
class Segment:
    tools: tuple[Mapping[str, Any], ...]
    messages: list[Mapping[str, Any]]  # the conversation so far, assistant turns as returned to the harness
    raw: list[Mapping[str, Any]]  # the same, assistant turns as the raw sampled text (for the mismatch check)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on sampled tokens only
    logprobs: list[float] = field(default_factory=list)  # the engine's, on sampled tokens; 0 elsewhere
    versions: list[int] = field(default_factory=list)  # weight version per sampled token; -1 elsewhere
    turns: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each sampled span
    open_turn: bool = False  # the last turn stopped before its end-of-turn marker (length, a stop string)

    def append(self, ids: Sequence[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


class Trajectory:
    """One episode's segments. Not thread-safe: the gateway serves one request per episode at a time."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, fmt: ToolCallFormat) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt
        self.segments: list[Segment] = []
        self.history_rewrites = 0
        self.requests = 0
        self.malformed_calls = 0
        self._undo: tuple[Segment, int, bool, int] | None = None  # the last prompt's segment, as it was

    def prompt(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids to generate from for this request, reusing the stored ids when it extends the last one.
        Everything is rendered before anything is stored: a conversation the chat template refuses (raises)
        leaves the trajectory as it was."""
        seg = self.segments[-1] if self.segments else None
        new = self._appended(seg, messages, tools)
        appended = None
        if seg is not None and new is not None:
            try:
                appended = continuation_ids(
                    self.tokenizer,
                    new,
                    close_turn=seg.open_turn,
                    end_of_turn=self.fmt.turn_ends,
                    answered=seg.messages[-1],
                    history=seg.messages[:-1],
                )
            except ChatTemplateError:  # the template writes this history otherwise: a new segment, from text
                appended = None
        if seg is None or appended is None or new is None:
            ids = render_prompt_ids(self.tokenizer, messages, tools or None)
            self.requests += 1
            self.history_rewrites += seg is not None
            seg = Segment(tools=tuple(tools), messages=list(messages), raw=list(messages))
            self.segments.append(seg)
            self._undo = (seg, 0, False, 0)
            seg.append(ids)
            return list(seg.ids)
        self.requests += 1
        self._undo = (seg, len(seg.ids), seg.open_turn, len(seg.messages))
        seg.append(appended)
        seg.messages += new
        seg.raw += new
        seg.open_turn = False
        return list(seg.ids)

    def _appended(
        self, seg: Segment | None, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> list[Mapping[str, Any]] | None:
        """The messages this request adds to `seg`'s conversation; None when it is not an extension."""
        if seg is None or tuple(tools) != seg.tools or not seg.turns or len(messages) <= len(seg.messages):
            return None
        if seg.messages[-1]["role"] != "assistant":
            return None
        if any(canonical(a) != canonical(b) for a, b in zip(seg.messages, messages, strict=False)):
            return None
        new = list(messages[len(seg.messages) :])
        return None if any(m["role"] == "assistant" for m in new) else new

    def abandon(self) -> None:
        """Forget the last prompt (its generation failed, or it left no room to sample): the next request
        starts from where it was, and the refused request is not counted."""
        if self._undo is None:
            return
        seg, size, open_turn, n_messages = self._undo
        self._undo = None
        self.requests -= 1
        if size == 0:  # the request had opened a new segment: a rewrite when one came before it
            self.segments.remove(seg)
            self.history_rewrites -= bool(self.segments)
            return
        del seg.ids[size:], seg.mask[size:], seg.logprobs[size:], seg.versions[size:]
        del seg.messages[n_messages:], seg.raw[n_messages:]
        seg.open_turn = open_turn

    def record(self, gen: Generation, message: Mapping[str, Any], raw_text: str, ended: bool) -> None:
        """The sampled turn: its ids with their logprobs and versions, and the message returned for it."""
        seg = self.segments[-1]
        start = len(seg.ids)
        seg.ids += gen.output_ids
        seg.mask += [1] * gen.num_tokens
        seg.logprobs += gen.logprobs
        seg.versions += gen.token_weight_versions or [gen.weight_version] * gen.num_tokens
        seg.turns.append((start, len(seg.ids)))
        seg.messages.append(message)
        seg.raw.append({"role": "assistant", "content": raw_text})
        seg.open_turn = not ended
        self._undo = None

    def record_dict(self) -> dict[str, Any]:
        mismatch, drift = zip(*(self._drift(s) for s in self.segments), strict=True) if self.segments else ((), ())
        return {
            "segments": [
                {"ids": s.ids, "mask": s.mask, "logprobs": s.logprobs, "versions": s.versions, "turns": s.turns}
                for s in self.segments
            ],
            "requests": self.requests,
            "gateway_history_rewrites": self.history_rewrites,
            "malformed_calls": self.malformed_calls,
            "tito_mismatch_tokens": sum(mismatch),
            "retokenize_drift_tokens": sum(drift),
        }

    def _drift(self, seg: Segment) -> tuple[int, int]:
        """(tito mismatch, naive re-tokenization drift) of one segment, over its ids up to the last turn."""
        if not seg.turns:
            return 0, 0
        stored = seg.ids[: seg.turns[-1][1]]
        try:
            text, spans = self.sampled_spans(seg)
        except (TemplateError, ChatTemplateError):  # the template refuses the raw sampled text (harmony's)
            # a naive proxy renders the turns as it returned them instead
            returned = render_text(self.tokenizer, _through_last_turn(seg.messages), seg.tools or None)
            return self._gaps_mismatch(seg), _differ(stored, encode(self.tokenizer, returned)[: len(stored)])
        naive = _differ(stored, encode(self.tokenizer, text)[: len(stored)])
        if spans is None:  # the template re-renders a sampled turn (Qwen3 drops an empty think block)
            return self._gaps_mismatch(seg), naive
        expected: list[int] = []
        pos = 0
        for (start, stop), (prompt_end, after) in zip(seg.turns, spans, strict=True):
            expected += encode(self.tokenizer, text[pos:prompt_end]) + seg.ids[start:stop]
            pos = after
        return _differ(stored, expected), naive

    def _gaps_mismatch(self, seg: Segment) -> int:
        """The check for a template that will not render the raw sampled text (gpt-oss's refuses channel
        markup in content): the ids between each two sampled turns against what the template writes there,
        rendered with the conversation's real history (assistant turns as returned to the harness)."""
        sampled = [i for i, m in enumerate(seg.messages) if m["role"] == "assistant"][-len(seg.turns) :]
        mismatch = 0
        for k in range(1, len(seg.turns)):
            before, now = sampled[k - 1], sampled[k]
            stop, nxt = seg.turns[k - 1][1], seg.turns[k][0]
            closed = self.tokenizer.decode(seg.ids[stop - 1 : stop]) in (*self.fmt.turn_ends, *self.fmt.stops)
            # a turn cut off is closed as the agent closes it: with the marker the template writes next
            # (GLM-4.5: the role of the message that follows)
            expected = continuation_ids(
                self.tokenizer,
                seg.messages[before + 1 : now],
                close_turn=not closed,
                end_of_turn=self.fmt.turn_ends,
                answered=seg.messages[before],
                history=seg.messages[:before],
            )
            mismatch += _differ(seg.ids[stop:nxt], expected)
        return mismatch

    def sampled_spans(self, seg: Segment) -> tuple[str, list[tuple[int, int]] | None]:
        """The segment's conversation rendered from text in one piece (assistant turns as the raw sampled
        text) through its last sampled turn, and for each sampled turn where the text before it ends and
        where its text ends (characters); None when the render does not contain one of them. The text before
        a turn ends where its own prompt's render does when that render is a prefix of this one: what the
        template writes between that and the sampled text is its re-render of the sampled turn (Qwen3's
        empty think block on a conversation's last turn), which the sampled ids stand for."""
        text = render_text(self.tokenizer, _through_last_turn(seg.raw), seg.tools or None)
        spans: list[tuple[int, int]] = []
        pos = 0
        sampled = [i for i, m in enumerate(seg.raw) if m["role"] == "assistant"][-len(seg.turns) :]
        for (start, stop), k in zip(seg.turns, sampled, strict=True):
            span = str(
                self.tokenizer.decode(
                    seg.ids[start:stop], skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            )
            # searched for only past where the turn's own prompt stops agreeing with the render: a short
            # span ("sys") also occurs in the text before it ("<|im_start|>system")
            prompt = render_text(self.tokenizer, seg.raw[:k], seg.tools or None, add_generation_prompt=True)
            agree = common_prefix_len(prompt, text)
            found = _locate(text, span, max(pos, agree), (*self.fmt.turn_ends, *self.fmt.stops))
            if found is None:
                return text, None
            spans.append((len(prompt) if agree == len(prompt) else found[0], found[1]))
            pos = found[1]
        return text, spans


def _locate(text: str, span: str, start: int, markers: Sequence[str]) -> tuple[int, int] | None:
    """Where the sampled `span` is in `text`, from `start`: as sampled, or as a template that trims what an
    assistant wrote renders it (Llama 3's: `content | trim`, its end marker right after). The sampled ids
    stay as sampled either way; only where the text around them is matters here."""
    at = text.find(span, start)
    if at >= 0:
        return at, at + len(span)
    marker = next((m for m in markers if span.endswith(m)), "")
    body = span[: len(span) - len(marker)].strip()
    at = text.find(body, start)
    if at < 0:
        return None
    end = at + len(body)
    return at, end + len(marker) if marker and text.startswith(marker, end) else end


def _through_last_turn(raw: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    last = max(i for i, m in enumerate(raw) if m["role"] == "assistant")
    return list(raw[: last + 1])


def _differ(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens of `a` not matched in `b` (insertions counted too): 0 exactly when the two are equal."""
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops if op != "equal")
