"""`furlong image import`: OCI archives and layouts (layers in order, whiteouts), rootfs directories and
tarballs, unpacked safely into the store and used by a Dockerfile's `FROM NAME` in a real sandbox."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from conftest import run, spec
from furlong.cli import main
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.images.imports import ImageImportError, directory, import_image
from furlong.sandbox.images.layertar import UnpackError

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


@pytest.fixture(scope="module")
def import_store(store: ImageStore):
    """A store of its own (so tests never replace the user's imports), reachable by the sandbox uid."""
    root = store.root.parent / "test-imports"
    shutil.rmtree(root, ignore_errors=True)
    yield ImageStore(root=root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def import_backend(import_store: ImageStore) -> BwrapBackend:
    return BwrapBackend(layers=import_store)  # the images imported here are found in their own store


def meta_dir(store: ImageStore, name: str) -> str:
    return directory(store.root, name).name


def _tar(entries: list[tuple[str, str, str | bytes]], compress: bool = False) -> bytes:
    """A layer: (name, kind, content) with kind file, exe, dir, symlink (content: target), link or chr."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, content in entries:
            info = tarfile.TarInfo(name)
            info.mode = 0o755 if kind in ("dir", "exe") else 0o644
            data = content.encode() if isinstance(content, str) else content
            if kind in ("file", "exe"):
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "link": tarfile.LNKTYPE,
                         "chr": tarfile.CHRTYPE}[kind]
            info.linkname = content if kind in ("symlink", "link") else ""
            tar.addfile(info)
    return gzip.compress(buf.getvalue()) if compress else buf.getvalue()


def _oci_layout(out: Path, layers: list[tuple[bytes, str]], config: dict) -> Path:
    """An OCI image layout: index.json -> manifest -> config and layers, all by sha256 digest."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes, media: str) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}

    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
                "layers": [blob(data, media) for data, media in layers]}
    desc = blob(json.dumps(manifest).encode(), manifest["mediaType"])
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return out


def _closure(rootfs: Path, path: str) -> set[str]:
    """Every path (symlinks along the way included) that `path` needs to resolve inside the rootfs."""
    needed, todo = set(), [path]
    while todo:
        parts, cur = todo.pop().strip("/").split("/"), ""
        for i, part in enumerate(parts):
            cur = f"{cur}/{part}".lstrip("/")
            needed.add(cur)
            if (rootfs / cur).is_symlink():
                target = os.readlink(rootfs / cur)
                base = target if target.startswith("/") else os.path.normpath(f"/{os.path.dirname(cur)}/{target}")
                todo.append("/".join([base, *parts[i + 1:]]))
                break
    return needed


async def _bash_paths(backend, base_image) -> set[str]:
    """/bin/bash (which the sandbox init runs) and the libraries it loads, as ldd reports them."""
    box = await backend.create(spec(base_image))
    try:
        out = (await box.exec("ldd /usr/bin/bash")).stdout
    finally:
        await box.close()
    return {"/bin/bash", "/usr/bin/bash", *(w for w in out.split() if w.startswith("/"))}


def _bash_layer(rootfs: Path, paths: set[str]) -> bytes:
    """Layer 1: a minimal image (bash and its libraries, copied from the base) plus files to delete."""
    entries = []
    for rel in sorted(set().union(*(_closure(rootfs, p) for p in paths))):
        full = rootfs / rel
        if full.is_symlink():
            entries.append((rel, "symlink", os.readlink(full)))
        elif full.is_dir():
            entries.append((rel, "dir", ""))
        else:
            entries.append((rel, "exe" if os.access(full, os.X_OK) else "file", full.read_bytes()))
    entries[0:0] = [("data", "dir", ""), ("opq", "dir", "")]
    entries += [("data/old.txt", "file", "old\n"), ("data/kept.txt", "file", "kept\n"),
                ("opq/a.txt", "file", "a\n"), ("opq/sub", "dir", ""), ("opq/sub/b.txt", "file", "b\n"),
                ("data/hard.txt", "link", "data/kept.txt")]
    return _tar(entries)


SECOND = [("data/.wh.old.txt", "file", ""), ("data/new.txt", "file", "new\n"),
          ("opq/new.txt", "file", "fresh\n"), ("opq/.wh..wh..opq", "file", "")]
CONFIG = {"architecture": "amd64", "os": "linux",
          "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hi there"], "WorkingDir": "/data"}}


@pytest.mark.parametrize("form", ["oci-archive", "oci-layout"])
def test_oci_image_layers_apply_in_order_with_whiteouts(import_store, import_backend, store, backend, base_image,
                                                        tmp_path, form):
    rootfs = store.root / store.base_key() / "rootfs"
    first = _bash_layer(rootfs, run(_bash_paths(backend, base_image)))
    layout = _oci_layout(tmp_path / "layout", [(first, LAYER_TAR), (_tar(SECOND, compress=True), LAYER_TAR + "+gzip")],
                         CONFIG)
    source = layout
    if form == "oci-archive":
        source = tmp_path / "image.tar"
        with tarfile.open(source, "w") as tar:
            for child in sorted(layout.iterdir()):
                tar.add(child, arcname=child.name)
    meta = import_image(import_store.root, "t/oci:1", source, lambda _: None)
    assert meta["kind"] == form and meta["layers"] == 2
    dockerfile = tmp_path / "task" / "environment" / "Dockerfile"
    dockerfile.parent.mkdir(parents=True)
    dockerfile.write_text("FROM t/oci:1\nRUN echo built > /data/built.txt\n")

    async def go():
        image = await import_store.image(dockerfile, import_backend)
        box = await import_backend.create(spec(image))
        try:
            return image, await box.exec(
                'pwd; echo "$GREETING"; echo /data/* /opq/*; '
                'echo "$(</data/new.txt)$(</opq/new.txt)$(</data/hard.txt)"; '
                "[ -O /data/kept.txt ] && [ -O /usr/bin/bash ] && echo root-owned; echo $(</data/built.txt)")
        finally:
            await box.close()

    image, r = run(go())
    assert r.stdout == ("/data\nhi there\n/data/built.txt /data/hard.txt /data/kept.txt /data/new.txt /opq/new.txt\n"
                        "newfreshkept\nroot-owned\nbuilt\n"), r
    assert image.note.startswith("t/oci:1: imported by hand")
    if os.geteuid() == 0:  # on disk the store's files are root's; the sandbox sees them through id-mapped views
        tree = import_store.root / meta_dir(import_store, "t/oci:1") / f"rootfs-{meta['id']}"
        assert (tree / "data/kept.txt").stat().st_uid == 0
    # a re-import is a new image: layers built on the old one are not reused
    import_image(import_store.root, "t/oci:1", source, lambda _: None)
    import_store._resolved.clear()
    assert run(import_store.image(dockerfile, import_backend)).digest != image.digest


