"""Which skips CI allows, and the pytest hooks that enforce it (tests/conftest.py imports them).

A skip that CI allows is raised through `skip` or `skipif` below, with a kind from `KINDS`: a GPU (CI's
machine has none), an install.sh extra that CI does not install, or root (allowed in the as-user run
only). With FURLONG_STRICT_SKIPS set (.ci/run sets it: `1` for the root run, `as-user` for the ordinary
user's), any other skip fails the session, listed at the end: CI's machine has everything else, so
there a skip would hide a regression. Unset (a developer's machine), skips are only reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NoReturn

import pytest

STRICT_ENV = "FURLONG_STRICT_SKIPS"
# install.sh's optional extras, and the flags that install them
EXTRAS = {"vllm": "bash install.sh --vllm", "harbor": "bash install.sh --harbor",
          "verifiers": "bash install.sh --verifiers"}
# the extras .ci/run installs (tests/test_skips.py checks this against .ci/run): a skip for one fails CI
CI_EXTRAS = frozenset({"vllm", "harbor", "verifiers"})
KINDS = {
    "gpu": "needs a GPU, or checks what happens without one",
    "root": "needs root: skipped by design when the suite runs as an ordinary user",
    **{f"extra:{name}": f"needs the {name} extra ({flag})" for name, flag in EXTRAS.items()},
}
_SKIPS = pytest.StashKey[list["Skip"]]()


class AllowedSkip(pytest.skip.Exception):
    """A skip of a named kind, which strict runs allow when the kind is in `allowed_kinds`."""

    # pytest reports a skip as "<type>: <reason>" and strips only "Skipped: ": named like its base, a
    # skip of this kind reads like any other in pytest's summary
    __module__ = "builtins"
    __qualname__ = "Skipped"

    def __init__(self, kind: str, reason: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"skip kind {kind!r} is not one of {sorted(KINDS)} (tests/skips.py KINDS)")
        super().__init__(f"[{kind}] {reason}", _use_item_location=True)
        self.kind = kind


def skip(kind: str, reason: str) -> NoReturn:
    """Skips the running test for an allowed `kind` (see KINDS)."""
    raise AllowedSkip(kind, reason)


def skipif(kind: str, condition: bool, reason: str) -> pytest.MarkDecorator:
    """A marker: the test skips for `kind` when `condition` holds (checked at setup, by `pytest_runtest_setup`)."""
    if kind not in KINDS:
        raise ValueError(f"skip kind {kind!r} is not one of {sorted(KINDS)} (tests/skips.py KINDS)")
    return pytest.mark.allowed_skipif(kind, condition, reason=reason)


def needs_root(reason: str) -> pytest.MarkDecorator:
    return skipif("root", os.geteuid() != 0, reason)


def allowed_kinds(mode: str) -> frozenset[str]:
    """The kinds a strict run allows: `1` (the root run) or `as-user` (also root-only tests)."""
    if mode not in ("1", "as-user"):
        raise pytest.UsageError(f"{STRICT_ENV}={mode!r}: expected 1 (CI's root run) or as-user (its ordinary "
                                f"user's run), or unset")
    extras = {f"extra:{name}" for name in EXTRAS if name not in CI_EXTRAS}
    return frozenset({"gpu", *extras, *(("root",) if mode == "as-user" else ())})


@dataclass(frozen=True)
class Skip:
    nodeid: str
    kind: str  # "" for a skip of no allowed kind (a plain pytest.skip, skipif or importorskip)
    reason: str


def _reason(longrepr) -> str:
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allowed_skipif(kind, condition, reason): a skip CI allows (tests/skips.py)")
    config.stash[_SKIPS] = []
    config.pluginmanager.register(_Collection(config.stash[_SKIPS]), "furlong-skip-collection")
    if mode := os.environ.get(STRICT_ENV):
        allowed_kinds(mode)  # a wrong value stops the run before any test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("allowed_skipif"):
        kind, condition = mark.args
        if condition:
            skip(kind, mark.kwargs["reason"])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        exc = call.excinfo.value if call.excinfo else None
        kind = exc.kind if isinstance(exc, AllowedSkip) else ""
        item.config.stash[_SKIPS].append(Skip(report.nodeid, kind, _reason(report.longrepr)))
    return report


class _Collection:
    """Records the modules skipped while collected (importorskip, a module-level pytest.skip): a collect
    report carries no config, so this plugin holds the session's list."""

    def __init__(self, skips: list[Skip]) -> None:
        self.skips = skips

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.skips.append(Skip(report.nodeid, "", _reason(report.longrepr)))


def disallowed(config: pytest.Config) -> list[Skip]:
    """The skips this strict run does not allow (none when the run is not strict)."""
    mode = os.environ.get(STRICT_ENV)
    if not mode:
        return []
    allowed = allowed_kinds(mode)
    return [s for s in config.stash[_SKIPS] if s.kind not in allowed]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if disallowed(session.config) and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    bad = disallowed(config)
    if not bad:
        return
    mode = os.environ[STRICT_ENV]
    terminalreporter.section(f"skips not allowed with {STRICT_ENV}={mode}", sep="=", red=True, bold=True)
    for s in bad:
        terminalreporter.line(f"{s.nodeid}: {s.reason}" + (f" (kind {s.kind})" if s.kind else ""))
    terminalreporter.line(f"{len(bad)} skip(s) fail this run: allowed are only skips of the kinds "
                          f"{sorted(allowed_kinds(mode))} (tests/skips.py); the feature these need is missing here")
