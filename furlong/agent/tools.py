"""The agent's one tool, bash, and how its results are written back to the model."""

from __future__ import annotations

import time

from furlong.model.chat import ToolCall, ToolCallError
from furlong.sandbox.base import Sandbox

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


def clip(text: str, limit: int) -> str:
    """Head and tail of a long observation, so the context holds both the start and the error at the end."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


class ToolRunner:
    def __init__(self, sandbox: Sandbox, timeout_s: float, observation_chars: int):
        self.sandbox, self.timeout_s, self.limit = sandbox, timeout_s, observation_chars
        self.seconds = 0.0
        self.errors = 0

    def error_text(self, err: ToolCallError) -> str:
        """A malformed call is an observation the model can learn from, not a crash."""
        self.errors += 1
        return f"error: {err.message}"

    async def run(self, call: ToolCall) -> str:
        command = call.arguments.get("command")
        if call.name != "bash":
            self.errors += 1
            return f"error: unknown tool {call.name!r}; the only tool is bash"
        if not isinstance(command, str) or not command.strip():
            self.errors += 1
            return 'error: bash needs {"command": "<a non-empty string>"}'
        t = time.perf_counter()
        try:
            res = await self.sandbox.exec(command, timeout_s=self.timeout_s)
        finally:
            self.seconds += time.perf_counter() - t
        head = f"exit code {res.exit_code}" + (f" (timed out after {self.timeout_s:g}s)" if res.timed_out else "")
        body = res.stdout + (res.stderr if not res.stdout else ("\n" + res.stderr if res.stderr else ""))
        return clip(f"{head}\n{body}".rstrip("\n"), self.limit)
