"""A Dockerfile's USER: resolved to ids from the image's own /etc/passwd and /etc/group, read through the
layers as the sandbox's overlay shows them (whiteouts, opaque directories, symlinks kept inside the
image); carried into ImageRef.user by buildah (a USER other than root) and by the native builder (USER root,
or the FROM image's USER under ENV/COPY steps); a USER the image cannot honour is a build error naming the
line; USER is part of the image's key."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest
import skips
from conftest import run
from test_image_import import LAYER_TAR, _bash_layer, _bash_paths, _oci_layout

from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageBuildError, ImageStore
from furlong.sandbox.images.imports import import_image
from furlong.sandbox.runtime.users import ROOT, Identity, UserError, resolve_user

PASSWD = "root:x:0:0:root:/root:/bin/bash\nworker:x:1000:1000::/home/worker:/bin/bash\n"
GROUP = "root:x:0:\nworker:x:1000:\nstaff:x:50:worker,other\n"
# a user made without useradd (whose chown furlong's layers would not keep): only the two files change
ADD_WORKER = ("RUN echo 'worker:x:1000:1000::/home/worker:/bin/bash' >> /etc/passwd "
              "&& echo 'worker:x:1000:' >> /etc/group")
needs_root = skips.needs_root("whiteouts and trusted.* xattrs need root")


def _layer(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _dockerfile(tmp_path: Path, text: str) -> Path:
    env = tmp_path / "task" / "environment"
    env.mkdir(parents=True, exist_ok=True)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


@pytest.mark.parametrize("user, expected", [
    ("", ROOT),
    ("worker", Identity(1000, 1000, "/home/worker", "worker", (50,))),
    ("1000", Identity(1000, 1000, "/home/worker", "worker", (50,))),  # a uid with an entry takes its gid and home
    ("worker:staff", Identity(1000, 50, "/home/worker", "worker")),  # an explicit group: no supplementary ones
    ("worker:0", Identity(1000, 0, "/home/worker", "worker")),
    ("1234", Identity(1234, 0, "/", "")),  # a bare uid needs no entry: gid 0 and home /, as Docker
    ("1234:77", Identity(1234, 77, "/", "")),
    ("65535", Identity(65535, 0, "/", "")),
    ("root", Identity(0, 0, "/root", "root")),
])
def test_user_forms_resolve_like_docker(tmp_path: Path, user: str, expected: Identity):
    layer = _layer(tmp_path / "l", {"etc/passwd": PASSWD, "etc/group": GROUP})
    assert resolve_user(user, [layer]) == expected


@pytest.mark.parametrize("user, words", [
    ("nobody", "USER nobody: no such user in the image's /etc/passwd"),
    ("worker:wheel", "USER worker:wheel: no such group 'wheel' in the image's /etc/group"),
    ("65536", "USER 65536: id 65536 is outside 0..65535, the ids a sandbox maps"),
    ("1000:70000", "id 70000 is outside 0..65535"),
    ("worker:", "expected name, name:group, uid or uid:gid"),
    (":staff", "expected name, name:group, uid or uid:gid"),
])
def test_a_user_the_image_cannot_honour_is_one_line(tmp_path: Path, user: str, words: str):
    layer = _layer(tmp_path / "l", {"etc/passwd": PASSWD + "big:x:70000:70000::/:/bin/sh\n", "etc/group": GROUP})
    with pytest.raises(UserError) as err:
        resolve_user(user, [layer])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_passwd_entry_out_of_range_is_refused(tmp_path: Path):
    layer = _layer(tmp_path / "l", {"etc/passwd": "big:x:70000:1::/:/bin/sh\n"})
    with pytest.raises(UserError, match="id 70000 is outside 0..65535"):
        resolve_user("big", [layer])


def test_an_image_without_passwd_takes_uids_only(tmp_path: Path):
    layer = _layer(tmp_path / "l", {"bin/sh": ""})
    assert resolve_user("1000:1000", [layer]) == Identity(1000, 1000, "/", "")
    with pytest.raises(UserError, match="the image has no /etc/passwd"):
        resolve_user("worker", [layer])


def test_the_top_layer_wins(tmp_path: Path):
    lower = _layer(tmp_path / "lower", {"etc/passwd": "worker:x:1:1::/old:/bin/sh\n", "etc/group": GROUP})
    upper = _layer(tmp_path / "upper", {"etc/passwd": PASSWD})  # the group file comes from below
    assert resolve_user("worker", [upper, lower]) == Identity(1000, 1000, "/home/worker", "worker", (50,))
    assert resolve_user("worker", [lower]).home == "/old"


@needs_root
def test_a_whiteout_and_an_opaque_directory_hide_the_lower_files(tmp_path: Path):
    lower = _layer(tmp_path / "lower", {"etc/passwd": PASSWD, "etc/group": GROUP})
    deleted = tmp_path / "deleted"
    (deleted / "etc").mkdir(parents=True)
    os.mknod(deleted / "etc/passwd", 0o600 | 0o020000, os.makedev(0, 0))  # overlay's whiteout
    with pytest.raises(UserError, match="the image has no /etc/passwd"):
        resolve_user("worker", [deleted, lower])
    whole = tmp_path / "whole"  # /etc deleted, a file in its place: nothing below shows through
    _layer(whole, {"etc": "not a directory"})
    with pytest.raises(UserError, match="the image has no /etc/passwd"):
        resolve_user("worker", [whole, lower])
    opaque = _layer(tmp_path / "opaque", {"etc/hostname": "box\n"})
    os.setxattr(opaque / "etc", "trusted.overlay.opaque", b"y")
    with pytest.raises(UserError, match="the image has no /etc/passwd"):
        resolve_user("worker", [opaque, lower])
    os.removexattr(opaque / "etc", "trusted.overlay.opaque")  # a plain directory merges with the one below
    assert resolve_user("worker", [opaque, lower]).uid == 1000


def test_symlinks_resolve_inside_the_image_never_on_the_host(tmp_path: Path):
    """An image's /etc/passwd (or /etc) that is a symlink is followed against the image's root, as in a
    chroot: a link aimed at the host's files, absolute or through `..`, reads the image's file of that
    name, never the host's."""
    host = _layer(tmp_path / "host", {"etc/passwd": "hostonly:x:4242:4242::/h:/bin/sh\n"})
    real = _layer(tmp_path / "real", {"usr/share/base/passwd": PASSWD, "etc/group": GROUP})
    (real / "etc/passwd").symlink_to("../usr/share/base/passwd")
    assert resolve_user("worker", [real]).uid == 1000
    for target in (str(host / "etc/passwd"), "../../../../../../.." + str(host / "etc/passwd")):
        escape = tmp_path / f"escape{len(target)}"
        (escape / "etc").mkdir(parents=True)
        (escape / "etc/passwd").symlink_to(target)
        with pytest.raises(UserError, match="the image has no /etc/passwd"):  # resolved in the image: none there
            resolve_user("hostonly", [escape])
        _layer(escape, {str(host / "etc/passwd").lstrip("/"): PASSWD})  # the same path inside the image
        assert resolve_user("worker", [escape]).uid == 1000
    linked_dir = tmp_path / "linked"
    linked_dir.mkdir()
    (linked_dir / "etc").symlink_to(host / "etc")  # a whole /etc pointing at the host's
    with pytest.raises(UserError, match="the image has no /etc/passwd"):
        resolve_user("hostonly", [linked_dir])
    loop = tmp_path / "loop"
    (loop / "etc").mkdir(parents=True)
    (loop / "etc/passwd").symlink_to("/etc/passwd")
    with pytest.raises(UserError, match="too many symlinks"):
        resolve_user("worker", [loop])


