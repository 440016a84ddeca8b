"""A Harbor task in a sandbox: the first `Environment` (furlong.envs.base).

The episode's sandbox comes from a `SandboxSource` (fresh sandboxes, or a warm pool), its tool is bash
(and the user's extra tools, furlong.envs.toolset), and its score is the task's tests (furlong.tasks.verifier)
run in the agent's sandbox, or in a sandbox of their own that gets the agent's artifacts (Harbor's separate
verifier, furlong.envs.separate), with the user's reward functions (furlong.envs.rewards) weighed in. When
those leave no reward, a control run on a fresh sandbox no agent touched says whose fault that is (the
rules: furlong.agent.runner's docstring, and furlong.envs.rewards' for reward functions). A multi-step
task's steps run one after another in the one sandbox (furlong.envs.steps); the reward functions score the
episode's last step, with its tests.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from furlong.envs.base import (
    NO_USAGE,
    EnvUnavailable,
    Score,
    StepScore,
    ToolArgumentError,
    Usage,
    describe,
)
from furlong.envs.guarded import GuardedSandbox
from furlong.envs.rewards import TESTS_ONLY, EpisodeView, RewardFn, RewardRun, Scorer, VerifierSandbox
from furlong.envs.separate import BundledTests, VerifierUnavailable, hand_over
from furlong.envs.steps import aggregate, failed_step, gate, prepare, run_hooks
from furlong.envs.toolset import Tool, ToolSet, check_tools, exec_observation
from furlong.sandbox.base import (
    HostLost,
    ImageRef,
    LayerSource,
    NetworkSwitching,
    Sandbox,
    SandboxDied,
    SandboxError,
    SandboxSpec,
)
from furlong.sandbox.network import NetworkPolicy
from furlong.sandbox.pool import sandbox_spec
from furlong.tasks.family import Family
from furlong.tasks.model import ARTIFACTS_DIR, Task, TaskNetwork, phases
from furlong.tasks.network import with_default
from furlong.tasks.receipt import Receipt
from furlong.tasks.verifier import Verdict, verifier_env, verify
from furlong.timing import Clock

log = logging.getLogger(__name__)

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the task's terminal and return its exit code and output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command to run"}},
            "required": ["command"],
        },
    },
}


BASH_TOOL_SCHEMAS = (BASH_TOOL,)


class SandboxSource(Protocol):
    """Where episodes get images and started sandboxes (fresh ones, or from a warm pool)."""

    async def image(self, task: Task) -> ImageRef: ...

    def reserve(self, task: Any) -> None: ...  # an episode of `task` (a Task) is coming: start its sandbox ahead

    async def acquire(self, spec: SandboxSpec) -> Sandbox: ...  # started: it answered a first command


class BashTools:
    """The Harbor episode's toolbox: bash in the sandbox. Scripted agents (the oracle) use `sandbox` itself."""

    schemas = BASH_TOOL_SCHEMAS

    def __init__(self, sandbox: GuardedSandbox):
        self.sandbox = sandbox

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ToolArgumentError('bash needs {"command": "<a non-empty string>"}')
        return exec_observation(await self.sandbox.exec(command, timeout_s=timeout_s), timeout_s)