def test_rootfs_directory_import_serves_a_dockerfile(import_store, store, tmp_path, monkeypatch, capsys):
    rootfs = store.root / store.base_key() / "rootfs"
    monkeypatch.setenv("FURLONG_CACHE", str(import_store.root.parent / "test-imports-cli"))
    assert main(["image", "import", "mydebian:copy", str(rootfs)]) == 0  # through the command, as a user would
    cli_store = ImageStore()
    backend = BwrapBackend(layers=cli_store)  # the imported image's layers are in the command's store
    dockerfile = tmp_path / "task" / "environment" / "Dockerfile"
    dockerfile.parent.mkdir(parents=True)
    dockerfile.write_text("FROM mydebian:copy\nWORKDIR /app\nRUN cat /etc/debian_version > v.txt && id -u > u.txt\n")

    async def go():
        image = await cli_store.image(dockerfile, backend)
        box = await backend.create(spec(image))
        try:
            return await box.exec("cat v.txt u.txt; stat -c %U /etc/passwd /usr/bin/bash")
        finally:
            await box.close()

    try:
        r = run(go())
        assert r.stdout.startswith("12.") and r.stdout.endswith("\n0\nroot\nroot\n"), r
        capsys.readouterr()
        assert main(["image", "list"]) == 0
        assert f"mydebian:copy\timported from {rootfs} (rootfs-dir)" in capsys.readouterr().out
        assert main(["image", "import", "other", str(tmp_path / "missing")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {tmp_path / 'missing'}: no such file or directory"]
    finally:
        shutil.rmtree(cli_store.root.parent, ignore_errors=True)


def test_rootfs_tarball_keeps_absolute_symlinks_and_drops_devices(import_store, tmp_path):
    source = tmp_path / "rootfs.tar.gz"
    source.write_bytes(_tar([("usr/bin/bash", "file", "#!fake\n"), ("bin", "symlink", "usr/bin"),
                             ("etc/localtime", "symlink", "/usr/share/zoneinfo/Etc/UTC"),
                             ("dev/sda", "chr", "")], compress=True))
    meta = import_image(import_store.root, "tiny", source, lambda _: None)
    tree = import_store.root / meta_dir(import_store, "tiny") / f"rootfs-{meta['id']}"
    assert meta["kind"] == "rootfs-tar" and meta["skipped_devices"] == 1 and not (tree / "dev/sda").exists()
    assert os.readlink(tree / "etc/localtime") == "/usr/share/zoneinfo/Etc/UTC"


def _layout_with(tmp_path: Path, layer: bytes, media: str = LAYER_TAR) -> Path:
    return _oci_layout(tmp_path / "bad", [(_tar([("usr/bin/bash", "file", "x")]), LAYER_TAR), (layer, media)], CONFIG)


@pytest.mark.parametrize("case, words", [
    ("missing", "no such file or directory"),
    ("not-layout", "not an OCI layout"),
    ("dotdot", "leaves the image root"),
    ("symlink", "goes through the symlink /escape -> "),
    ("media", "unsupported media type 'application/vnd.oci.image.layer.v1.tar+zstd'"),
    ("no-bash", "has no /bin/bash"),
    ("name", "image name 'bad name'"),
])
def test_bad_sources_are_one_line_errors(import_store, tmp_path: Path, case: str, words: str):
    outside = tmp_path / "outside"
    outside.mkdir()
    name, source = "bad", {
        "missing": lambda: tmp_path / "nope.tar",
        "not-layout": lambda: (tmp_path / "index.json").write_text("{oops") and tmp_path,
        "dotdot": lambda: _layout_with(tmp_path, _tar([("a/../../evil", "file", "x")])),
        "symlink": lambda: _layout_with(tmp_path, _tar([("escape", "symlink", str(outside)),
                                                        ("escape/pwned", "file", "x")])),
        "media": lambda: _layout_with(tmp_path, b"zstd?", LAYER_TAR + "+zstd"),
        "no-bash": lambda: _oci_layout(tmp_path / "nobash", [(_tar([("etc", "dir", "")]), LAYER_TAR)], CONFIG),
        "name": lambda: tmp_path,
    }[case]()
    if case == "name":
        name = "bad name"
    with pytest.raises((ImageImportError, UnpackError)) as err:
        import_image(import_store.root, name, source, lambda _: None)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not list(outside.iterdir()), "a layer wrote outside the image"
    assert not list(import_store.root.glob("import-*.tmp*")), "a failed import left its temp directory"
