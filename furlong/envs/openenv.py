"""An OpenEnv environment server as furlong's environment (furlong.envs.base): `train.env.openenv=true`.

Each episode is one WebSocket session on the server, driven with the `openenv` package's own client:
`reset` opens it (its observation is the model's first message), each tool call the model makes is one
`step`, and the episode's reward is the environment's. Two ways to map calls to actions:

- the server lists tools in its reset observation (`tools`: OpenAI function schemas; `furlong openenv
  serve` does): the model gets those tools, a call is the action `{"tool", "arguments", "timeout_s"}`,
  the observation's `output` is what the model reads, and when the model is done the action
  `{"done": true}` ends the episode and carries the server's reward and status back;
- otherwise the model gets one tool (`tool_name`) whose arguments are an action of the server's
  `/schema`, reads each observation as JSON, and the episode's reward is the last one the server gave
  (0 if it gave none).

A session whose connection drops or stops answering mid-episode is `SessionLost`: a HostLost, so the
runner records infra_error (unscored) and runs the episode again; it never becomes a reward.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from openenv.core.generic_client import GenericEnvClient
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

from furlong.envs.base import EnvUnavailable, Score, ToolArgumentError, describe, exception_chain
from furlong.sandbox.base import HostLost
from furlong.timing import Clock

log = logging.getLogger(__name__)

HELDOUT_SEED_BASE = 1_000_000  # seed resets: held-out instances never share a seed with train ones


class SessionLost(HostLost):
    """The episode's OpenEnv session closed or stopped answering mid-episode: the server's failure (the
    runner's rule for a lost host), never a reward."""


class ServerRefused(Exception):
    """The server answered a message with an error frame (`data`: its message and code)."""

    def __init__(self, data: Mapping[str, Any]):
        self.code = str(data.get("code", "UNKNOWN"))
        super().__init__(f"{data.get('message', 'error')} (code {self.code})")


@dataclass(frozen=True)
class OpenEnvServer:
    """Where the server is and how to talk to it."""

    url: str
    token: str | None = None
    connect_timeout_s: float = 30.0
    message_timeout_s: float = 900.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def http_url(self) -> str:
        return self.url.rstrip("/").replace("ws://", "http://", 1).replace("wss://", "https://", 1)


@dataclass(frozen=True)
class OpenEnvSpec:
    """One instance (furlong.envs.base.EnvSpec): the reset request that starts it."""

    id: str
    family: str | None
    split: str
    reset: tuple[tuple[str, Any], ...]
    instruction: str = ""
    agent_timeout_s: float = 600.0
    seed: int | None = None


class Session(GenericEnvClient):
    """One episode's session: one connection. The package's client opens a new connection (a new session,
    where the episode's state is gone) on the next call after one closed; here that is SessionLost."""

    _opened = False

    async def _connect_async(self) -> Session:
        if not self._opened:
            await super()._connect_async()
            self._opened = True
        elif self._ws is None or self._ws.state is not State.OPEN:
            raise SessionLost("the OpenEnv session's connection closed mid-episode")
        return self

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            try:
                await self._send(message)
            except ConnectionClosed:
                pass  # a refused session sends its error frame, then closes: read it
            response = await self._receive()
        except SessionLost:
            raise
        except (ConnectionClosed, TimeoutError, OSError) as exc:
            raise SessionLost(f"the OpenEnv session was lost: {describe(exc)}") from exc
        if response.get("type") == "error":
            raise ServerRefused(response.get("data") or {})
        return response


class OpenEnvSource:
    """The server's instances per split: its own tasks where it has the task API, else seeded resets."""

    def __init__(
        self,
        server: OpenEnvServer,
        limits: Mapping[str, int],
        splits: Mapping[str, str],
        instruction: str = "",
        agent_timeout_s: float = 600.0,
    ):
        self.server, self.limits, self.splits = server, dict(limits), dict(splits)
        self.instruction, self.agent_timeout_s = instruction, agent_timeout_s

    def instances(self, split: str) -> list[OpenEnvSpec]:
        if split == "all":
            return self.instances("train") + self.instances("heldout")
        limit = self.limits.get(split, 0)
        with httpx.Client(
            base_url=self.server.http_url, headers=self.server.headers, timeout=self.server.connect_timeout_s
        ) as http:
            name = _json(http.get("/list_environments"))[0]
            count = http.post(f"/{name}/num_tasks", json={"split": self.splits.get(split, split)})
            if count.status_code in (404, 501):  # no task API: instances are seeds
                first = 0 if split == "train" else HELDOUT_SEED_BASE
                return [
                    self._spec(f"{name}/{split}/seed-{first + k}", name, split, {"seed": first + k}, seed=first + k)
                    for k in range(limit)
                ]
            n = min(limit, int(_json(count)["num_tasks"]))
            tasks = _json(
                http.post(f"/{name}/task_range", json={"split": self.splits.get(split, split), "start": 0, "stop": n})
            )["tasks"]
        return [self._task_spec(name, split, k, task) for k, task in enumerate(tasks)]

    def _task_spec(self, name: str, split: str, index: int, task: Any) -> OpenEnvSpec:
        info = task if isinstance(task, dict) else {}
        spec_id = str(info.get("id", f"{name}/{split}/{index}"))
        timeout = float(info.get("agent_timeout_s") or self.agent_timeout_s)
        return self._spec(
            spec_id,
            str(info.get("family") or name),
            split,
            {"split": self.splits.get(split, split), "index": index},
            timeout,
            info.get("seed"),
        )

    def _spec(
        self, spec_id: str, family: str, split: str, reset: dict, timeout: float | None = None, seed: int | None = None
    ) -> OpenEnvSpec:
        return OpenEnvSpec(
            id=spec_id,
            family=family,
            split=split,
            reset=tuple(sorted(reset.items())),
            instruction=self.instruction,
            agent_timeout_s=timeout or self.agent_timeout_s,
            seed=seed,
        )


class OpenEnvEnvironment:
    """Opens an episode as a session on the server (furlong.envs.base.Environment)."""

    def __init__(self, server: OpenEnvServer, tool_name: str = "step"):
        self.server, self.tool_name = server, tool_name
        self._schema: dict | None = None

    def reserve(self, spec: OpenEnvSpec) -> None:
        pass  # a session holds a seat on the server: it opens when its episode starts, not ahead

    async def open(self, spec: OpenEnvSpec, clock: Clock) -> OpenEnvEpisode:
        t = time.perf_counter()
        try:
            session, first = await self._reset(spec)
        except Exception as exc:
            clock.add("sandbox_start", t)
            raise EnvUnavailable(f"OpenEnv session did not open: {describe(exc)}") from exc
        try:
            if first.done and first.reward is None:  # e.g. a furlong server whose sandbox did not start
                raise EnvUnavailable(f"the server ended the episode at reset: {first.observation.get('error')}")
            schema = None if _lists_tools(first.observation) else await self._action_schema()
        except Exception as exc:
            await _close_quietly(session)
            if isinstance(exc, EnvUnavailable):
                raise
            raise EnvUnavailable(f"OpenEnv session did not open: {describe(exc)}") from exc
        finally:
            clock.add("sandbox_start", t)
        return OpenEnvEpisode(session, first.observation, schema, self.tool_name, first.reward, first.done)

    async def _reset(self, spec: OpenEnvSpec):
        """A new session and its reset; a server at capacity is asked again until connect_timeout_s (a
        seat frees only once the server has closed an ended session, a moment after its client did)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.server.connect_timeout_s
        while True:
            session = Session(
                base_url=self.server.url,
                connect_timeout_s=self.server.connect_timeout_s,
                message_timeout_s=self.server.message_timeout_s,
                headers=self.server.headers,
            )
            try:
                return session, await session.reset(**dict(spec.reset))
            except ServerRefused as exc:
                await _close_quietly(session)
                if exc.code != "CAPACITY_REACHED" or loop.time() > deadline:
                    raise
            except BaseException:
                await _close_quietly(session)
                raise
            await asyncio.sleep(0.2)

    async def _action_schema(self) -> dict:
        if self._schema is None:
            async with httpx.AsyncClient(
                base_url=self.server.http_url, headers=self.server.headers, timeout=self.server.connect_timeout_s
            ) as http:
                self._schema = _json(await http.get("/schema"))["action"]
        return self._schema


class OpenEnvEpisode:
    """One session (furlong.envs.base.EpisodeEnv), and its own toolbox."""

    note = None

    def __init__(
        self,
        session: Session,
        first: dict,
        action_schema: dict | None,
        tool_name: str,
        reward: float | None,
        done: bool,
    ):
        self.session, self.tools = session, self
        self.listed = action_schema is None  # the server's own tools, furlong's convention
        self.schemas: Sequence[dict] = (
            tuple(first["tools"]) if self.listed else (_schema_tool(tool_name, action_schema or {}),)
        )
        self.opening = str(first.get("instruction", "")) if self.listed else _text(first)
        self.reward, self.done, self.last = reward, done, first
        self.seconds, self.calls = 0.0, 0
        self.errors: list[BaseException] = []

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        if self.done:
            return "the environment has ended the episode"
        action = {"tool": name, "arguments": arguments, "timeout_s": timeout_s} if self.listed else arguments
        self.calls += 1
        observation = await self._step(action)
        return str(observation.get("output", "")) if self.listed else _text(observation)

    async def _step(self, action: dict) -> dict:
        t = time.perf_counter()
        try:
            result = await self.session.step(action)
        except ServerRefused as exc:
            if exc.code == "VALIDATION_ERROR":
                raise ToolArgumentError(f"the environment refused the action: {exc}") from None
            self.errors.append(exc)
            raise
        finally:
            self.seconds += time.perf_counter() - t
        self.last, self.done = result.observation, bool(result.done)
        if result.reward is not None or self.done:
            self.reward = result.reward
        return result.observation

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc`, or one it was raised from or while handling, is an error frame of a step."""
        return any(c is e for c in exception_chain(exc) for e in self.errors)

    async def score(self) -> Score:
        if self.listed and not self.done:
            try:
                await self._step({"done": True})  # a furlong server runs the task's tests now
            except (ServerRefused, ToolArgumentError) as exc:
                return Score(reward=None, error=f"the server did not end the episode: {describe(exc)}")
        status = str(self.last.get("status") or "") if self.listed else ""
        error = self.last.get("error") if self.listed else None
        if status == "agent_broke_sandbox":
            return Score(reward=None, agent_broke_env=True, error=error or "the agent broke the server's sandbox")
        if self.reward is None and (self.done or status == "infra_error"):
            return Score(reward=None, error=error or "the environment ended the episode without a reward")
        return Score(
            reward=float(self.reward or 0.0),
            error=error,
            timed_out=status == "timeout",
            tampered=status == "reward_tampered",
        )

    async def close(self) -> None:
        await _close_quietly(self.session)


def environment_server(
    url: str | None, token: str | None, connect_timeout_s: float, message_timeout_s: float
) -> OpenEnvServer:
    if not url:
        raise ValueError("openenv.url: the OpenEnv server's base URL is needed (e.g. http://127.0.0.1:8000)")
    return OpenEnvServer(url, token, connect_timeout_s, message_timeout_s)


def _lists_tools(observation: dict) -> bool:
    tools = observation.get("tools")
    return isinstance(tools, list) and bool(tools) and all(isinstance(t, dict) and "function" in t for t in tools)


def _schema_tool(name: str, action: dict) -> dict:
    """The one tool whose arguments are an action: the action's JSON schema less its `metadata`."""
    params = {k: v for k, v in action.items() if k not in ("title", "description")}
    params["properties"] = {k: v for k, v in action.get("properties", {}).items() if k != "metadata"}
    params["required"] = [k for k in action.get("required", []) if k != "metadata"]
    params.setdefault("type", "object")
    description = action.get("description") or "Take one action in the environment; returns its observation."
    return {
        "type": "function",
        "function": {"name": name, "description": " ".join(description.split()), "parameters": params},
    }


def _text(observation: dict) -> str:
    """What the model reads of an observation: its fields as JSON, less metadata."""
    return json.dumps({k: v for k, v in observation.items() if k != "metadata"}, sort_keys=True, default=str)


def _json(response: httpx.Response) -> Any:
    response.raise_for_status()
    return response.json()


async def _close_quietly(session: Session) -> None:
    try:
        await asyncio.wait_for(session.close(), 30)
    except Exception as exc:  # noqa: BLE001  # the outcome is decided; a failed close must not change it
        log.warning("closing an OpenEnv session failed: %s", describe(exc))