class HarborEpisode:
    """One task's opened sandbox (furlong.envs.base.EpisodeEnv): its steps in order (one, for most tasks),
    each scored by its tests in this sandbox or in a separate verifier's (furlong.envs.separate, .steps)."""

    def __init__(
        self,
        task: Task,
        sandbox: Sandbox,
        image: ImageRef,
        sandboxes: SandboxSource,
        tools: Sequence[Tool] = (),
        scorer: Scorer = TESTS_ONLY,
        bundled: BundledTests | None = None,
    ):
        self.task, self.image, self.sandboxes, self.scorer = task, image, sandboxes, scorer
        self.bundled = bundled or BundledTests(None)
        self.guard = GuardedSandbox(sandbox)
        self.tools = ToolSet(BashTools(self.guard), tools, self.guard)
        self.note = image.note or None
        self.phases = phases(task)
        self.index = 0  # the step the agent is on
        self.done: list[StepScore] = []  # the steps scored so far
        self._tampered_paths: tuple[str, ...] = ()  # every step's, for the episode's record
        self._integrity_checked: bool | None = True  # every step's so far (None: a step's is unknown)
        self._receipts: tuple[Receipt, ...] = ()  # every scored step's, in order
        self._timed_out = False  # a step's tests ran out of time

    @property
    def seconds(self) -> float:
        return self.guard.seconds

    @property
    def calls(self) -> int:
        return self.guard.commands

    def caused(self, exc: BaseException) -> bool:
        return self.guard.caused(exc)

    async def begin(self) -> str | None:
        """Before the agent's first command (the first step's workdir and setup); what failed, or None."""
        return await ready(self.guard, self.task, 0, self.image.workdir)

    async def score(self, usage: Usage = NO_USAGE) -> Score:
        phase = self.phases[self.index]
        if phase.separate is None and (
            problem := await phase_network(self.guard.inner, phase.verifier_network, phase.agent_network)
        ):
            return Score(reward=None, error=problem, steps=tuple(self.done))
        guard, rewards = GuardedSandbox(self.guard.inner), self.scorer.start()
        last = self.index == len(self.phases) - 1
        try:
            verdict, problem = await self._verify(guard, rewards.run, self.close if last else None, usage=usage)
        except VerifierUnavailable as exc:
            return Score(reward=None, error=str(exc), steps=tuple(self.done))
        if problem:
            return dataclasses.replace(await self._no_reward(verdict, problem), steps=tuple(self.done))
        assert verdict is not None  # no problem means the tests left a reward
        score = Score(
            reward=verdict.reward,
            rewards=verdict.rewards,
            timed_out=verdict.timed_out,
            error=verdict.problem,
            tampered=verdict.tampered,
            **_record(verdict),
        )
        if self.task.steps:
            score = await self._stepped(score)
            if score.next_step is not None:
                return score
        if not self.scorer.active or score.tampered:
            return score  # tampered: 0 whatever the reward functions say
        return await self.scorer.settle(score, rewards, self._reward_control)

    async def _verify(
        self,
        guard: GuardedSandbox,
        rewards: Callable[..., Awaitable[None]] | None,
        release: Callable[[], Awaitable[None]] | None,
        usage: Usage | None = None,
    ) -> tuple[Verdict | None, str]:
        """The current step's tests on the work in `guard` (the agent's sandbox, or a control's):
        in it, or in a separate verifier's sandbox that gets its artifacts (`release`: the agent's
        sandbox is done with once they are out). `usage`: the agent's; None: a control run, no agent."""
        phase = self.phases[self.index]
        await run_hooks(guard, phase, self.image.workdir)
        calls = (tuple(self.tools.steps), tuple(self.tools.answers)) if usage is not None else ((), ())
        seen = usage or NO_USAGE
        if phase.separate is None:
            view = EpisodeView(self.task, *calls, VerifierSandbox(guard, self.image.workdir), usage=seen)
            return await verifier_phase(phase, guard, self.image, rewards, view)
        vbox, vguard, problem = await hand_over(phase, guard, release, self.sandboxes, self.bundled, GuardedSandbox)
        if vbox is None or vguard is None:  # both or neither
            return None, problem
        try:
            view = EpisodeView(self.task, *calls, VerifierSandbox(vguard, vbox.image.workdir), usage=seen)
            return await verifier_phase(phase, vguard, vbox.image, rewards, view, tests=vbox.tests)
        finally:
            await close_quietly(vbox.sandbox)

    async def _stepped(self, score: Score) -> Score:
        """A step's score: the next step's start, or (the last step, a closed gate, a failure) the episode's."""
        step = self.task.steps[self.index]
        self._tampered_paths = tuple(sorted({*self._tampered_paths, *score.tampered_paths}))
        checked = (self._integrity_checked, score.integrity_checked)
        self._integrity_checked = None if None in checked else all(checked)  # every step's, or unknown
        self._receipts += tuple(dataclasses.replace(r, step=step.name) for r in score.receipts)
        error = f"step {step.name!r}: the tests timed out" if score.timed_out else None
        self._timed_out |= score.timed_out
        self.done.append(StepScore(step.name, score.reward, {**score.rewards, "reward": score.reward}, error))  # type: ignore[arg-type, dict-item]  # a verdict without a problem has a reward
        stop = error or gate(step, self.done[-1].rewards)
        if score.tampered:
            return dataclasses.replace(score, steps=tuple(self.done), receipts=self._receipts)
        if not stop and self.index + 1 < len(self.phases):
            before, self.index = self.phases[self.index], self.index + 1
            if problem := await next_agent_network(self.guard.inner, before, self.phases[self.index]):
                return Score(reward=None, error=problem, steps=tuple(self.done))
            try:
                failure = await ready(self.guard, self.task, self.index, self.image.workdir)
            except HostLost:
                raise
            except Exception as exc:  # noqa: BLE001 -- the agent's sandbox broke between its steps: its doing
                return Score(
                    reward=None,
                    agent_broke_env=True,
                    steps=tuple(self.done),
                    error=f"the sandbox broke before step {self.task.steps[self.index].name!r}: {describe(exc)}",
                )
            if failure is None:
                return dataclasses.replace(score, steps=tuple(self.done), next_step=self.phases[self.index])
            self.done.append(failed_step(self.task.steps[self.index], failure))
            stop = failure
        rewards = aggregate(self.task.reward_strategy, self.done)
        return dataclasses.replace(
            score,
            reward=rewards["reward"],
            rewards=rewards,
            error=stop or score.error,
            timed_out=self._timed_out,
            tampered_paths=self._tampered_paths,
            integrity_checked=self._integrity_checked,
            steps=tuple(self.done),
            receipts=self._receipts,
        )

    async def _no_reward(self, verdict: Verdict | None, problem: str) -> Score:
        """No reward from the agent's work: the same step scored where no agent ran says whose fault."""
        await self.close()  # done with it (closing twice is a no-op); free it before taking another
        try:
            _, control_problem = await self._control_run()
        except HostLost:
            raise
        except Exception as exc:  # noqa: BLE001  # any start failure is recorded as the control problem
            control_problem = f"sandbox did not start: {describe(exc)}"
        if control_problem:
            return Score(
                reward=None, error=f"task bug: {problem}; with no agent either: {control_problem}", **_record(verdict)
            )
        return Score(
            reward=None,
            agent_broke_env=True,
            **_record(verdict),
            error=f"verifier failed in the agent's sandbox ({problem}) but not in a fresh one",
        )

    async def _control_run(self, fns: Sequence[RewardFn] = ()) -> tuple[RewardRun, str]:
        """The current step's tests (then `fns`, on an episode without tool calls or answers) on a fresh
        sandbox no agent touched, readied for each step up to this one: their values, and what went wrong
        when the tests left no reward. Raises what a sandbox's start raised."""
        rewards = RewardRun(fns)
        sandbox = await self.sandboxes.acquire(sandbox_spec(self.phases[self.index], self.image, control=True))
        try:
            guard = GuardedSandbox(sandbox)
            for k in range(self.index + 1):
                if failure := await ready(guard, self.task, k, self.image.workdir):
                    return rewards, failure
            _, problem = await self._verify(guard, rewards.run if fns else None, None)
            return rewards, problem
        finally:
            await close_quietly(sandbox)

    async def _reward_control(self, fns: Sequence[RewardFn]) -> RewardRun:
        await self.close()
        rewards, _ = await self._control_run(fns)
        return rewards

    async def close(self) -> None:
        await close_quietly(self.guard.inner)


