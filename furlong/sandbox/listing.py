"""Directory listings read inside a sandbox by GNU findutils, as the identity asking, so what a client
sees is what that identity could see. Served by the host's /v1 API and E2B's ListDir and Stat."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from furlong.sandbox.base import Sandbox, SandboxError

FORMAT = r"%f\0%y\0%p\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0"  # find -printf: one entry, ten fields
KINDS = {"f": "file", "d": "dir", "l": "symlink"}


@dataclass(frozen=True)
class Entry:
    name: str
    type: str  # file, dir, symlink, or other
    path: str
    size: int
    mode: int
    permissions: str  # as ls shows them: -rw-r--r--
    owner: str
    group: str
    mtime: float
    target: str | None  # a symlink's target


def parse(out: str) -> list[Entry]:
    fields = out.split("\0")[:-1]
    entries = []
    for i in range(0, len(fields) - 9, 10):
        name, kind, path, size, mode, perms, owner, group, mtime, target = fields[i : i + 10]
        entries.append(
            Entry(
                name,
                KINDS.get(kind, "other"),
                path,
                int(size),
                int(mode, 8),
                perms,
                owner,
                group,
                float(mtime),
                target or None,
            )
        )
    return entries


# A listing runs outside the agent's shell state: with a cwd, exec neither sources nor saves the state file
# (furlong.sandbox.runtime.shell.wrap), so a listing between two agent commands cannot undo a `cd` the first
# made, nor save the state of its own shell over it. A relative path is read from here.
OUTSIDE_SHELL_STATE = "/"


async def find(box: Sandbox, path: str, args: str, as_verifier: bool = False) -> list[Entry]:
    """`find PATH ARGS -printf FORMAT`'s entries; SandboxError with find's own words where it fails."""
    res = await box.exec(
        f"find {shlex.quote(path)} {args} -printf '{FORMAT}'",
        timeout_s=30,
        cwd=OUTSIDE_SHELL_STATE,
        as_verifier=as_verifier,
    )
    if res.exit_code != 0:
        raise SandboxError(f"{path}: {res.stderr.strip() or 'failed'}")
    if res.truncated:  # the output cap cut it: the rest is not entries (a marker, then a torn field)
        raise SandboxError(f"{path}: too many entries to list at once (a smaller depth lists fewer)")
    return parse(res.stdout)


async def stat(box: Sandbox, path: str, as_verifier: bool = False) -> Entry:
    found = await find(box, path, "-maxdepth 0", as_verifier)
    if not found:
        raise SandboxError(f"{path}: No such file or directory")
    return found[0]


async def list_dir(box: Sandbox, path: str, depth: int = 1, as_verifier: bool = False) -> list[Entry]:
    if (await stat(box, path, as_verifier)).type != "dir":
        raise SandboxError(f"{path}: not a directory")
    return await find(box, path, f"-mindepth 1 -maxdepth {max(1, depth)}", as_verifier)
