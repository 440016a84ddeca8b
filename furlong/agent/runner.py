"""The one episode runner for eval, SFT and RL: open the environment, agent phase, score, status and reward.

`run_outcome(spec, agent, env)` is the only code that decides an episode's status and reward. The
environment (furlong.envs.base.Environment) opens the episode's world and scores it; a Harbor task in
a sandbox (furlong.envs.harbor) is the first, and a plain SandboxSource stands for it. The model
conversation (furlong.agent.episode) and the scripted agents (furlong.eval.agents) plug into it as the
agent phase; it never raises for the agent's, the task's or the environment's fault.

Statuses (`STATUSES`), and who is to blame:

- `infra_error` (reward None, never scored, never trained on): failures the agent cannot cause.
  The image cannot be built or found; the sandbox cannot be started or does not answer its first
  command (all before the agent ran anything); the agent's own code, not the sandbox, raised (an
  agent or engine bug); the task is broken: its tests leave no reward, and they leave none in a
  fresh sandbox where no agent ran either; the scoring itself raised (a scorer bug, a server's malformed
  reply: see the end of this docstring).
- `agent_broke_sandbox` (reward 0.0, scored and trained on): once the agent phase has started, any
  exception from a sandbox call (SandboxDied, SandboxError, or anything else, e.g. a KeyError from
  a malformed reply) during the agent phase; or a verifier phase that yields no reward (a sandbox
  call fails while the tests are set up or read, or the tests write no reward) while the same tests
  DO write one in a fresh sandbox where no agent ran. Background processes the agent started keep
  running into the verifier phase, so a verifier that cannot work in the agent's sandbox but works
  in a clean one is the agent's doing (a filled disk, a removed /logs, a process deleting the reward).
  Without this control run, breaking the verifier would turn a failure into an unscored episode,
  which a policy can learn to prefer.
- `reward_tampered` (reward 0.0, scored and trained on): the agent changed what the tests execute (their
  interpreter, shell, test tools or a startup hook: the rule is furlong.tasks.integrity), before the tests
  ran or while they ran, and the task does not trust the agent's tools (`[verifier] trust_agent_tools`).
  The tests still ran (their output is kept), but a reward they give is not the task's; the policy must
  learn that tampering does not pay. The changed paths are kept (`tampered_paths`), also where the task
  trusts the agent's tools (and the status is what it would otherwise be).
- `timeout`: the agent ran out of time (the tests still run and score it), or the tests timed out
  (reward 0).
- `truncated`: the model agent hit its turn or context limit; the tests score it.
- `ok`: everything else the tests scored.

A multi-step task (Harbor's [[steps]]) is one episode: the environment's Score names the next step
(`next_step`), and the agent phase runs again with that step's spec (its instruction and timeout), in the
same world, until a Score names none. The rules above judge each phase and score as they come: one step's
broken sandbox is the episode's `agent_broke_sandbox`, and so on; the final Score's reward is the steps'
(furlong.envs.steps), its status `timeout` if any step's agent or tests ran out of time.

A sandbox host that dies or restarts mid-episode (HostLost, furlong.sandbox.remote.backend) is the one failure
an agent cannot cause from inside its sandbox: that episode is infra_error with `lost` set, and
`run_retrying` runs it again from the start (a fresh agent, a fresh sandbox on a host that answers), so
the episode is recorded once, as its last attempt ended.

Those are the Harbor environment's terms; for any environment the same rules read: `open` failing is
infra_error; an exception during the agent phase is agent_broke_sandbox if the environment caused it
(`EpisodeEnv.caused`), infra_error if the agent's own code did; a `Score` without a reward is
agent_broke_sandbox when it blames the agent (`agent_broke_env`), infra_error otherwise. The user's reward
functions (furlong.envs.rewards) follow the tests' rule: one that fails is infra_error only if it fails on an
episode no agent touched too, else the agent's doing (agent_broke_sandbox); its traceback is the error.

An exception out of `EpisodeEnv.score` (other than a lost host) is infra_error, with its traceback kept
(`Outcome.traceback`), and so is any other exception out of the runner's own steps: they are furlong's
machinery or the environment server failing, never the agent. The agent acts on its world only through
the environment's tools, and an exception from those is judged above (`caused`); a score's contract is
to turn whatever the agent can cause into a Score (Harbor: any sandbox call that fails while the tests
run goes to the control run; a furlong OpenEnv server says `agent_broke_sandbox` in its reply), so what
escapes `score` is the scorer's own failure: a bug, or a server that answers a malformed message. One
such episode never ends a run: it is recorded and the other episodes of its group go on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from furlong.envs.base import (
    NO_USAGE,
    Environment,
    EnvSpec,
    EnvUnavailable,
    EpisodeEnv,
    Score,
    StepScore,
    describe,
    exception_chain,
)
from furlong.envs.harbor import GuardedSandbox, HarborEnv, SandboxSource, sandbox_spec
from furlong.sandbox.base import HostLost
from furlong.timing import Clock, EpisodeTiming

log = logging.getLogger(__name__)

__all__ = [
    "AGENT_GRACE_S",
    "LOST_RETRIES",
    "STATUSES",
    "Agent",
    "AgentRun",
    "GuardedSandbox",
    "Outcome",
    "SandboxSource",
    "describe",
    "environment",
    "run_outcome",
    "run_retrying",
    "sandbox_spec",
]

STATUSES = ("ok", "truncated", "timeout", "agent_broke_sandbox", "reward_tampered", "infra_error")
AGENT_GRACE_S = 5.0  # past the agent timeout, for a command that was given the whole timeout to report back
LOST_RETRIES = 2  # more attempts at an episode whose sandbox host was lost


@dataclass(frozen=True)
class AgentRun:
    commands: int = 0
    timed_out: bool = False
    truncated: bool = False  # a model agent stopped by its turn or context limit
    last_exit_code: int | None = None  # a scripted agent's last command, kept for the episode's record
    last_output: str | None = None  # its output's tail (furlong.tasks.verifier.output_tail)


class Agent(Protocol):
    """The agent phase: it acts through the episode's `tools` (a Harbor episode's ToolSet also holds
    its sandbox, for scripted agents). In a multi-step episode `run` is called again for each later step,
    with that step's spec (its instruction, solution and timeout). An agent that waits on a shared engine may also define
    `engine_wait_s() -> float`: the seconds it has waited so far, a wait in progress included. The
    episode's `model_wait` time is that figure, and the runner's hard limit on the phase does not
    count it (see `_agent_phase`). Any agent may define `usage() -> Usage`: its tokens and turns so far,
    what reward functions see (furlong.envs.rewards.EpisodeView.usage)."""

    @property
    def name(self) -> str: ...

    # positional-only (/): agents name them for what they get; `tools` is a Toolbox (a Harbor episode's
    # ToolSet for a scripted agent, which annotates that)
    async def run(self, spec: Any, tools: Any, timeout_s: float, /) -> AgentRun: ...


@dataclass(frozen=True)
class Outcome:
    reward: float | None  # None exactly for infra_error
    status: str  # one of STATUSES
    timing: EpisodeTiming
    error: str | None = None
    agent_timed_out: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    # What a user debugging a reward needs; None where that phase never ran (or left nothing to report).
    # After a control run, the verifier fields are still those of the tests in the agent's sandbox.
    verifier_exit_code: int | None = None
    verifier_output: str | None = None
    agent_exit_code: int | None = None
    agent_output: str | None = None
    image_note: str | None = None  # e.g. which stand-in served the task's FROM, and its real Python version
    tampered_paths: tuple[str, ...] = ()  # what the agent changed that the tests execute (capped, sorted)
    integrity_checked: bool | None = None  # furlong.envs.base.Score.integrity_checked (None: no tests ran)
    lost: bool = False  # infra_error because the sandbox's host was lost: the episode may be run again
    steps: tuple[StepScore, ...] = ()  # a multi-step task's steps that ran, each with its reward
    traceback: str | None = None  # the exception that decided the outcome, where one did (with its causes)
    # what the reward was computed from: one furlong.tasks.receipt.Receipt per run of the tests that scored the
    # agent's work (one per step of a multi-step task); () where the tests never ran, or the environment gives none
    receipts: tuple[Any, ...] = ()


def environment(source: Environment | SandboxSource) -> Environment:
    """`source` itself, or the Harbor environment over a SandboxSource."""
    return cast(Environment, source) if hasattr(source, "open") else HarborEnv(cast(SandboxSource, source))


async def run_outcome(spec: EnvSpec, agent: Agent, source: Environment | SandboxSource) -> Outcome:
    """Never raises for the agent's, the task's or the environment's fault (see the module docstring)."""
    clock = Clock()
    try:
        env = await environment(source).open(spec, clock)
    except EnvUnavailable as exc:
        return _unscored(clock, str(exc), lost=host_lost(exc), exc=exc.__cause__)  # the message says the rest
    except Exception as exc:  # noqa: BLE001  # an environment that fails to open is an unscored episode, not a crash
        return _unscored(clock, f"environment did not open: {describe(exc)}", lost=host_lost(exc), exc=exc)
    try:
        outcome = await _phases(spec, agent, env, clock)
    except Exception as exc:  # noqa: BLE001 -- not the agent's (module docstring): the episode's, not the run's
        log.warning(
            "episode %s: the episode runner failed (infra_error, traceback in its record): %s", spec.id, describe(exc)
        )
        outcome = _unscored(clock, f"the episode runner failed: {describe(exc)}", lost=host_lost(exc), exc=exc)
    finally:
        await _close(env)
    return dataclasses.replace(outcome, image_note=env.note)


