"""The tree an overlay of furlong's image layers shows, as one tar (for buildah, which takes images, not
overlay directories).

A layer is an overlayfs upper directory: a character device 0/0 is a whiteout (the path is deleted
below it) and a directory with the `overlay.opaque` xattr hides everything below it in lower layers.
Layers are walked top first; the first layer holding a path wins. As root, entries keep their owners
(on disk they are the ids inside a sandbox: layertar.py); as a user, every file is the user's, which is
the sandbox's root, so the tar is root-owned.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from furlong.sandbox.changes import is_opaque, is_whiteout
from furlong.sandbox.images.layertar import inside_id
from furlong.sandbox.tarball import root_owned


def _hidden(rel: str, whiteouts: set[str], opaque: set[str]) -> bool:
    """Whether a higher layer deleted `rel` or one of its parents, or made a parent opaque."""
    if rel in whiteouts:
        return True
    parent = rel
    while "/" in parent:
        parent = parent.rsplit("/", 1)[0]
        if parent in whiteouts or parent in opaque:
            return True
    return False


def _as_stored(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid, info.gid = inside_id(info.uid), inside_id(info.gid)
    info.uname = info.gname = ""  # the ids are the sandbox's, not the names this host gives them
    return info


def merged(layers: Sequence[Path], under: str = "") -> Iterator[tuple[str, str, os.stat_result]]:
    """What an overlay of `layers` (top first) shows: (path inside, host path, lstat) for each entry,
    a directory before what it holds; whiteouts, and what they or an opaque directory hide, left out.
    `under` (e.g. "tests"): only what is below that directory (paths still relative to the root)."""
    seen: dict[str, bool] = {}  # path -> is a directory, from the highest layer that has it
    whiteouts: set[str] = set()
    opaque: set[str] = set()
    for layer in layers:
        reaches, hides = _reach(layer, under)
        if reaches:
            yield from _layer_entries(layer, under, seen, whiteouts, opaque)
        if hides:
            return


def _reach(layer: Path, under: str) -> tuple[bool, bool]:
    """Whether `layer` holds the directory `under` through directories, and whether it hides `under` in
    the layers below it (a whiteout, something not a directory, or an opaque directory on the way)."""
    path = layer
    for part in [p for p in under.split("/") if p]:
        path = path / part
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False, False
        if not stat.S_ISDIR(st.st_mode):
            return False, True
        if is_opaque(str(path)):
            return _rest_is_dir(layer, under), True
    return True, False


def _rest_is_dir(layer: Path, under: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(layer / under).st_mode)
    except FileNotFoundError:
        return False


def _layer_entries(
    layer: Path, under: str, seen: dict[str, bool], whiteouts: set[str], opaque: set[str]
) -> Iterator[tuple[str, str, os.stat_result]]:
    new_whiteouts, new_opaque = set(), set()
    for dirpath, dirnames, filenames in os.walk(layer / under if under else layer):
        rel_dir = os.path.relpath(dirpath, layer)
        keep = []
        for name in sorted(dirnames) + sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            path = os.path.join(dirpath, name)
            is_dir = name in dirnames and not os.path.islink(path)
            if _hidden(rel, whiteouts, opaque):
                continue
            if rel in seen:  # a higher layer has it: descend only where both are directories
                if is_dir and seen[rel]:
                    keep.append(name)
                continue
            st = os.lstat(path)
            if is_whiteout(st):
                new_whiteouts.add(rel)
                continue
            seen[rel] = is_dir
            yield rel, path, st
            if is_dir:
                keep.append(name)
                if is_opaque(path):
                    new_opaque.add(rel)
        dirnames[:] = [d for d in dirnames if d in keep]
    whiteouts |= new_whiteouts
    opaque |= new_opaque


def subtree_tar(layers: Sequence[Path], under: str, mode_mask: int = 0o7777) -> bytes | None:
    """The image's directory `under` (relative to its root, e.g. "tests") as a tar of what it holds, names
    relative to it: regular files, directories and symlinks (never followed), each file read once, no hard
    links; modes trimmed by `mode_mask`, owners root. None when the image has no such directory."""
    buf, found = io.BytesIO(), False
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel, path, st in merged(layers, under):
            found = True
            info = tarfile.TarInfo(rel[len(under.strip("/")) + 1 :])
            info.mode, info.mtime = stat.S_IMODE(st.st_mode) & mode_mask, int(st.st_mtime)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                data = _read_nofollow(path)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue() if found or _has_dir(layers, under) else None


def _has_dir(layers: Sequence[Path], under: str) -> bool:
    """Whether the image shows `under` as a directory (an empty one yields no entries)."""
    for layer in layers:
        reaches, hides = _reach(layer, under)
        if reaches or hides:
            return reaches
    return False


def _read_nofollow(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def flatten_to_tar(layers: tuple[Path, ...], out: Path) -> None:
    """Writes the merged tree of `layers` (top first) to the tar `out`; device nodes left out (bwrap
    gives every sandbox its own /dev)."""
    owned = _as_stored if os.geteuid() == 0 else root_owned
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel, path, st in merged(layers):
            if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
                tar.add(path, arcname=rel, recursive=False, filter=owned)
