"""Shared fixtures: one sandbox backend and the (cached) base image for the whole session; one torch
thread and a freshly built tiny model per module for the model tests; one smoke-recipe training run for
the session; the skip policy's hooks (tests/skips.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the skip policy's hooks: under FURLONG_STRICT_SKIPS (CI) a skip of no allowed kind fails the run
from skips import (  # noqa: F401
    pytest_configure,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

from furlong.sandbox.runtime import idmap
from furlong.sandbox.base import ImageRef, Limits, SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.network import NO_NETWORK, PUBLIC

# Task fixtures carry their own tests (tests/fixtures/audit/*/tests/test_*.py): those run in a sandbox as
# the task's verifier, never in this suite.
collect_ignore_glob = ["fixtures/*"]


@pytest.fixture(scope="session")
def store() -> ImageStore:
    return ImageStore()


@pytest.fixture(scope="session")
def backend(store: ImageStore) -> BwrapBackend:
    return BwrapBackend(layers=store)


@pytest.fixture(scope="session")
def base_image(store: ImageStore) -> ImageRef:
    return store.base()  # debootstrap on first use (about a minute), cached afterwards


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and on a busy 2-core machine OpenMP's spinning
    workers made steps 5-30x slower (measured). Restored when the module ends. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from furlong.model.tiny import init_tiny
    from tests_support import SMALL

    return init_tiny(tmp_path_factory.mktemp("models") / "small", spec=SMALL)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from furlong.model.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of `furlong train --config recipes/smoke.yaml` (local mode, seed 0, nothing else set),
    run once per session: test_async pins its samples, test_cluster_ray's Ray run must match it, test_report
    reads its records. Readers only: a test that writes beside its files works on a copy."""
    run = tmp_path_factory.mktemp("smoke") / "run"
    cmd = [sys.executable, "-m", "furlong.cli", "train", "--config", "recipes/smoke.yaml", f"train.run_dir={run}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    return run


def spec(image: ImageRef, **limits) -> SandboxSpec:
    network = limits.pop("network", False)
    policy = PUBLIC if network is True else NO_NETWORK if network is False else network
    return SandboxSpec(image=image, network=policy, limits=Limits(**limits))


def init_host_uid(backend: BwrapBackend) -> int:
    """The host uid of a sandbox's init: its INIT_UID in the subordinate range (many uids), else the sandbox uid."""
    return backend.subids.uid_start + idmap.INIT_UID - 1 if backend.subids else backend.host_uid


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def local_registry(tmp_path_factory: pytest.TempPathFactory):
    """A real `docker-registry` on 127.0.0.1 (plain HTTP, no auth) for the session; tests may stop() and
    start() it again to play an unreachable registry (its images stay)."""
    import shutil

    from registry_support import LocalRegistry

    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
        pytest.fail("needs Debian's docker-registry and skopeo: bash install.sh installs them")  # always: no skip
    work = tmp_path_factory.mktemp("registry")
    server = LocalRegistry(work, work / "storage").start()
    yield server
    server.stop()
