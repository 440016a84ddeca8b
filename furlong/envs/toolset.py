"""Tools beside an environment's own (bash for a Harbor task, a Python environment's `tools`): the user's
extra tools, and the toolbox that offers both and records every call (docs/environments.md).

A `Tool` is a name, a description and a JSON schema of its arguments (what the model sees, in OpenAI's
function format) and one handler: a `command` template, run in the episode's sandbox as the agent with
each `{argument}` shell-quoted in, or a `python` callable run on the host with the arguments and the
episode's sandbox (`AgentSandbox`: every call as the agent; None in an environment without a sandbox).

A call a tool cannot serve is a tool error the model sees (furlong.envs.base.ToolError), never a crash:
arguments that do not fit the schema, a handler that raises, returns no text, or runs past the call's
timeout. Only a failure of the sandbox itself goes up, for the runner to score as the agent's.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import json
import logging
import re
import shlex
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from furlong.envs.base import ToolArgumentError, Toolbox, ToolError, describe

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "array": list,
    "object": dict,
}


async def call_user(fn: Callable, *args: Any, timeout_s: float) -> Any:
    """`fn(*args)` of user code, sync or async, at most `timeout_s` (TimeoutError past it). A sync function
    runs in a thread so that a slow one does not stall every other episode; one that never returns keeps
    its thread (Python cannot stop a thread), the episode goes on."""

    async def go() -> Any:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):  # a def or an object
            return await fn(*args)
        result = await _in_daemon_thread(fn, *args)
        return await result if inspect.isawaitable(result) else result

    return await asyncio.wait_for(go(), timeout_s)


def _in_daemon_thread(fn: Callable, *args: Any) -> asyncio.Future:
    """`fn(*args)` in a daemon thread of its own. Not the loop's default executor: `asyncio.run` joins that
    one's threads when it ends, and the interpreter joins non-daemon threads at exit, so a user function
    that never returns would hang the run after its episode was already recorded."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, exc: BaseException | None) -> None:
        if future.done():  # cancelled meanwhile (the call timed out)
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def work() -> None:
        try:
            result, exc = context.run(fn, *args), None
        except BaseException as error:  # noqa: BLE001 -- handed to the caller, as asyncio.to_thread would
            result, exc = None, error
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:
            pass  # the loop has closed: nobody waits for this result any more

    threading.Thread(target=work, name=f"user-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def schema_of(tool: Mapping) -> dict:
    """An OpenAI function schema, from itself or from its bare `{name, description, parameters}`."""
    if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
        return dict(tool)
    if not isinstance(tool.get("name"), str):
        raise ValueError(f"a tool schema needs a name: {dict(tool)!r}")
    return {"type": "function", "function": dict(tool)}


def tool_name(schema: Mapping) -> str:
    return schema["function"]["name"]


@dataclass(frozen=True)
class Tool:
    """One tool beside the environment's own (the module docstring has the rules)."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    command: str | None = None  # e.g. "wc -w -- {path}": run in the sandbox as the agent
    python: Callable[[dict, Any], Any] | None = None  # python(arguments, sandbox) -> str, sync or async

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r}: letters, digits, _ and -, starting with a letter or _")
        if (self.command is None) == (self.python is None):
            raise ValueError(f"tool {self.name!r}: give exactly one of command (a template) and python (a callable)")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type object")
        if self.command is not None:
            required = set(self.parameters.get("required", ()))
            fields = {f for _, f, _, _ in string.Formatter().parse(self.command) if f is not None}
            if unknown := sorted(fields - required):
                raise ValueError(f"tool {self.name!r}: the command's {unknown} must be required parameters")

    @property
    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }

    def check(self, arguments: Any) -> None:
        check_arguments(self.name, self.parameters, arguments)


def check_arguments(name: str, parameters: Mapping[str, Any], arguments: Any) -> None:
    """ToolArgumentError naming what does not fit the schema `parameters`: arguments that are not an
    object, a missing required one, one of the wrong JSON type, or (additionalProperties false) an unknown one."""
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{name} takes a JSON object of arguments")
    if missing := [k for k in parameters.get("required", ()) if k not in arguments]:
        raise ToolArgumentError(f"{name} needs the arguments {missing}")
    properties = parameters.get("properties", {})
    for key, value in arguments.items():
        if key not in properties:
            if parameters.get("additionalProperties", True) is False:
                raise ToolArgumentError(f"{name} takes no argument {key!r}; its arguments: {sorted(properties)}")
            continue
        kind = properties[key].get("type")
        wanted = _TYPES.get(kind) if isinstance(kind, str) else None
        if wanted and (not isinstance(value, wanted) or (isinstance(value, bool) and kind != "boolean")):
            raise ToolArgumentError(f"{name}: argument {key!r} must be of JSON type {kind}")


def clip(text: str, limit: int) -> str:
    """Head and tail of a long observation, so the context holds both the start and the error at the end."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def exec_observation(res: Any, timeout_s: float) -> str:
    """What the model sees of a command: its exit code (and a timeout), then stdout and stderr."""
    head = f"exit code {res.exit_code}" + (f" (timed out after {timeout_s:g}s)" if res.timed_out else "")
    body = res.stdout + (res.stderr if not res.stdout else ("\n" + res.stderr if res.stderr else ""))
    return f"{head}\n{body}".rstrip("\n")


class AgentSandbox:
    """What a host tool gets of the episode's sandbox: every call as the agent. A handler is driven by the
    model's arguments, so it must not lend them the verifier's identity (the verifier's /logs and /tests
    are what score the episode)."""

    def __init__(self, guard: Any):
        self._guard = guard

    async def exec(self, cmd: str, timeout_s: float = 60.0, cwd: str | None = None, env: dict[str, str] | None = None):
        return await self._guard.exec(cmd, timeout_s=timeout_s, cwd=cwd, env=env)

    async def read_file(self, path: str) -> bytes:
        return await self._guard.read_file(path)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        await self._guard.write_file(path, data, mode)


@dataclass(frozen=True)
class ToolStep:
    """One tool call of an episode and what the model saw back (an error's text too)."""

    tool: str
    arguments: dict
    observation: str


def check_tools(own: Sequence[dict], extra: Sequence[Tool], has_sandbox: bool) -> tuple[dict, ...]:
    """The schemas the model sees: the environment's own, then the extra tools'. ValueError for a name used
    twice, or a command tool where there is no sandbox to run it in."""
    schemas = (*own, *(t.schema for t in extra))
    names = [tool_name(s) for s in schemas]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"tools named twice: {twice} (an extra tool may not reuse an environment's tool name)")
    if not has_sandbox and (commands := [t.name for t in extra if t.command is not None]):
        raise ValueError(f"command tools {commands} run in the episode's sandbox; this environment has none")
    return schemas


