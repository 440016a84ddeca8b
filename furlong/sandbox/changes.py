"""What a sandbox changed in its image: a walk of its overlay's upper directory against the lower layers.

An overlay upper directory (the sandbox's writes, or a built layer) holds every new or changed entry at
its path; a character device 0/0 is a whiteout (the path was deleted) and a directory whose
`overlay.opaque` xattr is "y" hides everything the lower layers hold under it (a directory deleted and
made again). A file that was only opened for writing, chmod-ed or chown-ed is copied up with its content
unchanged, so content is compared with the image's before an entry counts as modified. Lower layers
(top first) may hold whiteouts and opaque directories of their own: the image a path resolves to is the
highest layer that shows it. No symlink is ever followed, on either side: every path is the entry itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

WALK_LIMIT = 200_000  # entries walked per scan; past it the scan ends with one "truncated" Change
_OPAQUE = ("trusted.overlay.opaque", "user.overlay.opaque")  # root's overlays, and user-namespace ones
_CHUNK = 1 << 20

Kind = Literal["added", "modified", "deleted", "truncated", "unreadable"]
EntryType = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True)
class Change:
    """One entry that differs from the image. `uid` owns the upper entry (for a deletion, the whiteout),
    in the walker's view of uids (a sandbox translates it into its own). `type` is the new entry's, or
    for a deletion the image entry's. Two kinds say what lies beyond `path` is unknown, and a reader must
    not take that as "nothing changed": "truncated" (the walk stopped after WALK_LIMIT entries) and
    "unreadable" (a directory the walker may not list: a host user has no CAP_DAC_OVERRIDE)."""

    path: str
    kind: Kind
    uid: int
    type: EntryType


def entry_type(st: os.stat_result) -> EntryType:
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    return "other"


def is_whiteout(st: os.stat_result) -> bool:
    """Whether an lstat result is an overlay whiteout: the path is deleted below this layer."""
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(path: Path | str | int) -> bool:
    """Whether the directory at `path` (or the open fd) hides what lower layers hold under it."""
    for name in _OPAQUE:
        try:
            value = os.getxattr(path, name) if isinstance(path, int) else os.getxattr(path, name, follow_symlinks=False)
            if value == b"y":
                return True
        except OSError:
            continue
    return False


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def image_entry(lowers: Sequence[Path], rel: str) -> Path | None:
    """The host path of what the image (the lower layers, top first) shows at `rel` (no leading "/"),
    or None where the image has nothing there: deleted or hidden by a higher layer, or reached through
    a symlink or a non-directory."""
    parts = [p for p in rel.split("/") if p]
    for layer in lowers:
        hidden_below = False
        path = layer
        for i, part in enumerate(parts):
            path = path / part
            st = _lstat(path)
            if st is None:
                break
            if is_whiteout(st):
                return None  # deleted in this layer: nothing below shows
            if i == len(parts) - 1:
                return path
            if not stat.S_ISDIR(st.st_mode):
                return None  # a file or symlink on the way hides the rest (no symlink is followed)
            if is_opaque(path):
                hidden_below = True
        if hidden_below:
            return None  # an opaque directory on the way, and this layer lacks the entry
    return None


def image_listing(lowers: Sequence[Path], rel: str) -> set[str]:
    """The names the image shows in directory `rel`."""
    names: set[str] = set()
    for layer in lowers:
        try:
            names.update(os.listdir(layer / rel if rel else layer))
        except OSError:
            continue
    return {n for n in names if image_entry(lowers, f"{rel}/{n}" if rel else n) is not None}


def same_entry(new: _Upper, new_st: os.stat_result, old: Path) -> bool:
    """Whether an upper entry and an image entry have the same type and content (a symlink's target, a
    file's bytes)."""
    old_st = _lstat(old)
    if old_st is None or entry_type(new_st) != entry_type(old_st):
        return False
    if stat.S_ISLNK(new_st.st_mode):
        return new.readlink() == os.readlink(old)
    if stat.S_ISREG(new_st.st_mode):
        return new_st.st_size == old_st.st_size and _same_bytes(new, old)
    if stat.S_ISDIR(new_st.st_mode):
        return True
    return (new_st.st_mode & 0o170000, new_st.st_rdev) == (old_st.st_mode & 0o170000, old_st.st_rdev)


def _same_bytes(new: _Upper, old: Path) -> bool:
    try:
        fd = new.open_file()
    except OSError:
        return False  # gone or swapped for something else: cannot say it is the same
    try:
        with open(fd, "rb", closefd=False) as fa, open(old, "rb") as fb:
            while True:
                ca, cb = fa.read(_CHUNK), fb.read(_CHUNK)
                if ca != cb:
                    return False
                if not ca:
                    return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Upper:
    """An entry of the upper directory, named relative to its parent's open fd: the sandbox's processes
    may still be running, so a directory swapped for a symlink mid-walk must not lead the walk outside."""

    dir_fd: int
    name: str

    def lstat(self) -> os.stat_result | None:
        try:
            return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def readlink(self) -> str:
        return os.readlink(self.name, dir_fd=self.dir_fd)

    def open_dir(self) -> int:
        return os.open(self.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)

    def open_file(self) -> int:
        fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(f"{self.name}: no longer a regular file")
        return fd


class _Walk:
    def __init__(self, lowers: Sequence[Path], limit: int):
        self.lowers, self.left = tuple(lowers), limit
        self.found: dict[str, Change] = {}
        self.truncated: str | None = None

    def add(self, rel: str, kind: Kind, uid: int, etype: EntryType) -> None:
        self.found.setdefault("/" + rel, Change("/" + rel, kind, uid, etype))

    def spend(self, rel: str) -> bool:
        self.left -= 1
        if self.left < 0:
            self.truncated = self.truncated or "/" + rel
            return False
        return True

    def root(self, top_fd: int, root: str) -> None:
        """One root: down its ancestors while they are directories in both the upper and the image (a
        replaced /usr/local is a change of every root under it), then its whole tree."""
        parts = [p for p in root.split("/") if p]
        fd, parent_opaque, parent_uid = os.dup(top_fd), False, -1
        try:
            for i in range(1, len(parts) + 1):
                rel, entry = "/".join(parts[:i]), _Upper(fd, parts[i - 1])
                st = entry.lstat()
                if st is None:  # the image shows through here, unless an opaque parent hides it
                    if parent_opaque and (old := image_entry(self.lowers, rel)) is not None:
                        self.add(rel, "deleted", parent_uid, entry_type(os.lstat(old)))
                    return
                if not self.spend(rel):
                    return
                old = image_entry(self.lowers, rel)
                if i == len(parts) or not stat.S_ISDIR(st.st_mode) or old is None or not _is_dir(old):
                    self.entry(rel, entry, st)
                    return
                if (child := self.open_dir(rel, entry, st)) is None:
                    return
                os.close(fd)
                fd, parent_opaque, parent_uid = child, is_opaque(child), st.st_uid
        finally:
            os.close(fd)

    def open_dir(self, rel: str, entry: _Upper, st: os.stat_result) -> int | None:
        """The upper directory's fd; None (recorded as "unreadable" when the host may not list it) if not."""
        try:
            return entry.open_dir()
        except PermissionError:
            self.add(rel, "unreadable", st.st_uid, "dir")
        except OSError:
            pass  # swapped mid-walk: the next scan sees what it became
        return None

    def entry(self, rel: str, entry: _Upper, st: os.stat_result) -> None:
        """Compares one upper entry with what the image holds at its path, then its children."""
        old = image_entry(self.lowers, rel)
        if is_whiteout(st):
            if old is not None:
                self.add(rel, "deleted", st.st_uid, entry_type(os.lstat(old)))
            return
        if old is None:
            self.add(rel, "added", st.st_uid, entry_type(st))
        elif not same_entry(entry, st, old):
            self.add(rel, "modified", st.st_uid, entry_type(st))
        if not stat.S_ISDIR(st.st_mode):
            return
        if (fd := self.open_dir(rel, entry, st)) is None:
            return
        try:
            self.children(rel, fd, st.st_uid, opaque_over=old is not None and _is_dir(old) and is_opaque(fd))
        finally:
            os.close(fd)

    def children(self, rel: str, fd: int, uid: int, opaque_over: bool) -> None:
        try:
            names = sorted(os.listdir(fd))
        except OSError:  # opened (O_RDONLY needs read permission), so not for lack of it
            return
        for name in names:
            child = f"{rel}/{name}" if rel else name
            if not self.spend(child):
                return
            entry = _Upper(fd, name)
            if (st := entry.lstat()) is not None:
                self.entry(child, entry, st)
        if opaque_over:  # a directory made again over the image's: what it lacks of the image's is deleted
            for name in sorted(image_listing(self.lowers, rel) - set(names)):
                old = image_entry(self.lowers, f"{rel}/{name}" if rel else name)
                if old is not None:
                    self.add(f"{rel}/{name}" if rel else name, "deleted", uid, entry_type(os.lstat(old)))


def _is_dir(path: Path) -> bool:
    st = _lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def overlay_changes(
    upper: Path, lowers: Sequence[Path], roots: Sequence[str], limit: int = WALK_LIMIT
) -> tuple[Change, ...]:
    """The entries under `roots` (absolute in-sandbox paths) where the overlay of `upper` on `lowers`
    (top first) differs from the lowers alone, sorted by path. At most `limit` entries are walked; past
    it, the last Change is kind "truncated"."""
    walk = _Walk([Path(p) for p in lowers], limit)
    top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for root in _outermost(roots):
            if root == "/":
                walk.children("", top, os.fstat(top).st_uid, opaque_over=False)
            else:
                walk.root(top, root)
    finally:
        os.close(top)
    found = [c for path, c in sorted(walk.found.items()) if _under(path, roots)]
    if walk.truncated:
        found.append(Change(walk.truncated, "truncated", -1, "other"))
    return tuple(found)


def _outermost(roots: Sequence[str]) -> list[str]:
    """The roots, normalised, without those under another (each tree is walked once)."""
    norm = sorted({"/" + r.strip("/") for r in roots})
    return [r for r in norm if not any(o != r and (o == "/" or r.startswith(o + "/")) for o in norm)]


def _under(path: str, roots: Sequence[str]) -> bool:
    """Whether `path` is one of `roots`, under one, or above one (a replaced ancestor changes the root)."""
    for root in roots:
        root = "/" + root.strip("/")
        if path == root or path.startswith(root.rstrip("/") + "/") or root.startswith(path + "/"):
            return True
    return False
