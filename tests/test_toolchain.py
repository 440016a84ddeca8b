"""The verifier toolchain layer: opt-in parsing, and uv/uvx/pytest working offline over real images."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import run, spec
from furlong.config import load_config
from furlong.sandbox import toolchain
from furlong.tasks.loader import load_task
from furlong.tasks.model import TaskError
from tests_support import make_task

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


def test_hidden_entries_finds_whiteouts(tmp_path: Path):
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/bin/ok").write_text("x")
    assert toolchain.hidden_entries(tmp_path) == []
    if os.geteuid() != 0:
        pytest.skip("making a whiteout (a 0:0 character device) needs root")
    os.mknod(tmp_path / "usr/bin/gone", 0o600 | 0o020000, 0)
    assert toolchain.hidden_entries(tmp_path) == [str(tmp_path / "usr/bin/gone")]


def _in_sandbox(store, backend, ref: str, network: bool, cmd: str, files: Path | None = None):
    async def go():
        tc = await toolchain.build(store, backend)
        image = toolchain.stack(await store.parent(ref, backend, lambda _: None), tc, network)
        box = await backend.create(spec(image, memory_mb=2048))  # the sandbox itself has no network
        try:
            if files:
                await box.put_dir(files, "/src")
            return tc, image, await box.exec(cmd, timeout_s=120)
        finally:
            await box.close()
    return run(go())


def test_toolchain_works_offline_and_keeps_pip(store, backend, tmp_path: Path):
    (tmp_path / "pkg/tinypkg").mkdir(parents=True)
    (tmp_path / "pkg/pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "pkg/tinypkg/__init__.py").write_text("ANSWER = 42\n")
    cmd = ("set -e; uv --version; uvx --version; pytest --version; python3 -m pytest --version\n"
           "cd /tmp && printf 'def test_a():\\n    assert 1\\n' > test_a.py\n"
           "uvx -w pytest-json-ctrf==0.3.5 pytest -q --ctrf /tmp/ctrf.json test_a.py | tail -1\n"
           "uv venv -q v && . v/bin/activate && uv pip install -q pytest==8.4.1 && uv run pytest -q test_a.py | tail -1\n"
           "deactivate; . $HOME/.local/bin/env; command -v uv\n"
           "pip install -q --root-user-action=ignore --no-build-isolation --no-deps /src && "
           "python3 -c 'import tinypkg; print(tinypkg.ANSWER)'")
    tc, image, r = _in_sandbox(store, backend, "python:3.11-slim", False, cmd, tmp_path / "pkg")
    assert r.ok, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"uv {toolchain.UV_VERSION} ") and lines[1].startswith(f"uvx {toolchain.UV_VERSION} ")
    assert lines[2:4] == ["pytest 8.4.1", "pytest 8.4.1"]
    assert lines[4].startswith("1 passed") and lines[5].startswith("1 passed"), r.stdout
    assert lines[6:] == ["/root/.local/bin/uv", "42"]
    assert ("UV_OFFLINE", "1") in image.env and "verifier toolchain (uv " in image.note
    assert toolchain.hidden_entries(store.root / tc.key / "upper") == []


def test_toolchain_on_the_plain_debian_base(store, backend):
    """No pip in the image: pytest still runs on its python3; a networked task's uv is not told to stay offline."""
    _, image, r = _in_sandbox(store, backend, "debian:bookworm", True, "pytest --version; echo ${UV_OFFLINE:-online}")
    assert r.ok and r.stdout.split("\n")[:2] == ["pytest 8.4.1", "online"], r.stdout + r.stderr
    assert ("UV_FIND_LINKS", f"{toolchain.HOME}/wheels") in image.env


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
"""


def test_tb2_test_prologue_and_pytest_forms_work_offline(store, backend):
    _, image, r = _in_sandbox(store, backend, "python:3.11-slim", False, TB2_TESTS)
    assert r.ok, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"uv {toolchain.UV_VERSION} (furlong's verifier toolchain) is in /root/.local/bin")
    assert "1 passed" in lines[1] and lines[2].startswith("1 passed"), r.stdout
    assert lines[3].startswith("error: No interpreter found for Python 3.12"), r.stdout  # never a download
    assert dict(image.env)["PATH"].startswith("/opt/furlong/toolchain/offline:")
