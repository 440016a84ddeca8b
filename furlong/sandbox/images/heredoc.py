"""Heredoc `RUN <<EOF` for buildah 1.28, whose parser predates them: each heredoc RUN becomes one plain RUN.

Two forms, as BuildKit runs them:
- the heredoc *is* the command (`RUN <<EOF`, `RUN <<-EOF`, `RUN <<'EOF'`): its body is the script, run by
  the build's shell (SHELL is honoured), or, when it starts with `#!`, written to a file and executed, so
  that its interpreter runs it;
- a command that reads heredocs (`RUN python3 <<EOF`, `RUN cat <<'EOF' > /f`, several per RUN): the
  instruction with its bodies is shell syntax already, and the shell runs it as written (it strips `<<-`
  tabs and expands `$VAR` unless the delimiter is quoted, as the shell always has).
The text travels base64-encoded (`RUN eval "$(echo B64 | base64 -d)"`), so no quoting can break; the
instruction's other lines become blank lines, so every later line keeps its number in error messages.
`COPY <<EOF` / `ADD <<EOF` (inline files) are not converted: one error names the line and the way round.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.images.dockerfile import HEREDOC, DockerfileError


@dataclass(frozen=True)
class Logical:
    """One instruction: its physical lines first..last (0-based, continuations included) and its text."""

    first: int
    last: int
    text: str

    @property
    def op(self) -> str:
        return self.text.split(" ", 1)[0].upper()

    @property
    def args(self) -> str:
        return self.text.partition(" ")[2].strip()


def instructions(lines: list[str]) -> Iterator[Logical]:
    """The instructions of a Dockerfile with no heredocs left (comments and blank lines skipped)."""
    first: int | None = None
    parts: list[str] = []
    for number, raw in enumerate(lines):
        stripped = raw.strip()
        if not parts and (not stripped or stripped.startswith("#")):
            continue
        if parts and (stripped.startswith("#") or not stripped):
            continue  # comments and empty lines inside a continued instruction are dropped, as Docker does
        first = number if first is None else first
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].rstrip())
            continue
        parts.append(stripped)
        yield Logical(first, number, " ".join(p for p in parts if p))
        first, parts = None, []
    if parts and first is not None:  # parts were gathered from line `first` on
        yield Logical(first, len(lines) - 1, " ".join(parts))


def convert(path: Path, text: str) -> str:
    """`text` with every heredoc RUN turned into one RUN line; the line count is unchanged."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        step = next(instructions(lines[i:]), None)
        if step is None:
            out += lines[i:]
            break
        first, last = i + step.first, i + step.last
        out += lines[i:first]
        markers = list(HEREDOC.finditer(step.args)) if step.op in ("RUN", "COPY", "ADD") else []
        if not markers or step.args.startswith("["):
            out += lines[first : last + 1]
            i = last + 1
            continue
        if step.op != "RUN":
            raise DockerfileError(
                path,
                first + 1,
                f"{step.op} <<{markers[0].group(3)} (an inline file) is not "
                f"supported; write the file with RUN cat <<'EOF' > DEST",
            )
        bodies, end = _bodies(path, lines, last + 1, markers, first + 1)
        out.append(_run_line(step.args, markers, bodies))
        out += [""] * (end - first - 1)
        i = end
    return "\n".join(out) + "\n"


def _bodies(path: Path, lines: list[str], start: int, markers, line_no: int) -> tuple[list[list[str]], int]:
    """Each heredoc's body lines (raw) in order, and the index of the line after the last delimiter."""
    bodies, i = [], start
    for marker in markers:
        dash, delim = marker.group(1) == "-", marker.group(3)
        body = []
        while True:
            if i >= len(lines):
                raise DockerfileError(path, line_no, f"heredoc <<{delim} is never closed (no line {delim!r} follows)")
            line = lines[i].rstrip("\r")
            i += 1
            if (line.lstrip("\t") if dash else line) == delim:
                break
            body.append(line)
        bodies.append(body)
    return bodies, i


def _run_line(args: str, markers, bodies: list[list[str]]) -> str:
    flags, command = _split_flags(args)
    only = markers[0]
    if len(markers) == 1 and command.strip() == only.group(0):  # the heredoc is the script itself
        body = [b.lstrip("\t") for b in bodies[0]] if only.group(1) == "-" else bodies[0]
        script = "\n".join(body) + "\n"
        if script.startswith("#!"):  # its own interpreter: run it as an executable file
            encoded = _b64(script)
            return (
                f'RUN {flags}f=$(mktemp) && echo {encoded} | base64 -d > "$f" && chmod +x "$f" && "$f"; '
                f'rc=$?; rm -f "$f"; exit $rc'
            )
    else:
        script = command + "\n" + "".join("\n".join(body + [m.group(3)]) + "\n" for body, m in zip(bodies, markers))
    return f'RUN {flags}eval "$(echo {_b64(script)} | base64 -d)"'


def _split_flags(args: str) -> tuple[str, str]:
    """RUN's own flags (`--mount=...`, `--network=...`), kept in front, and the command."""
    words = args.split(" ")
    n = 0
    while n < len(words) and words[n].startswith("--"):
        n += 1
    flags = " ".join(words[:n])
    return (flags + " " if flags else ""), " ".join(words[n:]).strip()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