async def _close(env: EpisodeEnv) -> None:
    """The outcome is decided: an environment that fails to close is logged, and changes nothing."""
    try:
        await env.close()
    except Exception as exc:  # noqa: BLE001
        log.warning("closing an episode's environment failed: %s", describe(exc))


async def _phases(spec: EnvSpec, agent: Agent, env: EpisodeEnv, clock: Clock) -> Outcome:
    """The agent phase and its score; again with each next step's spec, while the score names one."""
    runs: list[AgentRun] = []
    while True:
        try:
            run, failure = await _agent_phase(spec, agent, env)
        finally:
            clock.spent["agent_commands"] = env.seconds
            clock.spent["model_wait"] = _engine_wait(agent)
        run = _joined([*runs, run])
        if failure is not None and host_lost(failure):
            return _unscored(
                clock, f"sandbox host lost during the agent phase: {describe(failure)}", run, lost=True, exc=failure
            )
        if failure is not None and env.caused(failure):
            return _broke(clock, f"sandbox broke during the agent phase: {describe(failure)}", run, exc=failure)
        if failure is not None:
            return _unscored(clock, f"agent failed: {describe(failure)}", exc=failure)
        t = time.perf_counter()
        try:
            score = await _score(env, agent)
        except Exception as exc:  # noqa: BLE001 -- the scorer's own failure, never the agent's (module docstring)
            lost = host_lost(exc)
            if not lost:  # a scorer that fails for every episode must not go unnoticed in a running job
                log.warning(
                    "episode %s: scoring failed (infra_error, traceback in its record): %s", spec.id, describe(exc)
                )
            what = "sandbox host lost while scoring" if lost else "scoring failed"
            return _unscored(clock, f"{what}: {describe(exc)}", run, lost=lost, exc=exc)
        finally:
            clock.add("verifier", t)
        if score.next_step is None:
            return _scored(clock, run, score)
        runs.append(run)
        spec = score.next_step


