"""A user's own environment in Python, on the environment seam (furlong.envs.base; docs/environments.md).

The user writes a class with two methods, each sync or async:

    reset(seed: int, split: str) -> str          the instance's instruction (the model's first user message)
    step(action: Action) -> (str, float, bool)   an observation, a reward, and whether the episode is done

and optionally `tools` (OpenAI function schemas the model may call; none: the model only answers in text)
and `close()`. An `Action` is one tool call (`tool`, `arguments`: its observation is the tool's result) or
one turn without a tool call (`text`: its observation is the next user message, unless done). The
episode's own reward is the sum of its steps' rewards; reward functions (furlong.envs.rewards) may be
weighed in. An instance is a (split, seed): `reset` must be a function of them (a GRPO group is several
episodes of one instance), which `open` checks against the instruction listed for it.

Status rules (furlong.agent.runner's, for this environment): `reset` failing is infra_error (the agent
has not acted). `step` raising, timing out or returning something else than (text, finite number, bool)
is a tool error the model sees; the step gives no reward and the episode goes on, so a step's failure is
never a way out of a score. Rewards below 0 would make that failure worth more than the step: keep them
at 0 or above, or catch the error in `step` and return its own observation and reward.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from furlong.envs.base import (
    NO_USAGE,
    EnvUnavailable,
    Score,
    ToolError,
    Usage,
    describe,
)
from furlong.envs.rewards import STEPS_ONLY, EpisodeView, RewardFn, RewardRun, Scorer
from furlong.envs.toolset import (
    Tool,
    ToolSet,
    call_user,
    check_arguments,
    check_tools,
    report_once,
    schema_of,
    tool_name,
)
from furlong.timing import Clock

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Action:
    """What the model did in one turn: a tool call (`tool` and its `arguments`), or a turn without a tool
    call (`text`, `tool` None)."""

    text: str = ""
    tool: str | None = None
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Instance:
    """One instance of a Python environment (an EnvSpec): reset(seed, split) makes it."""

    id: str
    instruction: str
    family: str
    split: str
    seed: int
    agent_timeout_s: float


def own_schemas(env: Any) -> tuple[dict, ...]:
    return tuple(schema_of(t) for t in getattr(env, "tools", None) or ())


async def reset(env: Any, seed: int, split: str, timeout_s: float) -> str:
    observation = await call_user(env.reset, seed, split, timeout_s=timeout_s)
    if not isinstance(observation, str):
        raise TypeError(f"reset returned {type(observation).__name__}, not the instruction's text")
    return observation


async def close_env(env: Any) -> None:
    if (close := getattr(env, "close", None)) is not None:
        try:
            await call_user(close, timeout_s=30.0)
        except Exception as exc:  # noqa: BLE001  # the outcome is decided; a failed close must not change it
            log.warning("closing a Python environment failed: %s", describe(exc))


class PythonSource:
    """The instances of a Python environment (an EnvSource): seeds 0..counts[split]-1 of each split, their
    instructions from `reset`, under the family `name`. Checks the extra tools against the environment's."""

    def __init__(
        self,
        factory: Callable[[], Any],
        name: str,
        counts: dict[str, int],
        agent_timeout_s: float,
        tools: Sequence[Tool] = (),
        timeout_s: float = 60.0,
    ):
        self.factory, self.name, self.counts = factory, name, dict(counts)
        self.agent_timeout_s, self.tools, self.timeout_s = agent_timeout_s, tuple(tools), timeout_s

    def instances(self, split: str) -> list[Instance]:
        """Runs `reset` for each instance, in an event loop of its own (call it outside one)."""
        return asyncio.run(self._instances(split))

    async def _instances(self, split: str) -> list[Instance]:
        env = self.factory()
        try:
            check_tools(own_schemas(env), self.tools, has_sandbox=False)
            found = []
            for seed in range(self.counts.get(split, 0)):
                instruction = await reset(env, seed, split, self.timeout_s)
                found.append(
                    Instance(f"{self.name}/{split}-{seed}", instruction, self.name, split, seed, self.agent_timeout_s)
                )
            return found
        finally:
            await close_env(env)


