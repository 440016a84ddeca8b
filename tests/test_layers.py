"""As root, image layers are root's on disk and the sandbox uid sees them only through read-only id-mapped
views: inside, the image still looks root-owned and is writable copy-on-write; outside, uid 61000 can
write neither the layer nor the view, even holding an fd to it."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import run
from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.bwrap import DEFAULT_HOST_UID

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="as a user, layers belong to the user (the sandbox uid)")
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

    from furlong.sandbox import layers

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
