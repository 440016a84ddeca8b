"""Builders for the sandbox side (backend and image store): light to import, for the commands that never
load a model (`furlong eval` with a scripted agent, `furlong image`)."""

from __future__ import annotations

from furlong.config import ImagesConfig, SandboxConfig
from furlong.sandbox.backends import make_backend
from furlong.sandbox.base import SandboxBackend
from furlong.sandbox.images import ImageStore
from furlong.sandbox.registry import Settings


def image_store(s: SandboxConfig, i: ImagesConfig) -> ImageStore:
    pulls = Settings.from_env(prefer_registry=i.prefer_registry, auth_file=i.registry_auth_file,
                              timeout_s=i.pull_timeout_s)
    return ImageStore(host_uid=s.host_uid, mirror=s.debian_mirror, pulls=pulls)


def sandbox_backend(s: SandboxConfig, store: ImageStore) -> SandboxBackend:
    """sandbox.backend over `store`, which resolves the images' layers."""
    return make_backend(s.backend, layers=store, host_uid=s.host_uid, output_cap=s.output_cap_bytes,
                        seccomp=s.seccomp)
