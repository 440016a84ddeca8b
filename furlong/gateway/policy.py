"""One chat request in, one sampled assistant turn out, recorded on the episode's trajectory.

The prompt comes from the trajectory (stored ids reused, only new messages rendered); the engine samples
until the format's end-of-turn marker; a stop string cuts the sampled ids where it completes (what was
sampled up to there is still the policy's); the text is parsed with the model's tool-call format. A call the
model wrote wrong comes back as plain text and is counted, never as an error.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from furlong.engine.base import Engine, Generation, SamplingParams
from furlong.gateway.reply import Reply, content_outside_calls
from furlong.gateway.request import ChatRequest, RequestError
from furlong.gateway.timing import Phases
from furlong.gateway.trajectory import Trajectory
from furlong.model.chat import ChatTemplateError, ToolCallError, end_of_turn_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from furlong.model.toolcall.base import ToolCallFormat


@dataclass(frozen=True)
class Policy:
    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    fmt: ToolCallFormat
    name: str  # the model name /v1/models lists
    max_context: int
    default_max_tokens: int = 512

    def trajectory(self) -> Trajectory:
        return Trajectory(self.tokenizer, self.fmt)

    async def reply(self, traj: Trajectory, req: ChatRequest, phases: Phases | None = None) -> Reply:
        phases = phases or Phases()
        try:
            ids = traj.prompt(req.messages, req.tools)
        except (TemplateError, ChatTemplateError) as e:  # the template's own refusal: the harness's to fix
            raise RequestError("messages", f"the model's chat template cannot render this conversation: {e}") from e
        room = self.max_context - len(ids)
        if room < 1:
            traj.abandon()
            raise RequestError(
                "messages",
                f"the conversation is {len(ids)} tokens: no room left in the {self.max_context}-token context",
            )
        phases.mark("render")
        try:
            gen = await self.engine.generate(ids, self._sampling(req, room))
        except BaseException:
            traj.abandon()
            raise
        phases.mark("engine")
        gen, stopped_by = self._cut(gen, req.stop)
        return self._record(traj, req, gen, stopped_by, len(ids), phases)

    def _sampling(self, req: ChatRequest, room: int) -> SamplingParams:
        stops = tuple(end_of_turn_id(self.tokenizer, m) for m in self.fmt.stops)
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_new_tokens=min(req.max_tokens or self.default_max_tokens, room),
            stop_token_ids=stops,
            seed=req.seed,
        )

    def _cut(self, gen: Generation, stops: tuple[str, ...]) -> tuple[Generation, str | None]:
        """The generation up to the token where a stop string first completes, and that string."""
        if not stops:
            return gen, None
        text = ""
        for k, token in enumerate(gen.output_ids):
            text += self._decode([token])
            hit = next((s for s in stops if s in text), None)
            if hit is not None:
                n = k + 1
                versions = gen.token_weight_versions[:n] if gen.token_weight_versions else ()
                return Generation(
                    gen.output_ids[:n], gen.logprobs[:n], "stop", gen.weight_version, versions, gen.prompt_len
                ), hit
        return gen, None

    def _decode(self, ids: Any) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _record(
        self,
        traj: Trajectory,
        req: ChatRequest,
        gen: Generation,
        stopped_by: str | None,
        prompt_tokens: int,
        phases: Phases | None = None,
    ) -> Reply:
        phases = phases or Phases()
        text = self._decode(gen.output_ids)
        marker = next((m for m in self.fmt.stops if text.endswith(m)), None)
        raw = text[: -len(marker)] if marker else text
        if stopped_by is not None:
            raw = raw[: raw.index(stopped_by)] if stopped_by in raw else raw
        parsed = self.fmt.parse(text, req.tools) if req.tools and req.tool_choice != "none" else []
        malformed = isinstance(parsed, ToolCallError)
        calls = () if isinstance(parsed, ToolCallError) else tuple(parsed)
        traj.malformed_calls += malformed
        content = self.fmt.answer(content_outside_calls(raw, bool(calls), self.fmt))
        call_ids = tuple(f"call_{secrets.token_hex(8)}" for _ in calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:  # no empty list: a template may read its presence as a call (Llama 3's raises on it)
            message["tool_calls"] = [{"id": i, **c.to_dict()} for i, c in zip(call_ids, calls, strict=True)]
        raw_text = self._decode(gen.output_ids[:-1]) if marker else self._decode(gen.output_ids)
        phases.mark("decode")
        traj.record(gen, message, raw_text, ended=marker is not None)
        phases.mark("record")
        reply = Reply(
            content=content,
            tool_calls=calls,
            call_ids=call_ids,
            finish_reason="length" if gen.finish_reason == "length" and not stopped_by else "stop",
            logprobs=gen.logprobs,
            # a decode per token: only where the request asked for logprobs, the one answer that shows them
            token_texts=tuple(self._decode([t]) for t in gen.output_ids) if req.logprobs else (),
            prompt_tokens=prompt_tokens,
            completion_tokens=gen.num_tokens,
            malformed_call=malformed,
            stop_sequence=stopped_by,
        )
        phases.mark("decode")  # the per-token texts
        return reply
