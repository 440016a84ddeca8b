"""Builders for the sandbox side (backend and image store): light to import, for the commands that never
load a model (`furlong eval` with a scripted agent, `furlong image`)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from furlong.config import ConfigError, ImagesConfig, SandboxConfig
from furlong.paths import cache_dir
from furlong.sandbox.backends import make_backend
from furlong.sandbox.base import SandboxBackend
from furlong.sandbox.images.registry import Settings
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.network import HostError, NetworkPolicy, normalize_hosts
from furlong.sandbox.remote.hosts import Hosts, read_secret
from furlong.sandbox.remote.images import HostImages
from furlong.sandbox.runtime.egress import host_egress
from furlong.tasks.model import TaskNetwork

log = logging.getLogger(__name__)


def image_store(s: SandboxConfig, i: ImagesConfig) -> ImageStore | HostImages:
    """This machine's image store; with sandbox.backend=remote, the hosts' (they build the images)."""
    if s.backend == "remote":
        return HostImages(hosts(s))
    pulls = Settings.from_env(
        prefer_registry=i.prefer_registry, auth_file=i.registry_auth_file, timeout_s=i.pull_timeout_s
    )
    egress = host_egress(i.trust_host_ca, i.host_ca_bundle, i.package_mirrors)
    return ImageStore(
        host_uid=s.host_uid,
        mirror=s.debian_mirror,
        pulls=pulls,
        egress=egress,
        standin_versions=i.standins,
        offline_uv=i.offline_uv,
        ubuntu_standins=i.ubuntu_standins,
    )


def sandbox_backend(s: SandboxConfig, store: ImageStore | HostImages) -> SandboxBackend:
    """sandbox.backend over `store`, which resolves the images' layers (remote: the hosts of `store`); this
    machine's networked sandboxes borrow from it what its builds do (the hosts' follow their own config)."""
    local, remote = (None, store) if isinstance(store, HostImages) else (store, None)
    backend = make_backend(
        s.backend,
        layers=local,
        host_uid=s.host_uid,
        output_cap=s.output_cap_bytes,
        seccomp=s.seccomp,
        images=remote,
        egress=local.egress if local else None,
        snapshot_ttl_s=s.snapshot_ttl_s,
        snapshot_max_mb=s.snapshot_max_mb,
    )
    if missing := backend.guarantees.missing():
        log.warning(
            "sandbox.backend=%s has no %s: rewards are not checked against tampering, and every episode "
            "records integrity_checked: false (docs/sandboxes.md#the-backend-contract)",
            s.backend,
            " or ".join(missing),
        )
    return backend


def hosts(s: SandboxConfig) -> Hosts:
    """sandbox.hosts with the token sandbox.host_token_file holds (default: the loopback host's own)."""
    token_file = s.host_token_file or cache_dir() / "host-token"
    return Hosts(s.hosts, read_secret(token_file, "sandbox.host_token_file", "token"))


def network_default(s: SandboxConfig) -> TaskNetwork:
    """The phases of a task that names no network mode (sandbox.network); `packages` also reaches
    sandbox.network.package_hosts and the host of sandbox.debian_mirror (the base image's apt source)."""
    mirror = urlsplit(s.debian_mirror).hostname
    try:
        extra = normalize_hosts([*s.network.package_hosts, *([mirror] if mirror else [])])
    except HostError as exc:
        raise ConfigError(f"sandbox.network.package_hosts: {exc}") from None

    def phase(mode: str) -> NetworkPolicy:
        return NetworkPolicy(mode, extra if mode == "packages" else ())  # type: ignore[arg-type]

    return TaskNetwork(agent=phase(s.network.agent), verifier=phase(s.network.verifier))