async def ready(sandbox: Sandbox, task: Task, index: int, workdir: str) -> str | None:
    """A sandbox readied for the agent phase of step `index` (0 for a task without steps); what failed.
    With one uid /logs is no verifier mount, so Harbor's convention dir is made here, for the agent."""
    if index == 0 and sandbox.verifier_uid is None:
        await sandbox.exec(f"mkdir -p {ARTIFACTS_DIR}", timeout_s=30, cwd="/")
    if not task.steps:
        return None
    return await prepare(sandbox, task.steps[index], workdir, after_another=index > 0)


class HarborSource:
    """Harbor task families as an EnvSource: each split's instances, family by family, at most
    `limits[split]` of each family (all where a split has no limit); those that name no network mode get
    `network`'s phases (None: offline)."""

    def __init__(
        self,
        families: Sequence[Family],
        limits: Mapping[str, int | None] | None = None,
        network: TaskNetwork | None = None,
    ):
        self.families, self.limits, self.network = tuple(families), dict(limits or {}), network

    def instances(self, split: str) -> list[Task]:
        found = [task for f in self.families for task in f.instances(split, self.limits.get(split))]
        return found if self.network is None else with_default(found, self.network)


class HarborEnv:
    """Harbor tasks, each episode in a sandbox from `sandboxes` (furlong.envs.base.Environment), with the
    user's extra `tools` beside bash and `scorer`'s reward functions beside the tests."""

    def __init__(
        self,
        sandboxes: SandboxSource,
        tools: Sequence[Tool] = (),
        scorer: Scorer = TESTS_ONLY,
        layers: LayerSource | None = None,
    ):
        self.sandboxes, self.tools, self.scorer = sandboxes, tuple(tools), scorer
        self.bundled = BundledTests(layers)  # `layers`: where a separate verifier's image shows its own tests
        check_tools(BASH_TOOL_SCHEMAS, self.tools, has_sandbox=True)  # a clash fails here, not in every episode

    def reserve(self, task: Task) -> None:
        self.sandboxes.reserve(task)

    async def open(self, task: Task, clock: Clock) -> HarborEpisode:
        try:
            image = await self.sandboxes.image(task)
        except Exception as exc:
            raise EnvUnavailable(f"image unavailable: {describe(exc)}") from exc
        t = time.perf_counter()
        try:
            sandbox = await self.sandboxes.acquire(sandbox_spec(task, image))
        except Exception as exc:
            raise EnvUnavailable(f"sandbox did not start: {describe(exc)}") from exc
        finally:
            clock.add("sandbox_start", t)
        episode = HarborEpisode(task, sandbox, image, self.sandboxes, self.tools, self.scorer, self.bundled)
        try:
            failure = await episode.begin()
        except Exception as exc:
            await episode.close()
            raise EnvUnavailable(f"the sandbox could not be readied: {describe(exc)}") from exc
        if failure:
            await episode.close()
            raise EnvUnavailable(failure)  # before the agent ran anything: the task's
        return episode


