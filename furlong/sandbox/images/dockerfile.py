"""The documented Dockerfile subset furlong builds itself: FROM (one resolvable base), RUN, COPY, WORKDIR, ENV,
and USER root. Build steps always run as the build sandbox's root (with many uids, with the capabilities
to `useradd`, `chown` and switch uids inside it), so a Dockerfile that names another USER (its RUN steps would
run as it) is built by buildah, and so is one whose RUN or WORKDIR would run as the USER its FROM image
sets (`step_as_user`).

A Dockerfile using anything else (`outside_subset` says what) is built by buildah instead (buildah.py);
within the subset, a malformed instruction is an error naming the file and line.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import shlex
import tarfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.images import standins
from furlong.sandbox.runtime.users import ROOT_USERS
from furlong.sandbox.tarball import root_owned

SUPPORTED = ("FROM", "RUN", "COPY", "WORKDIR", "ENV", "USER")
# `RUN <<EOF`, `cat <<-'EOF'`: a heredoc's body lines follow the instruction (`<<<` is a here-string).
HEREDOC = re.compile(r"(?<![<\\])<<(-?)([\"']?)([A-Za-z_][A-Za-z0-9_.-]*)\2(?!<)")


class DockerfileError(ValueError):
    def __init__(self, path: Path, line: int, problem: str):
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.problem = path, line, problem


@dataclass(frozen=True)
class Instruction:
    op: str
    args: str
    line: int


def parse(path: Path, imported: Collection[str] = ()) -> list[Instruction]:
    """Parses and validates; the first instruction must be FROM a known base (standins.resolve) or,
    by exact name, an image `furlong image import` brought in (`imported`)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DockerfileError(path, 0, f"cannot read: {exc}") from exc
    steps = []
    for line_no, logical in _logical_lines(text):
        op, _, args = logical.partition(" ")
        op = op.upper()
        if op not in SUPPORTED:
            raise DockerfileError(
                path, line_no, f"unsupported instruction {op} (furlong supports {', '.join(SUPPORTED)})"
            )
        if not args.strip():
            raise DockerfileError(path, line_no, f"{op} needs arguments")
        steps.append(Instruction(op, args.strip(), line_no))
    if not steps or steps[0].op != "FROM":
        raise DockerfileError(path, steps[0].line if steps else 1, "the first instruction must be FROM")
    for step in steps:
        _validate(path, step, first=step is steps[0], imported=imported)
    return steps


def outside_subset(path: Path) -> str | None:
    """`file:line: what` for the first instruction or form the native subset lacks (then buildah builds
    the Dockerfile), or None when the subset builds all of it. An unreadable file is parse()'s error."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    first = True
    for line_no, logical in _logical_lines(text):
        op, _, args = logical.partition(" ")
        op, args = op.upper(), args.strip()
        if op not in SUPPORTED:
            return f"{path}:{line_no}: {op}"
        if op == "USER" and args not in ROOT_USERS:
            return f"{path}:{line_no}: USER {args} (not root)"
        if op == "FROM" and not first:
            return f"{path}:{line_no}: a second FROM (multi-stage)"
        if op == "FROM" and len(args.split()) > 1:
            return f"{path}:{line_no}: FROM {args}"
        if op == "COPY" and args.startswith("--"):
            return f"{path}:{line_no}: COPY {args.split()[0]}"
        if op == "RUN" and not args.startswith("[") and HEREDOC.search(args):
            return f"{path}:{line_no}: a heredoc (RUN <<EOF)"  # the body lines are no instructions: stop here
        first = False
    return None


def step_as_user(steps: list[Instruction], user: str) -> Instruction | None:
    """The first RUN or WORKDIR (the steps whose effect depends on who runs them) that would run as a user
    other than root, starting as `user`, the FROM image's; buildah builds a Dockerfile that has one."""
    for step in steps[1:]:
        user = step.args if step.op == "USER" else user
        if step.op in ("RUN", "WORKDIR") and user not in ROOT_USERS:
            return step
    return None


def _logical_lines(text: str):
    start, parts = None, list[str]()
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not parts and (not stripped or stripped.startswith("#")):
            continue
        if parts and stripped.startswith("#"):
            continue  # comments inside a continued instruction are dropped, as Docker does
        start = start or number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].rstrip())
            continue
        parts.append(stripped)
        yield start, " ".join(p for p in parts if p)
        start, parts = None, []
    if parts:
        yield start, " ".join(parts)


