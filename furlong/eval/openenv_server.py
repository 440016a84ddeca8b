"""`furlong openenv serve`: furlong tasks as an OpenEnv environment (the `openenv` package's protocol).

Each OpenEnv session is one `TaskSession` (an `openenv` Environment). `reset` picks a task and starts
its episode in the one episode runner (furlong.agent.runner.run_outcome), exactly as `furlong eval`
runs one: a fresh sandbox, the task's agent timeout, and at the end the task's tests through
furlong's verifier, with every integrity rule and the control run. The agent of that episode is the
remote client (`RemoteAgent`): each `step` hands it one action, a bash command or a tool call, and
returns what the tool returned. The step that says `done` (or the first one after the agent timeout
passed) gets the episode's reward and status; nothing the client sends can skip the tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, EnvironmentMetadata, Observation, State
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from furlong.agent.runner import AgentRun, Outcome, SandboxSource, run_outcome
from furlong.envs.base import Environment as TaskEnvironment
from furlong.envs.base import ToolArgumentError, Toolbox
from furlong.tasks.model import Task

log = logging.getLogger(__name__)

SPLITS = ("train", "heldout")


class TaskAction(Action):
    """One step: a bash command, or a call of one of the tools the reset observation lists; `done`
    (alone, or after the command) ends the episode: the task's tests run and score it. In a multi-step
    task, `done` ends one step: its tests run, and the observation holds the next step's `instruction`
    (not done) until the last step's reward."""

    command: str | None = Field(None, description="a bash command to run in the task's sandbox")
    tool: str | None = Field(None, description="a tool to call instead (the reset observation's `tools`)")
    arguments: dict[str, Any] = Field(default_factory=dict, description="the tool call's arguments")
    timeout_s: float | None = Field(None, gt=0, description="this call's time limit (default: the agent time left)")
    done: bool = Field(
        False, description="the agent is finished: run the task's tests; this step's observation carries the reward"
    )

    @model_validator(mode="after")
    def _one_thing(self) -> TaskAction:
        # a PydanticCustomError, not a ValueError: the package's error frame carries the errors as JSON,
        # and a ValueError in them cannot be serialized (the session would end instead)
        if self.command is not None and self.tool is not None:
            raise PydanticCustomError("action", "give a command or a tool call, not both")
        if self.command is None and self.tool is None and not self.done:
            raise PydanticCustomError("action", "an action runs a command, calls a tool, or says done")
        return self


class TaskObservation(Observation):
    task_id: str = Field("", description="the task of this episode")
    instruction: str = Field("", description="reset, and a multi-step task's next step: what the agent is told")
    tools: list[dict[str, Any]] = Field(
        default_factory=list, description="reset: the tools it may call (OpenAI function schemas)"
    )
    output: str = Field("", description="what the command or tool call returned")
    status: str | None = Field(
        None,
        description="at the end: furlong's episode status (ok, timeout, "
        "agent_broke_sandbox, reward_tampered, infra_error...)",
    )
    error: str | None = Field(None, description="at the end: why, when the status is not ok")


class TaskState(State):
    task_id: str | None = None


class TaskBook:
    """The served tasks, shared by every session: picked by id, by split and index, or in turn."""

    def __init__(self, tasks: Sequence[Task], sandboxes: TaskEnvironment | SandboxSource, allow_network: bool = False):
        self.tasks, self.sandboxes, self.allow_network = list(tasks), sandboxes, allow_network
        self.by_id = {t.id: t for t in self.tasks}
        self._turn = itertools.cycle(range(len(self.tasks)))

    def split(self, split: str) -> list[Task]:
        """A split's family instances, and every plain task (a task outside a family is in both)."""
        if split not in SPLITS:
            raise IndexError(f"unknown split {split!r}; the splits: {', '.join(SPLITS)}")
        return [t for t in self.tasks if t.split in (split, None)]

    def pick(self, task_id: str | None, split: str | None, index: int | None) -> Task:
        """Raises ValueError, before anything starts, for a task this server does not serve."""
        task: Task | None
        if task_id is not None:
            if task_id not in self.by_id:
                raise ValueError(f"unknown task_id {task_id!r}")
            task = self.by_id[task_id]
        elif index is not None:
            try:
                task = self.split(split or "heldout")[index] if index >= 0 else None
            except (IndexError, TypeError):
                task = None
            if task is None:
                raise ValueError(f"no task at split {split!r} index {index!r}")
        else:
            task = self.tasks[next(self._turn)]
        if task.online and not self.allow_network:
            raise ValueError(f"task {task.id!r} has network in a phase; this server gives none (--allow-network)")
        return task


