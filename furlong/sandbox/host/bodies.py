"""The request bodies of the sandbox host API (/v1, furlong.sandbox.host.app), validated before any sandbox
is touched: a path inside the sandbox is absolute and has no '..'; a create's limits are bounded. `create_spec`
turns a create's body into the SandboxSpec it asks for, answering with the HTTP error a client can act on
(an unknown image, a network this host does not give, the layers it lacks).
"""

# no `from __future__ import annotations`, as in app.py: FastAPI and pydantic read these types at definition time
import posixpath
from typing import Annotated, Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from furlong.sandbox.base import ImageRef, LayerRef, Limits, SandboxSpec, SyscallPolicy
from furlong.sandbox.host.images import resolve_layers
from furlong.sandbox.host.snapshots import SnapshotBody
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.network import NO_NETWORK, PUBLIC, Mode, NetworkPolicy, policy
from furlong.sandbox.runtime import seccomp


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def inside_path(v: str) -> str:
    """An absolute path inside the sandbox with no '..' part: the file API never names a host path, and
    refusing '..' keeps a path's meaning plain to anyone who reads a request log."""
    if not v.startswith("/") or "\0" in v or ".." in v.split("/"):
        raise ValueError(f"path {v!r}: expected an absolute path inside the sandbox, without '..' or NUL")
    return posixpath.normpath(v)


class LayerBody(_Body):
    digest: str
    path: str


class ImageBody(_Body):
    """An image by content, as POST /v1/images answered it (furlong.sandbox.base.ImageRef)."""

    digest: str
    layers: list[LayerBody] = Field(min_length=1, max_length=256)
    env: list[tuple[str, str]] = []
    workdir: str = "/"
    user: str = ""
    note: str = ""

    def ref(self) -> ImageRef:
        return ImageRef(
            digest=self.digest,
            layers=tuple(LayerRef(x.digest, x.path) for x in self.layers),
            env=tuple(self.env),
            workdir=self.workdir,
            user=self.user,
            note=self.note,
        )


class NetworkBody(_Body):
    """A network policy (furlong.sandbox.network): a mode, and allowlist entries for 'allowlist'."""

    mode: Mode
    hosts: list[str] = Field([], max_length=4096)

    def policy(self) -> NetworkPolicy:
        try:
            return policy(self.mode, self.hosts)
        except ValueError as e:
            raise HTTPException(400, f"network: {e}") from e


class CreateBody(_Body):
    image: str | ImageBody = Field("base", description="a name this host serves ('base'), or an image by content")
    network: bool | NetworkBody = Field(False, description="the policy it starts with (true: public, false: none)")
    network_phases: list[NetworkBody] = Field([], max_length=16, description="policies it may switch to later")
    cpus: float = Field(1.0, gt=0, le=64)
    memory_mb: int = Field(2048, ge=64, le=1 << 20)
    pids: int = Field(512, ge=16, le=1 << 16)
    disk_mb: int = Field(1024, ge=16, le=1 << 20)
    lifetime_s: float | None = Field(None, gt=0, description="at most the host's own --lifetime-s")
    seccomp: bool = True
    allow_syscalls: list[str] = Field([], max_length=512)
    snapshot: SnapshotBody | None = Field(None, description="start from this snapshot (its /snapshot answer)")


class ExecBody(_Body):
    cmd: str
    timeout_s: float = Field(60.0, gt=0, le=86400)
    cwd: str | None = None
    env: dict[str, str] | None = None
    as_verifier: bool = False
    stream: bool = Field(False, description="answer with NDJSON lines as the command writes (docs/sandbox-hosts.md)")


# The schema's share of _inside_path (not enforced by it: the validator's message names the rule), so
# a client, or a fuzzer, reading the schema sends absolute paths
ABSOLUTE: dict[str, Any] = {"pattern": "^/"}


class PathBody(_Body):
    path: str = Field(json_schema_extra=ABSOLUTE)
    as_verifier: bool = False
    _check = field_validator("path")(classmethod(lambda cls, v: inside_path(v)))


class ListBody(PathBody):
    depth: int = Field(1, ge=1, le=16)


class WriteBody(PathBody):
    data_b64: str
    mode: int = Field(0o644, ge=0, le=0o7777)


class SwitchBody(_Body):
    network: NetworkBody
    verifier_only: bool = False


class RootsBody(_Body):
    paths: list[Annotated[str, Field(json_schema_extra=ABSOLUTE)]] = Field(max_length=10_000)
    _check = field_validator("paths")(classmethod(lambda cls, v: [inside_path(p) for p in v]))


def create_spec(
    body: CreateBody, images: dict[str, ImageRef], lifetime_s: float, store: ImageStore | None, allow_network: bool
) -> SandboxSpec:
    """The sandbox `body` asks for; a named image this host does not serve is 400, an image by content
    whose layers this host's store lacks is 409 naming them (a client builds them here, then retries)."""
    start = body.network.policy() if isinstance(body.network, NetworkBody) else PUBLIC if body.network else NO_NETWORK
    phases = tuple(p.policy() for p in body.network_phases)
    if any(p.online for p in (start, *phases)) and not allow_network:
        raise HTTPException(400, "network: this host gives sandboxes no network (serve --allow-network)")
    if isinstance(body.image, str):
        if body.image not in images:
            raise HTTPException(400, f"image: unknown image {body.image!r}; this host serves {sorted(images)}")
        image = images[body.image]
    else:
        if store is None:
            raise HTTPException(400, "image: this host serves named images only")
        image = body.image.ref()
        if missing := resolve_layers(store, image):
            raise HTTPException(
                409,
                {
                    "message": f"image {image.digest}: this host lacks {len(missing)} layer(s); "
                    f"build them with POST /v1/images",
                    "missing_layers": missing,
                },
            )
    if body.seccomp:
        try:
            seccomp.check(body.allow_syscalls)
        except seccomp.SeccompError as e:
            raise HTTPException(400, f"allow_syscalls: {e}") from e
    limits = Limits(
        cpus=body.cpus,
        memory_mb=body.memory_mb,
        pids=body.pids,
        disk_mb=body.disk_mb,
        lifetime_s=min(lifetime_s, body.lifetime_s or lifetime_s),
    )
    return SandboxSpec(
        image,
        network=start,
        limits=limits,
        network_phases=phases,
        syscalls=SyscallPolicy(enabled=body.seccomp, allow=tuple(body.allow_syscalls)),
    )