def test_a_user_other_than_root_routes_to_buildah(tmp_path: Path):
    """The native build sandbox maps one uid, so a RUN that chowns to another user fails there: a Dockerfile
    naming a USER other than root goes to buildah, and so does a RUN or WORKDIR as the FROM image's USER."""
    cases = {
        f"FROM debian:bookworm\n{ADD_WORKER}\nUSER worker\n": ":3: USER worker (not root)",
        "FROM debian:bookworm\nUSER 1000:1000\n": ":2: USER 1000:1000 (not root)",
        "FROM debian:bookworm\nUSER root\nRUN true\nUSER 0\nWORKDIR /a\n": None,
    }
    for text, reason in cases.items():
        why = df.outside_subset(_dockerfile(tmp_path, text))
        assert why is None if reason is None else (why is not None and why.endswith(reason)), (text, why)
    steps = df.parse(_dockerfile(tmp_path, "FROM debian:bookworm\nENV A=1\nRUN true\n"))
    assert df.step_as_user(steps, "") is None and df.step_as_user(steps, "worker") == steps[2]
    assert df.step_as_user(steps[:2], "worker") is None  # ENV (or COPY) alone does not depend on the user
    with pytest.raises(df.DockerfileError, match="USER takes one user"):
        df.parse(_dockerfile(tmp_path, "FROM debian:bookworm\nUSER a b\n"))


