"""A built image stored as one layer above its base: the tree buildah exports, less what the base shows.

buildah builds over a base furlong resolved (a FROM's base, stand-in, import or pull: `below`, its
layers top first, the way a sandbox stacks them). The export streams the whole built tree; this writer
keeps only what differs from the overlay of `below`, so the stored layer is an overlay upper directory
like a native build's (store.py) and the image is that layer stacked over `below`:

- a file is left out when the base has a regular file at the path with the same size, mode, owner
  (as root), mtime (to the second: GNU tar's precision) and bytes; a symlink when the base's has the same
  target (and owner); a fifo when the same mode and owner. Anything else is written whole.
- every directory is written as the tar goes (a kept file needs its parents with the image's modes and
  owners); at the end, one the base has with the same mode and owner that holds nothing kept is removed.
- a hard link whose target was left out brings the target up from the base (a link cannot span layers),
  unless the base holds the two as one inode already.
- a path the base shows but the image lacks becomes a whiteout (a character device 0/0, what overlayfs
  itself writes in a native build's upper directory, as root and, since Linux 5.8, as a user), at the
  highest such path only: below a directory the image replaced or deleted, nothing more is needed.

Owners are compared and kept only as root (layertar.py: as a user every stored file is the user's own);
xattrs are neither in buildah's export (tar without --xattrs) nor compared, as before. With no `below`
(a final stage FROM scratch) every entry is kept: the whole tree, as every buildah image was stored before.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from collections.abc import Sequence
from pathlib import Path

from furlong.sandbox.images.flatten import merged
from furlong.sandbox.images.layertar import LayerWriter, inside_id, make_dir_in_root

_CHUNK = 1 << 20


class DiffWriter(LayerWriter):
    """Unpacks an image's flat tree into `root`, keeping only what differs from `below` (top first)."""

    def __init__(self, root: Path, label: str, below: Sequence[Path] = (), owners: bool | None = None):
        super().__init__(root, label, owners)
        self.below = {rel: (Path(path), st) for rel, path, st in merged(below)}
        self.seen: dict[str, bool] = {}  # every path the image holds -> whether it is a directory
        self.same = 0  # entries left out: the base shows them as they are
        self.whiteouts = 0
        self._same_dirs: set[str] = set()  # written for their children; removed at the end if they have none

    # -- the tar stream -------------------------------------------------------------------------
    def _member(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        parts = self._parts(member.name)
        if not parts or member.ischr() or member.isblk():
            super()._member(tar, member)  # the root itself, or a device node: skipped and counted there
            return
        rel = "/".join(parts)
        self.seen[rel] = member.isdir()
        old = self.below.get(rel)
        if old is not None and self._same_meta(member, old[1]):
            if member.isdir():
                self._same_dirs.add(rel)
            elif member.isreg():
                if self._file_over(tar, member, parts, *old):
                    return
            elif (member.issym() and stat.S_ISLNK(old[1].st_mode) and os.readlink(old[0]) == member.linkname) or (
                member.isfifo() and stat.S_ISFIFO(old[1].st_mode)
            ):
                self.same += 1
                return
        if member.islnk() and self._link_below(member, rel):
            return
        super()._member(tar, member)

    def _same_meta(self, member: tarfile.TarInfo, st: os.stat_result) -> bool:
        """The type, mode (a symlink's is meaningless) and owner (as root) of the base's entry."""
        if member.isdir() != stat.S_ISDIR(st.st_mode):
            return False
        if not member.issym() and (member.mode & 0o7777) != stat.S_IMODE(st.st_mode):
            return False
        return not self.owners or (inside_id(member.uid), inside_id(member.gid)) == (
            inside_id(st.st_uid),
            inside_id(st.st_gid),
        )

    def _file_over(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, parts: list[str], old: Path, st: os.stat_result
    ) -> bool:
        """A regular file over the base's `old`: left out where its bytes (and size and mtime) are the
        same, else written here, what matched so far taken from the base (the stream cannot be read
        again). False: not comparable (not a regular file there, or unreadable), to be written whole."""
        if not stat.S_ISREG(st.st_mode) or st.st_size != member.size or st.st_mtime_ns // 10**9 != member.mtime:
            return False
        try:
            fd = os.open(old, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False  # a user's own file of mode 000: written from the stream instead
        with os.fdopen(fd, "rb") as base, tar.extractfile(member) as src:  # type: ignore[union-attr]  # a regular member's file is never None
            matched = 0
            while chunk := src.read(_CHUNK):
                if chunk != base.read(len(chunk)):
                    dst = self._place(parts, member)
                    self._remove(dst)
                    with self._create(dst) as out:
                        base.seek(0)
                        while matched and (same := base.read(min(matched, _CHUNK))):
                            matched -= out.write(same)
                        out.write(chunk)
                        shutil.copyfileobj(src, out, _CHUNK)
                    self._settle(dst, member)
                    return True
                matched += len(chunk)
        self.same += 1
        return True

    def _link_below(self, member: tarfile.TarInfo, rel: str) -> bool:
        """A hard link: left out where the base has both names as one file and the target was left out
        too; otherwise its target, if left out, is brought up so the link can be made here. True: done."""
        target = "/".join(self._parts(member.linkname))
        if os.path.lexists(self.root / target) or target not in self.below:
            return False  # the target is here (or nowhere: the writer's own error says so)
        old, mine = self.below[target][1], self.below.get(rel)
        if mine is not None and (mine[1].st_dev, mine[1].st_ino) == (old.st_dev, old.st_ino):
            self.same += 1
            return True
        self._bring_up(target)
        return False

    # -- after the stream -----------------------------------------------------------------------
    def make_dir(self, path: str) -> None:
        """WORKDIR's `mkdir -p` in the image as a whole: what the base shows on the way is brought up."""
        make_dir_in_root(self.root, path, reveal=self._reveal)

    def _reveal(self, rel: str) -> None:
        if os.path.lexists(self.root / rel):
            return
        if rel in self.seen and rel in self.below:
            self._bring_up(rel)  # the image has it as the base does: follow (or refuse) it as it is
        else:
            self.seen[rel] = True  # not in the image: make_dir_in_root makes it a new directory

    def _bring_up(self, rel: str) -> None:
        """Copies the base's entry at `rel` (a left-out one) into this layer, as it is."""
        path, st = self.below[rel]
        dst = self.root / rel
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(dst, 0o700)
            self._same_dirs.add(rel)
            self._dirs[rel] = (st.st_mode, st.st_mtime)
        elif stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(path), dst)
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as src, self._create(dst) as out:
                shutil.copyfileobj(src, out, _CHUNK)
        else:
            os.mkfifo(dst)
        info = tarfile.TarInfo(rel)
        info.uid, info.gid, info.mode, info.mtime = st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_mtime
        info.type = tarfile.SYMTYPE if stat.S_ISLNK(st.st_mode) else tarfile.REGTYPE
        if stat.S_ISDIR(st.st_mode):
            self._own(dst, info)
        else:
            self._settle(dst, info)

    def finish(self) -> None:
        """Whiteouts for what the image deleted, the directories nothing was kept under removed, then the
        directories' modes and times."""
        for rel in self.below:
            parent = rel.rpartition("/")[0]
            if rel not in self.seen and (not parent or self.seen.get(parent)):
                os.mknod(self.root / rel, stat.S_IFCHR, os.makedev(0, 0))
                self.whiteouts += 1
        for rel in sorted(self._same_dirs, key=lambda r: -r.count("/")):
            try:
                os.rmdir(self.root / rel)
            except OSError:
                continue  # something under it differs from the base
            del self._dirs[rel]
            self.same += 1
        super().finish()