async def verifier_phase(
    task: Task,
    sandbox: GuardedSandbox,
    image: ImageRef,
    rewards: Callable[..., Awaitable[None]] | None = None,
    view: EpisodeView | None = None,
    tests: bytes | None = None,
) -> tuple[Verdict | None, str]:
    """The verdict (None if a sandbox call failed), and what went wrong when the tests left no reward
    ("" when they did). `rewards(view, env)` runs right after the tests, inside their integrity check, with
    the tests' environment (furlong.tasks.verifier.verifier_env: the image's verifier toolchain's included).
    `tests`: what /tests gets (furlong.tasks.verifier.verify). The view gets the tests' reward."""
    env = verifier_env(task, image)

    async def after(verdict: Verdict) -> None:
        assert rewards is not None and view is not None
        await rewards(dataclasses.replace(view, tests=verdict.reward), env)

    try:
        verdict = await verify(
            task,
            sandbox,
            image.workdir,
            verifier_uid=sandbox.verifier_uid,
            env=env,
            after_tests=after if rewards is not None else None,
            tests=tests,
            image=image,
        )
    except HostLost:
        raise  # the host's failure, not the agent's nor the task's: the runner runs the episode again
    except Exception as exc:  # noqa: BLE001  # a verifier failure is reported with the episode
        return None, describe(exc)
    if verdict.reward is None:
        return verdict, verdict.problem or "no reward"
    return verdict, ""


async def next_agent_network(sandbox: Sandbox, done: Task, step: Task) -> str:
    """A multi-step task's next step's agent phase gets its network, for the whole sandbox (after `done`'s
    tests had theirs): "" once done, else what failed (the host's part, as in phase_network)."""
    if step.agent_network == done.agent_network and (done.verifier_network == done.agent_network or done.separate):
        return ""
    return await phase_network(sandbox, step.agent_network, None)


async def phase_network(sandbox: Sandbox, policy: NetworkPolicy, before: NetworkPolicy | None) -> str:
    """Gives the verifier phase its network (`policy`, after the agent phase's `before`): only the verifier's
    commands get it; the agent's processes still running keep theirs only where it is the same
    (furlong.sandbox.base.NetworkSwitching). With `before` None, the whole sandbox gets `policy` (a next
    step's agent phase). "" once done, else what failed: the host's part, never the
    agent's (it holds no capability over the sandbox's network), so the episode is not scored. A sandbox
    already gone is left to the tests' run, whose control run says whose doing that was."""
    if policy == before:
        return ""
    try:
        if not isinstance(sandbox, NetworkSwitching):
            raise SandboxError(f"{type(sandbox).__name__} cannot change a sandbox's network")
        await sandbox.set_network(policy, verifier_only=before is not None)
    except HostLost:
        raise  # the runner runs the episode again
    except SandboxDied:
        return ""
    except Exception as exc:  # noqa: BLE001 -- any other failure is the host's: the episode goes unscored
        return f"the verifier phase's network ({policy.describe()}) could not be set: {describe(exc)}"
    return ""


async def close_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:  # noqa: BLE001  # the outcome is decided; a failed close must not change or abort it
        log.warning("closing a sandbox failed: %s", describe(exc))


def _record(verdict: Verdict | None) -> dict[str, Any]:
    return {
        "exit_code": verdict.exit_code if verdict else None,
        "output": verdict.output_tail if verdict else None,
        "tampered_paths": verdict.tampered_paths if verdict else (),
        "integrity_checked": verdict.integrity_checked if verdict else None,
        "receipts": (verdict.receipt,) if verdict and verdict.receipt else (),
    }
