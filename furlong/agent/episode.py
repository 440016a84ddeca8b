"""One model-driven episode, token in / token out: the ids the model sampled and the ids of the tool
results are appended to one list, never re-tokenized, with a loss mask of 1 exactly on sampled ids.

The conversation is the agent phase (`ModelAgent`) of the one episode runner, furlong.agent.runner,
which owns the sandbox, the verifier, the status and the reward (its docstring has the rules).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from furlong.agent.runner import AgentRun, Outcome, SandboxSource, run_retrying
from furlong.agent.tools import BASH_TOOL, ToolRunner
from furlong.engine.base import Engine, SamplingParams
from furlong.envs.base import Environment, EnvSpec, StepScore, Toolbox, Usage
from furlong.gateway.trajectory import GatewayStats
from furlong.model.chat import (
    Message,
    ToolCall,
    ToolCallError,
    continuation_ids,
    end_of_turn_id,
    render_prompt_ids,
)
from furlong.model.moe import merge_routes
from furlong.model.toolcall import tool_format
from furlong.seeding import mix_seed
from furlong.timing import EpisodeTiming

if TYPE_CHECKING:
    import torch

    from furlong.config import AgentConfig


@dataclass(frozen=True)
class AgentParams:
    """The agent loop's limits and prompt: the config's `train.agent` keys of the same names
    (furlong.config.AgentConfig holds their defaults and meanings)."""

    max_turns: int
    max_context_tokens: int
    max_new_tokens: int  # per model turn
    command_timeout_s: float
    observation_chars: int  # a tool result beyond this is cut, keeping head and tail
    system_prompt: str
    tool_schema_in_prompt: bool
    tool_format: str  # auto, or a name in furlong.model.toolcall.FORMATS

    @classmethod
    def of(cls, agent: AgentConfig) -> AgentParams:
        """From the config's `train.agent` node: training and `furlong eval --agent model` run the same
        loop with the same limits."""
        return cls(**{f.name: getattr(agent, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class TeacherScore:
    """What on-policy distillation's teacher made of an episode (furlong.train.distill; docs/distill.md)."""

    status: str  # scored | teacher_failed (the scoring raised) | unscorable (no prompt to re-render)
    tokens: int = 0  # sampled tokens the teacher scored (its prefill was longer: the prompt and observations)
    reverse_kl: float | None = None  # mean over those of logp_rollout - logp_teacher (a k1 estimate)
    error: str | None = None  # why it failed, one line

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "tokens": self.tokens, "reverse_kl": self.reverse_kl, "error": self.error}


@dataclass(frozen=True, kw_only=True)
class Episode:
    task_id: str
    group_id: int  # RL: its group's index in the stream of groups (rollout/scheduler.py); eval: its task's index
    step: int | None = None  # the RL step its group was planned for; None outside RL (held-out eval)
    attempt: int = 0  # 0, or how many stale copies of its group were re-queued before this one
    sample_id: int
    prompt_len: int
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 exactly on model-sampled tokens
    rollout_logprobs: tuple[float, ...]  # 0.0 where loss_mask is 0
    token_weight_versions: tuple[int, ...]  # -1 where loss_mask is 0
    reward: float | None  # None exactly for infra_error: never scored, never trained on
    status: str  # one of furlong.agent.runner.STATUSES
    timing: EpisodeTiming
    turns: int
    error: str | None = None
    tool_errors: int = 0
    family: str | None = None
    tampered_paths: tuple[str, ...] = ()  # what the agent changed that the tests execute (furlong.tasks.integrity)
    integrity_checked: bool | None = None  # its reward checked against tampering (Outcome.integrity_checked)
    rewards: dict[str, float] = field(default_factory=dict)  # the reward's parts (tests, reward functions)
    steps: tuple[StepScore, ...] = ()  # a multi-step task's steps that ran, each with its reward
    traceback: str | None = None  # the exception that decided its outcome, where one did (Outcome.traceback)
    receipts: tuple[Any, ...] = ()  # what its reward was computed from (Outcome.receipts: furlong.tasks.receipt)
    gateway: GatewayStats | None = None  # a harness episode's (furlong.agent.harness); None for furlong's own loop
    # The prompt as messages (system, user) and the tool schemas rendered into it, as the agent rendered
    # tokens[:prompt_len]: a distillation teacher renders them with its own system prompt and template.
    # Empty for a harness episode (its program wrote its own prompt).
    prompt: tuple[Message, ...] = ()
    prompt_tools: tuple[dict, ...] | None = None
    # MoE routing replay (furlong.model.moe): the experts the engine chose per token, [len(tokens), layers,
    # top_k] int16, -1 where it recorded none; None: the engine recorded no routes (a dense model, vLLM).
    routes: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # Distillation (train.distill): the teacher's logprob of each token, aligned like rollout_logprobs (0.0
    # where loss_mask is 0); None before scoring or where the teacher gave none (`distill` says why).
    teacher_logprobs: tuple[float, ...] | None = None
    distill: TeacherScore | None = None

    @property
    def response_len(self) -> int:
        return sum(self.loss_mask)

    @cached_property
    def oldest_version(self) -> int | None:
        """The weight version of its oldest sampled token (None: nothing was sampled); staleness and
        sample lag are measured from it."""
        return min((v for v, m in zip(self.token_weight_versions, self.loss_mask) if m), default=None)

    @property
    def group_key(self) -> tuple[str, int | None, int, int]:
        """The GRPO group it belongs to: one per (step, group, attempt), so two re-queued copies of a group
        in one batch are two groups; the task id too, so two tasks reusing a group number never pool."""
        return self.task_id, self.step, self.group_id, self.attempt

    @property
    def response_sha(self) -> str:
        return response_sha(self.tokens, self.loss_mask)