def test_native_builder_keeps_user_root_in_the_key(store: ImageStore, backend, tmp_path: Path):
    plain = run(store.image(_dockerfile(tmp_path / "a", "FROM debian:bookworm\nENV A=1\n"), backend))
    rooted = run(store.image(_dockerfile(tmp_path / "b", "FROM debian:bookworm\nENV A=1\nUSER root\n"), backend))
    assert (plain.user, rooted.user) == ("", "root") and plain.digest != rooted.digest
    assert store.check_user(rooted, "x") == ROOT
    meta = json.loads((store.root / rooted.digest / "meta.json").read_text())
    assert meta["builder"] == "furlong" and meta["user"] == "root"


def _user_layer(user_files: dict[str, str]) -> bytes:
    """A layer with /etc's passwd and group and a world-writable /tmp (modes kept, unlike _tar's)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mode in (("etc", 0o755), ("tmp", 0o1777)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        for name, text in user_files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text.encode()), 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


@pytest.fixture(scope="module")
def user_import(store, backend, base_image, tmp_path_factory):
    """A store of its own holding imported images whose config sets USER: `t/user:1` (worker, in its
    passwd) and `t/ghost:1` (no such user); bash and its libraries only, from the base."""
    root = store.root.parent / f"test-imports-users-{os.getpid()}"
    import_store = ImageStore(root=root)
    rootfs = store.root / store.base_key() / "rootfs"
    bash = _bash_layer(rootfs, run(_bash_paths(backend, base_image)))
    files = _user_layer({"etc/passwd": PASSWD, "etc/group": GROUP})
    for name, user in (("t/user:1", "worker"), ("t/ghost:1", "ghost")):
        config = {"architecture": "amd64", "os": "linux", "config": {"User": user, "WorkingDir": "/"}}
        layout = _oci_layout(tmp_path_factory.mktemp("layout"), [(bash, LAYER_TAR), (files, LAYER_TAR)], config)
        import_image(import_store.root, name, layout, lambda _: None)
    yield import_store
    shutil.rmtree(root, ignore_errors=True)


def test_from_an_image_with_a_user_inherits_it(user_import: ImageStore, tmp_path: Path):
    """An image FROM names keeps its USER: ENV/COPY steps build natively under it, a RUN goes to buildah
    (it runs there as that user), and a USER the image lacks fails the build naming the FROM line."""
    backend = BwrapBackend(layers=user_import)
    native = run(user_import.image(_dockerfile(tmp_path / "n", "FROM t/user:1\nENV A=1\n"), backend))
    meta = json.loads((user_import.root / native.digest / "meta.json").read_text())
    assert meta["builder"] == "furlong" and native.user == "worker"
    assert user_import.check_user(native, "x") == Identity(1000, 1000, "/home/worker", "worker", (50,))
    ghost = _dockerfile(tmp_path / "g", "FROM t/ghost:1\nENV A=1\n")
    with pytest.raises(ImageBuildError) as err:
        run(user_import.image(ghost, backend))
    assert str(err.value) == f"{ghost}:1: FROM t/ghost:1: USER ghost: no such user in the image's /etc/passwd"
    if shutil.which("buildah") is None:
        return
    path = _dockerfile(tmp_path / "b", 'FROM t/user:1\nRUN ["/bin/bash", "-c", "echo $UID > /tmp/uid"]\n')
    built = run(user_import.image(path, backend))
    meta = json.loads((user_import.root / built.digest / "meta.json").read_text())
    assert meta["builder"] == "buildah" and built.user == "worker"
    assert (user_import.root / built.layers[0].path / "tmp/uid").read_text() == "1000\n"


def test_the_agent_runs_as_the_user_with_its_supplementary_groups(user_import: ImageStore, tmp_path: Path):
    """As Docker runs USER worker: uid and gid 1000 and the groups /etc/group lists worker in (staff, 50)."""
    backend = BwrapBackend(layers=user_import)
    if backend.subids is None:
        pytest.skip("sandboxes here have one uid: a USER other than root cannot run")
    image = run(user_import.image(_dockerfile(tmp_path / "g", "FROM t/user:1\nENV A=1\n"), backend))

    async def go():
        box = await backend.create(SandboxSpec(image=image))
        try:
            return await box.exec('echo $UID; while read -r k v; do case $k in Gid:|Groups:) echo "$k $v";; esac; '
                                  "done < /proc/self/status")
        finally:
            await box.close()

    res = run(go())
    assert res.ok and res.stdout.split("\n")[:3] == ["1000", "Gid: 1000\t1000\t1000\t1000", "Groups: 50"], res


def test_buildah_carries_the_user_and_runs_later_steps_as_it(store: ImageStore, backend, tmp_path: Path):
    trailing = _dockerfile(tmp_path / "t", f"FROM debian:bookworm\n{ADD_WORKER}\nUSER worker\n")
    ref = run(store.image(trailing, backend))
    meta = json.loads((store.root / ref.digest / "meta.json").read_text())
    assert meta["builder"] == "buildah" and ref.user == "worker" and "not honoured" not in ref.note
    dirs = [store.root / layer.path for layer in ref.layers]
    assert resolve_user(ref.user, dirs) == Identity(1000, 1000, "/home/worker", "worker")
    by_uid = run(store.image(_dockerfile(tmp_path / "u", f"FROM debian:bookworm\n{ADD_WORKER}\nUSER 1000\n"), backend))
    assert by_uid.user == "1000" and by_uid.digest != ref.digest  # only USER differs: the key does too
    path = _dockerfile(tmp_path / "r", f"FROM debian:bookworm\n{ADD_WORKER}\nUSER 1000:1000\n"
                                       "RUN id -u > /tmp/built-as && id -g >> /tmp/built-as\n")
    numeric = run(store.image(path, backend))
    assert numeric.user == "1000:1000"
    assert store.check_user(numeric, "x") == Identity(1000, 1000, "/home/worker", "worker")
    assert (store.root / numeric.layers[0].path / "tmp/built-as").read_text() == "1000\n1000\n"


def test_buildah_refuses_a_user_the_image_lacks(store: ImageStore, backend, tmp_path: Path):
    path = _dockerfile(tmp_path, "FROM debian:bookworm\nLABEL a=b\nUSER ghost\n")
    with pytest.raises(ImageBuildError) as err:
        run(store.image(path, backend))
    assert str(err.value) == f"{path}: USER ghost: no such user in the image's /etc/passwd"
