"""The skip policy (tests/skips.py): under FURLONG_STRICT_SKIPS a skip of no allowed kind fails the run and
is listed; an allowed one passes; unset, every skip passes. Each case is a real pytest run of a tiny test
file with the policy's hooks, in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import skips

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONFTEST = ("from skips import (pytest_configure, pytest_runtest_makereport, pytest_runtest_setup,  # noqa: F401\n"
            "                   pytest_sessionfinish, pytest_terminal_summary)\n")

PLAIN = """
import pytest
def test_plain():
    pytest.skip("buildah is not installed")
@pytest.mark.skipif(True, reason="no delegated cgroup")
def test_marked():
    pass
def test_runs():
    assert 1 + 1 == 2
"""
ALLOWED = """
import skips
def test_imperative():
    skips.skip("gpu", "needs CUDA")
@skips.skipif("gpu", True, "checks the refusal without CUDA")
def test_marked():
    pass
@skips.skipif("gpu", False, "never skips")
def test_runs():
    assert 1 + 1 == 2
"""
ROOT_ONLY = """
import skips
@skips.skipif("root", True, "whiteouts need root")
def test_root_only():
    pass
"""
EXTRA = """
import skips
def test_vllm():
    skips.skip("extra:vllm", "vllm is not installed")
"""
MODULE_SKIP = """
import pytest
pytest.importorskip("no_such_module_furlong")
def test_never():
    pass
"""


def _pytest(tmp_path: Path, source: str, strict: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_tiny.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != skips.STRICT_ENV}
    env["PYTHONPATH"] = str(TESTS)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the installed plugins (hypothesis, schemathesis...) take seconds
    if strict is not None:
        env[skips.STRICT_ENV] = strict
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
                          check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_disallowed_skip_fails_a_strict_run_and_is_named(tmp_path: Path):
    res = _pytest(tmp_path, PLAIN, "1")
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "1 passed, 2 skipped" in out, out
    assert "skips not allowed with FURLONG_STRICT_SKIPS=1" in out, out
    assert re.search(r"test_tiny.py::test_plain: buildah is not installed$", out, re.MULTILINE), out
    assert re.search(r"test_tiny.py::test_marked: no delegated cgroup$", out, re.MULTILINE), out
    assert "2 skip(s) fail this run" in out, out


def test_without_the_variable_every_skip_passes(tmp_path: Path):
    res = _pytest(tmp_path, PLAIN, None)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 2 skipped" in res.stdout and "not allowed" not in res.stdout, res.stdout


def test_allowed_kinds_pass_a_strict_run(tmp_path: Path):
    res = _pytest(tmp_path, ALLOWED, "1")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 2 skipped" in res.stdout and "[gpu] needs CUDA" in res.stdout, res.stdout


@pytest.mark.parametrize(("mode", "rc"), [("1", 1), ("as-user", 0)])
def test_a_root_only_skip_is_allowed_in_the_as_user_run_only(tmp_path: Path, mode: str, rc: int):
    res = _pytest(tmp_path, ROOT_ONLY, mode)
    assert res.returncode == rc, res.stdout + res.stderr
    assert ("test_root_only: [root] whiteouts need root (kind root)" in res.stdout) == (rc == 1), res.stdout


def test_an_extra_that_ci_installs_may_not_skip(tmp_path: Path):
    res = _pytest(tmp_path, EXTRA, "1")
    assert res.returncode == 1 and "(kind extra:vllm)" in res.stdout, res.stdout + res.stderr


def test_a_module_skipped_while_collected_fails_a_strict_run(tmp_path: Path):
    res = _pytest(tmp_path, MODULE_SKIP, "as-user")
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"^test_tiny.py: could not import 'no_such_module_furlong'", res.stdout, re.MULTILINE), res.stdout


def test_a_wrong_value_stops_the_run(tmp_path: Path):
    res = _pytest(tmp_path, ALLOWED, "yes")
    assert res.returncode == pytest.ExitCode.USAGE_ERROR, res.stdout + res.stderr
    assert "FURLONG_STRICT_SKIPS='yes': expected 1" in res.stderr, res.stderr


def test_ci_sets_the_variable_for_both_runs_and_installs_the_extras_the_policy_says():
    ci = (REPO / ".ci" / "run").read_text()
    install = re.search(r"^bash install\.sh (.*)$", ci, re.MULTILINE)
    assert install, ".ci/run: no `bash install.sh ...` line"
    assert {flag.removeprefix("--") for flag in install.group(1).split()} == skips.CI_EXTRAS
    assert re.search(rf"^{skips.STRICT_ENV}=1 python -m pytest -q$", ci, re.MULTILINE), ci
    assert re.search(rf"{skips.STRICT_ENV}=as-user python tests/as_user.py ", ci), ci
