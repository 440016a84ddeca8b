"""An unmodified agent program as the agent phase (`train.agent.harness`): it talks to the run's gateway
(furlong.gateway.local) with an episode key, acts in the episode's world through the gateway's exec route,
and the gateway, not the harness, records what the policy sampled.

Per agent phase: a key is minted, the program runs with OPENAI_BASE_URL / OPENAI_API_KEY, ANTHROPIC_BASE_URL /
ANTHROPIC_API_KEY, FURLONG_EXEC_URL, FURLONG_INSTRUCTION and FURLONG_REWARD_FILE set, until it exits or the task's agent timeout
(then its whole process group is killed), and the key is ended: anything the program, or a child it left,
sends later gets a 401 and records nothing. The program's own crash or non-zero exit is not an infra_error:
the tests score whatever it left. An exception from the episode's world during one of its commands is raised
from the phase, to be judged by the one episode runner's rules (furlong.agent.runner).

A program may report numbers of its own (a verifiers rubric's reward) as a JSON object in FURLONG_REWARD_FILE,
a file in a private directory on the host, read once the program and its process group are gone. They are
the agent's Usage.reported, and count only through a reward function the config names
(furlong.envs.rewards.harness_reported), with its weight: by itself a harness cannot raise any reward.

Training data: one sample per trajectory segment (a harness that rewrote its history has several), each an
Episode with the episode's reward and group, loss mask 1 exactly on the sampled ids, the engine's logprobs
and weight versions. An episode that never reached the model is one sample of its instruction's prompt
with nothing sampled: its reward still counts in its group's baseline.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from furlong.agent.episode import AgentParams, Episode, outcome_fields, response_sha, system_prompt
from furlong.agent.runner import AgentRun, SandboxSource, run_retrying
from furlong.engine.base import Engine
from furlong.envs.base import Environment, EnvSpec, Toolbox, Usage
from furlong.gateway.exec import EpisodeTools
from furlong.gateway.local import LocalGateway
from furlong.gateway.policy import Policy
from furlong.gateway.sessions import Session
from furlong.gateway.trajectory import GatewayStats, Segment
from furlong.model.chat import Message, render_prompt_ids
from furlong.model.toolcall import tool_format

OUTPUT_TAIL = 4000  # characters of the program's output kept with the episode (Outcome.agent_output)
MODEL_NAME = "policy"  # what /v1/models lists; FURLONG_MODEL tells the program


def program(command: Sequence[str]) -> tuple[str, ...]:
    """The argv to run: a first word `python` is this run's own interpreter. ValueError (one line) for a
    program that is not there."""
    argv = (sys.executable, *command[1:]) if command[0] == "python" else tuple(command)
    if shutil.which(argv[0]) is None:
        raise ValueError(f"train.agent.harness.command: {argv[0]!r} is not an executable program (or on PATH)")
    return argv


class HarnessAgents:
    """The run's gateway and harness program; a fresh HarnessAgent per episode (furlong.eval.agents.EpisodeAgents)."""

    name = "harness"

    def __init__(
        self, engine: Engine, tokenizer: Any, params: AgentParams, command: Sequence[str], owns_engine: bool = False
    ) -> None:
        self.command, self.tokenizer, self.params = program(command), tokenizer, params
        self.engine, self.owns_engine = engine, owns_engine  # `furlong eval`'s engine is closed with its agents
        policy = Policy(
            engine=engine,
            tokenizer=tokenizer,
            fmt=tool_format(tokenizer, params.tool_format),
            name=MODEL_NAME,
            max_context=params.max_context_tokens,
            default_max_tokens=params.max_new_tokens,
        )
        self.gateway = LocalGateway(policy)

    def for_episode(self, task: Any, sample: int) -> HarnessAgent:
        return HarnessAgent(self.gateway, self.command, self.params)

    async def close(self) -> None:
        await self.gateway.close()
        close = getattr(self.engine, "close", None)  # the Engine protocol does not require one
        if self.owns_engine and close is not None:
            await close()