def describe_task(task: Task) -> dict[str, Any]:
    return {
        "id": task.id,
        "family": task.family,
        "split": task.split,
        "seed": task.seed,
        "agent_timeout_s": task.agent_timeout_s,
    }


class RemoteAgent:
    """The agent phase of a served episode (furlong.agent.runner.Agent): it runs the client's actions
    through the episode's tools, one at a time, until the client says done or the agent time is up."""

    name = "openenv-client"

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.opened = asyncio.Event()
        self.tools: Toolbox | None = None
        self.commands = 0
        self.next_steps: asyncio.Queue[str] = asyncio.Queue()  # a later step's instruction, as its phase starts

    @property
    def schemas(self) -> Sequence[dict]:
        """The episode's tools' schemas, once its sandbox is up (`opened`)."""
        if self.tools is None:
            raise RuntimeError("the episode's tools are not open yet (wait for `opened`)")
        return self.tools.schemas

    async def run(self, spec: Task, tools: Toolbox, timeout_s: float) -> AgentRun:
        if self.opened.is_set():  # a multi-step task's next step: the client reads its instruction
            self.next_steps.put_nowait(spec.instruction)
        self.tools = tools
        self.opened.set()
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            try:
                request = await asyncio.wait_for(self.inbox.get(), max(0.0, end - loop.time()))
            except TimeoutError:
                return AgentRun(commands=self.commands, timed_out=True)
            if request is None:  # the client said done
                return AgentRun(commands=self.commands)
            name, arguments, timeout, reply = request
            self.commands += 1
            left = max(0.001, end - loop.time())
            try:
                text = await tools.call(name, arguments, min(timeout or left, left))
            except ToolArgumentError as exc:
                text = f"error: {exc}"
            except BaseException:
                reply.cancel()  # the runner judges the exception; the step reports its outcome
                raise
            reply.set_result(text)


