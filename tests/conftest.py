"""Shared fixtures: one sandbox backend and the (cached) base image for the whole session."""

from __future__ import annotations

import asyncio

import pytest

from furlong.sandbox.base import ImageRef, Limits, SandboxSpec
from furlong.sandbox.bwrap import BwrapBackend
from furlong.sandbox.images import ImageStore


@pytest.fixture(scope="session")
def store() -> ImageStore:
    return ImageStore()


@pytest.fixture(scope="session")
def backend() -> BwrapBackend:
    return BwrapBackend()


@pytest.fixture(scope="session")
def base_image(store: ImageStore) -> ImageRef:
    return store.base()  # debootstrap on first use (about a minute), cached afterwards


def spec(image: ImageRef, **limits) -> SandboxSpec:
    network = limits.pop("network", False)
    return SandboxSpec(image=image, network=network, limits=Limits(**limits))


def run(coro):
    return asyncio.run(coro)
