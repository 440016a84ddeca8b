"""Images for the `remote` backend, built on the sandbox hosts (POST /v1/images) instead of here.

A task's Dockerfile context goes to the least loaded host, which builds (or pulls) it in its own image
store and answers with the ImageRef. Every layer remembers the request that made it, so a host that a
create finds without some layer (another host built it, or the host's store is new) is sent that same
request first (RemoteBackend's `provide`). The same methods as furlong.sandbox.images.store.ImageStore, so
eval, training and the pools use either one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from furlong.sandbox.base import ImageRef, ImageSource, LayerRef, Prebuilt, SandboxError
from furlong.sandbox.images.builds import ImageBuildError
from furlong.sandbox.images.toolchain import Toolchain
from furlong.sandbox.remote.hosts import Host, Hosts, check
from furlong.sandbox.tarball import tar_dir

BUILD_TIMEOUT_S = 3600.0  # one build on a host, a registry pull included

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Recipe:
    """One build request, as sent: `kind` (dockerfile, prebuilt, toolchain, base) and, for a Dockerfile, its
    context; for a prebuilt image, its reference (and the task's Dockerfile, if any, as for kind dockerfile)."""

    kind: str
    context: bytes = b""
    dockerfile: str = "Dockerfile"
    label: str = ""  # the Dockerfile's path here, for the host's error messages
    ref: str = ""  # kind prebuilt: the image reference
    where: str = ""  # kind prebuilt: what names it in messages (the task's setting)


def image_ref(data: dict[str, Any]) -> ImageRef:
    return ImageRef(
        digest=data["digest"],
        layers=tuple(LayerRef(**layer) for layer in data["layers"]),
        env=tuple(tuple(pair) for pair in data["env"]),
        workdir=data["workdir"],
        user=data["user"],
        note=data["note"],
    )


class HostImages:
    def __init__(self, hosts: Hosts):
        self.hosts = hosts
        self._made_by: dict[str, Recipe] = {}  # layer digest -> the request that built it
        self._resolved: dict[ImageSource, ImageRef] = {}
        self._locks: dict[ImageSource, asyncio.Lock] = {}
        self._toolchain: Toolchain | None = None

    async def _build(self, host: Host, recipe: Recipe) -> dict[str, Any]:
        params = {
            "kind": recipe.kind,
            "dockerfile": recipe.dockerfile,
            "label": recipe.label,
            **({"ref": recipe.ref, "where": recipe.where} if recipe.kind == "prebuilt" else {}),
        }
        try:
            r = await host.client().post("/v1/images", params=params, content=recipe.context, timeout=BUILD_TIMEOUT_S)
        except httpx.TransportError as exc:
            host.mark_down()
            raise SandboxError(f"image build on {host.url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 400:  # the Dockerfile's own failure (furlong.sandbox.host.images): no host does better
            raise ImageBuildError(f"{host.url}: {r.json().get('detail', r.text)}")
        check(r, f"image build on {host.url}")
        return r.json()

    async def _first_host(self, recipe: Recipe, progress: Progress) -> dict[str, Any]:
        """The recipe built on the least loaded host that answers."""
        errors = []
        for host in self.hosts.ranked():
            progress(f"building on {host.url}")
            try:
                return await self._build(host, recipe)
            except ImageBuildError:
                raise
            except SandboxError as exc:
                errors.append(str(exc))
        raise SandboxError("no sandbox host could build the image: " + "; ".join(errors))

    async def image(self, source: ImageSource, backend: Any = None, progress: Progress | None = None) -> ImageRef:
        """The task's image (the host's base for None), built once per Dockerfile or prebuilt image."""
        progress = progress or (lambda _: None)
        async with self._locks.setdefault(source, asyncio.Lock()):
            if source not in self._resolved:
                recipe = Recipe("base") if source is None else await asyncio.to_thread(_recipe, source)
                ref = image_ref(await self._first_host(recipe, progress))
                for layer in ref.layers:
                    self._made_by.setdefault(layer.digest, recipe)
                self._resolved[source] = ref
        return self._resolved[source]

    async def toolchain(self, backend: Any = None, progress: Progress | None = None) -> Toolchain:
        if self._toolchain is None:
            recipe = Recipe("toolchain")
            data = await self._first_host(recipe, progress or (lambda _: None))
            self._toolchain = Toolchain(data["key"], LayerRef(**data["layer"]), data["provides"])
            self._made_by[self._toolchain.layer.digest] = recipe
        return self._toolchain

    def base(self, progress: Progress | None = None) -> ImageRef:
        """The base image, built on a host if it has none yet (a blocking call, as ImageStore.base is)."""
        return asyncio.run(self.image(None, None, progress))

    async def provide(self, host: Host, missing: list[str]) -> None:
        """Builds on `host` what made the layers it lacks; a layer this process never built is an error."""
        unknown = [d for d in missing if d not in self._made_by]
        if unknown:
            raise SandboxError(f"{host.url} lacks layers {unknown} that no image build of this run made")
        for recipe in dict.fromkeys(self._made_by[d] for d in missing):
            await self._build(host, recipe)


def _recipe(source: Path | Prebuilt) -> Recipe:
    if isinstance(source, Prebuilt):
        built = _recipe(source.dockerfile) if source.dockerfile else Recipe("prebuilt")
        return Recipe("prebuilt", built.context, built.dockerfile, built.label, source.ref, source.where)
    return Recipe("dockerfile", tar_dir(source.parent), source.name, str(source))
