"""A verifiers environment as a furlong harness (docs/gateway.md#a-verifiers-environment): verifiers 0.4.0's
own Env, Taskset, Task, @reward rubric, chat harness and OpenAI-compatible client run one rollout against
the run's gateway, and its reward is reported to furlong through FURLONG_REWARD_FILE.

verifiers requires openai<3 and furlong pins openai 3, so this runs under its own interpreter, the venv
`bash install.sh --verifiers` makes:

    train:
      agent:
        harness: {command: [.venv-verifiers/bin/python, examples/verifiers_harness.py]}

The environment: one task, the episode's instruction, whose answer is a shell command in a ```bash block.
verifiers' chat program (its `null` harness: the model's one reply, no tools) asks the model through
verifiers' interception server and client, which forward to the gateway (OPENAI_BASE_URL, the episode's
key); the task's `finalize` runs the command in the episode's sandbox (FURLONG_EXEC_URL), and its rubric
gives 0.9 where the command exited 0, plus 0.1 for a brief reply. The task's tests still judge the world the
command left; how the two rewards combine is the config's (examples/verifiers.yaml).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile

import httpx
import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig

__all__ = ["FurlongTaskset", "OwnInterpreterHarness"]  # what verifiers' loaders look up by this module's name

SYSTEM = ("You are an agent in a Linux terminal. Reply with exactly one shell command that completes the task, "
          "in a ```bash block.")  # fmt: skip
COMMAND = re.compile(r"```(?:bash|sh)?\n(.*?)```", re.DOTALL)


def run_in_sandbox(command: str) -> dict:
    """The command in the episode's sandbox: furlong's exec route, authenticated by the episode key."""
    r = httpx.post(os.environ["FURLONG_EXEC_URL"], json={"command": command},
                   headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}, timeout=300)  # fmt: skip
    r.raise_for_status()
    return r.json()


class CommandTask(vf.Task[vf.TaskData]):
    """The instruction, answered by one shell command; scored by verifiers' rubric (the @reward methods):
    0.9 where the command ran and exited 0, 0.1 for a brief reply (one command, not an essay)."""

    async def finalize(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        reply = trace.messages[-1].content if trace.messages else ""
        reply = reply if isinstance(reply, str) else ""
        found = COMMAND.search(reply)
        command = found.group(1).strip() if found else ""
        result = await asyncio.to_thread(run_in_sandbox, command) if command else None
        trace.info.update(reply_chars=len(reply.strip()), command=command, exit_code=result and result["exit_code"])

    @vf.reward(weight=0.9)
    async def ran_cleanly(self, trace: vf.Trace) -> float:
        return 1.0 if trace.info.get("exit_code") == 0 else 0.0

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if 0 < trace.info.get("reply_chars", 0) <= 200 else 0.0


class FurlongTaskset(vf.Taskset[CommandTask]):
    """One task: the episode's instruction (FURLONG_INSTRUCTION)."""

    def load(self):
        yield CommandTask(vf.TaskData(prompt=os.environ["FURLONG_INSTRUCTION"], system_prompt=SYSTEM))


class _OwnPython:
    """The runtime, but a chat program runs under this interpreter (whose venv has the program's packages)
    instead of a uv environment resolved from the network at each run."""

    def __init__(self, runtime: vf.Runtime, directory: str) -> None:
        self._runtime, self._dir = runtime, directory

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: dict | None = None, *, activate: bool = True):
        path = os.path.join(self._dir, "program.py")
        await self._runtime.write(path, script.encode() if isinstance(script, str) else script)
        return [sys.executable, path]


class OwnInterpreterHarness(NullHarness):
    """verifiers' `null` harness (its chat program, unmodified), run with this venv's Python."""

    async def setup(self, runtime: vf.Runtime) -> None:
        pass  # nothing to install: the program's packages are verifiers' own dependencies

    async def launch(self, ctx, trace, runtime, *args, **kwargs):
        with tempfile.TemporaryDirectory() as d:
            return await super().launch(ctx, trace, _OwnPython(runtime, d), *args, **kwargs)


async def rollout() -> vf.Episode:
    me = os.path.splitext(os.path.basename(__file__))[0]
    agent = vf.AgentConfig(harness=NullHarnessConfig(id=me), runtime=vf.SubprocessConfig())  # on this host
    config = vf.SingleAgentEnvConfig(taskset={"id": me}, agent=agent)
    env = vf.SingleAgentEnv(config)
    client = vf.EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY")
    ctx = vf.ModelContext(model=os.environ.get("FURLONG_MODEL", "policy"), client=client)
    (task,) = list(env.taskset)
    async with env.serving():
        return await env.run_episode(task, ctx)


def main() -> int:
    episode = asyncio.run(rollout())
    errors = [e.message for t in episode.traces for e in t.errors] + [e.message for e in episode.errors]
    reward = episode.traces[0].reward if episode.ok and len(episode.traces) == 1 else None
    info = episode.traces[0].info if episode.traces else {}
    print(json.dumps({"ok": episode.ok, "reward": reward, "info": info, "errors": errors}))  # the output's last line
    if reward is None:
        return 1  # nothing reported: harness_reported reads 0, as for a program that crashed
    with open(os.environ["FURLONG_REWARD_FILE"], "w") as f:
        json.dump({"verifiers": reward}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