class ServedEpisode:
    """One task's episode: the runner's task, and its remote agent."""

    def __init__(self, task: Task, sandboxes: TaskEnvironment | SandboxSource):
        self.task, self.agent = task, RemoteAgent()
        self.loop = asyncio.get_running_loop()
        self.outcome = asyncio.ensure_future(run_outcome(task, self.agent, sandboxes))
        self.reported = False

    async def start(self) -> TaskObservation:
        """The first observation once the sandbox is up; the outcome if the episode never started."""
        opened = asyncio.ensure_future(self.agent.opened.wait())
        await asyncio.wait({opened, self.outcome}, return_when=asyncio.FIRST_COMPLETED)
        opened.cancel()
        if not self.agent.opened.is_set():
            return self.final()
        names = [s["function"]["name"] for s in self.agent.schemas]
        log.info("episode of %s started (tools: %s)", self.task.id, ", ".join(names))
        return TaskObservation(task_id=self.task.id, instruction=self.task.instruction, tools=list(self.agent.schemas))

    async def act(self, action: TaskAction) -> TaskObservation:
        if self.outcome.done():
            return self.final()  # ended by the agent timeout (or a broken sandbox) since the last step
        output: str | None
        output = ""
        if action.command is not None or action.tool is not None:
            output = await self._call(action)
            if output is None:
                return self.final()
        if action.done:
            await self.agent.inbox.put(None)
            step = asyncio.ensure_future(self.agent.next_steps.get())
            await asyncio.wait({step, self.outcome}, return_when=asyncio.FIRST_COMPLETED)
            if step.done():  # a multi-step task goes on: its next step's instruction, not yet a reward
                return TaskObservation(task_id=self.task.id, output=output, instruction=step.result())
            step.cancel()
            return self.final(output)
        return TaskObservation(task_id=self.task.id, output=output)

    async def _call(self, action: TaskAction) -> str | None:
        """What the call returned; None if the episode ended first."""
        name, arguments = (
            ("bash", {"command": action.command}) if action.command is not None else (action.tool, action.arguments)
        )
        names = [s["function"]["name"] for s in self.agent.schemas]
        if name not in names:
            return f"error: unknown tool {name!r}; the tools: {', '.join(names)}"
        reply = self.loop.create_future()
        await self.agent.inbox.put((name, arguments, action.timeout_s, reply))
        await asyncio.wait({reply, self.outcome}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done() and not reply.cancelled():
            return reply.result()
        await asyncio.wait({self.outcome})
        return None

    def final(self, output: str = "") -> TaskObservation:
        if self.reported:
            raise RuntimeError("the episode is over: reset for a new one")
        self.reported = True
        o: Outcome = self.outcome.result()
        meta = {
            "rewards": o.rewards,
            "verifier_exit_code": o.verifier_exit_code,
            "tampered_paths": o.tampered_paths,
            "receipts": [r.to_json() for r in o.receipts],  # what the reward was computed from
            "agent_timed_out": o.agent_timed_out,
            "timing": dataclasses.asdict(o.timing),
        }
        return TaskObservation(
            task_id=self.task.id,
            output=output,
            status=o.status,
            error=o.error,
            done=True,
            reward=o.reward,
            metadata=meta,
        )

    async def stop(self) -> None:
        """Cancels the episode if it runs; the runner closes its sandbox either way."""
        if not self.outcome.done():
            self.outcome.cancel()
        await asyncio.gather(self.outcome, return_exceptions=True)


_stopping: set[asyncio.Task] = set()  # stops scheduled from the event loop's own thread, held until done


class TaskSession(Environment):
    """One OpenEnv session over furlong tasks: at most one episode at a time, each in a fresh sandbox."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session has its own episode and sandbox

    def __init__(self, book: TaskBook):
        super().__init__()
        self.book = book
        self.episode: ServedEpisode | None = None
        self.steps = 0
        self.episode_id: str | None = None

    async def reset_async(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        task_id: str | None = None,
        split: str | None = None,
        index: int | None = None,
    ) -> TaskObservation:
        task = self.book.pick(task_id, split, index)  # a bad request raises before anything starts
        await self._stop()
        self.episode, self.steps, self.episode_id = ServedEpisode(task, self.book.sandboxes), 0, episode_id
        return await self.episode.start()

    def reset(self, seed=None, episode_id=None, **kwargs) -> TaskObservation:
        raise RuntimeError("furlong tasks reset over the WebSocket session (/ws) only")

    async def step_async(self, action: TaskAction, timeout_s: float | None = None, **kwargs) -> TaskObservation:
        if self.episode is None:
            raise RuntimeError("no episode: reset first")
        self.steps += 1
        return await self.episode.act(action)

    def step(self, action, timeout_s=None, **kwargs) -> TaskObservation:
        raise RuntimeError("furlong tasks step over the WebSocket session (/ws) only")

    @property
    def state(self) -> TaskState:
        task = self.episode.task.id if self.episode else None
        return TaskState(episode_id=self.episode_id, step_count=self.steps, task_id=task)

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="furlong",
            description=f"{len(self.book.tasks)} furlong tasks, each "
            "episode in a fresh sandbox, scored by the task's tests",
            version="1",
        )

    def list_splits(self) -> list[str]:
        return list(SPLITS)

    def list_tasks(self, split: str) -> list[dict]:
        return [describe_task(t) for t in self.book.split(split)]

    def num_tasks(self, split: str) -> int:
        return len(self.book.split(split))

    def get_task(self, split: str, index: int) -> dict:
        return describe_task(self.book.split(split)[index])

    def get_task_range(self, split: str, start: int | None = None, stop: int | None = None) -> list[dict]:
        return [describe_task(t) for t in self.book.split(split)[start:stop]]

    async def _stop(self) -> None:
        episode, self.episode = self.episode, None
        if episode is not None:
            await episode.stop()

    def close(self) -> None:
        """Called by the package's server from a worker thread (or, for its one-shot instances, from the
        event loop's own thread): the episode stops, and its sandbox closes, on the loop it runs on."""
        episode, self.episode = self.episode, None
        if episode is None:
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is episode.loop:
            job = episode.loop.create_task(episode.stop())
            _stopping.add(job)
            job.add_done_callback(_stopping.discard)
        elif not episode.loop.is_closed():
            asyncio.run_coroutine_threadsafe(episode.stop(), episode.loop).result(timeout=120)
