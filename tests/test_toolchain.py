"""The verifier toolchain layer: opt-in parsing, its place (the verifier's environment, never the agent's),
and uv/uvx/pytest working offline over real images."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import skips
from conftest import run, spec
from tests_support import make_task

from furlong.config import load_config
from furlong.sandbox.images import toolchain
from furlong.sandbox.base import BASE_ENV, ImageRef, LayerRef, SandboxSpec
from furlong.sandbox.network import NO_NETWORK, NetworkPolicy
from furlong.sandbox.remote.backend import create_body
from furlong.tasks.loader import load_task
from furlong.tasks.model import TaskError
from furlong.tasks.verifier import verifier_env

TOOLCHAIN = toolchain.Toolchain("toolchain-x", LayerRef("toolchain-x", "toolchain-x/upper"), "uv, pytest")
PYPROJECT = '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n' \
            '[project]\nname = "tinypkg"\nversion = "0.1"\n'


def test_opt_in_per_task_and_globally(tmp_path: Path):
    task = make_task(tmp_path, "t", "x", "true")
    assert task.verifier_toolchain is False and load_config().eval.verifier_toolchain is False
    (task.path / "task.toml").write_text("[furlong]\nverifier_toolchain = true\n")
    assert load_task(task.path).verifier_toolchain is True
    (task.path / "task.toml").write_text("[furlong]\nverifier_toolchain = 'maybe'\n")
    with pytest.raises(TaskError, match="furlong.verifier_toolchain"):
        load_task(task.path)
    assert load_config(overrides=["eval.verifier_toolchain=true"]).eval.verifier_toolchain is True
    assert toolchain.opt_in_all([task])[0].verifier_toolchain is True


def test_the_layer_refuses_what_hides_or_lies_outside_its_home(tmp_path: Path):
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "tmp").mkdir()  # a directory the builder leaves: no file of the layer
    (tmp_path / "opt/furlong/toolchain/bin").mkdir(parents=True)
    (tmp_path / "opt/furlong/toolchain/bin/uv").write_text("x")
    assert toolchain.hidden_entries(tmp_path) == [] and toolchain.stray_files(tmp_path) == []
    (tmp_path / "usr/bin/ok").write_text("x")
    (tmp_path / "usr/bin/uv").symlink_to("/opt/furlong/toolchain/bin/uv")
    assert toolchain.stray_files(tmp_path) == [str(tmp_path / "usr/bin/ok"), str(tmp_path / "usr/bin/uv")]
    if os.geteuid() != 0:
        skips.skip("root", "making a whiteout (a 0:0 character device) needs root")
    os.mknod(tmp_path / "usr/bin/gone", 0o600 | 0o020000, 0)
    assert toolchain.hidden_entries(tmp_path) == [str(tmp_path / "usr/bin/gone")]


def test_only_the_verifier_gets_the_toolchain_and_offline_only_offline():
    image = ImageRef("d", (), env=(("PATH", "/opt/app/bin:/usr/bin"), ("A", "1")))
    offline = toolchain.stack(image, TOOLCHAIN, toolchain.verifier_offline(SimpleNamespace(verifier_network=NO_NETWORK)))
    online = toolchain.stack(image, TOOLCHAIN, toolchain.verifier_offline(SimpleNamespace(verifier_network=NetworkPolicy("packages"))))
    assert offline.env == online.env == image.env and offline.layers[0] == TOOLCHAIN.layer
    # the shims first in every mode (uv's installer is the toolchain's uv); offline-only settings offline only
    assert dict(offline.verifier_env)["PATH"] == dict(online.verifier_env)["PATH"] == (
        "/opt/furlong/toolchain/offline:/opt/furlong/toolchain/bin:/opt/app/bin:/usr/bin")
    assert {"FURLONG_OFFLINE", "UV_OFFLINE", "UV_PYTHON_DOWNLOADS", "PIP_NO_INDEX"} <= dict(offline.verifier_env).keys()
    assert not {"FURLONG_OFFLINE", "UV_OFFLINE", "PIP_NO_INDEX"} & dict(online.verifier_env).keys()
    task = make_task(Path(tempfile.mkdtemp()), "t", "x", "true")
    env = verifier_env(dataclasses.replace(task, verifier_env=(("UV_OFFLINE", "0"),)), offline)
    assert env["UV_OFFLINE"] == "0" and "PYTHONPYCACHEPREFIX" not in env  # the task's own wins
    assert env["PATH"] == dict(offline.verifier_env)["PATH"] and "PATH" not in verifier_env(task)
    assert verifier_env(task, image)["PATH"] == "/opt/app/bin:/usr/bin"  # no toolchain: the sandbox's own
    assert create_body(SandboxSpec(offline))["image"].keys() == {"digest", "layers", "env", "workdir", "user", "note"}


@pytest.fixture(scope="module")
def offline_python(store, backend) -> ImageRef:
    """The bookworm python stand-in with the toolchain, for an offline verifier phase."""
    async def go():
        tc = await toolchain.build(store, backend)
        return toolchain.stack(await store.parent("python:3.11-slim", backend, lambda _: None), tc, True)
    return run(go())


def _both(backend, image: ImageRef, agent: str, verifier: str, files: Path | None = None):
    """`agent` run as the agent, then `verifier` as the verifier with its environment, in one sandbox."""
    async def go():
        box = await backend.create(spec(image, memory_mb=2048))  # the sandbox itself has no network
        try:
            if files:
                await box.put_dir(files, "/src")
            mine = await box.exec(agent, timeout_s=120)
            env = verifier_env(make_task(Path(tempfile.mkdtemp()), "t", "x", "true"), image)
            return mine, await box.exec(verifier, timeout_s=120, env=env, as_verifier=True)
        finally:
            await box.close()
    return run(go())


# The same probes for both: the agent's environment is the image's; the verifier's has the toolchain.
PROBES = ("command -v uv || echo no-uv; command -v pytest || echo no-pytest; "
          "python3 -c 'import pytest' 2>/dev/null || echo no-import; env | grep -c '^UV_\\|^PIP_\\|^PYTHONUSERBASE' ; "
          "python3 -c 'import sys; print(any(\"furlong\" in p for p in sys.path))'; echo $PATH\n")
VERIFIER = ("set -e; uv --version; uvx --version; pytest --version; python3 -m pytest --version\n"
            "cd /tmp && printf 'def test_a():\\n    assert 1\\n' > test_a.py\n"
            "python3 -m pytest -q -p no:cacheprovider --ctrf /tmp/c.json test_a.py | tail -1\n"
            "uvx -w pytest-json-ctrf==0.3.5 pytest -q --ctrf /tmp/ctrf.json test_a.py | tail -1\n"
            "uv venv -q v && . v/bin/activate && uv pip install -q pytest==8.4.1 && uv run pytest -q test_a.py | tail -1\n"
            "deactivate; pip install -q --root-user-action=ignore --no-build-isolation --no-deps /src && "
            "python3 -c 'import tinypkg; print(tinypkg.ANSWER)'\n"
            "pip install -q --root-user-action=ignore pytest-json-ctrf==0.3.5 && pip show pytest-json-ctrf | head -1\n")


def test_the_agent_sees_the_image_and_the_verifier_the_toolchain(backend, offline_python, tmp_path: Path):
    (tmp_path / "pkg/tinypkg").mkdir(parents=True)
    (tmp_path / "pkg/pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "pkg/tinypkg/__init__.py").write_text("ANSWER = 42\n")
    mine, theirs = _both(backend, offline_python, PROBES + "apt-get install -y curl >/dev/null 2>&1; echo apt=$?",
                         PROBES + VERIFIER, tmp_path / "pkg")
    assert mine.stdout.splitlines() == ["no-uv", "no-pytest", "no-import", "0", "False", BASE_ENV["PATH"], "apt=100"], \
        mine.stdout + mine.stderr  # no shim answers the agent's apt-get either
    assert theirs.ok, theirs.stdout + theirs.stderr
    lines = theirs.stdout.splitlines()
    # uv, pytest and `import pytest` found; the six variables; the fallback's user site on sys.path
    assert lines[:4] == ["/opt/furlong/toolchain/bin/uv", "/opt/furlong/toolchain/bin/pytest", "6", "True"], lines
    assert lines[4].startswith("/opt/furlong/toolchain/offline:/opt/furlong/toolchain/bin:")
    assert lines[5].startswith(f"uv {toolchain.UV_VERSION} ") and lines[6].startswith(f"uvx {toolchain.UV_VERSION} ")
    assert lines[7:9] == ["pytest 8.4.1", "pytest 8.4.1"]
    assert all(line.startswith("1 passed") for line in lines[9:12]), lines  # the fallback finds ctrf's plugin
    assert lines[12:] == ["42", "Name: pytest-json-ctrf"]  # pip installs offline, from the wheels


def test_toolchain_on_the_plain_debian_base(store, backend):
    """No pip in the image: pytest still runs on its python3; a networked verifier's uv is not told to stay offline."""
    async def go():
        tc = await toolchain.build(store, backend)
        return toolchain.stack(await store.parent("debian:bookworm", backend, lambda _: None), tc, False)
    image = run(go())
    _, r = _both(backend, image, "true", "pytest --version; echo ${UV_OFFLINE:-online}")
    assert r.ok and r.stdout.split("\n")[:2] == ["pytest 8.4.1", "online"], r.stdout + r.stderr
    assert ("UV_FIND_LINKS", f"{toolchain.HOME}/wheels") in image.verifier_env


