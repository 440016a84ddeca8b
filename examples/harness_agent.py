"""An agent harness as anyone would write it with the `openai` SDK: one `bash` tool, a loop of model turns and
tool calls. furlong trains it unmodified (docs/gateway.md#training-a-harness): it reads the endpoint and key
from the environment the SDK reads anyway, and runs its commands through FURLONG_EXEC_URL, which executes
them in the episode's sandbox.

    furlong eval --config examples/harness.yaml --agent model --model DIR
    furlong train --config examples/harness.yaml
"""

from __future__ import annotations

import json
import os
import sys

import httpx
import openai

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the task's terminal and return its exit code and output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
SYSTEM = "You are an agent in a Linux terminal. Use the bash tool to complete the task. When done, reply without a tool call."
MAX_TURNS = int(os.environ.get("HARNESS_MAX_TURNS", "3"))


def bash(command: str) -> str:
    """The command in the episode's sandbox (the gateway's exec route, authenticated by the episode key)."""
    r = httpx.post(
        os.environ["FURLONG_EXEC_URL"],
        json={"command": command},
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
        timeout=300,
    )
    r.raise_for_status()
    return r.json()["output"]


def main() -> int:
    client = openai.OpenAI(max_retries=0, timeout=300)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": os.environ["FURLONG_INSTRUCTION"]},
    ]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model=os.environ.get("FURLONG_MODEL", "policy"), messages=messages,
                                               tools=[BASH], temperature=1.0)  # fmt: skip
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # resent as returned: no re-tokenization
        if not message.tool_calls:
            return 0
        for call in message.tool_calls:
            try:
                command = json.loads(call.function.arguments).get("command", "")
            except (json.JSONDecodeError, AttributeError):
                command = ""
            output = bash(command) if isinstance(command, str) and command.strip() else "error: no command given"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0


if __name__ == "__main__":
    sys.exit(main())
