"""Reward functions beside an environment's own reward (a Harbor task's tests, a Python environment's
steps), combined by weights: reward = own_weight * own + sum(weight * value) (docs/environments.md).

A reward function is a Python callable over the finished episode (`EpisodeView`: its task, every tool
call and answer, its sandbox as the verifier), run on the host, or a `command` run in the episode's
sandbox as the verifier, after the tests and inside their integrity check, whose last line of output is
the value. Neither is reachable from the agent: host code is out of the sandbox, and the verifier's
processes and mounts are out of the agent's reach (docs/sandboxes.md).

A reward function that raises, runs past its timeout or gives no finite number never gives a reward,
and never crashes the run: the failure (with its traceback) is the episode's error. Whose failure is it?
The failed functions run again on an episode no agent touched (Harbor: a fresh sandbox, after the
tests; Python: a fresh environment reset to the same instance), with no tool calls and no answer:

- they fail there too: the function is broken, the episode is `infra_error` (unscored);
- they do not: the agent's episode made them fail, which scores 0 (`agent_broke_sandbox`), so failing a
  reward function is never a way out of a zero.

So a reward function must score an episode in which the agent did nothing (usually 0).
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from furlong.envs.base import NO_USAGE, Score, Usage, describe
from furlong.envs.toolset import ToolStep, call_user
from furlong.sandbox.base import HostLost

FAILURE_CHARS = 4000  # of a failure's traceback kept in the episode's record (its end: where it raised)
RESERVED = ("reward", "tests", "steps")  # keys of an episode's rewards that are not a reward function's


class VerifierSandbox:
    """What a reward function gets of the episode's sandbox: every call as the verifier."""

    def __init__(self, guard: Any, workdir: str):
        self._guard, self.workdir = guard, workdir

    async def exec(self, cmd: str, timeout_s: float = 60.0, cwd: str | None = None, env: dict[str, str] | None = None):
        return await self._guard.exec(cmd, timeout_s=timeout_s, cwd=cwd or self.workdir, env=env, as_verifier=True)

    async def read_file(self, path: str) -> bytes:
        return await self._guard.read_file(path, as_verifier=True)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._guard.write_file(path, data, mode, as_verifier=True)


@dataclass(frozen=True)
class EpisodeView:
    """What a reward function sees of a finished episode."""

    task: Any  # its EnvSpec: a Harbor Task, or a Python environment's Instance (seed, split)
    steps: tuple[ToolStep, ...] = ()  # every tool call in order, with what the model saw back
    answers: tuple[str, ...] = ()  # the model's turns without a tool call, in order
    sandbox: VerifierSandbox | None = None  # Harbor: the episode's sandbox, as the verifier
    env: Any = None  # Python environments: the user's environment object, after the episode
    # The environment's own reward, as the runner got it: the tests' (Harbor; this step's, in a multi-step
    # task) or the steps' sum (Python). None where the tests left none (the function still runs).
    tests: float | None = None
    usage: Usage = NO_USAGE  # the agent's tokens and turns (all 0 for a scripted agent, a control episode)
    params: Mapping[str, Any] = field(default_factory=dict)  # this function's train.env.rewards.NAME.params

    @property
    def answer(self) -> str | None:
        """The model's last turn without a tool call (its final answer), or None."""
        return self.answers[-1] if self.answers else None

    @property
    def passed(self) -> bool:
        """Whether the tests passed: their reward is at least 1 (pass@1's rule, on the tests alone)."""
        return self.tests is not None and self.tests >= 1.0


def harness_reported(episode: EpisodeView) -> float:
    """The number a harness program reported under `params.key` (default "reward") in its FURLONG_REWARD_FILE
    (docs/gateway.md#a-harnesss-own-reward), or 0 where it reported none: a program that crashed or timed out
    before reporting, another agent, a control episode. A reward function like any other: it counts, with its
    weight, only where the config names it, so a harness can never raise a reward on its own."""
    value = episode.usage.reported.get(str(episode.params.get("key", "reward")))
    return 0.0 if value is None else value


@dataclass(frozen=True)
class RewardFn:
    """One reward function (exactly one of `python` and `command`)."""

    name: str
    weight: float = 1.0
    python: Callable[[EpisodeView], Any] | None = None  # -> a number, sync or async
    command: str | None = None  # its stdout's last line is the value
    timeout_s: float = 60.0
    params: Mapping[str, Any] = field(default_factory=dict)  # what a python one sees as EpisodeView.params

    def __post_init__(self) -> None:
        if (self.python is None) == (self.command is None):
            raise ValueError(f"reward function {self.name!r}: give exactly one of python and command")
        if self.name in RESERVED:
            raise ValueError(f"reward function name {self.name!r} is reserved ({', '.join(RESERVED)})")
        if self.params and self.command is not None:
            raise ValueError(f"reward function {self.name!r}: params are for a python function; a command has none")


class RewardFailed(Exception):
    """A reward function gave no value; the message says why (a traceback, an exit code and output)."""


def failure_text(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc)).rstrip()
    return text if len(text) <= FAILURE_CHARS else "[...]\n" + text[-FAILURE_CHARS:]


