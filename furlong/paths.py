"""Where furlong keeps what it builds: images, models, generated task instances, weight arenas."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

SHM = Path("/dev/shm")
_ARENA = re.compile(r"furlong-weights-(\d+)-(\d+)-[0-9a-f]{16}")  # pid namespace, owner's pid, random part


def read_secret(path: Path, flag: str, what: str) -> str:
    """A secret of at least 16 characters from `path`, which the flag `flag` named (ValueError otherwise).
    Here, at the bottom of the layers, so that every server and client reads token files alike."""
    try:
        secret = path.read_text().strip()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
    if len(secret) < 16:
        raise ValueError(f"{flag} {path}: expected a {what} of at least 16 characters")
    return secret


def cache_dir() -> Path:
    """$FURLONG_CACHE; else ~/.cache/furlong, or /var/cache/furlong when running as root.

    As root, sandboxes run as an unprivileged uid that must be able to reach the image layers, and
    root's home is closed to other users (bwrap resolves overlay sources by path, so an open fd
    does not get around that).
    """
    env = os.environ.get("FURLONG_CACHE")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/cache/furlong")
    return Path.home() / ".cache" / "furlong"


def check_traversable(path: Path, uid: int) -> None:
    """Raises if `uid` (other than the owner) cannot reach `path`: every parent needs o+x."""
    if uid == os.geteuid():
        return
    for parent in [path, *path.parents]:
        if parent.exists() and parent.stat().st_uid != uid and not parent.stat().st_mode & 0o001:
            raise PermissionError(
                f"the sandbox uid {uid} cannot traverse {parent} (mode {oct(parent.stat().st_mode & 0o777)}), "
                f"so it cannot reach images under {path}; set FURLONG_CACHE to a directory outside it"
            )


def layer_mounts_dir() -> Path:
    """Where root attaches the read-only, id-mapped views of image layers (see sandbox/layers.py).

    Under /run, so the views go away with a reboot, and reachable by the sandbox uid, which bwrap
    runs as when it resolves its overlay sources.
    """
    return Path(os.environ.get("FURLONG_LAYER_MOUNTS", "/run/furlong/layers"))


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_arena_path() -> Path:
    """A fresh name for this process's weight arena (furlong.sync.handover) in /dev/shm."""
    return SHM / f"furlong-weights-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"


def is_arena(name: str) -> bool:
    return _ARENA.fullmatch(name) is not None


def arena_owner(name: str) -> int | None:
    """The pid that made the arena file `name`; None if `name` is not an arena's, or was made in another
    pid namespace (a container sharing this /dev/shm), where the pid means nothing here."""
    m = _ARENA.fullmatch(name)
    return int(m[2]) if m and int(m[1]) == _pid_namespace() else None


def remove_arenas(pids: set[int] | None = None) -> list[Path]:
    """Delete the arena files of `pids` (None: of every process of this host that is gone): what a killed
    trainer left in /dev/shm. Light on purpose (no torch): the run's watchdog calls it."""
    removed = []
    for path in SHM.glob("furlong-weights-*"):
        owner = arena_owner(path.name)
        if owner is None or (owner not in pids if pids is not None else _alive(owner)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:  # another user's, or removed meanwhile
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
