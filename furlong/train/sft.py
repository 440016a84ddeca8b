"""`furlong sft`: warm-start on oracle trajectories, so a fresh model learns the tool-call format.

A demonstration is a task's own solution replayed through the agent format, in a real sandbox so the
tool result is the real one: prompt, an assistant turn calling bash with the solution, the tool
result, and a closing assistant turn. Its token layout is exactly what the RL loop produces. A prompt
dataset's demonstration is a row's reference answer as the one assistant turn; a Python environment's is
its `demonstrate()`'s Actions, played through the environment so every observation is its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from furlong.agent.episode import AgentParams, system_prompt
from furlong.agent.runner import AgentRun, SandboxSource, environment, run_outcome
from furlong.agent.tools import BASH_TOOL, ToolRunner
from furlong.envs.base import Environment, EnvSpec, Toolbox
from furlong.envs.prompts import PromptRow
from furlong.envs.user import Action, Instance, PythonEnv
from furlong.eval.agents import AnswerAgent
from furlong.model.chat import Message, ToolCall, assistant_ids, continuation_ids, render_prompt_ids
from furlong.model.toolcall import tool_format
from furlong.tasks.model import Task

log = logging.getLogger(__name__)

FINAL_ANSWER = "Done."


@dataclass(frozen=True)
class Demo:
    task_id: str
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]


def solution_command(task: Task) -> str:
    """The solution script as one bash command: without its shebang, comments and blank lines."""
    if task.solution is None:
        raise ValueError(f"task {task.id}: no solution script to demonstrate")
    lines = task.solution.read_text().splitlines()
    keep = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return "\n".join(keep)


Turn = tuple[Message, Message | None]  # an assistant turn, and what answered it (a tool result, a user message)


def turn_tokens(tokenizer, spec: Any, turns: Sequence[Turn], params: AgentParams, schemas: Sequence[dict]) -> Demo:
    """A demonstration laid out as an RL episode of `spec` is: its prompt (`schemas`: the episode's tools,
    shown as an RL episode shows them), then each assistant turn (trained on) and what answered it (not)."""
    ends = tool_format(tokenizer, params.tool_format).turn_ends
    prompt = render_prompt_ids(
        tokenizer,
        [Message("system", system_prompt(spec, params)), Message("user", spec.instruction)],
        list(schemas) if params.tool_schema_in_prompt else None,
    )
    parts = [(prompt, 0)]
    for said, answer in turns:
        parts.append((assistant_ids(tokenizer, said, ends), 1))
        if answer is not None:
            parts.append((continuation_ids(tokenizer, [answer], end_of_turn=ends, answered=said), 0))
    return Demo(
        task_id=spec.id,
        tokens=tuple(t for ids, _ in parts for t in ids),
        loss_mask=tuple(m for ids, m in parts for _ in ids),
    )


def demo_tokens(
    tokenizer, task: Task, command: str, observation: str, params: AgentParams, schemas: Sequence[dict] = (BASH_TOOL,)
) -> Demo:
    """A Harbor task's: the solution as one bash call, its result, and a closing answer."""
    calling = Message("assistant", "", (ToolCall("bash", {"command": command}),))
    return turn_tokens(
        tokenizer,
        task,
        [(calling, Message("tool", observation)), (Message("assistant", FINAL_ANSWER), None)],
        params,
        schemas,
    )


DEMO_ATTEMPTS = 3  # a sandbox that fails to start or answer on a loaded machine is tried again
# A trusted solution does not break its sandbox: these statuses are the machine's doing, worth a retry.
RETRIED = ("infra_error", "agent_broke_sandbox")


class DemoAgent:
    """The oracle acting as the model would: the solution as one bash tool call through the same
    ToolRunner a model's call goes through, its command and observation kept for the demonstration."""

    name = "oracle-demo"

    def __init__(self, params: AgentParams):
        self.params = params
        self.command: str | None = None
        self.observation: str | None = None
        self.schemas: tuple[dict, ...] = (BASH_TOOL,)

    async def run(self, task: Task, tools: Toolbox, timeout_s: float) -> AgentRun:
        self.command, self.schemas = solution_command(task), tuple(tools.schemas)
        runner = ToolRunner(tools, self.params.command_timeout_s, self.params.observation_chars)
        self.observation = await runner.run(ToolCall("bash", {"command": self.command}))
        return AgentRun(commands=1)


