"""Where furlong keeps what it builds: images, models, generated task instances."""

from __future__ import annotations

import os
from pathlib import Path


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
                f"so it cannot reach images under {path}; set FURLONG_CACHE to a directory outside it")


def layer_mounts_dir() -> Path:
    """Where root attaches the read-only, id-mapped views of image layers (see sandbox/layers.py).

    Under /run, so the views go away with a reboot, and reachable by the sandbox uid, which bwrap
    runs as when it resolves its overlay sources.
    """
    return Path(os.environ.get("FURLONG_LAYER_MOUNTS", "/run/furlong/layers"))
