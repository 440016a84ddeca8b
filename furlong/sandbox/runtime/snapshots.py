"""The snapshot store: sandboxes' writable layers copied out, named by content, expiring, under a disk cap.

A snapshot is the overlay upper directory of a running sandbox (its writes over the image: new and changed
entries, whiteouts, opaque directories), copied entry by entry with owners, modes and xattrs, and hashed
as it is copied: the digest names it, so two identical sandboxes make one snapshot. A sandbox restored from
it gets it as a read-only layer over the image (and a fresh writable layer on top), so the copy is never
written again. The copy walks the upper directory by file descriptors and never follows a symlink: the
directory belongs to the sandbox, whose processes are frozen meanwhile where a freezer cgroup exists.

The store lives under this process's own directory, which the sandbox uid can traverse but not list (and
no other host user can enter) (a snapshot means something only to the backend that
made it): one left by a dead process is removed when the next store starts. Hard links are copied as
separate files, sockets are left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from furlong.sandbox.base import SandboxError, SnapshotRef
from furlong.sandbox.runtime import cgroups

DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_MB = 4096
TTL_SETTING, CAP_SETTING = "sandbox.snapshot_ttl_s", "sandbox.snapshot_max_mb"
_CHUNK = 1 << 20
_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# What a lower layer means to overlay (opaque directories, xattr whiteouts) and to exec (file capabilities);
# not an upper's bookkeeping (uuid, origin, impure), which differs per mount and would split the digest.
_KEPT_XATTRS = tuple(f"{ns}.overlay.{k}" for ns in ("trusted", "user") for k in ("opaque", "whiteout")) + (
    "security.capability",
)


@dataclass
class _Copy:
    """One capture under way: the digest so far, and the bytes written against what the cap leaves."""

    room: int
    cap_mb: int
    sha: hashlib._Hash = field(default_factory=hashlib.sha256)
    size: int = 0

    def add(self, n: int) -> None:
        self.size += n
        if self.size > self.room:
            raise SandboxError(
                f"snapshot: the store is full: its cap is {self.cap_mb} MB ({CAP_SETTING}), and this "
                "snapshot would pass it; raise the cap, or let older snapshots expire"
            )


class SnapshotStore:
    """Snapshots of one process's sandboxes, at `root`/<owner tag>/<digest> (meta beside, as .json)."""

    def __init__(self, root: Path, ttl_s: float = DEFAULT_TTL_S, max_mb: int = DEFAULT_MAX_MB, group: int = 0):
        if ttl_s <= 0 or max_mb <= 0:
            raise ValueError(f"snapshot store: ttl_s and max_mb must be positive, got {ttl_s} and {max_mb}")
        self.ttl_s, self.max_mb = ttl_s, max_mb
        self.dir = root / f"snapshots@{cgroups.owner_tag()}"  # a later store removes it once this process is dead
        self._leases: Counter[str] = Counter()  # digests live sandboxes stack (never removed meanwhile)
        self._lock = threading.Lock()
        # bwrap, as the sandbox uid, resolves overlay sources by path: as root the store is root's, and only
        # `group` (the sandbox uid's gid) may traverse it, never list it; no other host user reaches a copied
        # set-id file. As a user, bwrap runs as the user. The sandboxes see none of the host's filesystem.
        for d in (root, self.dir):
            d.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(d, 0, group)
            d.chmod(0o710 if os.geteuid() == 0 else 0o700)
        for other in root.iterdir():
            if other != self.dir and other.is_dir() and cgroups.owner_dead(other.name):
                shutil.rmtree(other, ignore_errors=True)

    def capture(self, upper: Path, image_digest: str, below: tuple[str, ...] = ()) -> SnapshotRef:
        """Copies `upper` (a sandbox's writable layer; `below`: the snapshot layers under it, top first)."""
        with self._lock:
            self._sweep()
            room = (self.max_mb << 20) - self.usage()
        tmp = self.dir / f".capture-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        copy = _Copy(room, self.max_mb)
        copy.sha.update(json.dumps([image_digest, *below]).encode())
        try:
            top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                _copy_dir(top, tmp, copy)
            finally:
                os.close(top)
        except BaseException:
            _remove(tmp)
            raise
        digest = "sha256:" + copy.sha.hexdigest()
        ref = SnapshotRef((digest, *below), image_digest, copy.size, time.time() + self.ttl_s)
        with self._lock:
            final = self._path(digest)
            if final.exists():  # the same content again: one copy, its expiry renewed
                _remove(tmp)
            else:
                tmp.rename(final)
            self._meta(digest).write_text(json.dumps({"size": copy.size, "expires_at": ref.expires_at}))
            for under in below:  # the layers it stacks on live as long as it does
                meta = json.loads(self._meta(under).read_text())
                meta["expires_at"] = max(meta["expires_at"], ref.expires_at)
                self._meta(under).write_text(json.dumps(meta))
        return ref

    def layers(self, ref: SnapshotRef, image_digest: str) -> tuple[Path, ...]:
        """The snapshot's layer directories (top first), leased until `release`: one line when it is
        unknown, expired or over another image."""
        if ref.image_digest != image_digest:
            raise SandboxError(
                f"snapshot {ref.digest[:19]} was taken over image {ref.image_digest[:19]}, "
                f"not {image_digest[:19]}: restore it with its own image"
            )
        with self._lock:
            for digest in ref.layers:
                expires = self._expires(digest)
                if expires is None or not self._path(digest).is_dir():
                    raise SandboxError(f"snapshot {digest[:19]}: no such snapshot in this backend's store")
                if expires < time.time() and digest == ref.digest:
                    raise SandboxError(
                        f"snapshot {digest[:19]} expired {time.time() - expires:.0f}s ago ({TTL_SETTING})"
                    )
            self._leases.update(ref.layers)
        return tuple(self._path(d) for d in ref.layers)

    def release(self, ref: SnapshotRef) -> None:
        with self._lock:
            self._leases.subtract(ref.layers)
            self._leases = +self._leases

    def usage(self) -> int:
        """Bytes the stored snapshots hold (file contents and link targets)."""
        return sum(self._size(m) for m in self.dir.glob("*.json"))

    def _sweep(self) -> None:
        """Removes expired snapshots that no live sandbox stacks (or that no live snapshot stacks on)."""
        now = time.time()
        for meta in self.dir.glob("*.json"):
            digest = "sha256:" + meta.stem
            expires = self._expires(digest)
            if expires is not None and expires < now and not self._leases[digest]:
                _remove(self._path(digest))
                meta.unlink(missing_ok=True)

    def _path(self, digest: str) -> Path:
        return self.dir / digest.removeprefix("sha256:")

    def _meta(self, digest: str) -> Path:
        return self._path(digest).with_suffix(".json")

    def _expires(self, digest: str) -> float | None:
        try:
            return float(json.loads(self._meta(digest).read_text())["expires_at"])
        except (OSError, ValueError, KeyError):
            return None

    @staticmethod
    def _size(meta: Path) -> int:
        try:
            return int(json.loads(meta.read_text())["size"])
        except (OSError, ValueError, KeyError):
            return 0


