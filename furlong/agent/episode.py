"""One model-driven episode, token in / token out: the ids the model sampled and the ids of the tool
results are appended to one list, never re-tokenized, with a loss mask of 1 exactly on sampled ids.

The conversation is the agent phase (`ModelAgent`) of the one episode runner, furlong.agent.runner,
which owns the sandbox, the verifier, the status and the reward (its docstring has the rules).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from furlong.agent.runner import AgentRun, SandboxSource, run_outcome
from furlong.agent.tools import BASH_TOOL, ToolRunner
from furlong.engine.base import Engine, SamplingParams
from furlong.model.chat import Message, ToolCallError, continuation_ids, end_of_turn_id, parse_tool_calls, render_prompt_ids
from furlong.sandbox.base import Sandbox
from furlong.seeding import mix_seed
from furlong.tasks.model import Task
from furlong.timing import EpisodeTiming

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

    @classmethod
    def of(cls, config) -> AgentParams:
        """From the config's `train.agent` node (furlong.config.AgentConfig): training and `furlong eval
        --agent model` run the same loop with the same limits."""
        return cls(max_turns=config.max_turns, max_context_tokens=config.max_context_tokens,
                   max_new_tokens=config.max_new_tokens, command_timeout_s=config.command_timeout_s,
                   observation_chars=config.observation_chars)


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
    reward: float | None  # None exactly for infra_error: never scored, never trained on
    status: str  # ok | truncated | timeout | agent_broke_sandbox | infra_error (furlong.agent.runner)
    timing: EpisodeTiming
    turns: int
    error: str | None = None
    tool_errors: int = 0
    family: str | None = None

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


class ModelAgent:
    """The agent phase of a model-driven episode: one conversation, its tokens kept in `trace` (also
    when the phase ends by a timeout or a broken sandbox: those tokens are trained on too)."""

    name = "model"

    def __init__(self, engine: Engine, tokenizer, params: AgentParams, sampling: SamplingParams, instruction: str):
        self.engine, self.tokenizer, self.params, self.sampling = engine, tokenizer, params, sampling
        messages = [Message("system", params.system_prompt), Message("user", instruction)]
        self.trace = _Trace(render_prompt_ids(tokenizer, messages, [BASH_TOOL] if params.tool_schema_in_prompt else None))
        self.prompt_len = len(self.trace.tokens)
        self.model_wait_s = 0.0  # finished engine waits; engine_wait_s() adds one in progress
        self._waiting_since: float | None = None  # perf_counter() at the start of an engine wait in progress
        self.turns = 0
        self.tool_calls = 0
        self.tool_errors = 0

    def engine_wait_s(self) -> float:
        """Seconds spent waiting on the engine so far, a wait in progress included: the runner's hard limit
        on the agent phase excuses them too."""
        since = self._waiting_since
        return self.model_wait_s + (0.0 if since is None else time.perf_counter() - since)

    async def run(self, task: Task, sandbox: Sandbox, timeout_s: float) -> AgentRun:
        runner = ToolRunner(sandbox, self.params.command_timeout_s, self.params.observation_chars)
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                status = await self._converse(runner, deadline)
        except TimeoutError:
            if not deadline.expired():
                raise  # not our deadline: a sandbox call's own timeout, for the runner to judge
            return AgentRun(commands=self.tool_calls, timed_out=True)
        finally:
            self.tool_errors = runner.errors
        return AgentRun(commands=self.tool_calls, truncated=status == "truncated")

    async def _converse(self, runner: ToolRunner, deadline: asyncio.Timeout) -> str:
        """Model turn, tool calls, observations... until a turn without a tool call or a limit.

        The task's agent timeout counts the agent's work in the sandbox, not the time spent waiting on
        the shared engine: that depends on the load others put on it (a busy engine must not turn a
        policy's episode into a zero), and a turn's tokens are bounded by max_new_tokens anyway."""
        params, trace, eot = self.params, self.trace, end_of_turn_id(self.tokenizer)
        for turn in range(1, params.max_turns + 1):
            budget = params.max_context_tokens - len(trace.tokens)
            if budget <= 0:
                return "truncated"
            self.turns = turn
            t, loop = time.perf_counter(), asyncio.get_running_loop()
            left = deadline.when() - loop.time()
            deadline.reschedule(None)  # the clock stops while the engine works on this turn
            self._waiting_since = t
            try:
                gen = await self.engine.generate(list(trace.tokens), SamplingParams(
                    temperature=self.sampling.temperature, top_p=self.sampling.top_p, top_k=self.sampling.top_k,
                    max_new_tokens=min(params.max_new_tokens, budget), stop_token_ids=(eot,),
                    seed=None if self.sampling.seed is None else mix_seed(self.sampling.seed, turn)))
            finally:
                self.model_wait_s += time.perf_counter() - t
                self._waiting_since = None
            deadline.reschedule(loop.time() + left)
            trace.add_sampled(list(gen.output_ids), list(gen.logprobs), list(gen.token_weight_versions))
            if gen.finish_reason != "stop":
                return "truncated"  # cut off mid-turn: no well-formed turn to answer
            calls = parse_tool_calls(self.tokenizer.decode(gen.output_ids, skip_special_tokens=False))
            if not isinstance(calls, ToolCallError) and not calls:
                return "ok"  # the model answered without a tool call: it is done
            if isinstance(calls, ToolCallError):
                observations = [Message("tool", runner.error_text(calls))]
            else:
                observations = []
                for call in calls:
                    self.tool_calls += 1
                    observations.append(Message("tool", await runner.run(call)))
            trace.add_context(continuation_ids(self.tokenizer, observations))
        return "truncated"


async def run_episode(task: Task, engine: Engine, tokenizer, sandboxes: SandboxSource, params: AgentParams,
                      sampling: SamplingParams, group_id: int = 0, sample_id: int = 0) -> Episode:
    """One RL episode through the one episode runner (furlong.agent.runner.run_outcome); never raises
    for the model's, the task's or the sandbox's fault: failures become the status."""
    agent = ModelAgent(engine, tokenizer, params, sampling, task.instruction)
    outcome = await run_outcome(task, agent, sandboxes)
    t = agent.trace
    return Episode(task_id=task.id, group_id=group_id, sample_id=sample_id, prompt_len=agent.prompt_len,
                   tokens=tuple(t.tokens), loss_mask=tuple(t.mask), rollout_logprobs=tuple(t.logprobs),
                   token_weight_versions=tuple(t.versions), reward=outcome.reward, status=outcome.status,
                   timing=outcome.timing, turns=agent.turns, error=outcome.error, tool_errors=agent.tool_errors,
                   family=task.family)