class PythonEnv:
    """Opens each episode of a Python environment: a new object from `factory`, reset to the instance
    (furlong.envs.base.Environment). `timeout_s`: the most `reset` may take."""

    def __init__(
        self,
        factory: Callable[[], Any],
        tools: Sequence[Tool] = (),
        scorer: Scorer = STEPS_ONLY,
        timeout_s: float = 60.0,
    ):
        self.factory, self.tools, self.scorer, self.timeout_s = factory, tuple(tools), scorer, timeout_s

    def reserve(self, spec: Instance) -> None:
        """Nothing to start ahead: an object is quick to make."""

    async def open(self, spec: Instance, clock: Clock) -> PythonEpisode:
        t = time.perf_counter()
        try:
            env = await self._reset(spec)
        finally:
            clock.add("sandbox_start", t)
        return PythonEpisode(spec, env, self)

    async def demonstration(self, spec: Instance) -> list[Action]:
        """SFT's demonstration of `spec` (train.env.demonstrations): `demonstrate()` of a new object reset to
        it, a list of Actions (a TypeError naming the rule when the environment has none or gives another)."""
        env = await self._reset(spec)
        try:
            demonstrate = getattr(env, "demonstrate", None)
            if not callable(demonstrate):
                raise TypeError(
                    f"train.env.demonstrations: {type(env).__name__} has no demonstrate() method "
                    "returning the Actions that solve its instance (docs/environments.md)"
                )
            actions = await call_user(demonstrate, timeout_s=self.timeout_s)
        finally:
            await close_env(env)
        if not isinstance(actions, (list, tuple)) or not all(isinstance(a, Action) for a in actions):
            raise TypeError(
                f"train.env.demonstrations: {type(env).__name__}.demonstrate() gave {actions!r}, "
                "not a list of furlong.envs.user.Action"
            )
        return list(actions)

    async def _reset(self, spec: Instance) -> Any:
        """A new environment object reset to `spec`; EnvUnavailable (with the traceback) if that fails."""
        env = None
        try:
            env = self.factory()
            instruction = await reset(env, spec.seed, spec.split, self.timeout_s)
        except Exception as exc:
            if env is not None:
                await close_env(env)
            raise EnvUnavailable(f"the environment did not reset to {spec.id}: {describe(exc)}") from exc
        if instruction != spec.instruction:
            await close_env(env)
            raise EnvUnavailable(
                f"reset({spec.seed}, {spec.split!r}) gave another instruction than when the "
                f"instances were listed: reset must be a function of seed and split"
            )
        return env


class StepTools:
    """A Python environment's own tools: each call, and each turn without one, is a `step`."""

    def __init__(self, env: Any, timeout_s: float):
        self.env, self.timeout_s = env, timeout_s
        self.schemas = own_schemas(env)
        self.parameters = {tool_name(s): s["function"].get("parameters", {}) for s in self.schemas}
        self.rewards: list[float] = []
        self.finished = False

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        check_arguments(name, self.parameters[name], arguments)  # step gets arguments that fit the schema
        return await self._step(Action(tool=name, arguments=arguments), timeout_s)

    async def reply(self, text: str, timeout_s: float) -> str | None:
        observation = await self._step(Action(text=text), timeout_s)
        return None if self.finished else observation

    async def _step(self, action: Action, timeout_s: float) -> str:
        if self.finished:
            raise ToolError("the episode is over")
        try:
            result = await call_user(self.env.step, action, timeout_s=timeout_s)
        except TimeoutError:
            raise ToolError(f"the environment's step timed out after {timeout_s:g}s") from None
        except ToolError:
            raise
        except Exception as exc:
            report_once("a Python environment's step", exc)
            raise ToolError(f"the environment's step failed: {describe(exc)}") from exc
        observation, reward, done = _checked(result)
        self.rewards.append(reward)
        self.finished = done
        return observation


def _checked(result: Any) -> tuple[str, float, bool]:
    if not (isinstance(result, tuple) and len(result) == 3):
        raise ToolError(f"the environment's step returned {type(result).__name__}, not (observation, reward, done)")
    observation, reward, done = result
    number = isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward)
    if not isinstance(observation, str) or not number or not isinstance(done, bool):
        raise ToolError(
            f"the environment's step returned ({type(observation).__name__}, {reward!r}, "
            f"{type(done).__name__}), not (text, a finite number, bool)"
        )
    return observation, float(reward), done


class PythonEpisode:
    """One opened Python environment (furlong.envs.base.EpisodeEnv)."""

    note = None

    def __init__(self, spec: Instance, env: Any, opened_by: PythonEnv):
        self.spec, self.env, self.opened_by = spec, env, opened_by
        self.steps = StepTools(env, opened_by.timeout_s)
        self.tools = ToolSet(self.steps, opened_by.tools)

    @property
    def seconds(self) -> float:
        return self.tools.seconds

    @property
    def calls(self) -> int:
        return self.tools.calls

    def caused(self, exc: BaseException) -> bool:
        return False  # its failures reach the model as tool errors: what raises is the agent's own code

    async def score(self, usage: Usage = NO_USAGE) -> Score:
        scorer = self.opened_by.scorer
        own = Score(reward=float(sum(self.steps.rewards)))
        if not scorer.active:
            return own
        rewards = scorer.start()
        await rewards.run(
            EpisodeView(
                self.spec,
                tuple(self.tools.steps),
                tuple(self.tools.answers),
                env=self.env,
                tests=own.reward,
                usage=usage,
            )
        )
        return await scorer.settle(own, rewards, self._control)

    async def _control(self, fns: Sequence[RewardFn]) -> RewardRun:
        """`fns` on a fresh environment reset to the same instance, where no agent acted."""
        env = await self.opened_by._reset(self.spec)
        try:
            rewards = RewardRun(fns)
            await rewards.run(EpisodeView(self.spec, env=env, tests=0.0))  # no steps: their sum is 0
            return rewards
        finally:
            await close_env(env)

    async def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            await close_env(env)
