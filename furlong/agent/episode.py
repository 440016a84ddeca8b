"""One model-driven episode, token in / token out: the ids the model sampled and the ids of the tool
results are appended to one list, never re-tokenized, with a loss mask of 1 exactly on sampled ids."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from furlong.agent.tools import BASH_TOOL, ToolRunner
from furlong.engine.base import Engine, SamplingParams
from furlong.metrics.timing import Clock, EpisodeTiming
from furlong.model.chat import Message, ToolCallError, continuation_ids, end_of_turn_id, parse_tool_calls, render_prompt_ids
from furlong.seeding import mix_seed
from furlong.sandbox.base import ImageRef, SandboxError, SandboxSpec
from furlong.tasks.model import Task
from furlong.tasks.verifier import verify

SYSTEM_PROMPT = ("You are an agent in a Linux terminal. Use the bash tool to complete the task. "
                 "When the task is done, reply without a tool call.")


@dataclass(frozen=True)
class AgentParams:
    max_turns: int = 4
    max_context_tokens: int = 1024
    max_new_tokens: int = 128  # per model turn
    command_timeout_s: float = 10.0
    observation_chars: int = 600  # a tool result beyond this is cut, keeping head and tail
    system_prompt: str = SYSTEM_PROMPT
    tool_schema_in_prompt: bool = False  # tiny models do better without the JSON schema in context


@dataclass(frozen=True)
class Episode:
    task_id: str
    group_id: int
    sample_id: int
    prompt_len: int
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 exactly on model-sampled tokens
    rollout_logprobs: tuple[float, ...]  # 0.0 where loss_mask is 0
    token_weight_versions: tuple[int, ...]  # -1 where loss_mask is 0
    reward: float | None  # None for infra_error: never scored
    status: str  # ok | truncated | timeout | infra_error
    timing: EpisodeTiming
    turns: int
    error: str | None = None
    tool_errors: int = 0

    @property
    def response_len(self) -> int:
        return sum(self.loss_mask)


@dataclass
class _Trace:
    """The growing token record of one episode."""

    tokens: list[int]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.mask, self.logprobs, self.versions = [0] * n, [0.0] * n, [-1] * n

    def add_sampled(self, ids, logprobs, versions) -> None:
        self.tokens += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)


async def run_episode(task: Task, engine: Engine, tokenizer, backend, image: ImageRef, params: AgentParams,
                      sampling: SamplingParams, group_id: int = 0, sample_id: int = 0) -> Episode:
    """Never raises for the model's, the task's or the sandbox's fault: failures become the status."""
    clock = Clock()
    messages = [Message("system", params.system_prompt), Message("user", task.instruction)]
    trace = _Trace(render_prompt_ids(tokenizer, messages, [BASH_TOOL] if params.tool_schema_in_prompt else None))
    prompt_len, sandbox, turns, status, error = len(trace.tokens), None, 0, "ok", None
    runner = None
    try:
        t = time.perf_counter()
        sandbox = await backend.create(SandboxSpec(image=image, network=task.network, limits=task.limits))
        await sandbox.exec("true", timeout_s=30)
        clock.add("sandbox_start", t)
        runner = ToolRunner(sandbox, params.command_timeout_s, params.observation_chars)
        try:
            turns, status = await asyncio.wait_for(
                _converse(trace, engine, tokenizer, runner, params, sampling, clock), task.agent_timeout_s)
        except asyncio.TimeoutError:
            status = "timeout"
        t = time.perf_counter()
        verdict = await verify(task, sandbox, image.workdir)
        clock.add("verifier", t)
        reward = verdict.reward
        if reward is None:
            status, error = "infra_error", verdict.problem
        elif verdict.timed_out:
            status, error = "timeout", verdict.problem
    except SandboxError as exc:
        reward, status, error = None, "infra_error", f"{type(exc).__name__}: {exc}"
    finally:
        if sandbox is not None:
            await sandbox.close()
        if runner is not None:
            clock.spent["agent_commands"] = runner.seconds
    return Episode(task_id=task.id, group_id=group_id, sample_id=sample_id, prompt_len=prompt_len,
                   tokens=tuple(trace.tokens), loss_mask=tuple(trace.mask), rollout_logprobs=tuple(trace.logprobs),
                   token_weight_versions=tuple(trace.versions), reward=reward, status=status,
                   timing=clock.timing(), turns=turns, error=error, tool_errors=runner.errors if runner else 0)


async def _converse(trace: _Trace, engine: Engine, tokenizer, runner: ToolRunner, params: AgentParams,
                    sampling: SamplingParams, clock: Clock) -> tuple[int, str]:
    """Model turn, tool calls, observations... until a turn without a tool call or a limit."""
    eot = end_of_turn_id(tokenizer)
    for turn in range(1, params.max_turns + 1):
        budget = params.max_context_tokens - len(trace.tokens)
        if budget <= 0:
            return turn - 1, "truncated"
        t = time.perf_counter()
        gen = await engine.generate(list(trace.tokens), SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_new_tokens=min(params.max_new_tokens, budget), stop_token_ids=(eot,),
            seed=None if sampling.seed is None else mix_seed(sampling.seed, turn)))
        clock.add("model_wait", t)
        trace.add_sampled(list(gen.output_ids), list(gen.logprobs), list(gen.token_weight_versions))
        if gen.finish_reason != "stop":
            return turn, "truncated"  # cut off mid-turn: no well-formed turn to answer
        calls = parse_tool_calls(tokenizer.decode(gen.output_ids, skip_special_tokens=False))
        if not isinstance(calls, ToolCallError) and not calls:
            return turn, "ok"  # the model answered without a tool call: it is done
        observations = [Message("tool", runner.error_text(calls))] if isinstance(calls, ToolCallError) else [
            Message("tool", await runner.run(call)) for call in calls]
        trace.add_context(continuation_ids(tokenizer, observations))
    return params.max_turns, "truncated"