class ReplayAgent:
    """A Python environment's demonstration (its `demonstrate()`'s Actions) played as the model would act,
    through the same ToolRunner; each turn is kept with what answered it, for the demonstration's tokens."""

    name = "demo-replay"

    def __init__(self, actions: Sequence[Action], params: AgentParams):
        self.actions, self.params = tuple(actions), params
        self.turns: list[Turn] = []
        self.schemas: tuple[dict, ...] = ()

    async def run(self, spec: Instance, tools: Toolbox, timeout_s: float) -> AgentRun:
        self.schemas = tuple(tools.schemas)
        runner = ToolRunner(tools, self.params.command_timeout_s, self.params.observation_chars)
        for action in self.actions:
            if runner.finished:
                break
            if action.tool is None:
                follow = await runner.reply(action.text)
                answer = None if follow is None else Message("user", follow)
                self.turns.append((Message("assistant", action.text), answer))
                if follow is None:
                    break
                continue
            call = ToolCall(action.tool, dict(action.arguments))
            said = Message("assistant", action.text, (call,))
            self.turns.append((said, Message("tool", await runner.run(call))))
        return AgentRun(commands=len(self.turns))


async def env_demo(spec: Instance, tokenizer, env: PythonEnv, params: AgentParams) -> Demo | None:
    """A Python environment's own demonstration, replayed as an episode of the one runner; None unless its
    steps' reward is at least 1 (a demonstration must not teach what the environment does not reward)."""
    agent = ReplayAgent(await env.demonstration(spec), params)
    outcome = await run_outcome(spec, agent, env)
    own = outcome.rewards.get("steps", outcome.reward)
    if own is None or own < 1.0 or not agent.turns:
        log.warning(
            "sft: the demonstration of %s is not kept: %s, reward %s%s",
            spec.id,
            outcome.status,
            own,
            f" ({outcome.error})" if outcome.error else "",
        )
        return None
    return turn_tokens(tokenizer, spec, agent.turns, params, agent.schemas)


def answer_tokens(tokenizer, row: PromptRow, answer: str, params: AgentParams) -> Demo:
    """A prompt row's answer as the model's one turn, laid out as an episode of it: the prompt (the row's
    system message or the run's, no tools), then the answer."""
    prompt = render_prompt_ids(
        tokenizer, [Message("system", system_prompt(row, params)), Message("user", row.instruction)]
    )
    turn = assistant_ids(tokenizer, Message("assistant", answer), tool_format(tokenizer, params.tool_format).turn_ends)
    return Demo(task_id=row.id, tokens=(*prompt, *turn), loss_mask=(0,) * len(prompt) + (1,) * len(turn))


def demonstrable(task: EnvSpec) -> bool:
    """Whether SFT can have a demonstration of `task`: a prompt row only when it has an answer; a Harbor
    task of one step (a demonstration is one instruction and one solution call)."""
    if isinstance(task, PromptRow):
        return task.answer is not None
    return not getattr(task, "steps", ())  # other environments' instances have no steps


async def answer_demo(row: PromptRow, tokenizer, env: Environment, params: AgentParams) -> Demo | None:
    """The row's reference answer, scored by the reward function through the one runner; None unless it
    scores 1 (a demonstration must not teach an answer the reward disowns) or when the row has none."""
    if row.answer is None:
        return None
    outcome = await run_outcome(row, AnswerAgent(), env)
    if outcome.reward is None or outcome.reward < 1.0:
        log.warning(
            "sft: the answer of %s is not demonstrated: %s, reward %s%s",
            row.where,
            outcome.status,
            outcome.reward,
            f" ({outcome.error})" if outcome.error else "",
        )
        return None
    return answer_tokens(tokenizer, row, row.answer, params)