def response_sha(tokens: Sequence[int], loss_mask: Sequence[int]) -> str:
    """A short digest of the sampled ids: two episodes with the same one sampled the same tokens."""
    sampled = ",".join(str(t) for t, m in zip(tokens, loss_mask) if m)
    return hashlib.sha256(sampled.encode()).hexdigest()[:16]


@dataclass
class _Trace:
    """The growing token record of one episode."""

    tokens: list[int]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: torch.Tensor | None = None  # furlong.model.moe.merge_routes of every turn's Generation.routes

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


class ModelAgent:
    """The agent phase of a model-driven episode: one conversation, its tokens kept in `trace` (also
    when the phase ends by a timeout or a broken sandbox: those tokens are trained on too)."""

    name = "model"

    def __init__(self, engine: Engine, tokenizer, params: AgentParams, sampling: SamplingParams, instruction: str):
        self.engine, self.tokenizer, self.params, self.sampling = engine, tokenizer, params, sampling
        self.format = tool_format(tokenizer, params.tool_format)
        self.instruction = instruction
        self._messages = [Message("system", params.system_prompt), Message("user", instruction)]
        self._prompt((BASH_TOOL,))
        self.model_wait_s = 0.0  # finished engine waits; engine_wait_s() adds one in progress
        self._waiting_since: float | None = None  # perf_counter() at the start of an engine wait in progress
        self.turns = 0
        self.tool_calls = 0
        self.tool_errors = 0
        self._started = False
        # the trajectory's last sampled turn while nothing answers it yet: (cut off by the token limit, the
        # name of its tool call still running); None once the tokens after it are in the trace
        self._open: tuple[bool, str | None] | None = None

    def _prompt(self, schemas: Sequence[dict]) -> None:
        """The episode's first tokens (with the tool schemas when params.tool_schema_in_prompt)."""
        self.schemas = tuple(schemas)
        self.shown_schemas = self.schemas if self.params.tool_schema_in_prompt else None
        shown = list(self.shown_schemas) if self.shown_schemas is not None else None
        self.trace = _Trace(render_prompt_ids(self.tokenizer, self._messages, shown))
        self.prompt_len = len(self.trace.tokens)
        self.prompt_messages = tuple(self._messages)  # what tokens[:prompt_len] renders

    @property
    def response_len(self) -> int:
        """Tokens the model sampled so far (the loss mask's ones)."""
        return sum(self.trace.mask)

    @property
    def response_sha(self) -> str:
        return response_sha(self.trace.tokens, self.trace.mask)

    def usage(self) -> Usage:
        """Its tokens and turns so far (furlong.agent.runner.Agent's optional usage)."""
        return Usage(prompt_tokens=self.prompt_len, generated_tokens=self.response_len, turns=self.turns)

    def engine_wait_s(self) -> float:
        """Seconds spent waiting on the engine so far, a wait in progress included: the runner's hard limit
        on the agent phase excuses them too."""
        since = self._waiting_since
        return self.model_wait_s + (0.0 if since is None else time.perf_counter() - since)

    async def run(self, spec: EnvSpec, tools: Toolbox, timeout_s: float) -> AgentRun:
        """One agent phase. Called again for each later step of a multi-step episode: that step's instruction
        is then the next user turn of the same conversation (one trajectory, one reward)."""
        if self._started:
            if not self._next_instruction(spec.instruction):
                return AgentRun(commands=self.tool_calls, truncated=True)
        else:
            self._open_conversation(spec, tools)
        self._started = True
        runner = ToolRunner(tools, self.params.command_timeout_s, self.params.observation_chars)
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                status = await self._converse(runner, deadline, answers_only=not tools.schemas)
        except TimeoutError:
            if not deadline.expired():
                raise  # not our deadline: a sandbox call's own timeout, for the runner to judge
            return AgentRun(commands=self.tool_calls, timed_out=True)
        finally:
            self.tool_errors += runner.errors
        return AgentRun(commands=self.tool_calls, truncated=status == "truncated")

    def _next_instruction(self, instruction: str) -> bool:
        """A later step's instruction appended as the next user turn; False where the trajectory already
        ended at a limit (its turns or context are spent), so the step gets no turn."""
        if self._open is None or self.turns >= self.params.max_turns:
            return False
        cut, call = self._open
        running = call is not None and not cut  # the step's time ran out during this call
        messages = [Message("tool", STEP_OVER)] if running else []
        ids = continuation_ids(
            self.tokenizer,
            [*messages, Message("user", instruction)],
            close_turn=cut,
            end_of_turn=self.format.turn_ends,
            answered=_calling(call) if running and call else _ANSWER,
        )
        if len(self.trace.tokens) + len(ids) >= self.params.max_context_tokens:
            return False
        self.trace.add_context(ids)
        self._open = None
        return True

    def _open_conversation(self, spec: EnvSpec, tools: Toolbox) -> None:
        opening = getattr(tools, "opening", None)  # optional (furlong.envs.base.Toolbox)
        if opening:  # the environment's first observation follows the instruction
            text = f"{self.instruction}\n\n{opening}" if self.instruction else opening
            self._messages[1] = Message("user", text)
        own_system = system_prompt(spec, self.params) != self._messages[0].content
        if own_system:  # the instance's own system message (a prompt dataset's row may have one)
            self._messages[0] = Message("system", system_prompt(spec, self.params))
        if opening or own_system or (self.params.tool_schema_in_prompt and tuple(tools.schemas) != self.schemas):
            self._prompt(tools.schemas)  # the environment's own tools and opening, before the first turn

    async def _converse(self, runner: ToolRunner, deadline: asyncio.Timeout, answers_only: bool = False) -> str:
        """Model turn, tool calls, observations... until a turn without a tool call or a limit.

        The task's agent timeout counts the agent's work in the sandbox, not the time spent waiting on
        the shared engine: that depends on the load others put on it (a busy engine must not turn a
        policy's episode into a zero), and a turn's tokens are bounded by max_new_tokens anyway.
        `answers_only` (an environment without tools): every turn is an answer, whatever text it holds, and
        a turn cut off by max_new_tokens is still given to the environment as the answer it wrote."""
        params, trace = self.params, self.trace
        stops = tuple(end_of_turn_id(self.tokenizer, marker) for marker in self.format.stops)
        for turn in range(self.turns + 1, params.max_turns + 1):
            budget = params.max_context_tokens - len(trace.tokens)
            if budget <= 0:
                return "truncated"
            self.turns = turn
            t, loop = time.perf_counter(), asyncio.get_running_loop()
            left = cast(float, deadline.when()) - loop.time()  # set: the timeout is a number of seconds
            deadline.reschedule(None)  # the clock stops while the engine works on this turn
            self._waiting_since = t
            try:
                gen = await self.engine.generate(
                    list(trace.tokens),
                    SamplingParams(
                        temperature=self.sampling.temperature,
                        top_p=self.sampling.top_p,
                        top_k=self.sampling.top_k,
                        max_new_tokens=min(params.max_new_tokens, budget),
                        stop_token_ids=stops,
                        seed=None if self.sampling.seed is None else mix_seed(self.sampling.seed, turn),
                    ),
                )
            finally:
                self.model_wait_s += time.perf_counter() - t
                self._waiting_since = None
            deadline.reschedule(loop.time() + left)
            trace.add_sampled(list(gen.output_ids), list(gen.logprobs), list(gen.token_weight_versions))
            trace.routes = merge_routes(trace.routes, gen.routes, len(trace.tokens))
            self._open = (gen.finish_reason != "stop", None)
            if answers_only and gen.finish_reason != "stop":
                await runner.reply(self.format.answer(self.tokenizer.decode(gen.output_ids, skip_special_tokens=False)))
            if gen.finish_reason != "stop":
                return "truncated"  # cut off mid-turn: no well-formed turn to answer
            answer = await self._answer(
                runner, self.tokenizer.decode(gen.output_ids, skip_special_tokens=False), answers_only
            )
            if answer is None:
                return "ok"
            answered, observations = answer
            trace.add_context(
                continuation_ids(self.tokenizer, observations, end_of_turn=self.format.turn_ends, answered=answered)
            )
            self._open = None
            if runner.finished:
                return "ok"
        return "truncated"

    async def _answer(
        self, runner: ToolRunner, text: str, answers_only: bool = False
    ) -> tuple[Message, list[Message]] | None:
        """The messages that answer a sampled turn, and the turn as the template sees it (a stub: only a
        call's name can matter to what follows it); None when the conversation is over. `answers_only`:
        the turn is an answer whatever it holds (an environment without tools)."""
        calls = [] if answers_only else self.format.parse(text, tuple(runner.tools.schemas))
        if isinstance(calls, ToolCallError):
            error = runner.error_text(calls)
            if calls.name is None and self.format.tool_results_need_call:
                return _ANSWER, [Message("user", error)]
            return _calling(calls.name or "unknown"), [Message("tool", error)]
        if not calls:
            # an answer without a tool call: done, unless the environment answers it (a Python one)
            follow = await runner.reply(self.format.answer(text))
            return None if follow is None else (_ANSWER, [Message("user", follow)])
        observations = []
        self._open = (False, calls[0].name)
        for call in calls:
            self.tool_calls += 1
            observations.append(Message("tool", await runner.run(call)))
            if runner.finished:
                break  # the environment ended the episode: later calls of the turn do not run
        return _calling(calls[0].name), observations


