"""The environment seam: where an episode's world comes from, what the agent may call in it, and its score.

An `EnvSource` lists instances (`EnvSpec`s) per split. An `Environment` opens one episode's world
(`EpisodeEnv`: a sandbox, a remote session, a Python object) for a spec; the one episode runner
(furlong.agent.runner.run_outcome) hands the agent its `tools`, then asks it for a `Score` and
decides the episode's status from it. An episode of several steps (a Harbor task's [[steps]]) says so in
its Score (`next_step`): the runner then runs the agent again on that step's spec and asks again. A Harbor task in a sandbox (furlong.envs.harbor) is the first
implementation; anything with these few methods plugs into the same runner, Rollouts and eval.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from furlong.timing import Clock


class EnvSpec(Protocol):
    """One instance an episode is run on (furlong.tasks.model.Task is one). It may also have
    `system_prompt: str | None`: its episodes' system message in place of the run's (a prompt dataset's row)."""

    # read-only properties: frozen dataclasses (Task, PromptRow) satisfy them, and a `str` family fits `str | None`
    @property
    def id(self) -> str: ...
    @property
    def instruction(self) -> str: ...
    @property
    def family(self) -> str | None: ...
    @property
    def agent_timeout_s(self) -> float: ...


class EnvSource(Protocol):
    def instances(self, split: str) -> list[Any]: ...  # the split's EnvSpecs, in a fixed order


class ToolError(ValueError):
    """A tool call that failed in a way the model should see (the message), not the runner: the episode
    goes on. A failure of the environment itself (a dead sandbox) is raised as it is instead."""


class ToolArgumentError(ToolError):
    """A tool call the tool cannot run (missing or ill-typed arguments): the model sees the message."""


class Toolbox(Protocol):
    """The tools an agent may call in an episode, each with a JSON schema (OpenAI function format).

    A toolbox may also define `reply(text, timeout_s) -> str | None` (awaited): the model's turn without
    a tool call, answered with the next user message, or None to end the conversation (no `reply`: every
    such turn ends it); and `finished: bool`, true once the environment says the episode is over (a Python
    environment's step returned done). The model agent (furlong.agent.episode) honours both. With no
    `schemas` at all, every turn of the model is an answer given to `reply` (a turn cut off by the token
    limit too), whatever its text looks like.
    It may also have `opening: str`: what the environment shows the agent first (an OpenEnv
    server's reset observation), which a model agent reads after the instruction."""

    @property
    def schemas(self) -> Sequence[dict]: ...  # read-only, so a tuple or a list of schemas both fit

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str: ...  # the observation


@dataclass(frozen=True)
class StepScore:
    """One step of a multi-step episode (Harbor's [[steps]]): its reward and the reward's parts."""

    name: str
    reward: float
    rewards: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why it counted 0 without its tests' say (its setup failed, its tests hung)

    def to_json(self) -> dict:
        return {"name": self.name, "reward": self.reward, "rewards": dict(self.rewards), "error": self.error}


@dataclass(frozen=True)
class Usage:
    """The agent's side of an episode so far, for reward functions (budgets, length penalties): all 0
    for an agent without a model (a scripted one)."""

    prompt_tokens: int = 0  # the first prompt: system message, instruction, tool schemas
    generated_tokens: int = 0  # sampled by the model, every turn (the loss mask's ones)
    turns: int = 0  # model turns (each one sampling call)
    # What a harness program reported of its own episode (FURLONG_REWARD_FILE, furlong.agent.harness): names
    # to numbers, e.g. a verifiers rubric's reward. It counts only through a reward function the config names
    # (furlong.envs.rewards.harness_reported); {} for every other agent and a control episode.
    reported: Mapping[str, float] = field(default_factory=dict)


NO_USAGE = Usage()  # a scripted agent's, a control episode's


@dataclass(frozen=True)
class Score:
    """What an episode's environment says about the finished agent phase.

    `reward` None: no reward, and `agent_broke_env` says whose fault that is (True: the agent left the
    environment unable to score it, which scores 0; False: the environment or task is broken, unscored)."""

    reward: float | None
    rewards: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False  # the scoring itself ran out of time (reward 0)
    agent_broke_env: bool = False
    error: str | None = None
    exit_code: int | None = None  # the scorer's, e.g. the tests' exit code and output tail
    output: str | None = None
    tampered_paths: tuple[str, ...] = ()  # what the agent changed that the scorer runs (furlong.tasks.integrity)
    tampered: bool = False  # and the task does not trust the agent's tools: reward 0, status reward_tampered
    # whether the reward was checked against tampering by a verifier the agent cannot reach (furlong.tasks.verifier
    # Verdict.integrity_checked; False on a backend without it, Guarantees); None: no tests ran in a sandbox
    integrity_checked: bool | None = None
    # what each run of the scorer that counted computed its reward from (furlong.tasks.receipt.Receipt), in
    # order: one per step of a multi-step task; () where the environment gives none (a Python environment's)
    receipts: tuple[Any, ...] = ()
    # A multi-step episode: the steps scored so far, and the spec (instruction, agent timeout) of the step
    # the agent is to do next; None when the episode is over (the last step ran, or a step's gate closed).
    steps: tuple[StepScore, ...] = ()
    next_step: Any = None


class EpisodeEnv(Protocol):
    """One episode's opened world. `seconds`/`calls`: time spent in, and number of, the agent's calls
    into it (the episode's agent_commands time)."""

    # read-only properties: an environment's episode holds its own kind of toolbox (a ToolSet)
    @property
    def tools(self) -> Toolbox: ...
    @property
    def note(self) -> str | None: ...  # shown with the outcome, e.g. which stand-in image served the task
    @property
    def seconds(self) -> float: ...
    @property
    def calls(self) -> int: ...

    def caused(self, exc: BaseException) -> bool: ...  # whether `exc` came from the environment, not the agent

    # Of the agent's work so far (see Score.next_step). An implementation may add a keyword parameter
    # `usage: Usage = NO_USAGE` (the agent's tokens and turns, for reward functions): the runner passes it
    # only to a score() that names it, so environments written without it keep working.
    async def score(self) -> Score: ...

    async def close(self) -> None: ...  # idempotent; never called by the agent


class Environment(Protocol):
    """Opens episodes. `open` raising means the episode never started (an infra_error, never scored)."""

    # positional-only (/): an environment names its arguments for what it opens (task, row)
    def reserve(self, spec: Any, /) -> None: ...  # an episode of `spec` is coming: start its world ahead

    async def open(self, spec: Any, clock: Clock, /) -> EpisodeEnv: ...  # charges its start to clock's sandbox_start


class EnvUnavailable(Exception):
    """`Environment.open` failed before the agent could act; the message is the episode's error."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then each exception it was raised from or while handling, once each."""
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        yield chain
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__


def describe(exc: BaseException) -> str:
    """One line: the exception's type and message (a KeyError's message is just the key)."""
    text = " ".join(str(exc).split())[:800]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
