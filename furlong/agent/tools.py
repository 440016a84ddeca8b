"""The model's tool calls run against the episode's toolbox (furlong.envs.base.Toolbox), and how
their results are written back to the model."""

from __future__ import annotations

import time

from furlong.envs.base import Toolbox, ToolError
from furlong.envs.harbor import BASH_TOOL
from furlong.envs.toolset import clip
from furlong.model.chat import ToolCall, ToolCallError

__all__ = ["BASH_TOOL", "ToolRunner", "clip"]


def tool_names(tools: Toolbox) -> tuple[str, ...]:
    return tuple(schema["function"]["name"] for schema in tools.schemas)


class ToolRunner:
    def __init__(self, tools: Toolbox, timeout_s: float, observation_chars: int):
        self.tools, self.timeout_s, self.limit = tools, timeout_s, observation_chars
        self.names = tool_names(tools)
        self.seconds = 0.0
        self.errors = 0

    def error_text(self, err: ToolCallError) -> str:
        """A malformed call is an observation the model can learn from, not a crash."""
        self.errors += 1
        return f"error: {err.message}"

    async def run(self, call: ToolCall) -> str:
        if call.name not in self.names:
            self.errors += 1
            known = (
                f"the only tool is {self.names[0]}" if len(self.names) == 1 else f"the tools: {', '.join(self.names)}"
            )
            return f"error: unknown tool {call.name!r}; {known}"
        t = time.perf_counter()
        try:
            observation = await self.tools.call(call.name, call.arguments, self.timeout_s)
        except ToolError as exc:
            self.errors += 1
            return f"error: {exc}"
        finally:
            self.seconds += time.perf_counter() - t
        return clip(observation, self.limit)

    async def reply(self, text: str) -> str | None:
        """The model's turn without a tool call, given to the toolbox's optional `reply`
        (furlong.envs.base.Toolbox): the next user message, or None when the conversation ends."""
        reply = getattr(self.tools, "reply", None)
        if reply is None:
            return None
        try:
            follow = await reply(text, self.timeout_s)
        except ToolError as exc:
            self.errors += 1
            return f"error: {exc}"
        return None if follow is None else clip(follow, self.limit)

    @property
    def finished(self) -> bool:
        """The toolbox's optional `finished`: the environment ended the episode."""
        return bool(getattr(self.tools, "finished", False))
