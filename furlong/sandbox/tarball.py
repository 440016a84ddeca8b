"""Tar helpers: what goes into a sandbox is owned by the sandbox's root, modes kept."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def tar_dir(src: Path, mode_mask: int = 0o7777) -> bytes:
    """The directory's contents (not the directory itself) as an uncompressed tar; `mode_mask` trims
    every member's mode (0o700: only its owner may read it)."""

    def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mode &= mode_mask
        return root_owned(info)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name, filter=owned)
    return buf.getvalue()
