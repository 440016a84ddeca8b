"""What an exploit of the library is (furlong.audit.exploits): a scripted agent (no model), one shell script
run as the agent in the task's sandbox, after the files it brought (`payload`: what an agent could write
byte by byte with printf, such as a compiled library) are written there as the agent.

An exploit prints `TOUCHED <path>` for every path it wrote or removed: the audit's evidence.
"""

from __future__ import annotations

import shlex

from furlong.agent.runner import AgentRun
from furlong.audit.clues import Clues, clues
from furlong.envs.toolset import ToolSet
from furlong.tasks.model import Task
from furlong.tasks.verifier import output_tail

__all__ = ["PRELUDE", "SCRIPT_TIMEOUT_S", "Exploit", "words"]

SCRIPT_TIMEOUT_S = 120.0
PRELUDE = 't() { echo "TOUCHED $*"; }\nPRUNE="-path /proc -o -path /sys -o -path /dev -o -path /tests -o -path /logs -o -path /solution"\n'


def words(items: tuple[str, ...]) -> str:
    return " ".join(shlex.quote(i) for i in items)


class Exploit:
    """A scripted agent: its `payload` written, then `script(clues)` run once as the agent; what it touched is
    kept in `touched`."""

    name = ""
    kind = ""
    hint = ""  # one line for the task's author when this exploit earns reward

    def __init__(self) -> None:
        self.touched: list[str] = []

    def script(self, clue: Clues) -> str:
        raise NotImplementedError

    def payload(self) -> tuple[tuple[str, bytes, int], ...]:
        """Files (path, bytes, mode) written as the agent before the script runs; none by default."""
        return ()

    async def run(self, task: Task, tools: ToolSet, timeout_s: float) -> AgentRun:
        for path, data, mode in self.payload():
            await tools.sandbox.write_file(path, data, mode=mode)
        res = await tools.sandbox.exec(PRELUDE + self.script(clues(task)), timeout_s=min(timeout_s, SCRIPT_TIMEOUT_S))
        self.touched = [line[8:] for line in res.stdout.splitlines() if line.startswith("TOUCHED ")]
        return AgentRun(
            commands=1 + len(self.payload()),
            timed_out=res.timed_out,
            last_exit_code=res.exit_code,
            last_output=output_tail(res.stdout, res.stderr),
        )