async def oracle_demo(
    task: Task | PromptRow | Instance, tokenizer, sandboxes: Environment | SandboxSource, params: AgentParams
) -> Demo | None:
    """The solution replayed as an episode of the one runner (furlong.agent.runner). None when it does
    not pass (such a demo would teach a wrong answer), or when the sandbox failed every attempt: one
    lost demonstration must not end the run. A prompt dataset's row: its answer (answer_demo); a Python
    environment's instance: its own demonstration (env_demo)."""
    if isinstance(task, PromptRow):
        return await answer_demo(task, tokenizer, environment(sandboxes), params)
    if isinstance(task, Instance):
        assert isinstance(sandboxes, PythonEnv), "a Python environment's instance needs its PythonEnv"
        return await env_demo(task, tokenizer, sandboxes, params)
    for attempt in range(DEMO_ATTEMPTS):
        agent = DemoAgent(params)
        outcome = await run_outcome(task, agent, sandboxes)
        if outcome.status not in RETRIED:
            break
        if attempt == DEMO_ATTEMPTS - 1:
            log.warning(
                "sft: no demonstration of %s: %s %d times (%s)", task.id, outcome.status, DEMO_ATTEMPTS, outcome.error
            )
    # the task's tests passed (with reward functions weighed in, `rewards` holds the tests' own reward)
    if outcome.rewards.get("tests", outcome.reward) != 1.0 or agent.command is None or agent.observation is None:
        return None
    return demo_tokens(tokenizer, task, agent.command, agent.observation, params, agent.schemas)


async def oracle_demos(
    tasks: list[Task | PromptRow | Instance],
    tokenizer,
    sandboxes: Environment | SandboxSource,
    params: AgentParams,
    concurrency: int,
    on_done: Callable[[], None] = lambda: None,
) -> list[Demo]:
    slots = asyncio.Semaphore(concurrency)

    async def one(task: Task | PromptRow | Instance) -> Demo | None:
        async with slots:
            demo = await oracle_demo(task, tokenizer, sandboxes, params)
        on_done()
        return demo

    demos = await asyncio.gather(*(one(t) for t in tasks))
    return [d for d in demos if d is not None]


def _batch(demos: list[Demo], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(d.tokens) for d in demos)
    ids = torch.full((len(demos), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(demos), width), dtype=torch.long)
    labels = torch.full((len(demos), width), -100, dtype=torch.long)
    for i, d in enumerate(demos):
        n = len(d.tokens)
        ids[i, :n] = torch.tensor(d.tokens)
        attn[i, :n] = 1
        labels[i, :n] = torch.where(torch.tensor(d.loss_mask, dtype=torch.bool), ids[i, :n], -100)
    return ids, attn, labels


def demo_nll(model, demos: list[Demo], pad_id: int = 0, tokens: int | None = None) -> torch.Tensor:
    """Mean cross-entropy over the demonstrations' assistant tokens (their loss mask). `tokens`: divide the
    sum by this instead (a rank's part of a mean over more demonstrations: `nll_tokens` of them all)."""
    device = next(model.parameters()).device
    ids, attn, labels = (t.to(device) for t in _batch(demos, pad_id))
    if tokens is None:
        return model(input_ids=ids, attention_mask=attn, labels=labels).loss
    return model(input_ids=ids, attention_mask=attn, labels=labels, num_items_in_batch=tokens).loss


def nll_tokens(demos: list[Demo]) -> int:
    """The tokens demo_nll averages over: masked ones with a token before them (labels shift by one)."""
    return sum(sum(d.loss_mask[1:]) for d in demos)


def save_demos(path: Path, demos: list[Demo]) -> None:
    """One JSON line per demonstration: RL's demonstration anchor (rl.sft_coef) reuses exactly what SFT saw."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(asdict(d)) + "\n" for d in demos))
    tmp.replace(path)


def load_demos(path: Path) -> list[Demo]:
    demos = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            demos.append(Demo(task_id=row["task_id"], tokens=tuple(row["tokens"]), loss_mask=tuple(row["loss_mask"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a demonstration (expected task_id, tokens, loss_mask): {exc}") from exc
    return demos


def sft_train(
    model,
    demos: list[Demo],
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    pad_id: int,
    on_step: Callable[[int, float], None] = lambda step, loss: None,
) -> list[float]:
    """Cross-entropy on the assistant tokens only (the loss mask), AdamW; returns the loss of each step."""
    if epochs == 0:
        return []
    if not demos:
        raise ValueError("no demonstrations to train on (did every oracle solution fail?)")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = epochs * -(-len(demos) // batch_size)
    # Warm up then decay: a model trained from scratch diverges at full lr on its first steps.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, total // 10)) * max(0.05, 1 - i / total)
    )
    model.train()
    losses = []
    for _ in range(epochs):
        order = demos[:]
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            loss = demo_nll(model, order[start : start + batch_size], pad_id)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            on_step(len(losses), losses[-1])
    model.eval()
    return losses
