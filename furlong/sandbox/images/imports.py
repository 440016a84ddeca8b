"""`furlong image import NAME SOURCE`: an image brought by hand (a rootfs directory, a rootfs tarball, or
an OCI image as an `oci-archive` tar or an OCI layout directory), unpacked into the image store under
NAME, so that a Dockerfile's `FROM NAME` uses it.

Layers are unpacked by this module, never by `tar`: no member may leave the image root (`..`), be
written through a symlink (a layer's `etc -> /etc` followed by `etc/passwd` would reach the host's
/etc), or create a device node (bwrap gives every sandbox its own /dev). As root, files keep their
owners (0..65535; the store's id-mapped view shows them so inside); as a user, every file is the user's,
the sandbox's root (layertar.py says why). An image imported or pulled before owners were kept stays
root-owned until it is imported again.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import platform
import re
import shutil
import tarfile
import time
import zlib
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from furlong.sandbox.images.layertar import LayerWriter, apply_tar_output

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_INDEXES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
_MANIFESTS = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
_LAYER = re.compile(
    r"application/vnd\.(oci\.image\.layer(\.nondistributable)?\.v1\.tar(\+gzip)?"
    r"|docker\.image\.rootfs(\.foreign)?\.diff\.tar\.gzip)"
)
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


class ImageImportError(ValueError):
    """A source that cannot be imported: the message is one line naming it and why."""


def directory(root: Path, name: str) -> Path:
    return root / ("import-" + hashlib.sha256(name.encode()).hexdigest()[:16])


def find(root: Path, name: str) -> dict | None:
    """The meta of the image imported as `name`, or None."""
    meta = directory(root, name) / "meta.json"
    if not meta.exists():
        return None
    info = json.loads(meta.read_text())
    return info if info.get("name") == name else None


def names(root: Path) -> list[str]:
    # scandir, not glob: the store holds a directory per built layer (thousands), imports are few
    with os.scandir(root) as entries:
        metas = [Path(e.path) / "meta.json" for e in entries if e.name.startswith("import-") and e.is_dir()]
    return sorted(json.loads(m.read_text())["name"] for m in metas if m.is_file())


def import_image(root: Path, name: str, source: Path, progress: Callable[[str], None]) -> dict:
    """Unpacks `source` into the store under `name` (replacing an earlier import of that name)."""
    if not _NAME.fullmatch(name):
        raise ImageImportError(f"image name {name!r}: expected letters, digits and ._/:@+- (like python:3.12-slim)")
    if not source.exists():
        raise ImageImportError(f"{source}: no such file or directory")
    final = directory(root, name)
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Each import has its own id and rootfs path: layers built on an earlier import are not reused,
    # and a running sandbox's view of the earlier tree is never confused with the new one.
    image_id = hashlib.sha256(f"{name}\0{time.time_ns()}".encode()).hexdigest()[:16]
    rootfs = tmp / rootfs_name(image_id)
    rootfs.mkdir(parents=True)
    started = time.monotonic()
    try:
        meta = _unpack(source.resolve(), rootfs, tmp, progress)
        if not any(os.path.lexists(rootfs / p) for p in ("bin/bash", "usr/bin/bash")):
            raise ImageImportError(f"{source}: the image has no /bin/bash, which furlong's sandbox runs commands with")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta.update(name=name, source=str(source.resolve()), seconds=round(time.monotonic() - started, 1), id=image_id)
    (tmp / "meta.json").write_text(json.dumps(meta))
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = final.with_name(final.name + f".old{os.getpid()}")
        if final.exists():
            final.rename(old)  # sandboxes already running keep the old tree through their mounts
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    return meta


def rootfs_name(image_id: str) -> str:
    return f"rootfs-{image_id}"


def _unpack(source: Path, rootfs: Path, tmp: Path, progress: Callable[[str], None]) -> dict:
    if source.is_dir():
        if (source / "index.json").exists() or (source / "oci-layout").exists():
            return _oci_layout(source, rootfs, progress, "oci-layout")
        progress(f"copying rootfs {source}")
        return {"kind": "rootfs-dir", **_copy_dir(source, rootfs)}
    if not tarfile.is_tarfile(source):
        raise ImageImportError(f"{source}: neither a directory nor a tar archive (a rootfs tarball or an oci-archive)")
    with tarfile.open(source, "r:*") as tar:
        top = {n.removeprefix("./") for n in tar.getnames()}
    if "index.json" in top or "oci-layout" in top:
        blobs = tmp / "archive"
        _take_layout(source, blobs)
        try:
            return _oci_layout(blobs, rootfs, progress, "oci-archive")
        finally:
            shutil.rmtree(blobs, ignore_errors=True)
    progress(f"unpacking rootfs tarball {source}")
    writer = LayerWriter(rootfs, str(source))
    with _readable(str(source)), tarfile.open(source, "r|*") as tar:
        writer.apply(tar, whiteouts=False)
    writer.finish()
    return {"kind": "rootfs-tar", "skipped_devices": writer.skipped}


@contextmanager
def _readable(what: str):
    """A truncated or corrupt archive is one line, not a traceback."""
    try:
        yield
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ImageImportError(f"{what}: cannot unpack it: {exc}") from None


def _copy_dir(source: Path, rootfs: Path) -> dict:
    """A rootfs directory, through the same checked unpacking (GNU tar only reads it)."""
    cmd = ["tar", "-C", str(source), "--one-file-system", "--numeric-owner", "--exclude=./dev/*", "-cf", "-", "."]
    writer = LayerWriter(rootfs, str(source))
    code, err = apply_tar_output(cmd, writer)
    if code not in (0, 1):  # 1: a file changed while read, as GNU tar reports it
        raise ImageImportError(f"{source}: reading the directory failed: {err.strip().splitlines()[-1:]}")
    writer.finish()
    return {"skipped_devices": writer.skipped}


def _take_layout(archive: Path, into: Path) -> None:
    """Copies an oci-archive's index and blobs out of it (nothing else: names are checked)."""
    into.mkdir()
    wanted = re.compile(r"index\.json|oci-layout|blobs/sha256/[0-9a-f]{64}")
    with tarfile.open(archive, "r|*") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if member.isreg() and wanted.fullmatch(name):
                (into / name).parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(into / name, "wb") as dst:  # type: ignore[union-attr]  # a regular member's file is never None
                    shutil.copyfileobj(src, dst)


