"""FROM any image reference: pulled with skopeo from a real registry on loopback (Debian's docker-registry,
seeded with images made from the base rootfs), cached by digest, used offline once cached."""

from __future__ import annotations

import base64
import json
import logging
import platform
import shutil
import time
from pathlib import Path

import pytest
from rich.console import Console

from conftest import run, spec
from furlong.cli import main
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.run import run_eval
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageBuildError, ImageStore
from furlong.sandbox.images.registry import Reference, Registry, RegistryError, Settings
from furlong.tasks.loader import load_task
from furlong.tasks.model import Task
from registry_support import LocalRegistry, free_port, oci_from_rootfs, push

ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
OTHER = "arm64" if ARCH == "amd64" else "amd64"
QUIET = Console(quiet=True)


def noop(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def reg_store(store: ImageStore):
    """A store of its own (tests never touch the user's pulls), reachable by the sandbox uid."""
    root = store.root.parent / "test-registry" / "images"
    shutil.rmtree(root.parent, ignore_errors=True)
    yield ImageStore(root=root)
    shutil.rmtree(root.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def backend(reg_store: ImageStore) -> BwrapBackend:
    """This module's images live in its own store, so its sandboxes find their layers there."""
    return BwrapBackend(layers=reg_store)


@pytest.fixture(scope="module")
def seeded(local_registry: LocalRegistry, store: ImageStore, base_image, tmp_path_factory) -> dict:
    """test/img:1 (this machine's platform, /extra says "extra") and test/multi:1 (two platforms, /extra
    says which), each the whole base rootfs plus a one-file layer, pushed with skopeo."""
    rootfs = store.root / store.base_key() / "rootfs"
    work = tmp_path_factory.mktemp("seed")
    started = time.monotonic()
    push(oci_from_rootfs(rootfs, work / "single", {ARCH: "extra\n"}), f"{local_registry.host}/test/img:1")
    push(oci_from_rootfs(rootfs, work / "multi", {ARCH: "host\n", OTHER: "other\n"}),
         f"{local_registry.host}/test/multi:1", all_platforms=True)
    print(f"\nseeding two images (282 MB rootfs each, skopeo gzips on push): {time.monotonic() - started:.1f} s")
    shutil.rmtree(work, ignore_errors=True)
    return {"img": f"{local_registry.host}/test/img:1", "multi": f"{local_registry.host}/test/multi:1"}


def _dockerfile(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name / "environment" / "Dockerfile"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


async def _build_and_exec(store: ImageStore, backend, dockerfile: Path, cmd: str):
    image = await store.image(dockerfile, backend)
    box = await backend.create(spec(image))
    try:
        return image, await box.exec(cmd)
    finally:
        await box.close()


@pytest.mark.parametrize("ref, canonical, loopback", [
    ("ubuntu", "docker.io/library/ubuntu:latest", False),
    ("python:3.12-slim", "docker.io/library/python:3.12-slim", False),
    ("library/python:3.12", "docker.io/library/python:3.12", False),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "ghcr.io/laude-institute/t-bench/python-3-13:20250620",
     False),
    ("public.ecr.aws/docker/library/python:3.11-slim", "public.ecr.aws/docker/library/python:3.11-slim", False),
    ("localhost:5000/x", "localhost:5000/x:latest", True),
    ("127.0.0.1:5000/a/b:1@sha256:" + "a" * 64, "127.0.0.1:5000/a/b@sha256:" + "a" * 64, True),
])
def test_references_normalise_as_docker_does(ref: str, canonical: str, loopback: bool):
    parsed = Reference.parse(ref)
    assert parsed is not None and parsed.canonical == canonical and parsed.loopback == loopback


@pytest.mark.parametrize("ref", ["Ubuntu:24.04", "a:b:c", "x@sha256:abc", "x y", ""])
def test_malformed_references_are_one_line_errors(tmp_path: Path, ref: str):
    with pytest.raises(RegistryError) as err:
        Registry(tmp_path).image(ref, noop)
    assert "not an image reference" in str(err.value) and "\n" not in str(err.value)


def test_from_a_registry_builds_and_runs(reg_store, backend, local_registry, seeded, tmp_path):
    dockerfile = _dockerfile(tmp_path, "task", f"FROM {seeded['img']}\nRUN cat /extra > copied\n")
    started = time.monotonic()
    image, res = run(_build_and_exec(reg_store, backend, dockerfile,
                                     "cat copied /extra; echo $SEEDED; pwd; stat -c %U /usr/bin/bash"))
    digest = reg_store.registry.refs()[seeded["img"]]
    meta = reg_store.registry.stored(digest)
    print(f"\npull + import of {seeded['img']}: {meta['seconds']} s; with the task layer and a sandbox: "
          f"{time.monotonic() - started:.1f} s")
    assert res.ok and res.stdout == "extra\nextra\nyes\n/root\nroot\n", res
    assert image.note == f"{seeded['img']}: pulled, {digest}"
    assert meta["ref"] == seeded["img"] and meta["manifest"] == digest


def test_cached_images_work_offline_and_by_digest(reg_store, backend, local_registry, seeded, tmp_path, caplog):
    first = reg_store.registry.image(seeded["img"], noop)  # pulled here if this test runs alone
    digest = first["digest"]
    local_registry.stop()  # from here on, any pull would fail: what follows comes from the cache
    try:
        fresh = ImageStore(root=reg_store.root)  # another run: no in-process memory of the first
        started = time.monotonic()
        again = fresh.registry.image(seeded["img"], noop)
        print(f"\ncached resolution of {seeded['img']}: {(time.monotonic() - started) * 1000:.1f} ms")
        assert again["id"] == first["id"]  # the same unpacked tree, not a second pull
        name = seeded["img"].rsplit(":", 1)[0]
        pinned = _dockerfile(tmp_path, "pinned", f"FROM {name}@{digest}\nRUN cat /extra > copied\n")
        _, res = run(_build_and_exec(fresh, backend, pinned, "cat copied"))
        assert res.stdout == "extra\n", res

        missing = _dockerfile(tmp_path, "missing", f"# no such image\nFROM {local_registry.host}/test/other:1\n")
        with pytest.raises(ImageBuildError) as err:
            run(fresh.image(missing, backend))
        text = str(err.value)
        assert text.startswith(f"{missing}:2: FROM {local_registry.host}/test/other:1: registry ") and "\n" not in text
        assert "unreachable" in text and f"furlong image import {local_registry.host}/test/other:1" in text

        with caplog.at_level(logging.WARNING, logger="furlong.sandbox.images.registry"):
            refreshed = fresh.registry.image(seeded["img"], noop, refresh=True)  # `image pull`: asks, then falls back
        assert refreshed["id"] == first["id"]
        assert [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()][0].startswith(
            f"{seeded['img']}: registry unreachable (")
    finally:
        local_registry.start()


def test_image_pull_prints_the_digest_and_list_shows_it(reg_store, local_registry, seeded, monkeypatch, capsys):
    monkeypatch.setenv("FURLONG_CACHE", str(reg_store.root.parent))
    assert main(["image", "pull", seeded["img"]]) == 0
    digest = reg_store.registry.refs()[seeded["img"]]
    assert capsys.readouterr().out == f"{seeded['img']}\t{digest}\n"
    assert main(["image", "list"]) == 0
    assert f"pulled {seeded['img']}\t{digest}\t(host)" in capsys.readouterr().out
    assert main(["image", "pull", f"{local_registry.host}/test/nothing:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "test/nothing:1" in err[0] and "manifest unknown" in err[0], err


def test_multi_platform_images_get_this_machines_platform(reg_store, local_registry, seeded):
    registry = reg_store.registry
    meta = registry.image(seeded["multi"], noop)
    assert (registry.rootfs(meta) / "extra").read_text() == "host\n"
    assert meta["digest"] != meta["manifest"]  # the list's digest names the image; the manifest is one platform's
    name = seeded["multi"].rsplit(":", 1)[0]
    assert registry.image(f"{name}@{meta['digest']}", noop)["id"] == meta["id"]  # by either digest, no pull
    assert registry.image(f"{name}@{meta['manifest']}", noop)["id"] == meta["id"]
    other = registry.image(seeded["multi"], noop, refresh=True, platform=f"linux/{OTHER}")
    assert (registry.rootfs(other) / "extra").read_text() == "other\n" and other["id"] != meta["id"]


def _htpasswd(path: Path, user: str, password: str) -> Path:
    """A bcrypt htpasswd line (the registry accepts only bcrypt), made with the C library's crypt."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import crypt
        except ImportError:
            pytest.skip("making a bcrypt htpasswd entry needs Python's crypt module (removed in 3.13)")
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        pytest.skip("this C library's crypt makes no bcrypt hashes")
    path.write_text(f"{user}:{hashed}\n")
    return path


def test_private_registry_is_pulled_with_the_auth_file(local_registry, seeded, tmp_path):
    private = LocalRegistry(tmp_path, local_registry.storage, _htpasswd(tmp_path / "htpasswd", "u", "pw")).start()
    try:
        ref = f"{private.host}/test/img:1"
        with pytest.raises(RegistryError) as err:
            Registry(tmp_path / "cache", Settings()).image(ref, noop)
        assert "authentication required" in str(err.value) and "\n" not in str(err.value)
        auth = tmp_path / "auth.json"  # the containers-auth.json format skopeo and podman read
        auth.write_text(json.dumps({"auths": {private.host: {"auth": base64.b64encode(b"u:pw").decode()}}}))
        meta = Registry(tmp_path / "cache", Settings(auth_file=auth)).image(ref, noop)
        assert (Registry(tmp_path / "cache").rootfs(meta) / "extra").read_text() == "extra\n"
    finally:
        private.stop()


def _prebuilt_task(root: Path, name: str, image: str, dockerfile: str | None = None) -> Task:
    """A Harbor task naming a prebuilt image: solved when /tmp/solved exists and the image's /extra is there."""
    d = root / name
    for sub in ("tests", "solution", "environment"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text(f'[environment]\ndocker_image = "{image}"\n')
    (d / "instruction.md").write_text("Solve it.\n")
    (d / "tests" / "test.sh").write_text("test -f /tmp/solved && test -s /extra && echo 1 > /logs/verifier/reward.txt"
                                         " || echo 0 > /logs/verifier/reward.txt\n")
    (d / "solution" / "solve.sh").write_text("touch /tmp/solved\n")
    if dockerfile:
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    return load_task(d)


def test_docker_image_tasks_run_on_the_pulled_image_else_their_dockerfile_else_one_line(
        reg_store, backend, local_registry, seeded, tmp_path):
    """Harbor's [environment] docker_image: pulled from the registry (cached by digest); where its registry
    cannot be reached and it is not cached, the task's own Dockerfile; with neither, the episode's one-line
    infra_error naming the setting. Never furlong's default base."""
    gone = f"127.0.0.1:{free_port()}/test/img:1"  # nothing listens there: the registry is unreachable
    # the fallback Dockerfile builds on the seeded image (cached by the first task), not on a base this
    # module's store would have to bootstrap
    tasks = [_prebuilt_task(tmp_path, "pulled", seeded["img"]),
             _prebuilt_task(tmp_path, "built", gone, f"FROM {seeded['img']}\nRUN echo built > /extra\n"),
             _prebuilt_task(tmp_path, "neither", gone)]
    assert tasks[0].image_source.dockerfile is None and tasks[1].image_source.dockerfile is not None
    oracle = {r.task: r for r in run(run_eval(tasks, OracleAgent(), backend, reg_store, 3, None, QUIET))}
    noop = {r.task: r for r in run(run_eval(tasks, NoopAgent(), backend, reg_store, 3, None, QUIET))}
    for name in ("pulled", "built"):
        assert (oracle[name].reward, oracle[name].status) == (1.0, "ok"), oracle[name].error
        assert (noop[name].reward, noop[name].status) == (0.0, "ok"), noop[name].error
    digest = reg_store.registry.refs()[seeded["img"]]
    assert oracle["pulled"].image_note == f"{seeded['img']}: pulled, {digest}"
    assert oracle["built"].image_note.startswith(f"{gone}: not pulled (registry 127.0.0.1:") and \
        f"built from {tasks[1].dockerfile} instead" in oracle["built"].image_note
    for res in (oracle["neither"], noop["neither"]):
        assert res.status == "infra_error" and res.reward is None and "\n" not in res.error, res
        assert "task 'neither': task.toml: environment.docker_image: " in res.error and \
            f"{gone}: registry 127.0.0.1:" in res.error and f"furlong image import {gone} OCI_ARCHIVE" in res.error
