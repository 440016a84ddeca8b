"""The one episode runner for eval and RL: sandbox, agent phase, verifier phase, status and reward.

`run_outcome(task, agent, sandboxes)` is the only code that decides an episode's status and reward.
The model conversation (furlong.agent.episode) and the scripted agents (furlong.eval.agents) plug
into it as the agent phase; it never raises for the agent's, the task's or the sandbox's fault.

Statuses (`STATUSES`), and who is to blame:

- `infra_error` (reward None, never scored, never trained on): failures the agent cannot cause.
  The image cannot be built or found; the sandbox cannot be started or does not answer its first
  command (all before the agent ran anything); the agent's own code, not the sandbox, raised (an
  agent or engine bug); the task is broken: its tests leave no reward, and they leave none in a
  fresh sandbox where no agent ran either.
- `agent_broke_sandbox` (reward 0.0, scored and trained on): once the agent phase has started, any
  exception from a sandbox call (SandboxDied, SandboxError, or anything else, e.g. a KeyError from
  a malformed reply) during the agent phase; or a verifier phase that yields no reward (a sandbox
  call fails while the tests are set up or read, or the tests write no reward) while the same tests
  DO write one in a fresh sandbox where no agent ran. Background processes the agent started keep
  running into the verifier phase, so a verifier that cannot work in the agent's sandbox but works
  in a clean one is the agent's doing (a filled disk, a removed /logs, a process deleting the reward).
  Without this control run, breaking the verifier would turn a failure into an unscored episode,
  which a policy can learn to prefer.
- `timeout`: the agent ran out of time (the tests still run and score it), or the tests timed out
  (reward 0).
- `truncated`: the model agent hit its turn or context limit; the tests score it.
- `ok`: everything else the tests scored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from furlong.sandbox.base import ImageRef, Sandbox, SandboxSpec
from furlong.sandbox.pool import sandbox_spec
from furlong.tasks.model import Task
from furlong.tasks.verifier import Verdict, verify
from furlong.timing import Clock, EpisodeTiming

log = logging.getLogger(__name__)

STATUSES = ("ok", "truncated", "timeout", "agent_broke_sandbox", "infra_error")
AGENT_GRACE_S = 5.0  # past the agent timeout, for a command that was given the whole timeout to report back


@dataclass(frozen=True)
class AgentRun:
    commands: int = 0
    timed_out: bool = False
    truncated: bool = False  # a model agent stopped by its turn or context limit
    last_exit_code: int | None = None  # a scripted agent's last command, kept for the episode's record
    last_output: str | None = None  # its output's tail (furlong.tasks.verifier.output_tail)


class Agent(Protocol):
    """The agent phase. An agent that waits on a shared engine may also define `engine_wait_s() -> float`:
    the seconds it has waited so far, a wait in progress included. The episode's `model_wait` time is
    that figure, and the runner's hard limit on the phase does not count it (see `_agent_phase`)."""

    name: str

    async def run(self, task: Task, sandbox: Sandbox, timeout_s: float) -> AgentRun: ...


class SandboxSource(Protocol):
    """Where episodes get images and started sandboxes (fresh ones, or from a warm pool)."""

    async def image(self, task: Task) -> ImageRef: ...

    def reserve(self, task: Task) -> None: ...  # an episode of `task` is coming: start its sandbox ahead

    async def acquire(self, spec: SandboxSpec) -> Sandbox: ...  # started: it answered a first command


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