def _blob(layout: Path, descriptor: dict, what: str) -> Path:
    digest = descriptor.get("digest", "")
    if not _DIGEST.fullmatch(digest):
        raise ImageImportError(f"{layout}: {what} digest {digest!r}: expected sha256:<64 hex digits>")
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    if not path.is_file():
        raise ImageImportError(f"{layout}: {what} blob {digest} is missing")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if "sha256:" + h.hexdigest() != digest:
        raise ImageImportError(f"{layout}: {what} blob {digest} does not match its digest")
    return path


def _json(layout: Path, descriptor: dict, what: str) -> dict:
    try:
        return json.loads(_blob(layout, descriptor, what).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ImageImportError(f"{layout}: {what} is not JSON: {exc}") from None


def _manifest(layout: Path) -> dict:
    """The image manifest: the index's one manifest, or the one for this machine's platform."""
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, ValueError) as exc:
        raise ImageImportError(f"{layout}: not an OCI layout (index.json: {exc})") from None
    for _ in range(4):  # an index may point at a nested index (a multi-platform image)
        found = index.get("manifests") or []
        arch = _ARCH.get(platform.machine(), platform.machine())
        fits = [d for d in found if d.get("platform", {}).get("architecture", arch) == arch]
        if len(fits) != 1:
            raise ImageImportError(f"{layout}: index.json lists {len(fits)} manifests for {arch}; expected exactly one")
        kind = fits[0].get("mediaType", "")
        if kind in _MANIFESTS:
            return _json(layout, fits[0], "manifest")
        if kind not in _INDEXES:
            raise ImageImportError(f"{layout}: unsupported media type {kind!r} in index.json")
        index = _json(layout, fits[0], "nested index")
    raise ImageImportError(f"{layout}: index.json nests indexes more than 4 deep")


def _oci_layout(layout: Path, rootfs: Path, progress: Callable[[str], None], kind: str) -> dict:
    manifest = _manifest(layout)
    config = _json(layout, manifest.get("config", {}), "config").get("config") or {}
    layers = manifest.get("layers") or []
    writer = LayerWriter(rootfs, str(layout))
    for n, layer in enumerate(layers, 1):
        media = layer.get("mediaType", "")
        if not _LAYER.fullmatch(media):
            raise ImageImportError(f"{layout}: layer {n}: unsupported media type {media!r} (tar and tar+gzip only)")
        progress(f"layer {n}/{len(layers)} {layer.get('digest', '')[:19]}")
        path = _blob(layout, layer, f"layer {n}")
        writer.label = f"{layout}: layer {n}"
        with _readable(f"{layout}: layer {n}"), tarfile.open(path, "r:*") as tar:
            writer.apply(tar, whiteouts=True)
    writer.finish()
    env = [e.split("=", 1) for e in config.get("Env") or [] if "=" in e]
    return {
        "kind": kind,
        "layers": len(layers),
        "env": env,
        "workdir": config.get("WorkingDir") or "/",
        "user": config.get("User", ""),
        "skipped_devices": writer.skipped,
    }
