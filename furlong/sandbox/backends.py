"""The one place a sandbox backend is chosen by name (config `sandbox.backend`).

Every kind is imported here at the top: a kind with heavy optional dependencies would need its own entry in
tests/test_import_layers.py's LAZY_ALLOWED (with the reason) before it could be imported only when picked.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from furlong.sandbox.base import (
    DEFAULT_HOST_UID,
    DEFAULT_OUTPUT_CAP,
    LayerSource,
    SandboxBackend,
    SandboxError,
)
from furlong.sandbox.images.store import DefaultStore
from furlong.sandbox.remote.backend import RemoteBackend
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.gvisor import GvisorBackend
from furlong.sandbox.runtime.snapshots import DEFAULT_MAX_MB, DEFAULT_TTL_S

if TYPE_CHECKING:
    from furlong.sandbox.remote.images import HostImages
    from furlong.sandbox.runtime.egress import Egress

KINDS = ("bwrap", "remote", "gvisor")


def make_backend(
    kind: str,
    *,
    layers: LayerSource | None = None,
    host_uid: int | None = None,
    output_cap: int | None = None,
    seccomp: bool = True,
    images: HostImages | None = None,
    egress: Egress | None = None,
    snapshot_ttl_s: float = DEFAULT_TTL_S,
    snapshot_max_mb: int = DEFAULT_MAX_MB,
) -> SandboxBackend:
    """A backend of `kind`, resolving image layers through `layers` (an ImageStore; none: the default store,
    made on first need); `remote` sends its sandboxes to the hosts of `images` (furlong.sandbox.remote.images),
    which build what it lacks. `egress`: what this machine's networked sandboxes borrow from it
    (furlong.sandbox.runtime.egress)."""
    local = functools.partial(
        BwrapBackend,
        host_uid=DEFAULT_HOST_UID if host_uid is None else host_uid,
        output_cap=DEFAULT_OUTPUT_CAP if output_cap is None else output_cap,
        seccomp=seccomp,
        layers=DefaultStore(host_uid, egress) if layers is None else layers,
        egress=egress,
        snapshot_ttl_s=snapshot_ttl_s,
        snapshot_max_mb=snapshot_max_mb,
    )
    if kind == "bwrap":
        return local()
    if kind == "gvisor":  # images are built, and family generators run, on bwrap (`local`)
        return GvisorBackend(layers=layers, output_cap=local.keywords["output_cap"], local=local)
    if kind == "remote":
        if images is None:
            raise SandboxError("sandbox.backend=remote: no hosts given (sandbox.hosts)")
        # made on first run_python only: a remote client (harbor in a chroot) may have no bwrap or compiler
        return RemoteBackend(images.hosts, images.provide, local=local)
    raise SandboxError(f"sandbox.backend: unknown backend {kind!r}; known: {', '.join(KINDS)}")