_ANSWER = Message("assistant", "answer")  # a turn without a call, as the template sees it
STEP_OVER = "[stopped: this step's time ran out]"  # a call cut off when a step's agent phase timed out


def _calling(name: str) -> Message:
    return Message("assistant", "", (ToolCall(name),))


def system_prompt(spec: EnvSpec, params: AgentParams) -> str:
    """An episode's system message: its instance's own (an EnvSpec may have `system_prompt`, e.g. a prompt
    dataset's row), else train.agent.system_prompt."""
    return getattr(spec, "system_prompt", None) or params.system_prompt


async def run_episode(
    task: EnvSpec,
    engine: Engine,
    tokenizer,
    env: Environment | SandboxSource,
    params: AgentParams,
    sampling: SamplingParams,
    *,
    group_id: int = 0,
    step: int | None = None,
    attempt: int = 0,
    sample_id: int = 0,
) -> Episode:
    """One RL episode through the one episode runner (furlong.agent.runner.run_outcome); never raises
    for the model's, the task's or the sandbox's fault: failures become the status."""
    agent, outcome = await run_retrying(
        task, lambda: ModelAgent(engine, tokenizer, params, sampling, task.instruction), env
    )
    t = agent.trace
    return Episode(
        task_id=task.id,
        group_id=group_id,
        step=step,
        attempt=attempt,
        sample_id=sample_id,
        prompt_len=agent.prompt_len,
        tokens=tuple(t.tokens),
        loss_mask=tuple(t.mask),
        rollout_logprobs=tuple(t.logprobs),
        token_weight_versions=tuple(t.versions),
        routes=merge_routes(t.routes, None, len(t.tokens)),
        turns=agent.turns,
        tool_errors=agent.tool_errors,
        family=task.family,
        prompt=tuple(agent.prompt_messages),
        prompt_tools=agent.shown_schemas,
        **outcome_fields(outcome),
    )


def outcome_fields(outcome: Outcome) -> dict[str, Any]:
    """The Episode fields the one episode runner decided (its Outcome's)."""
    return {
        "reward": outcome.reward,
        "status": outcome.status,
        "timing": outcome.timing,
        "error": outcome.error,
        "tampered_paths": outcome.tampered_paths,
        "integrity_checked": outcome.integrity_checked,
        "rewards": outcome.rewards,
        "steps": outcome.steps,
        "traceback": outcome.traceback,
        "receipts": outcome.receipts,
    }
