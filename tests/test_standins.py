"""Stand-ins for official images by version (python, gcc, golang, node, rust, openjdk, eclipse-temurin): which
Debian release serves a tag, what its note says, the exact-mode refusal; and the offline shims of the verifier
toolchain (uv's installer, apt-get install curl) run by a real sh. Building every stand-in is slow and downloads
packages: bench/standins_check.py does that (bench/results/standins.json)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run, spec

from furlong.sandbox.images import offline_shims, standins
from furlong.sandbox.base import Prebuilt
from furlong.sandbox.images.builds import ImageBuildError
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.images.registry import RegistryError, Settings
from furlong.sandbox.images.standin_recipes import FAMILIES


@pytest.mark.parametrize("ref, name, suite, exact, words", [
    ("python:3.13-slim-bookworm", "python-3.13", "trixie", True, "Debian 13 (trixie), not Debian 12 (bookworm)"),
    ("python:3.12-slim", "python-3.13", "trixie", False,
     "the tag asks for Python 3.12 (nearest: Debian trixie's 3.13)"),
    ("python:3.14", "python-3.13", "trixie", False, "asks for Python 3.14"),
    ("python:3", "python", "bookworm", True, "(Python 3.11.2, Debian bookworm's python3"),
    ("gcc:12.2.0-bookworm", "gcc-12", "bookworm", True, "(gcc 12.2.0, Debian bookworm's gcc"),
    ("gcc:13", "gcc-14", "trixie", False, "the tag asks for gcc 13 (nearest: Debian trixie's 14)"),
    # no gcc 13 anywhere: the tag's own Debian release (its apt pins are bookworm's), not trixie's gcc 14
    ("gcc:13.3.0-bookworm", "gcc-12", "bookworm", False, "the tag asks for gcc 13.3.0 (nearest: Debian bookworm's 12)"),
    ("python:3.12-slim-bookworm", "python", "bookworm", False, "asks for Python 3.12 (nearest: Debian bookworm's 3.11)"),
    ("golang:1.22-bookworm", "golang-1.22", "bookworm", True, "bookworm-backports's golang-1.22-go"),
    ("golang:1.24.4", "golang-1.24", "trixie", True, "Go 1.24.4"),
    ("node:18-bookworm-slim", "node-18", "bookworm", True, "no yarn or corepack"),
    ("node:22", "node-20", "trixie", False, "buildpack-deps packages are not included"),
    ("rust:1.85-slim", "rust-1.85", "trixie", True, "no rustup"),
    ("docker.io/library/rust:1.63", "rust-1.63", "bookworm", True, "rustc and cargo"),
    ("eclipse-temurin:17-jdk-jammy", "jdk-17", "bookworm", True, "not Ubuntu 22.04 (jammy)"),
    ("eclipse-temurin:21-jre", "jdk-21", "trixie", True, "a JDK, where the tag asks for a JRE"),
    ("openjdk:17-jdk-slim", "jdk-17", "bookworm", True, "OpenJDK (default-jdk-headless)"),
])
def test_versioned_tags_map_to_the_release_debian_has(ref, name, suite, exact, words):
    choice = standins.resolve(ref)
    assert (choice.standin.name, choice.suite, choice.exact) == (name, suite, exact)
    provides = {"python": "3.11.2", "gcc-12": "12.2.0", "golang-1.24": "1.24.4"}.get(name, choice.standin.version)
    note = choice.note(provides)
    assert note.startswith(f"{ref}: furlong's {name} stand-in (") and words in note, note
    assert choice.registry_first == (not ref.startswith("python"))  # python stays stand-in first, as before


def test_nearest_takes_the_newer_of_two_as_near_and_exact_refuses_with_what_debian_has():
    family = FAMILIES["python"]
    assert [(o.version, e) for o, e in (standins.pick(family, v) for v in ("3.12", "3.10", "3.13.5", "3"))] == [
        ("3.13", False), ("3.11", False), ("3.13", True), ("3.11", True)]
    choice = standins.resolve("node:22-slim")
    assert choice.allowed("nearest") and not choice.allowed("exact")
    line = choice.refusal("exact")
    assert line.startswith("node:22-slim: Debian has no Node.js 22 (Debian has 18 (bookworm), 20 (trixie)") and \
        "\n" not in line
    for ref in ("golang:1.20", "golang:latest"):  # Go needs its release, whatever the mode
        go = standins.resolve(ref)
        assert not go.allowed("nearest") and "Go stand-ins need the exact release" in go.refusal("nearest")
    assert "1.23 (bookworm-backports)" in standins.resolve("golang:1.20").refusal("nearest")


def test_trixie_names_and_recipes():
    assert [standins.resolve(ref).suite for ref in ("debian:trixie-slim", "debian:13.1")] == ["trixie", "trixie"]
    assert standins.resolve("furlong/base-trixie").standin is None
    go = standins.resolve("golang:1.22").standin.dockerfile()
    assert go.startswith("FROM furlong/base\n") and "bookworm-backports main" in go and "ENV GOTOOLCHAIN=local" in go
    assert standins.resolve("python:3.13").standin.dockerfile().startswith("FROM furlong/base-trixie\n")


def test_exact_mode_is_one_line_naming_the_file_and_what_debian_has(store, backend, tmp_path: Path):
    """No base is built: the registry is asked first (here one that never answers in time, whatever this
    machine's network), then the refusal names the Dockerfile's line."""
    never = Settings(inspect_timeout_s=0.001)
    exact = ImageStore(root=store.root, pulls=never, standin_versions="exact")
    with pytest.raises(RegistryError, match=r"^python:3\.12-slim: Debian has no Python 3\.12 \(Debian has 3\.11"):
        run(exact.parent("python:3.12-slim", backend, lambda _: None))
    path = tmp_path / "t" / "environment" / "Dockerfile"
    path.parent.mkdir(parents=True)
    path.write_text("# a Go task\nFROM golang:1.20-bookworm\nRUN go version\n")
    nearest = ImageStore(root=store.root, pulls=never)
    with pytest.raises(ImageBuildError) as err:
        run(nearest.image(path, backend))
    assert str(err.value).startswith(f"{path}:2: FROM golang:1.20-bookworm: Debian has no Go 1.20") and \
        "\n" not in str(err.value)
    with pytest.raises(ValueError, match="images.standins"):
        ImageStore(root=store.root, standin_versions="closest")


@pytest.fixture
def shims(tmp_path: Path) -> Path:
    """The offline shims as the toolchain layer lays them out, under tmp_path."""
    where = tmp_path / "offline"
    where.mkdir()
    (where / "shim").write_text(offline_shims.shim().replace(offline_shims.DIR, str(where)))
    (where / "uv-installer.sh").write_text(offline_shims.installer("0.13.9"))
    for name in ("shim", "uv-installer.sh"):
        os.chmod(where / name, 0o755)
    for command in offline_shims.COMMANDS:
        (where / command).symlink_to("shim")
    return where


def _sh(shims: Path, script: str, cwd: Path, offline: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": f"{shims}:/usr/bin:/bin", "HOME": str(cwd / "home"), **({"FURLONG_OFFLINE": "1"} if offline else {})}
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_offline_shims_answer_uvs_installer_and_apt_get_install_curl(shims: Path, tmp_path: Path):
    script = ("set -e\napt-get install -y --no-install-recommends curl coreutils\n"
              "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nsource $HOME/.local/bin/env\n"
              "readlink $HOME/.local/bin/uv; echo ${PATH%%:*}\n"
              "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\n"  # again: changes nothing
              "curl -LsSfo a.sh https://astral.sh/uv/install.sh; wget -q https://astral.sh/uv/install.sh\n"
              "curl -LO https://github.com/astral-sh/uv/releases/download/0.9.5/uv-installer.sh\n"
              "wget -qO- https://astral.sh/uv/install.sh | head -1\n")
    res = _sh(shims, script, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    installed = f"uv 0.13.9 (furlong's verifier toolchain) is in {tmp_path}/home/.local/bin; astral.sh was not asked"
    assert res.stdout.splitlines() == [installed, "/opt/furlong/toolchain/bin/uv", f"{tmp_path}/home/.local/bin", installed,
                                       "#!/bin/sh"], res.stdout
    assert "curl coreutils: installed already, or curl answering uv's installer only" in res.stderr
    assert all((tmp_path / f).read_text() == offline_shims.installer("0.13.9")
               for f in ("a.sh", "install.sh", "uv-installer.sh"))


def test_online_the_shims_answer_uvs_installer_only(shims: Path, tmp_path: Path):
    """With network (no FURLONG_OFFLINE) apt-get is the image's own, which fetches what is asked; uv's installer
    is still the toolchain's uv (astral.sh may be out of reach, or out of the phase's allowlist)."""
    image = tmp_path / "image-bin"  # the image's apt-get, after the shims on PATH: it says what it was asked
    image.mkdir()
    (image / "apt-get").write_text('#!/bin/sh\necho "image apt-get $*"\n')
    os.chmod(image / "apt-get", 0o755)
    res = _sh(shims, f"PATH={shims}:{image}:$PATH; apt-get install -y curl; "
                     "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh", tmp_path, offline=False)
    assert res.returncode == 0 and res.stdout.splitlines()[0] == "image apt-get install -y curl", res.stdout + res.stderr
    assert res.stdout.splitlines()[1].endswith("astral.sh was not asked"), res.stdout


def test_offline_shims_leave_everything_else_to_the_image(shims: Path, tmp_path: Path):
    res = _sh(shims, "apt-get install -y no-such-package-furlong; echo rc=$?; apt-get --version | head -1; "
                     "wget --version >/dev/null 2>&1; echo wget=$?", tmp_path)
    assert "rc=100" in res.stdout and "\napt " in res.stdout, res.stdout + res.stderr
    wget_here = any(Path(d, "wget").exists() for d in ("/usr/bin", "/bin"))
    assert f"wget={0 if wget_here else 127}" in res.stdout


@pytest.mark.parametrize("ref, breaks", [
    ("eclipse-temurin:17.0.12_7-jdk-jammy", True),  # TB2's Kotlin tasks: `RUN pip3 install pytest==...` as root
    ("eclipse-temurin:17-jdk-focal", True),
    ("eclipse-temurin:21-jdk-noble", False),  # Ubuntu 24.04 marks its Python externally managed, as Debian does
    ("eclipse-temurin:17", False),  # a tag naming no release means noble
    ("openjdk:17-jdk-slim", False),
])
def test_a_tag_for_ubuntu_before_pep_668_lets_pip_install_into_the_system_python(ref, breaks):
    choice = standins.resolve(ref)
    env = dict(choice.standin.env)
    assert (env.get("PIP_BREAK_SYSTEM_PACKAGES") == "1") == breaks, env
    assert ("ENV PIP_BREAK_SYSTEM_PACKAGES=1" in choice.standin.dockerfile()) == breaks
    assert ("externally managed, PEP 668" in choice.note(choice.standin.version)) == breaks
    assert env["JAVA_HOME"] == "/usr/lib/jvm/default-java"  # the family's own env kept


@pytest.mark.parametrize("ref, mode, name, suite, words", [
    ("ubuntu:24.04", "nearest", "ubuntu-24.04", "trixie", "Ubuntu 24.04 (noble) has glibc 2.39, Python 3.12"),
    ("ubuntu:noble-20250404", "nearest", "ubuntu-24.04", "trixie", "the `ubuntu` user (uid 1000) exists"),
    ("docker.io/library/ubuntu:jammy", "nearest", "ubuntu-22.04", "bookworm", "works as on Ubuntu 22.04 (jammy)"),
    ("ubuntu:20.04", "nearest", "ubuntu-20.04", "bookworm", "Ubuntu 20.04 (focal) has glibc 2.31, Python 3.8"),
    ("ubuntu:24.04", "bookworm", "ubuntu-24.04", "bookworm", "images.ubuntu_standins=bookworm, not the nearest"),
    ("ubuntu:22.04@sha256:" + "a" * 64, "trixie", "ubuntu-22.04", "trixie", "a digest pins one build"),
])
def test_ubuntu_tags_map_to_the_nearest_debian_release_and_say_what_differs(ref, mode, name, suite, words):
    choice = standins.resolve(ref, mode)
    assert (choice.standin.name, choice.suite, choice.registry_first, choice.allowed("exact")) == (
        name, suite, True, True)
    note = choice.note("Debian 13.2: glibc 2.41, Python 3.13.5, gcc 14.2.0, OpenSSL 3.5.4")
    assert note.startswith(f"{ref}: furlong's {name} stand-in (Debian 13.2: glibc 2.41, Python 3.13.5, ") and \
        words in note and "\n" not in note, note
    for said in (f"apt's sources are Debian {suite}'s", "PPA", "/etc/os-release says Debian", "preinstalled"):
        assert said in note, note
    recipe = choice.standin.dockerfile()
    assert recipe.startswith(f"FROM {standins.base_name(suite)}\n") and "apt-get" not in recipe
    noble = name == "ubuntu-24.04"  # its user; jammy and focal: pip into the system Python, unminimize
    assert ("useradd --uid 1000 --user-group" in recipe) == noble
    assert ("ENV PIP_BREAK_SYSTEM_PACKAGES=1" in recipe and "/usr/local/sbin/unminimize" in recipe) == (not noble)


def test_ubuntu_tags_without_a_fixed_release_have_no_stand_in():
    """latest and rolling name whatever is newest when pulled (latest is 26.04 now): no stand-in is honest."""
    assert [standins.resolve(ref, "nearest") for ref in ("ubuntu", "ubuntu:latest", "ubuntu:rolling",
                                                        "ubuntu:18.04", "ubuntu:26.04")] == [None] * 5


def test_ubuntu_standins_off_is_one_line_naming_the_setting_and_the_alternatives(store, backend, tmp_path: Path):
    """The default: no base is built; the registry is asked first (one that never answers in time), then the
    line says what to turn on and how else to bring the image."""
    never = Settings(inspect_timeout_s=0.001)
    off = ImageStore(root=store.root, pulls=never)
    assert not standins.resolve("ubuntu:24.04").allowed("nearest")
    path = tmp_path / "t" / "environment" / "Dockerfile"
    path.parent.mkdir(parents=True)
    path.write_text("FROM ubuntu:24.04\nRUN apt-get update\n")
    with pytest.raises(ImageBuildError) as err:
        run(off.image(path, backend))
    line = str(err.value)
    assert line.startswith(f"{path}:1: FROM ubuntu:24.04: no registry serves it here") and "\n" not in line, line
    for said in ("images.ubuntu_standins=off; `nearest` builds one from Debian trixie",
                 "`furlong image import ubuntu:24.04 OCI_ARCHIVE`", "`furlong image pull ubuntu:24.04`"):
        assert said in line, line
    with pytest.raises(ValueError, match="images.ubuntu_standins: expected off or nearest or bookworm or trixie"):
        ImageStore(root=store.root, ubuntu_standins="on")


@pytest.fixture(scope="module")
def noble_task(store, backend, tmp_path_factory) -> tuple:
    """TB2's usual `FROM ubuntu:24.04` Dockerfile, built once on its stand-in over the cached bookworm base
    (images.ubuntu_standins=bookworm: CI bootstraps no trixie base; trixie's, the nearest, is built by
    bench/standins_check.py --only ubuntu). Returns the image, the stand-in's meta and the seconds."""
    ubuntu = ImageStore(root=store.root, ubuntu_standins="bookworm")
    path = tmp_path_factory.mktemp("noble") / "environment" / "Dockerfile"
    path.parent.mkdir(parents=True)
    path.write_text("FROM ubuntu:24.04\nENV DEBIAN_FRONTEND=noninteractive\n"
                    "RUN apt-get update && apt-get install -y python3 curl\nWORKDIR /app\n")
    started = time.monotonic()
    image = run(ubuntu.image(path, backend))
    standin = json.loads((store.root / image.layers[1].path).parent.joinpath("meta.json").read_text())
    return image, standin, time.monotonic() - started


