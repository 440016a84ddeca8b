"""The wheel holds what furlong reads at run time besides its modules: the sandbox helpers' C sources and the
headers they include (built on first use from the installed package: furlong.sandbox.runtime.native), and
the chat templates. Built here with setuptools from a copy of the tracked files (no network: the installed
setuptools, as pip's --no-build-isolation), so pyproject's package-data is what is checked."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from furlong.sandbox.runtime.native import HELPERS, _compiler

ROOT = Path(__file__).resolve().parent.parent
NATIVE = "furlong/sandbox/runtime/native"
BUILD = "from setuptools import build_meta; print(build_meta.build_wheel('dist'))"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[zipfile.ZipFile, Path]:
    """The wheel (opened) and where it was unpacked."""
    src = tmp_path_factory.mktemp("src")
    tracked = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "LICENSE*", "furlong"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    built = subprocess.run([sys.executable, "-c", BUILD], cwd=src, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    whl = zipfile.ZipFile(src / "dist" / built.stdout.split()[-1])
    unpacked = tmp_path_factory.mktemp("site")
    whl.extractall(unpacked)
    return whl, unpacked


def test_the_wheel_holds_every_tracked_file_of_the_package(wheel):
    whl, _ = wheel
    tracked = subprocess.run(["git", "ls-files", "furlong"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = sorted(set(tracked) - set(whl.namelist()))
    assert not missing, f"not in the wheel (pyproject.toml [tool.setuptools.package-data]): {missing}"


def test_each_helpers_includes_are_in_the_wheel_and_in_its_digest(wheel):
    """Every `#include "..."` of a helper's source is in the wheel, and among the headers its build's digest
    covers (an edited header must rebuild it)."""
    whl, _ = wheel
    names = set(whl.namelist())
    for name, helper in HELPERS.items():
        text = (ROOT / NATIVE / helper.source).read_text()
        local = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)
        assert f"{NATIVE}/{helper.source}" in names, helper.source
        for header in local:
            assert f"{NATIVE}/{header}" in names, f"{helper.source} includes {header}, which the wheel lacks"
        assert set(local) == set(helper.headers), f"{name}: Helper.headers {helper.headers}, includes {local}"


def test_the_helpers_compile_from_the_installed_wheel(wheel):
    """As a wheel install builds them: from the unpacked package's directory alone (syntax and includes)."""
    _, site = wheel
    for helper in HELPERS.values():
        flags = [f for f in helper.flags if f not in ("-s", "-static", "-shared") and not f.startswith("-Wl")]
        r = subprocess.run([_compiler(), *flags, "-fsyntax-only", str(site / NATIVE / helper.source)],
                           cwd=site, capture_output=True, text=True)
        assert r.returncode == 0, f"{helper.source} does not build from the wheel:\n{r.stderr[-2000:]}"
