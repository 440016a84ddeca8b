"""Harbor's multi-step tasks (`[[steps]]`) in one sandbox, in the order Harbor's MultiStepTrial runs them.

Each step: its workdir/ is copied into the working directory and its workdir/setup.sh run (as the agent);
the agent phase gets the step's instruction and timeout; the `[[verifier.collect]]` hooks run; the step's
tests run (in the agent's sandbox, or a sandbox of their own: furlong.envs.separate). A step whose rewards
fall below its `min_reward` ends the episode there. Before the next step, the previous step's tests and
outputs (/tests, /logs/verifier) are cleared, as Harbor clears a shared verifier's, and /logs/artifacts
emptied, as Harbor's Docker mount of it is.

The episode's reward is `multi_step_reward_strategy`'s: "mean" (the default), each reward key's mean over
the steps that ran (a key a step lacks counts 0), or "final", the last step's rewards.

Where furlong differs from Harbor, so that no agent profits from breaking a step: a step whose setup.sh
fails after an earlier step's agent phase, or whose tests time out, counts as a step with reward 0 and
ends the episode (Harbor leaves such a step out of the mean, so an agent could raise its mean by making
the next step fail). A setup.sh that fails before any agent ran is the task's: the episode never starts.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence

from furlong.envs.base import StepScore, describe
from furlong.sandbox.base import HostLost, Sandbox
from furlong.tasks.model import ARTIFACTS_DIR, TESTS_DIR, VERIFIER_LOG_DIR, Step, Task
from furlong.tasks.verifier import output_tail

CLEAR = f"shopt -s dotglob nullglob; rm -rf -- {TESTS_DIR}/* {VERIFIER_LOG_DIR}/* {ARTIFACTS_DIR}/*"


async def prepare(sandbox: Sandbox, step: Step, workdir: str, after_another: bool) -> str | None:
    """Readies the sandbox for `step`'s agent phase; what failed, or None."""
    if after_another:
        res = await sandbox.exec(CLEAR, timeout_s=60, cwd="/", as_verifier=True)
        if not res.ok:
            return f"clearing the previous step's tests failed (exit {res.exit_code}): {res.stderr.strip()[-300:]}"
    if step.workdir is None:
        return None
    await sandbox.put_dir(step.workdir, workdir)
    if not (step.workdir / "setup.sh").is_file():
        return None
    script = shlex.quote(f"{workdir.rstrip('/')}/setup.sh")
    res = await sandbox.exec(f"bash {script}", timeout_s=step.agent_timeout_s, cwd=workdir)
    if not res.ok:
        how = "ran out of time" if res.timed_out else f"exited {res.exit_code}"
        return f"step {step.name!r}: workdir/setup.sh {how}: {output_tail(res.stdout, res.stderr, 1000)}"
    return None


async def run_hooks(sandbox: Sandbox, phase: Task, workdir: str) -> None:
    """The phase's [[verifier.collect]] commands, as the agent, best effort (as Harbor's): what they fail to
    write is simply not there for the tests."""
    for hook in phase.collect:
        try:
            await sandbox.exec(hook.command, timeout_s=hook.timeout_s, cwd=workdir)
        except HostLost:
            raise
        except Exception:  # noqa: BLE001 -- a broken sandbox shows again, and is judged, when the tests run
            return


def gate(step: Step, rewards: dict[str, float]) -> str | None:
    """Why the steps after `step` do not run (a reward below its min_reward), or None."""
    for key, threshold in step.min_reward or ():
        actual = rewards.get(key, -math.inf)
        if actual < threshold:
            return f"step {step.name!r}: {key} = {actual:g} is below its min_reward {threshold:g}"
    return None


def aggregate(strategy: str, steps: Sequence[StepScore]) -> dict[str, float]:
    """The episode's rewards from its steps' (the module docstring)."""
    if strategy == "final":
        return dict(steps[-1].rewards)
    keys = sorted({k for s in steps for k in s.rewards})
    return {k: sum(s.rewards.get(k, 0.0) for s in steps) / len(steps) for k in keys}


def failed_step(step: Step, error: str) -> StepScore:
    return StepScore(name=step.name, reward=0.0, rewards={"reward": 0.0}, error=error)


def setup_error(exc: BaseException) -> str:
    return f"preparing the step failed: {describe(exc)}"