class HarnessAgent:
    """One episode's agent phases (one per step of a multi-step task), each a run of the program."""

    name = "harness"

    def __init__(self, gateway: LocalGateway, command: tuple[str, ...], params: AgentParams) -> None:
        self.gateway, self.command, self.params = gateway, command, params
        self.sessions: list[Session] = []  # one per agent phase
        self.reported: dict[str, float] = {}  # the last phase's FURLONG_REWARD_FILE (module docstring)

    async def run(self, spec: EnvSpec, tools: Toolbox, timeout_s: float) -> AgentRun:
        url = await self.gateway.start()
        box = EpisodeTools(tools, self.params.command_timeout_s, self.params.observation_chars)
        key, session = self.gateway.mint(box)
        self.sessions.append(session)
        environ = {
            **os.environ,
            "OPENAI_BASE_URL": f"{url}/v1",
            "OPENAI_API_KEY": key,
            "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": key,
            "FURLONG_EXEC_URL": self.gateway.exec_url,
            "FURLONG_INSTRUCTION": spec.instruction,
            "FURLONG_MODEL": MODEL_NAME,
        }
        with tempfile.TemporaryDirectory(prefix="furlong-harness-") as private:  # 0700: the run's user only
            environ["FURLONG_REWARD_FILE"] = reward_file = os.path.join(private, "reward.json")
            try:
                code, output, timed_out = await run_program(self.command, environ, timeout_s, session.engine_wait_s)
            finally:
                await self.gateway.end(session.episode_id)  # also when the runner cancels the phase
            self.reported = read_reported(reward_file)
        if box.failure is not None:
            raise box.failure  # the world failed during a command: the runner's blame rules decide
        return AgentRun(commands=box.calls, timed_out=timed_out, last_exit_code=code, last_output=output)

    def segments(self) -> list[Segment]:
        return [seg for s in self.sessions for seg in s.trajectory.segments if seg.turns]

    def engine_wait_s(self) -> float:
        """The runner's optional engine wait (furlong.agent.runner.Agent): its hard limit does not count it."""
        return sum(s.engine_wait_s() for s in self.sessions)

    @property
    def turns(self) -> int:
        return sum(len(s.turns) for s in self.segments())

    @property
    def response_len(self) -> int:
        return sum(sum(s.mask) for s in self.segments())

    @property
    def response_sha(self) -> str:
        return response_sha([t for s in self.segments() for t in s.ids], [m for s in self.segments() for m in s.mask])

    def usage(self) -> Usage:
        segments = self.segments()
        first = segments[0].turns[0][0] if segments else 0
        return Usage(prompt_tokens=first, generated_tokens=self.response_len, turns=self.turns, reported=self.reported)

    def gateway_stats(self) -> GatewayStats:
        return GatewayStats.of([s.trajectory.record_dict() for s in self.sessions])


async def run_program(
    argv: Sequence[str], environ: dict[str, str], timeout_s: float, engine_wait_s: Callable[[], float] = lambda: 0.0
) -> tuple[int | None, str, bool]:
    """(exit code, output tail, timed out) of the program, its process group killed whatever happens (a timeout,
    a cancelled phase, children it left). The timeout does not count `engine_wait_s()`, the time its requests
    spent in the engine: a loaded engine must not turn an episode into a timeout scored 0. Its output goes to a
    file, not a pipe: a child that escaped the group and holds the output open must not keep the episode waiting."""
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=environ,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group, killed as one
        )
        end = loop.time() + timeout_s
        timed_out = False
        try:
            while True:
                try:
                    await asyncio.wait_for(proc.wait(), max(0.0, end + engine_wait_s() - loop.time()))
                    break
                except TimeoutError:
                    if loop.time() >= end + engine_wait_s():
                        timed_out = True
                        break
        finally:
            _kill_group(proc.pid)
            await proc.wait()
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - 4 * OUTPUT_TAIL))
        tail = out.read().decode(errors="replace")[-OUTPUT_TAIL:]
    return (None if timed_out else proc.returncode), tail, timed_out


def read_reported(path: str) -> dict[str, float]:
    """The program's FURLONG_REWARD_FILE: {} where it wrote none; ValueError (the program's bug, an
    infra_error) for anything but a JSON object of names to finite numbers."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return {}
    what = "FURLONG_REWARD_FILE: the harness program wrote {!r}; expected a JSON object of names to finite numbers"
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(what.format(text[:200])) from None
    ok = isinstance(data, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in data.values()
    )
    if not ok:
        raise ValueError(what.format(text[:200]))
    return {str(k): float(v) for k, v in data.items()}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone already


async def run_harness_episode(
    task: EnvSpec,
    agents: HarnessAgents,
    env: Environment | SandboxSource,
    *,
    group_id: int = 0,
    step: int | None = None,
    attempt: int = 0,
    sample_id: int = 0,
) -> list[Episode]:
    """One episode of the harness through the one episode runner; its samples (module docstring)."""
    agent, outcome = await run_retrying(task, lambda: agents.for_episode(task, sample_id), env)
    common: dict[str, Any] = {
        "task_id": task.id,
        "group_id": group_id,
        "step": step,
        "attempt": attempt,
        "sample_id": sample_id,
        "family": task.family,
        "gateway": agent.gateway_stats(),
        **outcome_fields(outcome),
    }
    segments = agent.segments()
    if not segments:  # the model was never asked: its prompt, nothing sampled
        ids = render_prompt_ids(
            agents.tokenizer, [Message("system", system_prompt(task, agents.params)), Message("user", task.instruction)]
        )
        n = len(ids)
        return [Episode(**common, prompt_len=n, tokens=tuple(ids), loss_mask=(0,) * n,
                        rollout_logprobs=(0.0,) * n, token_weight_versions=(-1,) * n, turns=0)]  # fmt: skip
    return [Episode(**common, **_sample(seg)) for seg in segments]


def _sample(seg: Segment) -> dict[str, Any]:
    end = seg.turns[-1][1]  # what follows the last sampled turn is nobody's prompt
    return {
        "prompt_len": seg.turns[0][0],
        "tokens": tuple(seg.ids[:end]),
        "loss_mask": tuple(seg.mask[:end]),
        "rollout_logprobs": tuple(seg.logprobs[:end]),
        "token_weight_versions": tuple(seg.versions[:end]),
        "turns": len(seg.turns),
    }