def _joined(runs: list[AgentRun]) -> AgentRun:
    """The agent phases of an episode's steps as one: the last one's command, any one's time-out."""
    last = runs[-1]
    return AgentRun(
        commands=sum(r.commands for r in runs),
        timed_out=any(r.timed_out for r in runs),
        truncated=any(r.truncated for r in runs),
        last_exit_code=last.last_exit_code,
        last_output=last.last_output,
    )


def _scored(clock: Clock, run: AgentRun, score: Score) -> Outcome:
    """The outcome of a finished episode's score (the module docstring's rules)."""
    if score.agent_broke_env:
        return _broke(clock, score.error or "the agent left the environment unable to score it", run, score)
    if score.reward is None:
        return _unscored(clock, score.error or "no reward", run, score)
    if score.tampered:
        return Outcome(
            reward=0.0,
            status="reward_tampered",
            timing=clock.timing(),
            error=score.error,
            agent_timed_out=run.timed_out,
            rewards=score.rewards,
            **_records(run, score),
        )
    status = "timeout" if score.timed_out or run.timed_out else ("truncated" if run.truncated else "ok")
    return Outcome(
        reward=score.reward,
        status=status,
        timing=clock.timing(),
        error=score.error,
        agent_timed_out=run.timed_out,
        rewards=score.rewards,
        **_records(run, score),
    )


