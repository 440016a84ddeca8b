"""Dockerfile subset: parsing errors name the line; layers build, cache by content and stack over the base."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import run, spec
from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.images import standins
from furlong.paths import layer_mounts_dir
from furlong.sandbox.images.store import ImageBuildError


def _dockerfile(tmp_path: Path, text: str, files: dict[str, str] | None = None) -> Path:
    env = tmp_path / "environment"
    env.mkdir(parents=True, exist_ok=True)
    for name, content in (files or {}).items():
        (env / name).parent.mkdir(parents=True, exist_ok=True)
        (env / name).write_text(content)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


@pytest.mark.parametrize("text, line, words", [
    ("FROM debian:bookworm\nEXPOSE 80\n", 2, "unsupported instruction EXPOSE"),
    ("# comment\n\nFROM alpine:3.20\n", 3, "unknown base 'alpine:3.20'"),
    ("RUN echo hi\n", 1, "first instruction must be FROM"),
    ("FROM debian:bookworm\nCOPY --from=build /a /b\n", 2, "COPY flags"),
    ("FROM debian:bookworm\nRUN echo a \\\n  && echo b\nFROM debian:bookworm\n", 4, "multi-stage"),
    ("FROM debian:bookworm\nENV =x\n", 2, "KEY=VALUE"),
])
def test_unsupported_dockerfiles_name_the_line(tmp_path: Path, text: str, line: int, words: str):
    path = _dockerfile(tmp_path, text)
    with pytest.raises(df.DockerfileError) as err:
        df.parse(path)
    assert err.value.line == line and words in str(err.value) and str(path) in str(err.value)


def test_parse_accepts_the_subset_with_continuations_and_exec_form(tmp_path: Path):
    steps = df.parse(_dockerfile(tmp_path, (
        "FROM python:3.11-slim-bookworm\n# set up\nRUN echo a \\\n    && echo b\n"
        'RUN ["echo", "two words"]\nENV A=1 B="x y"\nENV LEGACY some value\nWORKDIR /app\nCOPY a.txt /app/\n')))
    assert [s.op for s in steps] == ["FROM", "RUN", "RUN", "ENV", "ENV", "WORKDIR", "COPY"]
    assert steps[1].args == "echo a && echo b" and steps[1].line == 3
    assert df.run_command(steps[2]) == "echo 'two words'"
    assert df.env_pairs(Path("x"), steps[3]) == [("A", "1"), ("B", "x y")]
    assert df.env_pairs(Path("x"), steps[4]) == [("LEGACY", "some value")]


def test_layer_builds_caches_and_stacks_over_the_base(store, backend, tmp_path: Path):
    files = {"data/a.txt": "alpha\n", "tool.sh": "echo tool\n"}
    path = _dockerfile(tmp_path, (
        "FROM debian:bookworm\nWORKDIR /app\nENV GREETING=hello MODE=\"x y\"\nCOPY data /app/data\n"
        "COPY tool.sh /usr/local/bin/tool\nRUN chmod +x /usr/local/bin/tool && rm /usr/bin/git "
        "&& echo built > /app/built.txt\n"), files)

    async def go():
        image = await store.image(path, backend)
        assert image.workdir == "/app" and dict(image.env) == {"GREETING": "hello", "MODE": "x y"}
        box = await backend.create(spec(image))
        try:
            r = await box.exec('pwd; cat data/a.txt built.txt; tool; echo "$GREETING $MODE"; which git || echo no-git')
            assert r.stdout == "/app\nalpha\nbuilt\ntool\nhello x y\nno-git\n", r
        finally:
            await box.close()
        again = await store.image(path, backend)
        assert again == image
        return image

    image = run(go())
    assert image.layers[1:] == store.base().layers
    # the layer's identity covers the content COPY brings in, not just the file names
    (tmp_path / "environment" / "data" / "a.txt").write_text("changed\n")
    steps = df.parse(path)
    assert store.layer_key(path, steps) != image.digest


def test_failing_run_step_is_an_error_naming_the_line(store, backend, tmp_path: Path):
    path = _dockerfile(tmp_path, "FROM debian:bookworm\nRUN echo fine\nRUN echo doomed >&2; exit 7\n")
    leftovers = set(store.root.glob(f"layer-*.tmp{os.getpid()}"))  # other processes may be building meanwhile

    async def go():
        with pytest.raises(ImageBuildError) as err:
            await store.image(path, backend)
        assert f"{path}:3" in str(err.value) and "exited 7" in str(err.value) and "doomed" in str(err.value)

    run(go())
    assert set(store.root.glob(f"layer-*.tmp{os.getpid()}")) == leftovers, "a failed build left its temp directory"


def test_copy_outside_the_context_is_refused(store, backend, tmp_path: Path):
    (tmp_path / "secret.txt").write_text("s")
    path = _dockerfile(tmp_path, "FROM debian:bookworm\nCOPY ../secret.txt /app/\n")

    async def go():
        with pytest.raises(df.DockerfileError, match="outside the build context"):
            await store.image(path, backend)

    run(go())


@pytest.mark.parametrize("ref, standin, version, words", [
    ("python:3.10-slim", "python", "3.10", "the tag asks for Python 3.10 (nearest: Debian bookworm's 3.11)"),
    ("public.ecr.aws/docker/library/python:3.11-slim", "python", "3.11", "python stand-in"),
    ("docker.io/library/python:3.10", "python", "3.10", "compilers are not included"),
    ("python:3.11-bullseye", "python", "3.11", "not Debian 11 (bullseye)"),
    ("python", "python", "", "python stand-in"),
    ("debian:bookworm-slim", None, "", ""),
    ("debian:12.5", None, "", ""),
    ("buildpack-deps:bookworm-scm", "buildpack-deps-scm", "", "buildpack-deps' packages"),
])
def test_known_names_map_to_the_base_or_a_standin(ref: str, standin: str | None, version: str, words: str):
    choice = standins.resolve(ref)
    assert choice is not None and (choice.standin.name if choice.standin else None) == standin
    assert choice.asked_version == version and words in choice.note("3.11.2")
    if version == "3.11":
        assert "asks for" not in choice.note("3.11.2")  # 3.11 is what the stand-in really has


@pytest.mark.parametrize("ref", ["ubuntu:latest", "ubuntu:18.04", "python:2.7", "python:3.12-alpine", "debian:bullseye",
                                 "debian:latest", "gcc:13-alpine", "node:20-bookworm-nanoserver",
                                 "buildpack-deps:jammy"])
def test_names_without_an_honest_mapping_are_refused(ref: str):
    assert standins.resolve(ref) is None


def test_unknown_base_is_one_line_naming_the_line_and_the_way_out(tmp_path: Path):
    path = _dockerfile(tmp_path, "# a task\nFROM alpine:3.20\nRUN true\n")
    with pytest.raises(df.DockerfileError) as err:
        df.parse(path)
    text = str(err.value)
    assert text.startswith(f"{path}:2: unknown base 'alpine:3.20'") and "\n" not in text
    assert "furlong image import alpine:3.20" in text and "ubuntu:24.04|22.04|20.04" in text
    assert df.parse(path, imported={"alpine:3.20"})[0].args == "alpine:3.20"  # once imported, it is known


PYPROJECT = """[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "tinypkg"
version = "0.1"
"""


def test_python_standin_behaves_like_the_official_image(store, backend, tmp_path: Path):
    """pip, pip3, python, python3 and venv work, and pip installs as root (a local project, offline)."""
    files = {"pkg/pyproject.toml": PYPROJECT, "pkg/tinypkg/__init__.py": "ANSWER = 42\n"}
    path = _dockerfile(tmp_path, (
        "FROM python:3.10-slim\nCOPY pkg /src/pkg\n"
        "RUN pip --version && pip3 --version && python --version && python3 --version\n"
        "RUN python -m venv /v && /v/bin/pip --version\n"
        "RUN pip install --no-build-isolation --no-deps /src/pkg\n"), files)
    other = _dockerfile(tmp_path / "other", "FROM python:3.11-slim-bookworm\nRUN python -m pip --version\n")

    async def go():
        image = await store.image(path, backend)
        box = await backend.create(spec(image))
        try:
            r = await box.exec("python -c 'import tinypkg, sys; print(tinypkg.ANSWER, sys.version_info[:2])'; "
                               "/usr/local/bin/python --version; /v/bin/python -c 'print(1)'; echo $LANG")
        finally:
            await box.close()
        return image, r, await store.image(other, backend)

    image, r, image311 = run(go())
    assert r.stdout.startswith("42 (3, 11)\nPython 3.11") and r.stdout.endswith("1\nC.UTF-8\n"), r
    assert "python stand-in (Python 3.11" in image.note and "asks for Python 3.10" in image.note
    assert "asks for" not in image311.note and image311.layers[1:] == image.layers[1:]  # one stand-in layer
    meta = json.loads((store.root / image.digest / "meta.json").read_text())
    assert meta["base"] == "python:3.10-slim" and meta["note"] == image.note


def test_env_and_workdir_expand_variables_and_relative_workdirs_chain():
    from furlong.sandbox.images import dockerfile as df

    env = {"PATH": "/usr/bin:/bin", "APP": "/srv/app"}
    assert df.expand("${APP}/bin:$PATH", env) == "/srv/app/bin:/usr/bin:/bin"
    assert df.expand("${MISSING:-fallback} ${APP:+set} \\$HOME", env) == "fallback set $HOME"
    assert df.next_workdir("/srv", "app", env) == "/srv/app"
    assert df.next_workdir("/srv/app", "$APP/data", env) == "/srv/app/data"
    assert df.next_workdir("/srv/app", "../x", env) == "/srv/x"


def _views() -> int:
    prefix = str(layer_mounts_dir()) + "/"
    return sum(line.split()[4].startswith(prefix) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def test_lookups_at_once_share_one_and_new_layers_add_no_mount(store, backend, tmp_path: Path, monkeypatch):
    """An RL step asks for a new task's image once per episode and per sandbox it reserves, all at once:
    one lookup serves them all. And new layers are seen through the store's one view, not a mount each:
    every sandbox start copies the host's mount table, and thousands of views made starts take seconds."""
    paths = [_dockerfile(tmp_path / str(i), "FROM debian:bookworm\nCOPY n.txt /app/n.txt\n",
                         {"n.txt": f"{i} {time.time_ns()}\n"}) for i in range(3)]  # new layers each run
    calls: Counter = Counter()
    real = store._resolve

    async def counting(path, *args):
        calls[path] += 1
        return await real(path, *args)

    monkeypatch.setattr(store, "_resolve", counting)

    async def go():
        store.base()  # the store's view, if this is its first use
        before = _views()
        refs = await asyncio.gather(*(store.image(p, backend) for p in paths for _ in range(8)))
        box = await backend.create(spec(refs[-1]))
        try:
            out = (await box.exec("cat /app/n.txt")).stdout
        finally:
            await box.close()
        return before, refs, out

    before, refs, out = run(go())
    assert calls == {p: 1 for p in paths}
    assert [r.digest for r in refs] == [r.digest for r in refs[::8] for _ in range(8)] and len({r.digest for r in refs}) == 3
    assert out.startswith("2 ")
    assert _views() == before  # three new layers, no new mount


def test_native_useradd_and_chown_build_and_the_layer_stays_removable(store, backend, tmp_path: Path):
    """Native RUN steps have the capabilities to `useradd` and `chown` (init.c BUILD_CAPS). As root the
    owners survive (tests/test_owners.py); as an ordinary user every stored file is the user's own, so
    the sandbox shows root's and the user can remove the layer (a 0700 home of another uid included)."""
    from furlong.sandbox.runtime import idmap
    from furlong.sandbox.images.builds import _rmtree

    if idmap.sub_ids() is None:
        pytest.skip(f"sandboxes here have one uid: {idmap.problem()}")
    path = _dockerfile(tmp_path, f"FROM debian:bookworm\nRUN echo {time.time_ns()} > /nonce && useradd -m --uid 1000 "
                                 "worker && chmod 700 /home/worker && touch /home/worker/f && chown 1000:1000 "
                                 "/home/worker/f && setpriv --reuid=1000 --regid=1000 --clear-groups id -u\n")

    async def go():
        image = await store.image(path, backend)
        box = await backend.create(spec(image))
        try:
            return image, (await box.exec("stat -c %u:%g:%a /home/worker; stat -c %u:%g /home/worker/f 2>/dev/null "
                                          "|| echo closed-to-the-agent")).stdout.split()
        finally:
            await box.close()

    image, owners = run(go())
    assert owners == (["1000:1000:700", "closed-to-the-agent"] if os.geteuid() == 0 else ["0:0:700", "0:0"])
    layer = store.root / image.layers[0].path
    copy = layer.parent.with_name(layer.parent.name + ".removal-check")
    os.rename(layer.parent, copy)  # the cached image goes, as a store's clean-up takes it
    _rmtree(copy)
    assert not copy.exists()
