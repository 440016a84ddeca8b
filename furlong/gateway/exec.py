"""The exec route's side of an episode: a harness runs commands in its episode's world through the
environment's own bash tool, with the limits furlong's own agent has (train.agent.command_timeout_s,
observation_chars), and under the same blame rules.

A tool error (an empty command) is an answer the harness sees. Any other exception is the environment's
(a sandbox that died, whatever the agent did to it): it is kept, every later command of the episode is
refused, and the agent phase raises it when the harness is done, so the episode runner judges it exactly
as it judges one raised during furlong's own agent's bash call (furlong.agent.runner, `EpisodeEnv.caused`).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

from furlong.envs.base import Toolbox, ToolError
from furlong.envs.toolset import clip

EXEC_ROUTE = "/furlong/v1/exec"
BASH = "bash"  # the tool a Harbor episode (and any environment with a sandbox) offers
_EXIT = re.compile(r"exit code (-?\d+)")  # the first line furlong.envs.toolset.exec_observation writes


class EnvironmentFailed(Exception):
    """An earlier command of this episode broke its environment: nothing more runs in it."""


@dataclass
class EpisodeTools:
    tools: Toolbox
    command_timeout_s: float
    observation_chars: int
    calls: int = 0
    failure: BaseException | None = None  # the environment's own exception, for the runner to judge
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one command at a time, as the model agent's

    @property
    def has_bash(self) -> bool:
        return any(s.get("function", {}).get("name") == BASH for s in self.tools.schemas)

    async def run(self, command: str, timeout_s: float | None) -> tuple[int | None, str]:
        """(exit code, the observation furlong's own agent would see); the exit code is None where the tool
        refused the call (its error is the observation)."""
        limit = self.command_timeout_s if timeout_s is None else min(timeout_s, self.command_timeout_s)
        async with self.lock:
            if self.failure is not None:
                raise EnvironmentFailed(f"the episode's environment failed earlier: {self.failure}")
            self.calls += 1
            try:
                text = await self.tools.call(BASH, {"command": command}, limit)
            except ToolError as exc:
                return None, f"error: {exc}"
            except Exception as exc:
                self.failure = exc
                raise
        found = _EXIT.match(text)
        return (int(found.group(1)) if found else None), clip(text, self.observation_chars)
