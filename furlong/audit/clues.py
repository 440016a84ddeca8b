"""What an exploit may know of a task: the paths, tool names and literals its instruction and tests name.

A policy sees the instruction, and over many episodes learns what the tests look at; the audit reads the
tests on the host to stand for that knowledge, so a weak check is found in one episode, not thousands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from furlong.tasks.model import Task

MAX_FILE_BYTES = 64 * 1024  # a test file longer than this is data, not checks
MAX_CLUES = 40
# where the tests' own machinery and the system live: never an answer's place
NOT_TARGETS = ("/logs", "/tests", "/solution", "/dev", "/proc", "/sys", "/usr", "/bin", "/sbin", "/lib", "/etc")
KEEP_TOOLS = frozenset({"bash", "sh", "env"})  # the verifier's own shell: deleting it breaks every task alike

_PATH = re.compile(r"(?<![\w.:/$-])(/[\w.-]+(?:/[\w.-]+)*)")
_TOOL = re.compile(r"(?:command -v|which|type -p|hash)\s+([\w.+-]+)|shutil\.which\(\s*['\"]([\w.+-]+)['\"]")
_PORT = re.compile(r"(?:localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\]):(\d{2,5})\b|--port[ =](\d{2,5})\b")
_LITERAL = re.compile(r"\"([^\"\n\\]{6,80})\"|'([^'\n\\]{6,80})'")


@dataclass(frozen=True)
class Clues:
    paths: tuple[str, ...]  # absolute paths outside the system's trees: inputs and outputs the tests read
    tools: tuple[str, ...]  # programs the tests look up before using them
    literals: tuple[str, ...]  # quoted strings in the tests: expected outputs, among others
    ports: tuple[str, ...] = ()  # loopback ports the instruction or tests name (a service's)


def clues(task: Task) -> Clues:
    """The task's instruction and tests, read for what an exploit may use."""
    tests = _test_texts(task)
    texts = [task.instruction, *tests]
    paths = [p for t in texts for p in (m.rstrip(".") for m in _PATH.findall(t)) if _target(p)]  # a sentence's "."
    tools = [a or b for t in tests for a, b in _TOOL.findall(t)]
    literals = [a or b for t in tests for a, b in _LITERAL.findall(t)]
    return Clues(
        paths=_first(paths),
        tools=_first(t for t in tools if t not in KEEP_TOOLS),
        literals=_first(lit for lit in literals if not lit.startswith("/")),
        ports=_first(a or b for t in texts for a, b in _PORT.findall(t)),
    )


def _first(items) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))[:MAX_CLUES]


def _target(path: str) -> bool:
    return path.count("/") >= 2 and not any(path == d or path.startswith(d + "/") for d in NOT_TARGETS)


def _test_texts(task: Task) -> list[str]:
    files: list[Path] = [task.test_script]
    for tests in (task.tests_dir, task.tests_overlay):
        if tests is not None:
            files += sorted(p for p in tests.rglob("*") if p.is_file())
    texts = []
    for f in dict.fromkeys(files):
        data = f.read_bytes()[:MAX_FILE_BYTES]
        if b"\0" not in data:
            texts.append(data.decode(errors="replace"))
    return texts