async def _agent_phase(spec: EnvSpec, agent: Agent, env: EpisodeEnv) -> tuple[AgentRun, Exception | None]:
    """The agent's run, or the exception it ended with. Its background processes keep running.

    The hard limit (agent timeout + grace, for an agent that overruns its own) stops its clock while the
    agent waits on a shared engine (`engine_wait_s`, as ModelAgent's own timeout does): a loaded engine
    must not turn an episode into a timeout scored 0."""
    loop = asyncio.get_running_loop()
    phase = asyncio.ensure_future(agent.run(spec, env.tools, spec.agent_timeout_s))
    excused, end = _engine_wait(agent), loop.time() + spec.agent_timeout_s + AGENT_GRACE_S
    try:
        while not phase.done():
            await asyncio.wait({phase}, timeout=max(0.0, end - loop.time()))
            waited = _engine_wait(agent)
            if not phase.done() and waited <= excused:
                return AgentRun(commands=env.calls, timed_out=True), None
            end, excused = end + waited - excused, waited
        return phase.result(), None
    except Exception as exc:  # noqa: BLE001  # raised inside the phase (e.g. a sandbox call's own timeout)
        return AgentRun(commands=env.calls), exc
    finally:
        if not phase.done():
            phase.cancel()
            await asyncio.gather(phase, return_exceptions=True)


async def _score(env: EpisodeEnv, agent: Agent) -> Score:
    """`env.score`, given the agent's usage where it takes one: environments written before `usage`
    (docs/extending.md's) define score() alone, and keep working."""
    if "usage" not in inspect.signature(env.score).parameters:
        return await env.score()
    usage = getattr(agent, "usage", None)
    scored: Any = env.score  # this one takes `usage` (checked above); the protocol's score() does not name it
    return await scored(usage=usage() if callable(usage) else NO_USAGE)


def _engine_wait(agent: Agent) -> float:
    """The optional `engine_wait_s()` of the Agent protocol; 0 for an agent without one (no engine)."""
    wait = getattr(agent, "engine_wait_s", None)
    return float(wait()) if callable(wait) else 0.0


def _records(run: AgentRun | None, score: Score | None) -> dict[str, Any]:
    """The Outcome fields that say what the agent's last command and the scorer printed."""
    return {
        "agent_exit_code": run.last_exit_code if run else None,
        "agent_output": run.last_output if run else None,
        "verifier_exit_code": score.exit_code if score else None,
        "verifier_output": score.output if score else None,
        "tampered_paths": score.tampered_paths if score else (),
        "integrity_checked": score.integrity_checked if score else None,
        "steps": score.steps if score else (),
        "receipts": score.receipts if score else (),
    }


def _unscored(
    clock: Clock,
    error: str,
    run: AgentRun | None = None,
    score: Score | None = None,
    lost: bool = False,
    exc: BaseException | None = None,
) -> Outcome:
    return Outcome(
        reward=None,
        status="infra_error",
        timing=clock.timing(),
        error=error,
        agent_timed_out=bool(run and run.timed_out),
        lost=lost,
        traceback=_traceback(exc),
        **_records(run, score),
    )


def _traceback(exc: BaseException | None) -> str | None:
    """The exception's traceback with its causes, as Python prints it (None without one)."""
    return None if exc is None else "".join(traceback.format_exception(exc))


def host_lost(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, is a lost sandbox host."""
    return any(isinstance(c, HostLost) for c in exception_chain(exc))


AgentT = TypeVar("AgentT", bound=Agent)  # run_retrying hands back the caller's own kind of agent


async def run_retrying(
    spec: EnvSpec, new_agent: Callable[[], AgentT], source: Environment | SandboxSource, retries: int = LOST_RETRIES
) -> tuple[AgentT, Outcome]:
    """`run_outcome` with a fresh agent, again while the episode's sandbox host was lost (at most `retries`
    more times); the last attempt's agent and outcome."""
    for attempt in range(retries + 1):
        agent = new_agent()
        outcome = await run_outcome(spec, agent, source)
        if not outcome.lost or attempt == retries:
            return agent, outcome
        log.warning(
            "episode %s: %s; running it again (attempt %d of %d)", spec.id, outcome.error, attempt + 2, retries + 1
        )
    raise AssertionError("unreachable")


def _broke(
    clock: Clock, error: str, run: AgentRun, score: Score | None = None, exc: BaseException | None = None
) -> Outcome:
    return Outcome(
        reward=0.0,
        status="agent_broke_sandbox",
        timing=clock.timing(),
        error=error,
        agent_timed_out=run.timed_out,
        traceback=_traceback(exc),
        **_records(run, score),
    )
