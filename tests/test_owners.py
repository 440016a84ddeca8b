"""File owners a Dockerfile sets survive into the sandbox (as root): buildah's export and imports keep a tar
member's uid/gid (0..65535; others become root's), a native build's files are mapped back from the build
sandbox's host ids, a parent flattened for buildah keeps its owners, and the store's id-mapped view shows
on-disk ids as the sandbox's. As an ordinary user every stored file is the user's own: nothing to test."""

from __future__ import annotations

import io
import os
import tarfile
import uuid
from pathlib import Path

import pytest
import skips
from conftest import run, spec

from furlong.sandbox.runtime import idmap
from furlong.sandbox.images import layers
from furlong.sandbox.base import DEFAULT_HOST_UID, ImageRef
from furlong.sandbox.images.flatten import flatten_to_tar
from furlong.sandbox.images.layertar import LayerWriter

pytestmark = skips.needs_root("ownership is kept only as root: as a user every stored file is the user's own, "
                               "the sandbox's root (docs/images.md, USER)")


def _task(tmp_path: Path, text: str) -> Path:
    (tmp_path / "environment").mkdir(parents=True, exist_ok=True)
    (tmp_path / "environment" / "Dockerfile").write_text(text)
    return tmp_path / "environment" / "Dockerfile"


def _member(name: str, uid: int, gid: int, kind: bytes = tarfile.REGTYPE, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.uid, info.gid, info.mode = kind, uid, gid, mode
    return info


def _owners(root: Path, *names: str) -> list[str]:
    return [f"{(st := os.lstat(root / n)).st_uid}:{st.st_gid}" for n in names]


def test_layertar_keeps_owners_the_sandbox_maps_and_gives_others_to_root(tmp_path: Path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(_member("data", 1000, 1000, tarfile.DIRTYPE, 0o755))
        tar.addfile(_member("data/f", 1000, 1001), io.BytesIO(b""))
        tar.addfile(_member("top", 65535, 65535), io.BytesIO(b""))
        tar.addfile(_member("far", 70000, 2_000_000), io.BytesIO(b""))  # beyond what a sandbox maps
        tar.addfile(_member("mine", 65533, 65532), io.BytesIO(b""))  # the verifier's and the init's: root's
        tar.addfile(_member("su", 1000, 5, mode=0o4755), io.BytesIO(b""))  # chown clears set-id: put back
        link = _member("link", 7, 8, tarfile.SYMTYPE)
        link.linkname = "data/f"
        tar.addfile(link)
    buf.seek(0)
    writer = LayerWriter(tmp_path / "root", "crafted")
    (tmp_path / "root").mkdir()
    with tarfile.open(fileobj=buf, mode="r") as tar:
        writer.apply(tar, whiteouts=False)
    writer.finish()
    root = tmp_path / "root"
    assert _owners(root, "data", "data/f", "top", "far", "mine", "su", "link") == [
        "1000:1000", "1000:1001", "65535:65535", "0:0", "0:0", "1000:5", "7:8"]
    assert os.stat(root / "su").st_mode & 0o7777 == 0o4755


def test_flatten_keeps_owners_as_root(tmp_path: Path):
    """A parent's layers flattened into one tar for buildah: each entry keeps its on-disk owner (the id it
    has inside), an id beyond the sandbox's range is root's, and the top layer's owner wins."""
    top, low = tmp_path / "top", tmp_path / "low"
    for d in (top / "data", low / "data", low / "etc"):
        d.mkdir(parents=True)
    for path, ids in ((low / "data" / "f", (0, 0)), (top / "data" / "f", (1000, 1000)),
                      (low / "etc" / "conf", (0, 0)), (low / "far", (2_000_000, 5))):
        path.write_text("x")
        os.lchown(path, *ids)
    os.lchown(top / "data", 1000, 1000)
    os.symlink("data/f", low / "link")
    os.lchown(low / "link", 3, 4)
    flatten_to_tar((top, low), tmp_path / "out.tar")
    with tarfile.open(tmp_path / "out.tar") as tar:
        got = {m.name: f"{m.uid}:{m.gid}" for m in tar.getmembers()}
    assert {k: got[k] for k in ("data", "data/f", "etc", "etc/conf", "far", "link")} == {
        "data": "1000:1000", "data/f": "1000:1000", "etc": "0:0", "etc/conf": "0:0", "far": "0:5", "link": "3:4"}


def test_the_stores_view_maps_disk_ids_as_the_sandbox_does(tmp_path: Path, monkeypatch):
    """On-disk 0 shows as the sandbox uid, 1..65535 as the subordinate range; the view is still read-only.
    A view attached earlier with the old one-id map (its own mount point) is detached when this one is."""
    if idmap.sub_ids() is None:
        pytest.skip(f"sandboxes here have one uid: {idmap.problem()}")
    sub = idmap.sub_ids()
    monkeypatch.setenv("FURLONG_LAYER_MOUNTS", str(tmp_path / "views"))
    layer = tmp_path / "layer"
    layer.mkdir()
    for name, ids in (("root", (0, 0)), ("worker", (1000, 1000))):
        (layer / name).write_text(name)
        os.lchown(layer / name, *ids)
    legacy = layers._legacy_mount_point(layer)
    legacy.mkdir(parents=True)
    layers._attach(layer, DEFAULT_HOST_UID, legacy)  # stands for the old view (the map does not matter here)
    try:
        view = layers.readonly_view(layer, DEFAULT_HOST_UID)
        assert view != legacy and str(legacy) not in layers._views()
        assert _owners(view, "root", "worker") == [f"{DEFAULT_HOST_UID}:{DEFAULT_HOST_UID}",
                                                   f"{sub.uid_start + 999}:{sub.gid_start + 999}"]
        with pytest.raises(OSError, match="Read-only"):
            (view / "new").write_text("x")
        assert layers.readonly_view(layer, DEFAULT_HOST_UID) == view  # attached once
    finally:
        layers.detach_all_but(Path("/nonexistent"))


def test_seal_maps_a_build_sandboxs_host_ids_back_to_the_ids_inside(store, tmp_path: Path):
    """A native build's RUN writes as host ids: the sandbox uid for its root, the subordinate range for its
    other ids. Sealed, each is the id it had inside; an id the sandbox does not map is root's. (A native
    RUN has no capability, so today it cannot chown; what it writes as another uid keeps that uid.)"""
    if idmap.sub_ids() is None:
        pytest.skip(f"sandboxes here have one uid: {idmap.problem()}")
    sub, upper = idmap.sub_ids(), tmp_path / "upper"
    (upper / "d").mkdir(parents=True)
    for name, ids in (("root", (DEFAULT_HOST_UID, DEFAULT_HOST_UID)), ("worker", (sub.uid_start + 999, sub.gid_start + 999)),
                      ("d", (sub.uid_start + 4, sub.gid_start + 6)), ("stray", (12345, 54321)),
                      ("su", (sub.uid_start, 0))):
        if name != "d":
            (upper / name).write_text(name)
        os.lchown(upper / name, *ids)
    os.chmod(upper / "su", 0o4755)
    os.link(upper / "worker", upper / "d" / "hardlink")  # two names, one inode: mapped once
    store._seal(upper)
    assert _owners(upper, ".", "root", "worker", "d", "d/hardlink", "stray", "su") == [
        "0:0", "0:0", "1000:1000", "5:7", "1000:1000", "0:0", "1:0"]
    assert os.stat(upper / "su").st_mode & 0o7777 == 0o4755


def test_native_build_files_are_root_owned_and_the_agent_writes_them(store, backend, tmp_path: Path):
    path = _task(tmp_path, f"FROM debian:bookworm\nRUN mkdir /d && echo {uuid.uuid4().hex} > /d/nonce\n")

    async def go():
        image = await store.image(path, backend)
        box = await backend.create(spec(image))
        try:
            return image, await box.exec("stat -c %u:%g /d /d/nonce /etc /usr/bin/python3; "
                                         "echo y >> /d/nonce && echo y >> /etc/hostname && echo root-writes")
        finally:
            await box.close()

    image, res = run(go())
    assert res.ok, res.stderr
    assert res.stdout.split() == ["0:0", "0:0", "0:0", "0:0", "root-writes"]
    assert _owners(store.root / image.layers[0].path, "d", "d/nonce") == ["0:0", "0:0"]  # on disk: root's


def test_buildah_build_keeps_useradd_and_chown_and_user_can_write_its_dir(store, backend, tmp_path: Path):
    """tasks-tb2/user-nonroot's shape: the agent runs as worker, owns /data and its home, not /etc."""
    path = _task(tmp_path, "FROM debian:bookworm\nRUN useradd -m --uid 1000 worker && mkdir /data && "
                           "chown worker:worker /data\nUSER worker\n")

    async def go():
        image = await store.image(path, backend)
        box = await backend.create(spec(image))
        try:
            return await box.exec("id -un; stat -c %u:%g /data /home/worker /etc /usr/bin/python3; "
                                  "echo v > /data/values.txt && stat -c %U /data/values.txt; "
                                  "echo x >> /etc/passwd 2>/dev/null || echo etc-refused")
        finally:
            await box.close()

    res = run(go())
    assert res.ok, res.stderr
    assert res.stdout.split() == ["worker", "1000:1000", "1000:1000", "0:0", "0:0", "worker", "etc-refused"]


def test_a_parent_flattened_for_buildah_keeps_its_owners(store, tmp_path: Path):
    """An imported or natively built parent becomes a buildah image through a flattened tar; what buildah
    then exports (the built image's tree) still has the parent's owners."""
    from furlong.sandbox.images.buildah import Buildah

    layer = tmp_path / "layer"
    (layer / "data").mkdir(parents=True)
    (layer / "data" / "f").write_text("x")
    (layer / "etc").mkdir()
    for path, ids in ((layer / "data", (1000, 1000)), (layer / "data" / "f", (1000, 1001)), (layer / "etc", (0, 0))):
        os.lchown(path, *ids)
    bh = Buildah(store.root.parent / "buildah")
    ref = ImageRef(digest=f"test-owners-{uuid.uuid4().hex[:12]}", layers=())
    name = bh.import_ref(ref, (layer,))
    try:
        (tmp_path / "out").mkdir()
        bh.export(name, tmp_path / "out", "flattened parent")
    finally:
        bh.run("rmi", name)
    assert _owners(tmp_path / "out", "data", "data/f", "etc") == ["1000:1000", "1000:1001", "0:0"]


def test_native_build_runs_useradd_and_chown_and_the_owners_survive(store, backend, tmp_path: Path):
    """A native RUN has Docker's build capabilities in its user namespace (init.c BUILD_CAPS): useradd
    makes a home of its user's, chown gives files to other uids, a step acts as one; the stored layer and
    the sandbox show those owners. (With a USER other than root the Dockerfile still goes to buildah.)"""
    if idmap.sub_ids() is None:
        pytest.skip(f"sandboxes here have one uid: {idmap.problem()}")
    path = _task(tmp_path, f"FROM debian:bookworm\nRUN echo {uuid.uuid4().hex} > /nonce && "
                           "useradd -m --uid 1000 worker && mkdir /data && chown worker:worker /data && "
                           "chmod 2775 /data && touch /data/f && chown 1234:4321 /data/f && "
                           "setpriv --reuid=1000 --regid=1000 --clear-groups touch /data/by-worker && "
                           "adduser --disabled-password --gecos '' --uid 1001 helper\n")

    async def go():
        image = await store.image(path, backend)
        box = await backend.create(spec(image))
        try:
            return image, await box.exec("stat -c '%n %u:%g %U %a' /data /data/f /data/by-worker /home/worker /etc; "
                                         "touch /data/by-root 2>/dev/null || echo agent-refused")
        finally:
            await box.close()

    image, res = run(go())
    assert res.ok, res.stderr
    assert res.stdout.splitlines() == ["/data 1000:1000 worker 2775", "/data/f 1234:4321 UNKNOWN 644",
                                       "/data/by-worker 1000:1000 worker 644", "/home/worker 1000:1000 worker 755",
                                       "/etc 0:0 root 755", "agent-refused"]  # the agent, root without caps
    assert _owners(store.root / image.layers[0].path, "data", "data/f", "home/worker", "home/helper") == [
        "1000:1000", "1234:4321", "1000:1000", "1001:1001"]  # on disk: the ids inside