# TB2's test prologue and its uvx and `uv init && uv add` forms (`uv venv` is the test above's), under `set -e`,
# with `-p` naming the image's Python (3.11 here; TB2's `-p 3.13` on the python:3.13 stand-in is
# bench/standins_check.py's). Its `apt-get update` is left out: offline it is apt's own 0, after seconds of DNS.
TB2_TESTS = """set -e
apt-get install -y curl 2>/dev/null
curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
source $HOME/.local/bin/env
cd /tmp && printf 'import sys\\ndef test_v():\\n    assert sys.version_info[:2] == (3, 11)\\n' > test_outputs.py
uvx -p 3.11 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /tmp/ctrf.json test_outputs.py -rA | tail -1
mkdir proj && cd proj && uv init -q && uv add -q pytest==8.4.1 && uv run pytest -q /tmp/test_outputs.py | tail -1
uvx -p 3.12 pytest --version 2>&1 | head -1
command -v uv
"""


def test_tb2_test_prologue_and_pytest_forms_work_offline(backend, offline_python):
    _, r = _both(backend, offline_python, "true", TB2_TESTS)
    assert r.ok, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"uv {toolchain.UV_VERSION} (furlong's verifier toolchain) is in /root/.local/bin")
    assert "1 passed" in lines[1] and lines[2].startswith("1 passed"), r.stdout
    assert lines[3].startswith("error: No interpreter found for Python 3.12"), r.stdout  # never a download
    assert lines[4] == "/root/.local/bin/uv"  # the installer's link, first once its `env` script ran
