"""The token-in/token-out inference contract every engine backend (hf, vllm, sglang, router) implements."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The engine could not serve a request (bad input, closed engine, failed forward pass)."""


class EngineUnavailable(EngineError):
    """No engine to serve here: the backend asked for cannot be built (not installed, unknown name, bad
    checkpoint path), or an engine process could not be reached (refused, reset, timed out): it is gone or
    hung, so the same request may be served by another instance (furlong.engine.router). An HTTP error reply
    is not this."""


class EngineTimedOut(EngineUnavailable):
    """An engine process took the request but did not answer in time: maybe hung, maybe only slow under load
    (a refused or reset connection is plain EngineUnavailable: nothing is listening there any more)."""


class EngineRefused(EngineError):
    """The engine answered and declined the request (an HTTP 4xx, or SGLang's `"success": false`): it is up,
    but did not do what was asked (a weight update it refused was not loaded)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    temperature 0 means greedy. top_k <= 0 and top_p >= 1 disable those filters. A sampled stop token is
    kept as the last output id (the trainer must see the end-of-turn token the policy chose).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # per-request RNG: same seed and inputs give the same sample, whatever the batch

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Accept any iterable of ints (a list is natural at call sites) but store a tuple: frozen means frozen.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Generation:
    """One completion.

    `logprobs[i]` is the log-probability of `output_ids[i]` under the sampling distribution: softmax of
    logits / temperature, *before* top-k / top-p truncation (for greedy: temperature 1). That is what a
    trainer recomputes from a forward pass at the same temperature, so the two can be compared for
    importance ratios. `token_weight_versions[i]` is the weight version that produced token i (an update can
    land mid-generation); `weight_version` is the oldest of them, the one that bounds staleness.
    """

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: int
    token_weight_versions: tuple[int, ...] = ()
    prompt_len: int = 0
    # MoE routing replay (furlong.model.moe): the experts each MoE layer chose for each position of prompt +
    # output, [prompt_len + num_tokens, layers, top_k] int16, UNKNOWN (-1) where this request ran no forward
    # (a prefix-cached prompt token, the last sampled token). None: the engine records none (only the
    # in-process hf engine does, with record_routes).
    routes: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)


def check_prompt(input_ids: Sequence[int], *, closed: bool, vocab_size: int, max_context: int) -> list[int]:
    """The prompt as a list of ints, or the EngineError every backend raises for it."""
    if closed:
        raise EngineError("engine is closed")
    prompt = [int(t) for t in input_ids]
    if not prompt:
        raise EngineError("input_ids is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"input_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(prompt) >= max_context:
        raise EngineError(f"prompt of {len(prompt)} tokens leaves no room in the {max_context}-token context")
    return prompt


def check_score(
    input_ids: Sequence[int], start: int, temperature: float, *, closed: bool, vocab_size: int, max_context: int
) -> list[int]:
    """A scoring request's ids as a list of ints, or the EngineError every backend raises for it: `start` must
    leave each scored token a context (1 <= start < len(input_ids)), and the whole sequence fit the context."""
    if closed:
        raise EngineError("engine is closed")
    ids = [int(t) for t in input_ids]
    if not 1 <= int(start) < len(ids):
        raise EngineError(
            f"start: expected 1 <= start < len(input_ids) = {len(ids)} (token 0 has no context), got {start}"
        )
    if not (temperature > 0 and math.isfinite(temperature)):
        raise EngineError(f"temperature: expected a finite value > 0 for scoring, got {temperature}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"input_ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if len(ids) > max_context:
        raise EngineError(f"input_ids: {len(ids)} tokens do not fit the {max_context}-token context")
    return ids


@runtime_checkable
class Engine(Protocol):
    """An inference engine shared by many concurrent episodes. All methods are async."""

    async def generate(self, input_ids: list[int], sampling: SamplingParams) -> Generation: ...

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """Prefill only, no sampling: the logprob of each of input_ids[start:] given the ids before it, under
        softmax(logits / temperature) in fp32, as furlong.train.logprobs.token_logprobs computes it (a teacher
        scoring a student's tokens, furlong.train.distill)."""
        ...

    async def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load (a subset of) the model's parameters between decode steps, then report `version`."""
        ...

    async def pause(self) -> None:
        """Stop running decode steps (in-flight requests wait, keeping their state) until resume()."""
        ...

    async def resume(self) -> None: ...

    @property
    def weight_version(self) -> int: ...