def _validate(path: Path, step: Instruction, first: bool, imported: Collection[str]) -> None:
    if step.op == "FROM":
        if not first:
            raise DockerfileError(path, step.line, "multi-stage builds (a second FROM) are not supported")
        words = step.args.split()
        if len(words) > 1:
            raise DockerfileError(
                path, step.line, f"FROM takes one image name here (no --platform or AS), got {step.args!r}"
            )
        if words[0] not in imported and standins.resolve(words[0]) is None:
            raise DockerfileError(
                path,
                step.line,
                (
                    f"unknown base {step.args!r}: no registry is reached here; known: {', '.join(standins.KNOWN)}"
                    f"{', or imported: ' + ', '.join(sorted(imported)) if imported else ''}; "
                    f"bring it by hand with `furlong image import {words[0]} ROOTFS_OR_OCI_ARCHIVE`"
                ),
            )
    elif step.op == "COPY":
        if step.args.startswith("--"):
            raise DockerfileError(path, step.line, "COPY flags (--from, --chown, ...) are not supported")
        if len(copy_paths(step)) < 2:
            raise DockerfileError(path, step.line, "COPY needs at least one source and a destination")
    elif step.op == "ENV":
        env_pairs(path, step)
    elif step.op == "USER" and len(step.args.split()) != 1:
        raise DockerfileError(path, step.line, f"USER takes one user[:group], got {step.args!r}")


def env_pairs(path: Path, step: Instruction) -> list[tuple[str, str]]:
    words = shlex.split(step.args)
    if "=" not in words[0]:  # legacy form: ENV KEY value with spaces
        return [(words[0], step.args[len(words[0]) :].strip())]
    pairs = []
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise DockerfileError(path, step.line, f"ENV expects KEY=VALUE, got {word!r}")
        pairs.append((key, value))
    return pairs


_VAR = re.compile(r"\\(\$)|\$(?:\{(\w+)(?::([-+])([^}]*))?\}|(\w+))")


def expand(text: str, env: dict[str, str]) -> str:
    """Docker's variable substitution in ENV and WORKDIR: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alt},
    and \\$ for a literal dollar; an unset variable is empty."""

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        value = env.get(name, "")
        if m.group(3) == "-":
            return value or m.group(4)
        if m.group(3) == "+":
            return m.group(4) if value else ""
        return value

    return _VAR.sub(sub, text)


def next_workdir(current: str, arg: str, env: dict[str, str]) -> str:
    """WORKDIR's new directory: expanded, and relative to the current one when not absolute."""
    return posixpath.normpath(posixpath.join(current or "/", expand(arg, env)))


def run_command(step: Instruction) -> str:
    """RUN's shell form as is; the exec (JSON) form joined into one shell command."""
    if step.args.startswith("["):
        return shlex.join(json.loads(step.args))
    return step.args


def copy_paths(step: Instruction) -> list[str]:
    if step.args.startswith("["):
        return list(json.loads(step.args))
    return shlex.split(step.args)


def _expand(root: Path, patterns: list[str], dockerfile: Path, step: Instruction) -> list[str]:
    """COPY sources with Docker's wildcards expanded (in the build context); a pattern matching nothing is
    an error, as in Docker."""
    sources: list[str] = []
    for pattern in patterns:
        if not any(ch in pattern for ch in "*?["):
            sources.append(pattern)
            continue
        found = sorted(str(m.relative_to(root)) for m in root.glob(pattern.lstrip("/")))
        if not found:
            raise DockerfileError(dockerfile, step.line, f"COPY source {pattern!r} matches nothing in {root}")
        sources += found
    return sources


def copy_tar(context: Path, step: Instruction, workdir: str, dockerfile: Path) -> bytes:
    """A tar, rooted at /, holding what COPY puts where (Docker's rules for files and directories)."""
    *patterns, dest = copy_paths(step)
    root = context.resolve()
    sources = _expand(root, patterns, dockerfile, step)
    dest_abs = posixpath.normpath(dest if dest.startswith("/") else posixpath.join(workdir, dest))
    # Docker copies into dest when it ends in / or ., names several sources, or is an existing
    # directory: the workdir is one (WORKDIR made it) even when written without a trailing slash.
    into_dir = dest.endswith(("/", "/.")) or dest == "." or len(sources) > 1 or dest_abs == posixpath.normpath(workdir)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for src in sources:
            local = (root / src).resolve()
            if root != local and root not in local.parents:
                raise DockerfileError(dockerfile, step.line, f"COPY source {src!r} is outside the build context")
            if not local.exists():
                raise DockerfileError(dockerfile, step.line, f"COPY source {src!r} not found in {root}")
            if local.is_dir():  # a directory's contents go into dest
                for child in sorted(local.rglob("*")):
                    tar.add(
                        child,
                        arcname=posixpath.join(dest_abs, str(child.relative_to(local))).lstrip("/"),
                        recursive=False,
                        filter=root_owned,
                    )
            else:
                target = posixpath.join(dest_abs, local.name) if into_dir else dest_abs
                tar.add(local, arcname=target.lstrip("/"), filter=root_owned)
    return buf.getvalue()
