"""Read-only, id-mapped views of image layers, so the sandbox uid never owns or can write the shared layers.

As root, layers hold on disk the ids their files have inside (0 for root, 1000 for a Dockerfile's
`worker`). A sandbox maps its host uid (61000) to its own root and ids 1..65535 to a subordinate range
(idmap.py), so a layer must *look* owned by those host ids to look owned by the right user inside. An
id-mapped mount (`mount_setattr(MOUNT_ATTR_IDMAP)`, Linux >= 5.12; overlayfs accepts such lower layers
since 5.19) maps on-disk ids exactly as the sandbox maps inside ids (0 -> 61000, 1..65535 -> the range),
and the same mount is read-only, so even a leaked fd or an escaped process with uid 61000 gets EROFS or
EACCES on the layer. With one uid per sandbox (no range), only 0 is mapped; other owners show as nobody.
bwrap resolves its `--overlay-src` fds back to paths, so the view is attached at a path (under
`paths.layer_mounts_dir()`, named by the layer and the id maps), once per boot; the image store views its
whole directory this way and names each layer inside that one view (views of deleted directories are
detached by the next sweep; the view an earlier version attached with its one-id map, when the new one is).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import subprocess
import time
from pathlib import Path

from furlong.paths import layer_mounts_dir
from furlong.sandbox.runtime import idmap

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # the same on x86_64 and arm64
_OPEN_TREE_CLONE, _AT_RECURSIVE, _AT_EMPTY_PATH, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x8000, 0x1000, 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_IDMAP = 0x1, 0x100000
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def id_maps(uid: int) -> tuple[str, str]:
    """The uid_map and gid_map of a view: on-disk 0 is `uid` (the sandbox's root), on-disk 1..COUNT the
    sandbox's subordinate range, as bwrap's launcher maps inside ids (idmap.py)."""
    sub = idmap.sub_ids()
    if sub is None:
        return f"0 {uid} 1\n", f"0 {uid} 1\n"
    return (f"0 {uid} 1\n1 {sub.uid_start} {sub.count}\n", f"0 {uid} 1\n1 {sub.gid_start} {sub.count}\n")


def _userns_fd(maps: tuple[str, str]) -> int:
    """A user namespace with these id maps (only they matter; its one process exits at once)."""
    proc = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "read _"], stdin=subprocess.PIPE)
    try:
        mine = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 5
        while os.readlink(f"/proc/{proc.pid}/ns/user") == mine:  # until unshare(2) has happened
            if time.monotonic() > deadline:
                raise OSError(f"unshare --user did not start a user namespace (pid {proc.pid})")
            time.sleep(0.002)
        for kind, text in zip(("uid", "gid"), maps):
            Path(f"/proc/{proc.pid}/{kind}_map").write_text(text)
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        proc.stdin.close()  # type: ignore[union-attr]  # Popen(stdin=PIPE)
        proc.wait()


def mount_point(layer: Path, uid: int) -> Path:
    """Where the view of `layer` with `uid`'s id maps is attached."""
    return layer_mounts_dir() / hashlib.sha256("\0".join([str(layer), *id_maps(uid)]).encode()).hexdigest()[:20]


def _legacy_mount_point(layer: Path) -> Path:
    """Where views mapping only uid 0 were attached (before owners were kept): detached once replaced."""
    return layer_mounts_dir() / hashlib.sha256(str(layer).encode()).hexdigest()[:20]


def _views() -> dict[str, list[str]]:
    """Mount point -> the source paths mounted there, bottom first ("...//deleted" once removed)."""
    found: dict[str, list[str]] = {}
    prefix = str(layer_mounts_dir()) + "/"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4].startswith(prefix):
            found.setdefault(fields[4], []).append(fields[3])
    return found


def _detach(target: Path, stacked: int) -> None:
    for _ in range(stacked):
        _libc.umount2(str(target).encode(), _MNT_DETACH)


def readonly_view(layer: Path, uid: int) -> Path:
    """The layer as seen through a read-only mount with id_maps(uid): the sandbox's ids (root only)."""
    target = mount_point(layer, uid)
    if _current(target, layer):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:  # two processes must not stack two views
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _current(target, layer):
            _attach(layer, uid, target)
    return target


def _current(target: Path, layer: Path) -> bool:
    """Whether the view at `target` shows this very directory: a bind mount keeps st_dev and st_ino, and
    an unmounted `target` is an empty directory of its own, so the two stats say it. (Not mountinfo: a
    host that has run many tasks has thousands of views, and parsing it cost more than an RL episode's
    sandbox start; mountinfo's source path is relative to its filesystem, so it could not be compared.)"""
    try:
        a, b = os.stat(target), os.stat(layer)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _attach(layer: Path, uid: int, target: Path) -> None:
    views = _views()
    _detach(target, len(views.get(str(target), [])))  # a layer rebuilt at the same path: the old tree
    # the view an earlier version attached with its one-id map (lazily: running sandboxes keep it)
    if (legacy := _legacy_mount_point(layer)) != target and str(legacy) in views:
        _detach(legacy, len(views[str(legacy)]))
    tree = _check(
        _libc.syscall(_SYS_OPEN_TREE, -100, str(layer).encode(), _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE),
        f"open_tree {layer}",
    )
    try:
        ns = _userns_fd(id_maps(uid))
        try:
            attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_IDMAP, 0, 0, ns)
            _check(
                _libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)),
                f"id-mapping {layer}",
            )
        finally:
            os.close(ns)
        _check(
            _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", -100, str(target).encode(), _MOVE_MOUNT_F_EMPTY_PATH),
            f"attaching {layer} at {target}",
        )
    finally:
        os.close(tree)


def sweep() -> None:
    """Detaches the views of layers that were deleted (a removed cache, a rebuilt image). The kernel
    marks those in mountinfo, so this is right in any mount namespace, whatever paths it can see."""
    for target, sources in _views().items():
        if any(src.endswith("//deleted") for src in sources):
            _detach(Path(target), len(sources))
            try:
                os.rmdir(target)
            except OSError:
                pass


def detach_all_but(keep: Path) -> int:
    """Detaches every view under layer_mounts_dir() except the one at `keep` (the image store's own view):
    the per-layer views earlier versions attached (one per layer a host ever used, kept until reboot, and
    copied into every new sandbox's namespace) and those of other stores. Detaching is lazy: sandboxes
    already running keep what they see. Returns how many views were detached."""
    detached = 0
    for target, sources in _views().items():
        if Path(target) != keep:
            _detach(Path(target), len(sources))
            detached += 1
            try:
                os.rmdir(target)
            except OSError:
                pass
    return detached


def supported() -> bool:
    """Id-mapped read-only views need root (CAP_SYS_ADMIN on the layer's filesystem)."""
    return os.geteuid() == 0