def finite_number(value: Any, what: str) -> float:
    """`value` as a float; RewardFailed naming `what` when it is not a finite number (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardFailed(f"{what} gave {value!r}, not a finite number")
    return float(value)


async def value_of(fn: RewardFn, view: EpisodeView, verifier_env: Mapping[str, str] | None = None) -> float:
    """`fn`'s value for the episode; RewardFailed when it gives none. A lost sandbox host is raised as it is."""
    if fn.python is not None:
        mine = dataclasses.replace(view, params=dict(fn.params))  # a copy: one function cannot change another's
        try:
            value = await call_user(fn.python, mine, timeout_s=fn.timeout_s)
            return finite_number(value, f"reward function {fn.name!r}")
        except (HostLost, RewardFailed):
            raise
        except TimeoutError:
            raise RewardFailed(f"reward function {fn.name!r} timed out after {fn.timeout_s:g}s") from None
        except Exception as exc:
            raise RewardFailed(failure_text(exc)) from exc
    if view.sandbox is None:
        raise RewardFailed(f"reward command {fn.name!r} needs a sandbox; this environment has none")
    if fn.command is None:
        raise ValueError(f"reward function {fn.name!r}: neither python nor command is set")
    try:
        res = await view.sandbox.exec(fn.command, timeout_s=fn.timeout_s, env=dict(verifier_env or {}))
    except HostLost:
        raise
    except Exception as exc:
        raise RewardFailed(f"reward command {fn.name!r}: the sandbox failed: {describe(exc)}") from exc
    tail = (res.stdout + res.stderr)[-FAILURE_CHARS:]
    if res.timed_out:
        raise RewardFailed(f"reward command {fn.name!r} timed out after {fn.timeout_s:g}s; output:\n{tail}")
    if res.exit_code != 0:
        raise RewardFailed(f"reward command {fn.name!r} exited {res.exit_code}; output:\n{tail}")
    lines = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
    try:
        return finite_number(float(lines[-1]), f"reward command {fn.name!r}")
    except (IndexError, ValueError):
        raise RewardFailed(
            f"reward command {fn.name!r}: its last line of output is not a number; output:\n{tail}"
        ) from None


@dataclass
class RewardRun:
    """The values of `fns` for one episode; until `run` finishes, every function counts as failed (a
    verifier phase that fails before it runs leaves them unmeasured)."""

    fns: Sequence[RewardFn]
    values: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.failures = {f.name: "never ran: the scoring stopped before it" for f in self.fns}

    async def run(self, view: EpisodeView, verifier_env: Mapping[str, str] | None = None) -> None:
        for fn in self.fns:
            try:
                self.values[fn.name] = await value_of(fn, view, verifier_env)
                del self.failures[fn.name]
            except RewardFailed as exc:
                self.failures[fn.name] = str(exc)


Control = Callable[[Sequence[RewardFn]], Awaitable[RewardRun]]  # the failed functions, on an untouched episode


class Scorer:
    """The user's reward functions, their weights and the own reward's (`own`: its key in `rewards`)."""

    def __init__(self, fns: Sequence[RewardFn] = (), own_weight: float = 1.0, own: str = "tests"):
        names = [f.name for f in fns]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"reward functions named twice: {twice}")
        self.fns, self.own_weight, self.own = tuple(fns), own_weight, own

    @property
    def active(self) -> bool:
        """False: the own reward alone, unweighted (the episode's Score is the environment's own)."""
        return bool(self.fns) or self.own_weight != 1.0

    def start(self) -> RewardRun:
        return RewardRun(self.fns)

    async def settle(self, score: Score, run: RewardRun, control: Control) -> Score:
        """`score` (the own reward's) with the functions' values combined in; or, where some failed, the
        rule of the module docstring."""
        if not run.failures:
            assert score.reward is not None
            reward = self.own_weight * score.reward + sum(f.weight * run.values[f.name] for f in self.fns)
            rewards = {
                **{k: v for k, v in score.rewards.items() if k != "reward"},
                self.own: score.reward,
                **run.values,
            }
            return dataclasses.replace(score, reward=reward, rewards=rewards)
        failed = [f for f in self.fns if f.name in run.failures]
        detail = "\n".join(f"[{name}] {text}" for name, text in run.failures.items())
        try:
            again = await control(failed)
        except HostLost:
            raise
        except Exception as exc:  # noqa: BLE001  # a user reward function's failure is recorded as the score's error
            return dataclasses.replace(
                score,
                reward=None,
                error=f"reward function failed ({detail}); the episode "
                f"that would say whose fault it is did not start: {describe(exc)}",
            )
        names = ", ".join(repr(f.name) for f in failed)
        if any(f.name not in again.failures for f in failed):
            return dataclasses.replace(
                score,
                reward=None,
                agent_broke_env=True,
                error=f"reward function {names} failed in this episode but not in one no agent touched:\n{detail}",
            )
        return dataclasses.replace(
            score,
            reward=None,
            error=f"reward function {names} failed, and failed with no "
            f"agent too (a bug in it; never a reward):\n{detail}",
        )


TESTS_ONLY = Scorer()  # no reward functions: a Harbor episode's reward is its tests'
STEPS_ONLY = Scorer(own="steps")  # a Python environment's is its steps'
