"""A Dockerfile's USER resolved to ids, from the image's own /etc/passwd and /etc/group.

USER is `name`, `name:group`, `uid` or `uid:gid` (either side a name or a number), resolved as Docker's
runtime (runc's GetExecUser) does: a number is always an id, and needs no entry; a name must have one; a
user's gid and home come from its passwd entry (gid 0 and home / without one); an explicit group replaces
the gid, else the user's supplementary groups are the groups listing it as a member.

The files are read from the image's layers (overlay upper directories or whole trees, top first) as the
sandbox's overlay would show them: a whiteout (a 0/0 character device) deletes the path below it, an
opaque directory hides the lower layers' contents, a file hides a lower directory of the same name. Each
path component is opened with O_NOFOLLOW: a symlink inside the image is followed inside the image
(against the image's root, as in a chroot), never by the host, so no lookup reads a file outside the layers.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.changes import is_opaque, is_whiteout

MAX_ID = 65535  # the sandbox maps uids and gids 0..65535 (0 to the host's sandbox uid, the rest subordinate)
ROOT_USERS = ("", "0", "root", "0:0", "root:root")  # what a USER of root may be written as
_MAX_FILE = 4 << 20  # bytes read of /etc/passwd or /etc/group: real ones are a few kB
_MAX_LINKS = 40  # symlinks followed in one lookup, as Linux allows


class UserError(ValueError):
    """A USER the image cannot honour, in one line (the builder prefixes the Dockerfile's file:line)."""


@dataclass(frozen=True)
class Identity:
    """Who the agent's commands (and the oracle's solve.sh) run as: ids inside the sandbox, HOME, and the
    supplementary groups to set. `name` is the passwd name, "" for a bare uid with no entry."""

    uid: int
    gid: int
    home: str
    name: str
    groups: tuple[int, ...] = ()


ROOT = Identity(0, 0, "/root", "root")


def resolve_user(user: str, layer_dirs: Sequence[Path]) -> Identity:
    """The identity USER `user` names in the image whose layers (top first) are `layer_dirs`; "" is root."""
    if user == "":
        return ROOT
    name, _, group = user.partition(":")
    if not name or (":" in user and not group):
        raise UserError(f"USER {user}: expected name, name:group, uid or uid:gid")
    text = _read(layer_dirs, "etc/passwd", user)
    match = next((e for e in _entries(text, 7) if (e[2] == name if name.isdigit() else e[0] == name)), None)
    if match is None and not name.isdigit():
        raise UserError(
            f"USER {user}: no such user in the image's /etc/passwd"
            if text
            else f"USER {user}: the image has no /etc/passwd to look the name up in (give a uid)"
        )
    if match is not None:
        uid, gid, home, login = _id(match[2], user), _id(match[3], user), match[5] or "/", match[0]
    else:
        uid, gid, home, login = _id(name, user), 0, "/", ""
    groups: tuple[int, ...] = ()
    if group or login:
        entries = _entries(_read(layer_dirs, "etc/group", user), 4)
        if group:
            gid = _group_id(group, entries, user)
        else:
            listed = [_id(e[2], user) for e in entries if login in e[3].split(",")]
            groups = tuple(dict.fromkeys(listed))
    return Identity(uid, gid, home, login, groups)


def _group_id(group: str, entries: list[list[str]], user: str) -> int:
    match = next((e for e in entries if (e[2] == group if group.isdigit() else e[0] == group)), None)
    if match is None and not group.isdigit():
        raise UserError(f"USER {user}: no such group {group!r} in the image's /etc/group")
    return _id(match[2] if match else group, user)


def _id(text: str, user: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= MAX_ID:
        raise UserError(f"USER {user}: id {text} is outside 0..{MAX_ID}, the ids a sandbox maps")
    return value


def _entries(text: str, fields: int) -> list[list[str]]:
    """The lines of a passwd/group file split into `fields` fields; comments, NIS `+`/`-` lines and lines
    without numeric ids are skipped, as the C library skips them."""
    out = []
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) < 3 or line.startswith(("#", "+", "-")) or not parts[2].isdigit():
            continue
        if fields == 7 and (len(parts) < 4 or not parts[3].isdigit()):
            continue
        out.append((parts + [""] * fields)[:fields])
    return out


def _read(layer_dirs: Sequence[Path], rel: str, user: str) -> str:
    """The image's file `rel` (relative to its root) as text, "" when the image has none."""
    parts, links = rel.split("/"), 0
    while True:
        found = _lookup(layer_dirs, parts)
        if isinstance(found, bytes):
            return found.decode("utf-8", "replace")
        if found is None:
            return ""
        links += 1
        if links > _MAX_LINKS:
            raise UserError(f"USER {user}: too many symlinks resolving the image's /{rel}")
        parts = found


def _lookup(layer_dirs: Sequence[Path], parts: list[str]) -> bytes | list[str] | None:
    """The file at `parts` in the merged layers: its bytes, None when absent (or not a regular file), or
    the image path to look up instead when a component is a symlink."""
    dir_above: set[int] = set()  # depths where a higher layer has a directory: lower ones merge into it
    for layer in layer_dirs:
        found, opaque = _in_layer(layer, parts, dir_above)
        if found is not _ABSENT:
            return found
        if opaque:
            return None
    return None


_ABSENT = object()  # not in this layer: a lower one may have it


def _in_layer(layer: Path, parts: list[str], dir_above: set[int]):
    """(what `parts` is in this one layer, or _ABSENT; whether an opaque directory hides lower layers)."""
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    opaque = False
    try:
        for depth, part in enumerate(parts):
            try:
                st = os.lstat(part, dir_fd=fd)
            except FileNotFoundError:
                return _ABSENT, opaque
            last = depth == len(parts) - 1
            if is_whiteout(st) or (depth in dir_above and not stat.S_ISDIR(st.st_mode)):
                return None, opaque  # deleted here, or a lower non-directory under a higher directory
            if stat.S_ISLNK(st.st_mode):
                return _target(parts, depth, os.readlink(part, dir_fd=fd)), opaque
            if last:
                return (_read_file(fd, part) if stat.S_ISREG(st.st_mode) else None), opaque
            if not stat.S_ISDIR(st.st_mode):
                return None, opaque  # a file where the path needs a directory
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
            dir_above.add(depth)
            opaque = opaque or is_opaque(fd)
        return _ABSENT, opaque
    finally:
        os.close(fd)


def _target(parts: list[str], depth: int, link: str) -> list[str]:
    """The image path a symlink at parts[depth] leads to, with the rest of `parts` after it; `..` stops
    at the image's root, as in a chroot."""
    start = [] if link.startswith("/") else parts[:depth]
    out: list[str] = []
    for part in [*start, *link.split("/"), *parts[depth + 1 :]]:
        if part == "..":
            out = out[:-1]
        elif part not in ("", "."):
            out.append(part)
    return out


def _read_file(dir_fd: int, name: str) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(_MAX_FILE)
    finally:
        os.close(fd)
