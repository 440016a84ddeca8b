"""As root, image layers are root's on disk and the sandbox uid sees them only through read-only id-mapped
views: inside, the image still looks root-owned and is writable copy-on-write; outside, uid 61000 can
write neither the layer nor the view, even holding an fd to it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import skips
from conftest import run

from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime.bwrap import DEFAULT_HOST_UID

pytestmark = skips.needs_root("as a user, layers belong to the user (the sandbox uid)")
AS_SANDBOX_UID = ["setpriv", f"--reuid={DEFAULT_HOST_UID}", f"--regid={DEFAULT_HOST_UID}", "--clear-groups", "--"]


def test_layer_is_root_owned_on_disk_and_read_only_to_the_sandbox_uid(store, base_image):
    disk = store.root / store.base_key() / "rootfs"
    view = store.layer_dir(base_image.layers[0])
    assert os.stat(disk / "etc").st_uid == 0 and os.stat(view / "etc").st_uid == DEFAULT_HOST_UID
    for target in (disk / "etc" / "pwned", view / "etc" / "pwned", view / "etc" / "passwd"):
        res = subprocess.run([*AS_SANDBOX_UID, "sh", "-c", f"echo x >> {target}"], capture_output=True, text=True)
        assert res.returncode != 0, target
    fd = os.open(view, os.O_PATH | os.O_DIRECTORY)  # a leaked fd to the layer, as the daemon once held
    try:
        res = subprocess.run([*AS_SANDBOX_UID, "sh", "-c", f"echo x > /proc/self/fd/{fd}/etc/pwned"],
                             pass_fds=[fd], capture_output=True, text=True)
    finally:
        os.close(fd)
    assert "Read-only file system" in res.stderr
    assert not (disk / "etc" / "pwned").exists()


def test_inside_the_image_still_looks_root_owned_and_writable(backend, base_image, store):
    async def go():
        box = await backend.create(SandboxSpec(image=base_image))
        try:
            return await box.exec("stat -c %U /etc /usr/bin/su && echo hi > /etc/furlong-probe && "
                                  "mkdir /root/x && cat /etc/furlong-probe && ls -l /usr/bin/su | cut -c1-4")
        finally:
            await box.close()

    res = run(go())
    assert res.ok, res.stderr
    assert res.stdout.split() == ["root", "root", "hi", "-rws"]
    assert not (store.root / store.base_key() / "rootfs" / "etc" / "furlong-probe").exists()


def test_sandbox_tidy_detaches_every_view_but_the_stores_own(tmp_path, monkeypatch):
    """Earlier versions left one view per layer mounted until reboot; `furlong sandbox tidy` detaches them
    (here under a private FURLONG_LAYER_MOUNTS) and keeps the store's own view, and a later lookup of a
    detached layer attaches it again."""
    import sys
    from pathlib import Path

    from furlong.sandbox.images import layers

    monkeypatch.setenv("FURLONG_LAYER_MOUNTS", str(tmp_path / "views"))
    monkeypatch.setenv("FURLONG_CACHE", str(tmp_path / "cache"))
    store, old = tmp_path / "cache" / "images", [tmp_path / "old" / f"layer{i}" for i in range(2)]
    for d in (store, *old):
        d.mkdir(parents=True)
        (d / "mark").write_text(d.name)
    try:
        kept = layers.readonly_view(store, DEFAULT_HOST_UID)
        views = [layers.readonly_view(d, DEFAULT_HOST_UID) for d in old]
        assert set(layers._views()) == {str(v) for v in (kept, *views)}
        res = subprocess.run([sys.executable, "-m", "furlong.cli", "sandbox", "tidy"], capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
        assert res.returncode == 0, res.stderr
        assert "detached 2 image-layer views" in res.stdout + res.stderr
        assert set(layers._views()) == {str(kept)} and (kept / "mark").read_text() == "images"
        assert (layers.readonly_view(old[0], DEFAULT_HOST_UID) / "mark").read_text() == "layer0"
    finally:
        layers.detach_all_but(Path("/nonexistent"))  # leave no view of tmp_path behind
    assert layers._views() == {}


def _mounts_under(path: Path) -> list[str]:
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(f"{path}/")]


def test_many_layers_and_rebuilds_keep_one_view_and_a_held_view_stays_valid(monkeypatch):
    """Every sandbox start copies the host's mount table, so views must not pile up: hundreds of layers,
    one layer rebuilt at its path again and again, and the whole store replaced leave one view, and the
    sandbox uid still cannot write through it. A view held open (a running sandbox's overlay) keeps showing
    what it showed when the store under it is replaced (its view detached lazily, not stacked)."""
    from furlong.sandbox.images import layers
    from furlong.sandbox.images.store import ImageStore

    views = Path(tempfile.mkdtemp(prefix="test-views-", dir="/run/furlong"))  # private: other runs' views differ
    root = Path(tempfile.mkdtemp(prefix="test-mounts-", dir="/var/cache/furlong")) / "images"
    for d in (views, root.parent):
        d.chmod(0o755)  # the sandbox uid must reach a store's layers and their views
    monkeypatch.setenv("FURLONG_LAYER_MOUNTS", str(views))
    try:
        store = ImageStore(root=root)
        refs = []
        for i in range(300):
            (root / f"layer-{i}").mkdir(parents=True)
            (root / f"layer-{i}" / "n").write_text(str(i))
            refs.append(store.layer(f"layer-{i}", root / f"layer-{i}"))
        assert [(store.layer_dir(r) / "n").read_text() for r in refs] == [str(i) for i in range(300)]
        for i in range(30):  # a layer rebuilt at the same path: a new directory each time
            shutil.rmtree(root / "layer-0")
            (root / "layer-0").mkdir()
            (root / "layer-0" / "n").write_text(f"rebuilt {i}")
            assert (store.layer_dir(refs[0]) / "n").read_text() == f"rebuilt {i}"
        assert len(_mounts_under(views)) == 1
        held = os.open(store.layer_dir(refs[1]), os.O_PATH | os.O_DIRECTORY)  # what a running sandbox holds
        try:
            root.rename(root.with_name("old"))  # the store replaced while that sandbox runs
            (root / "layer-1").mkdir(parents=True)
            (root / "layer-1" / "n").write_text("new store")
            store = ImageStore(root=root)
            assert (store.layer_dir(refs[1]) / "n").read_text() == "new store"
            assert Path(f"/proc/self/fd/{held}/n").read_text() == "1"
            assert len(_mounts_under(views)) == 1
            res = subprocess.run([*AS_SANDBOX_UID, "sh", "-c", f"echo x > {store.layer_dir(refs[1])}/n"],
                                 capture_output=True, text=True)
            assert res.returncode != 0 and "Read-only file system" in res.stderr
        finally:
            os.close(held)
    finally:
        layers.detach_all_but(Path("/nonexistent"))
        shutil.rmtree(root.parent, ignore_errors=True)
        shutil.rmtree(views, ignore_errors=True)
