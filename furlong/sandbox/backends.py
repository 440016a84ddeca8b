"""The one place a sandbox backend is chosen by name (config `sandbox.backend`).

A kind whose dependencies are optional (a remote host's client, a VM runner) is imported only when picked.
"""

from __future__ import annotations

from furlong.sandbox.base import DEFAULT_HOST_UID, DEFAULT_OUTPUT_CAP, LayerSource, SandboxBackend, SandboxError
from furlong.sandbox.bwrap import BwrapBackend

KINDS = ("bwrap",)


def make_backend(kind: str, *, layers: LayerSource | None = None, host_uid: int | None = None,
                 output_cap: int | None = None, seccomp: bool = True) -> SandboxBackend:
    """A backend of `kind`, resolving image layers through `layers` (an ImageStore)."""
    if kind == "bwrap":
        return BwrapBackend(host_uid=DEFAULT_HOST_UID if host_uid is None else host_uid,
                            output_cap=DEFAULT_OUTPUT_CAP if output_cap is None else output_cap,
                            seccomp=seccomp, layers=layers)
    raise SandboxError(f"sandbox.backend: unknown backend {kind!r}; known: {', '.join(KINDS)}")