def describe(exc: BaseException) -> str:
    """One line: the exception's type and message (a KeyError's message is just the key)."""
    text = " ".join(str(exc).split())[:800]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class GuardedSandbox:
    """What an agent or the verifier sees: the episode's sandbox, with the time spent in its calls
    added up and every exception a call raised remembered (and re-raised unchanged), so the runner
    can tell a broken sandbox from a bug in the agent's own code."""

    def __init__(self, inner: Sandbox):
        self.inner = inner
        self.seconds = 0.0
        self.commands = 0
        self.errors: list[BaseException] = []

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc`, or an exception it was raised from or while handling, came from a sandbox call."""
        seen: set[int] = set()
        chain: BaseException | None = exc
        while chain is not None and id(chain) not in seen:
            if any(chain is e for e in self.errors):
                return True
            seen.add(id(chain))
            chain = chain.__cause__ or chain.__context__
        return False

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await getattr(self.inner, method)(*args, **kwargs)
        except Exception as exc:
            self.errors.append(exc)
            raise
        finally:
            self.seconds += time.perf_counter() - start
            self.commands += method == "exec"

    async def exec(self, cmd: str, timeout_s: float = 60.0, cwd: str | None = None, env: dict[str, str] | None = None):
        return await self._call("exec", cmd, timeout_s, cwd, env)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._call("write_file", path, data, mode)

    async def read_file(self, path: str) -> bytes:
        return await self._call("read_file", path)

    async def put_dir(self, src, dest: str) -> None:
        await self._call("put_dir", src, dest)

    async def close(self) -> None:  # the runner closes the sandbox; an agent cannot end the episode early
        raise RuntimeError("an agent must not close its episode's sandbox")

    @property
    def alive(self) -> bool:
        return self.inner.alive


async def run_outcome(task: Task, agent: Agent, sandboxes: SandboxSource) -> Outcome:
    """Never raises for the agent's, the task's or the sandbox's fault (see the module docstring)."""
    clock = Clock()
    try:
        image = await sandboxes.image(task)
    except Exception as exc:
        return _unscored(clock, f"image unavailable: {describe(exc)}")
    t = time.perf_counter()
    try:
        sandbox = await sandboxes.acquire(sandbox_spec(task, image))
    except Exception as exc:
        clock.add("sandbox_start", t)
        return _unscored(clock, f"sandbox did not start: {describe(exc)}")
    clock.add("sandbox_start", t)
    guard = GuardedSandbox(sandbox)
    try:
        outcome = await _phases(task, agent, guard, sandboxes, image, clock)
        return dataclasses.replace(outcome, image_note=image.note or None)
    finally:
        await _close(sandbox)


async def _phases(task: Task, agent: Agent, guard: GuardedSandbox, sandboxes: SandboxSource, image: ImageRef,
                  clock: Clock) -> Outcome:
    try:
        run, failure = await _agent_phase(task, agent, guard)
    finally:
        clock.spent["agent_commands"] = guard.seconds
        clock.spent["model_wait"] = _engine_wait(agent)
    if failure is not None and guard.caused(failure):
        return _broke(clock, f"sandbox broke during the agent phase: {describe(failure)}", run)
    if failure is not None:
        return _unscored(clock, f"agent failed: {describe(failure)}")
    t = time.perf_counter()
    verdict, problem = await _verifier_phase(task, GuardedSandbox(guard.inner), image.workdir)
    if problem:  # no reward in the agent's sandbox: a clean run of the tests says whose fault
        await _close(guard.inner)  # done with it (closing twice is a no-op); free it before taking another
        _, control_problem = await _control_run(task, sandboxes, image)
        clock.add("verifier", t)
        if control_problem:
            return _unscored(clock, f"task bug: {problem}; with no agent either: {control_problem}", run, verdict)
        return _broke(clock, f"verifier failed in the agent's sandbox ({problem}) but not in a fresh one", run,
                      verdict)
    assert verdict is not None  # no problem means the tests left a reward
    clock.add("verifier", t)
    status = "timeout" if verdict.timed_out or run.timed_out else ("truncated" if run.truncated else "ok")
    return Outcome(reward=verdict.reward, status=status, timing=clock.timing(), error=verdict.problem,
                   agent_timed_out=run.timed_out, rewards=verdict.rewards, **_records(run, verdict))


async def _agent_phase(task: Task, agent: Agent, sandbox: GuardedSandbox) -> tuple[AgentRun, Exception | None]:
    """The agent's run, or the exception it ended with. Its background processes keep running.

    The hard limit (agent timeout + grace, for an agent that overruns its own) stops its clock while the
    agent waits on a shared engine (`engine_wait_s`, as ModelAgent's own timeout does): a loaded engine
    must not turn an episode into a timeout scored 0."""
    loop = asyncio.get_running_loop()
    phase = asyncio.ensure_future(agent.run(task, sandbox, task.agent_timeout_s))
    excused, end = _engine_wait(agent), loop.time() + task.agent_timeout_s + AGENT_GRACE_S
    try:
        while not phase.done():
            await asyncio.wait({phase}, timeout=max(0.0, end - loop.time()))
            waited = _engine_wait(agent)
            if not phase.done() and waited <= excused:
                return AgentRun(commands=sandbox.commands, timed_out=True), None
            end, excused = end + waited - excused, waited
        return phase.result(), None
    except Exception as exc:  # raised inside the phase (e.g. a sandbox call's own timeout)
        return AgentRun(commands=sandbox.commands), exc
    finally:
        if not phase.done():
            phase.cancel()
            await asyncio.gather(phase, return_exceptions=True)


def _engine_wait(agent: Agent) -> float:
    """The optional `engine_wait_s()` of the Agent protocol; 0 for an agent without one (no engine)."""
    wait = getattr(agent, "engine_wait_s", None)
    return float(wait()) if callable(wait) else 0.0


async def _verifier_phase(task: Task, sandbox: GuardedSandbox, workdir: str) -> tuple[Verdict | None, str]:
    """The verdict (None if a sandbox call failed), and what went wrong when the tests left no reward
    ("" when they did)."""
    try:
        verdict = await verify(task, sandbox, workdir)
    except Exception as exc:
        return None, describe(exc)
    if verdict.reward is None:
        return verdict, verdict.problem or "no reward"
    return verdict, ""


async def _control_run(task: Task, sandboxes: SandboxSource, image: ImageRef) -> tuple[Verdict | None, str]:
    """The task's tests alone, in a fresh sandbox no agent touched."""
    try:
        sandbox = await sandboxes.acquire(sandbox_spec(task, image))
    except Exception as exc:
        return None, f"sandbox did not start: {describe(exc)}"
    try:
        return await _verifier_phase(task, GuardedSandbox(sandbox), image.workdir)
    finally:
        await _close(sandbox)


async def _close(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:  # the outcome is decided; a failed close must not change or abort it
        log.warning("closing a sandbox failed: %s", describe(exc))


def _records(run: AgentRun | None, verdict: Verdict | None) -> dict[str, Any]:
    """The Outcome fields that say what the agent's last command and the tests printed."""
    return {"agent_exit_code": run.last_exit_code if run else None, "agent_output": run.last_output if run else None,
            "verifier_exit_code": verdict.exit_code if verdict else None,
            "verifier_output": verdict.output_tail if verdict else None}


def _unscored(clock: Clock, error: str, run: AgentRun | None = None, verdict: Verdict | None = None) -> Outcome:
    return Outcome(reward=None, status="infra_error", timing=clock.timing(), error=error,
                   agent_timed_out=bool(run and run.timed_out), **_records(run, verdict))


def _broke(clock: Clock, error: str, run: AgentRun, verdict: Verdict | None = None) -> Outcome:
    return Outcome(reward=0.0, status="agent_broke_sandbox", timing=clock.timing(), error=error,
                   agent_timed_out=run.timed_out, **_records(run, verdict))
