"""Crash-safe writes for checkpoints and exports: a file or directory is complete under its name or absent."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_synced(path: Path, write: Callable[[BinaryIO], object]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(new: Path, path: Path) -> None:
    """os.replace cannot overwrite a non-empty directory, so an old checkpoint is first moved aside; a crash
    between the two renames leaves it intact under `.<name>.old-*` rather than losing both."""
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