def test_an_ubuntu_standin_builds_a_tb2_dockerfile(noble_task, backend):
    image, standin, seconds = noble_task
    print(f"\nubuntu:24.04 stand-in layer {standin['seconds']} s; with the task's layer {seconds:.1f} s")
    assert image.workdir == "/app" and image.note.startswith("ubuntu:24.04: furlong's ubuntu-24.04 stand-in "
                                                             "(Debian 12."), image.note
    assert standin["standin"] == "ubuntu-24.04" and standin["provides"].startswith("Debian 12.")
    assert "glibc 2.36, Python 3.11." in standin["provides"] and "gcc 12." in standin["provides"], standin

    async def check():
        box = await backend.create(spec(image))
        try:
            return await box.exec("id ubuntu; getent passwd ubuntu | cut -d: -f6,7; python3 --version; "
                                  "curl --version | head -1 | cut -d' ' -f1; pwd; . /etc/os-release; echo $ID; "
                                  "ls /usr/lib/python3*/EXTERNALLY-MANAGED")
        finally:
            await box.close()
    res = run(check())
    user, home, python, curl, cwd, distro, marker = res.stdout.splitlines()
    assert res.ok and user == "uid=1000(ubuntu) gid=1000(ubuntu) groups=1000(ubuntu)", res
    assert (home, curl, cwd, distro) == ("/home/ubuntu:/bin/bash", "curl", "/app", "debian"), res
    assert python.startswith("Python 3.11.") and marker.endswith("EXTERNALLY-MANAGED"), res  # noble has PEP 668


def test_a_docker_image_gets_the_ubuntu_standin_only_when_turned_on(noble_task, store, backend):
    """Harbor's [environment] docker_image = "ubuntu:24.04" with no Dockerfile and no registry: the stand-in
    (here the one noble_task built), or with the stand-ins off, the line naming the task's setting."""
    never = Settings(inspect_timeout_s=0.001)
    source = Prebuilt("ubuntu:24.04", None, "task 'p': task.toml: environment.docker_image")
    on = run(ImageStore(root=store.root, pulls=never, ubuntu_standins="bookworm").image(source, backend))
    assert on.layers == noble_task[0].layers[1:] and on.note.startswith("ubuntu:24.04: furlong's ubuntu-24.04 "
                                                                          "stand-in (Debian 12."), on.note
    with pytest.raises(ImageBuildError) as err:
        run(ImageStore(root=store.root, pulls=never).image(source, backend))
    assert str(err.value).startswith("task 'p': task.toml: environment.docker_image: ubuntu:24.04: no registry "
                                     "serves it here") and "images.ubuntu_standins=off" in str(err.value)
