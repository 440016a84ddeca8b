"""Shared fixtures: one sandbox backend and the (cached) base image for the whole session; one torch
thread and a freshly built tiny model per module for the model tests; the skip policy's hooks
(tests/skips.py)."""

from __future__ import annotations

import asyncio
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

from furlong.sandbox import idmap
from furlong.sandbox.base import ImageRef, Limits, SandboxSpec
from furlong.sandbox.bwrap import BwrapBackend
from furlong.sandbox.images import ImageStore
from furlong.sandbox.network import NO_NETWORK, PUBLIC


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