_reported: set[tuple[str, str]] = set()


def report_once(what: str, exc: BaseException) -> None:
    """A user handler's exception, shown to the model as a tool error: its traceback is logged once per
    handler and exception type, for the user to fix, without a line per episode."""
    if (what, type(exc).__name__) not in _reported:
        _reported.add((what, type(exc).__name__))
        log.warning("%s raised (the model sees it as a tool error; logged once)", what, exc_info=exc)


class ToolSet:
    """An episode's toolbox: its environment's own tools (`own`), then the user's `extra` ones; it records
    every call and every turn without one (what reward functions see: furlong.envs.rewards.EpisodeView).
    `sandbox` (a GuardedSandbox, or None): what host tools act on, and what scripted agents (the oracle)
    use directly."""

    def __init__(self, own: Toolbox, extra: Sequence[Tool] = (), sandbox: Any = None):
        self.own, self.extra, self.sandbox = own, {t.name: t for t in extra}, sandbox
        self.schemas = check_tools(own.schemas, extra, has_sandbox=sandbox is not None)
        self.names = frozenset(tool_name(s) for s in self.schemas)
        self.steps: list[ToolStep] = []
        self.answers: list[str] = []
        self.seconds, self.calls = 0.0, 0

    @property
    def finished(self) -> bool:
        return bool(getattr(self.own, "finished", False))

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        t, self.calls = time.perf_counter(), self.calls + 1
        shown = copy.deepcopy(arguments)
        try:
            if name not in self.names:
                raise ToolArgumentError(f"unknown tool {name!r}; the tools: {', '.join(sorted(self.names))}")
            tool = self.extra.get(name)
            observation = await (
                self._extra(tool, arguments, timeout_s) if tool else self.own.call(name, arguments, timeout_s)
            )
        except ToolError as exc:
            self.steps.append(ToolStep(name, shown, f"error: {exc}"))
            raise
        finally:
            self.seconds += time.perf_counter() - t
        self.steps.append(ToolStep(name, shown, observation))
        return observation

    async def reply(self, text: str, timeout_s: float) -> str | None:
        self.answers.append(text)
        if (reply := getattr(self.own, "reply", None)) is None:
            return None
        t = time.perf_counter()
        try:
            return await reply(text, timeout_s)
        finally:
            self.seconds += time.perf_counter() - t

    async def _extra(self, tool: Tool, arguments: dict, timeout_s: float) -> str:
        tool.check(arguments)
        if tool.command is not None:
            command = tool.command.format_map(
                {k: shlex.quote(v if isinstance(v, str) else json.dumps(v)) for k, v in arguments.items()}
            )
            return exec_observation(await self.sandbox.exec(command, timeout_s=timeout_s), timeout_s)
        view = AgentSandbox(self.sandbox) if self.sandbox is not None else None
        assert tool.python is not None, "a Tool runs a command or a Python function"
        try:
            result = await call_user(tool.python, arguments, view, timeout_s=timeout_s)
        except TimeoutError:
            raise ToolError(f"{tool.name} timed out after {timeout_s:g}s") from None
        except ToolError:
            raise
        except Exception as exc:
            if self.sandbox is not None and self.sandbox.caused(exc):
                raise  # the sandbox failed under it: the runner's to judge
            report_once(f"tool {tool.name}", exc)
            raise ToolError(f"{tool.name} failed: {describe(exc)}") from exc
        if not isinstance(result, str):
            raise ToolError(f"{tool.name} returned {type(result).__name__}, not text")
        return result