def _copy_dir(src: int, dest: Path, copy: _Copy) -> None:
    """Copies the directory open at `src` to `dest` (new), its entries sorted by name for the digest."""
    st = os.fstat(src)
    os.mkdir(dest, 0o700)
    for name in sorted(os.listdir(src)):
        est = os.stat(name, dir_fd=src, follow_symlinks=False)
        copy.sha.update(_header(name, est))
        target = dest / name
        if stat.S_ISDIR(est.st_mode):
            fd = os.open(name, _NOFOLLOW | os.O_DIRECTORY, dir_fd=src)
            try:
                _copy_dir(fd, target, copy)
            finally:
                os.close(fd)
            continue
        if stat.S_ISREG(est.st_mode):
            _copy_file(src, name, target, copy)
        elif stat.S_ISLNK(est.st_mode):
            link = os.readlink(name, dir_fd=src)
            copy.sha.update(os.fsencode(link) + b"\0")
            copy.add(len(link))
            os.symlink(link, target)
        elif (stat.S_ISCHR(est.st_mode) and est.st_rdev == 0) or stat.S_ISFIFO(est.st_mode):
            os.mknod(target, est.st_mode, est.st_rdev)  # a whiteout is a character device 0/0
        else:
            continue  # a socket means nothing without its process; no other device is copied to the host
        _own(target, est)
    _xattrs(src, str(dest), copy)
    _own(dest, st)


def _copy_file(src: int, name: str, target: Path, copy: _Copy) -> None:
    fd = os.open(name, _NOFOLLOW, dir_fd=src)
    try:
        with open(target, "xb") as out:
            while chunk := os.read(fd, _CHUNK):
                copy.add(len(chunk))
                copy.sha.update(chunk)
                out.write(chunk)
        _xattrs(fd, str(target), copy)
    finally:
        os.close(fd)


def _header(name: str, st: os.stat_result) -> bytes:
    return f"{name}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{st.st_rdev}\0".encode()


def _xattrs(fd: int, target: str, copy: _Copy) -> None:
    """Copies the xattrs overlay and exec read (opaque directories, file capabilities) into the digest too."""
    try:
        names = sorted(n for n in os.listxattr(fd) if n in _KEPT_XATTRS)
    except OSError:
        return
    for name in names:
        value = os.getxattr(fd, name)
        copy.sha.update(name.encode() + b"=" + value + b"\0")
        os.setxattr(target, name, value, follow_symlinks=False)


def _own(path: Path, st: os.stat_result) -> None:
    """The entry's owner and mode as the sandbox had them (as an ordinary user, ids not its own are refused)."""
    try:
        os.lchown(path, st.st_uid, st.st_gid)
    except PermissionError:
        raise SandboxError(
            f"snapshot: {path.name} belongs to host uid {st.st_uid}, which this user cannot give files to "
            "(as an ordinary user, only the sandbox root's own files can be snapshotted)"
        ) from None
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(path, stat.S_IMODE(st.st_mode))


def _remove(path: Path) -> None:
    if os.geteuid() != 0 and path.is_dir():  # a copied directory of mode 0500 must be writable to be emptied
        for dirpath, dirnames, _ in os.walk(path):
            for d in [dirpath, *(os.path.join(dirpath, n) for n in dirnames)]:
                os.chmod(d, 0o700)
    shutil.rmtree(path, ignore_errors=True)
