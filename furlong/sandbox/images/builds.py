"""What both image builders share (the store's own in store.py, and buildah.py): the content key,
the cross-process build lock, build-tree removal, the build error and the progress callback."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from furlong.sandbox.base import SandboxError

Progress = Callable[[str], None]


class ImageBuildError(SandboxError):
    pass


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _rmtree(path: Path) -> None:
    """Removes a build's tree, also as an ordinary user, whose overlay work dirs are mode 000 and
    whose image may hold read-only directories (root ignores modes; an owner must chmod first)."""
    if not path.exists():
        return
    if os.geteuid() != 0 and not path.is_symlink():
        os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):  # top-down: each child is opened before descent
            for name in dirnames:
                child = os.path.join(dirpath, name)
                if not os.path.islink(child):
                    os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def _locked(path: Path):
    """A cross-process lock, so two runs never build the same image at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
