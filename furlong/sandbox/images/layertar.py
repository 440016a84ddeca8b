"""Unpacking image layers (tar streams) into a directory, checked member by member.

Python's `tarfile` extraction filters reject absolute symlinks, which a real rootfs is full of
(/etc/localtime -> /usr/share/zoneinfo/...), so this writes each member itself: a symlink is created
as it is and never followed; every parent of a member must be a real directory inside the root;
`..` is refused; device nodes are skipped (bwrap gives every sandbox its own /dev). OCI whiteouts
(`.wh.NAME`, `.wh..wh..opq`) delete what lower layers put there.

Owners: as root, a member keeps its uid/gid on disk when the sandbox can show it (0..idmap.COUNT: the
store's id-mapped view maps on-disk ids as the sandbox maps inside ids, so a Dockerfile's `chown worker`
survives); an id beyond that becomes 0, root's, as every file was before. As an ordinary user every file
is the user's own (the sandbox's root): giving them the user's subordinate ids would need the unpack to
run inside the user's namespace (newuidmap), so ownership is kept only as root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, cast

from furlong.sandbox.runtime.idmap import COUNT, RESERVED_UIDS

WHITEOUT, OPAQUE = ".wh.", ".wh..wh..opq"


class UnpackError(ValueError):
    """A layer member that would escape the image root, or that cannot be unpacked."""


def inside_id(on_disk: int) -> int:
    """The id a file keeps in the store: itself where a sandbox maps it (0..COUNT), else root's; the ids
    furlong's init and verifier run as are root's too, so no image file is theirs."""
    return on_disk if 0 <= on_disk <= COUNT and on_disk not in RESERVED_UIDS else 0


class LayerWriter:
    """Applies layers, in order, to one root directory; `finish` once after the last."""

    def __init__(self, root: Path, label: str, owners: bool | None = None):
        self.root, self.label = root, label
        self.owners = os.geteuid() == 0 if owners is None else owners  # keep the members' uid/gid
        self.skipped = 0  # device nodes left out
        self._dirs: dict[str, tuple[int, float]] = {}  # modes are set last, so read-only dirs can be filled

    def apply(self, tar: tarfile.TarFile, whiteouts: bool) -> None:
        """Unpacks one layer. With `whiteouts` (OCI layers; needs a seekable tar), its whiteouts are
        applied first: they only ever delete what lower layers hold, never this layer's own files."""
        if not whiteouts:
            for member in tar:
                self._member(tar, member)
            return
        members = tar.getmembers()
        for member in members:
            if self._is_whiteout(member):
                self._whiteout(member)
        for member in members:
            if not self._is_whiteout(member):
                self._member(tar, member)

    def _is_whiteout(self, member: tarfile.TarInfo) -> bool:
        parts = self._parts(member.name)
        return bool(parts) and parts[-1].startswith(WHITEOUT)

    def finish(self) -> None:
        """Directory modes and times, deepest first (a parent's time would change with each child)."""
        for rel, (mode, mtime) in sorted(self._dirs.items(), key=lambda kv: -kv[0].count("/")):
            path = self.root / rel
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, mode & 0o7777)
                os.utime(path, (mtime, mtime))

    def _parts(self, name: str) -> list[str]:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise UnpackError(f"{self.label}: member {name!r} leaves the image root ('..'); refused")
        return parts

    def _walk(self, parts: list[str], name: str, create: bool) -> Path | None:
        """The directory `parts` names, checked component by component: no symlink is followed."""
        path = self.root
        for i, part in enumerate(parts):
            path = path / part
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(path)
                os.chmod(path, 0o755)
                continue
            where = "/" + "/".join(parts[: i + 1])
            if stat.S_ISLNK(st.st_mode):
                raise UnpackError(
                    f"{self.label}: member {name!r} goes through the symlink {where} -> "
                    f"{os.readlink(path)}; refused (it could lead outside the image)"
                )
            if not stat.S_ISDIR(st.st_mode):
                raise UnpackError(f"{self.label}: member {name!r}: {where} is not a directory")
        return path

    def _remove(self, path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            rel = str(path.relative_to(self.root))
            for key in [k for k in self._dirs if k == rel or k.startswith(rel + "/")]:
                del self._dirs[key]
        elif os.path.lexists(path):
            os.unlink(path)

    def _whiteout(self, member: tarfile.TarInfo) -> None:
        *dirs, base = self._parts(member.name)
        parent = self._walk(dirs, member.name, create=False)
        if parent is None:
            return
        if base == OPAQUE:
            for child in os.listdir(parent):
                self._remove(parent / child)
        elif not base.startswith(WHITEOUT + WHITEOUT):  # other .wh..wh.* names are aufs metadata
            self._remove(parent / base[len(WHITEOUT) :])

    def _member(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        parts = self._parts(member.name)
        if not parts:
            return  # the root itself
        if member.ischr() or member.isblk():
            self.skipped += 1
            return
        dst = self._place(parts, member)
        if member.isdir():
            if not (dst.is_dir() and not dst.is_symlink()):
                self._remove(dst)
                os.mkdir(dst, 0o700)
            self._own(dst, member)
            self._dirs["/".join(parts)] = (member.mode, member.mtime)
            return
        self._remove(dst)
        if member.isreg():
            with self._create(dst) as out, tar.extractfile(member) as src:  # type: ignore[union-attr]  # a regular member's file is never None
                shutil.copyfileobj(src, out, 1 << 20)
        elif member.issym():
            os.symlink(member.linkname, dst)
        elif member.islnk():
            os.link(self._link_source(member), dst, follow_symlinks=False)
        elif member.isfifo():
            os.mkfifo(dst)
        else:
            raise UnpackError(f"{self.label}: member {member.name!r} has an unsupported type {member.type!r}")
        self._settle(dst, member)

    def _place(self, parts: list[str], member: tarfile.TarInfo) -> Path:
        """Where a member goes: its parents checked (and made where the tar left them out)."""
        return cast(Path, self._walk(parts[:-1], member.name, create=True)) / parts[-1]  # create=True: a Path

    @staticmethod
    def _create(dst: Path) -> BinaryIO:
        """A new regular file, never through a symlink or over an existing name."""
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        return os.fdopen(fd, "wb")

    def _settle(self, dst: Path, member: tarfile.TarInfo) -> None:
        """A written entry's owner, mode and time, as the member gives them."""
        self._own(dst, member)  # before chmod: chown clears set-id bits, chmod puts them back
        if not member.issym():
            os.chmod(dst, member.mode & 0o7777)
        os.utime(dst, (member.mtime, member.mtime), follow_symlinks=False)

    def _own(self, dst: Path, member: tarfile.TarInfo) -> None:
        if self.owners:
            os.lchown(dst, inside_id(member.uid), inside_id(member.gid))

    def _link_source(self, member: tarfile.TarInfo) -> Path:
        *dirs, base = self._parts(member.linkname) or [""]
        parent = self._walk(dirs, member.linkname, create=False)
        source = parent / base if parent is not None and base else None
        if source is None or not source.is_file() or source.is_symlink():
            raise UnpackError(
                f"{self.label}: hard link {member.name!r} -> {member.linkname!r}: no such file in the image"
            )
        return source


def apply_tar_output(cmd: list[str], writer: LayerWriter, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Streams the tar a command writes to stdout through `writer` (a flat tree: no whiteouts); returns
    the command's exit status and stderr. GNU tar exits 1 when a file changed while it read it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            writer.apply(tar, whiteouts=False)
    finally:
        proc.stdout.close()  # type: ignore[union-attr]  # Popen(stdout=PIPE, stderr=PIPE)
        err = proc.stderr.read().decode(errors="replace")  # type: ignore[union-attr]
        proc.wait()
    return proc.returncode, err


def make_dir_in_root(root: Path, path: str, hops: int = 40, reveal: Callable[[str], None] | None = None) -> None:
    """`mkdir -p path` as the image would see it, chrooted at `root`: symlinks on the way are followed
    inside the image (an absolute target from `root`, `..` stops at it), never out to the host's tree.
    Docker's WORKDIR creates its directory so; buildah only does when a later RUN uses it. `reveal` is
    told each path (relative to `root`) before it is looked at: a layer that leaves out what its base
    holds (layerdiff.py) brings that entry up first, so a symlink of the base is followed, not covered."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    while pending:
        part = pending.pop(0)
        if part == "..":
            done = done[:-1]
            continue
        here = root.joinpath(*done, part)
        if reveal is not None:
            reveal("/".join([*done, part]))
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            os.mkdir(here)
            os.chmod(here, 0o755)  # root's, as Docker's WORKDIR makes it (this process is the image's root)
            done.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                raise UnpackError(f"{path}: too many symlinks in the image")
            target = os.readlink(here)
            pending = [p for p in target.split("/") if p not in ("", ".")] + pending
            done = [] if target.startswith("/") else done
        elif stat.S_ISDIR(st.st_mode):
            done.append(part)
        else:
            raise UnpackError(f"{path}: /{'/'.join([*done, part])} in the image is not a directory")
