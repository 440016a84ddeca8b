"""The host's image routes: build (or pull) what a remote client's tasks need, in the host's own store.

`POST /v1/images?kind=dockerfile` takes a tar of a Dockerfile's build context. It is unpacked once per
content (the store keys layers by what they were built from, so the same context never builds twice)
under the host's cache, and built by the store exactly as a local `furlong eval` would build it: same
builders, stand-ins, pulls and build sandboxes. `kind=prebuilt&ref=REF` serves a task's prebuilt image
(furlong.sandbox.images.prebuilt), its body the task's Dockerfile context where it has one (else empty).
`kind=toolchain` builds the verifier toolchain layer and `kind=base` the base image. The answer is the
ImageRef (or Toolchain) as JSON; a create then names it by content (bodies.py resolves its layers in this
store, or answers 409 with the ones it lacks).
"""

# no `from __future__ import annotations`: FastAPI reads the route's Annotated dependencies at definition time
import asyncio
import dataclasses
import hashlib
import io
import logging
import os
import shutil
import tarfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, HTTPException, Request

from furlong.sandbox.base import ImageRef, Prebuilt, SandboxBackend, SandboxError
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.images.toolchain import Toolchain

log = logging.getLogger(__name__)


MAX_CONTEXT_BYTES = 4 << 30  # a build context's unpacked size: a small gzip body can expand far beyond its own


def _unpack(data: bytes, root: Path, max_bytes: int = MAX_CONTEXT_BYTES) -> Path:
    """The context's directory under `root`, unpacked once per content; members that would land outside
    it (absolute, `..`, links out) are refused by tarfile's data filter, and a context whose members add up
    to more than `max_bytes` is refused (413) before anything is written."""
    final = root / hashlib.sha256(data).hexdigest()[:32]
    if final.is_dir():
        os.utime(final)  # in use again: kept by prune_contexts for another CONTEXT_TTL_S
        return final
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        # the members' sizes from their headers (data skipped, never kept), before anything is written
        if sum(member.size for member in tar.getmembers()) > max_bytes:
            raise HTTPException(413, f"body: the build context unpacks to more than {max_bytes} bytes")
        # one per request: two requests of this process for one context (two trials of a task) must not share it
        tmp = root / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir(parents=True)
        try:
            tar.extractall(tmp, filter="data")  # the members read above, not a second parse of the body
            try:
                tmp.rename(final)
            except OSError:  # EEXIST or ENOTEMPTY: another request unpacked the same context meanwhile
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    prune_contexts(root, keep=final)
    return final


CONTEXT_TTL_S = 24 * 3600  # an unpacked context not used for this long goes; no build runs for a day


def prune_contexts(root: Path, keep: Path, ttl_s: float = CONTEXT_TTL_S) -> None:
    """Removes the contexts under `root` not used (unpacked or reused) for `ttl_s`, and leftovers of
    unpacks that died. Each new unpack runs it, so the cache does not grow forever."""
    cutoff = time.time() - ttl_s
    for entry in root.iterdir():
        try:
            stale = entry != keep and entry.lstat().st_mtime < cutoff
        except FileNotFoundError:  # another request removed it meanwhile
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)


def _dockerfile(context: Path, name: str) -> Path:
    path = (context / name).resolve()
    if not path.is_relative_to(context.resolve()) or not path.is_file():
        raise HTTPException(400, f"dockerfile: {name!r} is not a file of the build context")
    return path


def resolve_layers(store: ImageStore, image: ImageRef) -> list[str]:
    """The digests of the image's layers this host's store lacks."""
    missing = []
    for layer in image.layers:
        try:
            store.layer_dir(layer)
        except SandboxError:
            missing.append(layer.digest)
    return missing


def image_routes(
    app: FastAPI,
    store: ImageStore,
    backend: SandboxBackend,
    host_auth: Callable,
    max_context_bytes: int = MAX_CONTEXT_BYTES,
) -> None:
    contexts = store.root.parent / "host-contexts"

    @app.post("/v1/images", dependencies=[Depends(host_auth)])
    async def build(
        request: Request,
        kind: Literal["dockerfile", "prebuilt", "toolchain", "base"] = "dockerfile",
        dockerfile: str = "Dockerfile",
        label: str = "",
        ref: str = "",
        where: str = "",
    ) -> dict:
        if kind == "base":
            return await _built(asyncio.to_thread(store.base, _say))
        if kind == "toolchain":
            return await _built(store.toolchain(backend, _say))
        if kind == "prebuilt" and not ref:
            raise HTTPException(400, "ref: kind=prebuilt needs the image reference")
        data = await request.body()
        path = names = None
        if kind == "dockerfile" or data:  # a prebuilt image's body is the task's Dockerfile context, if any
            try:
                context = await asyncio.to_thread(_unpack, data, contexts, max_context_bytes)
            except (tarfile.TarError, OSError) as e:
                raise HTTPException(400, f"body: expected a tar of the build context ({e})") from e
            path = _dockerfile(context, dockerfile)
            # the client's own path in messages (a failing step names file:line), not this host's copy
            names = {str(path): label, str(context): "<context>"}
        source = path if kind == "dockerfile" else Prebuilt(ref, path, where or "docker_image")
        return await _built(store.image(source, backend, _say), names)


async def _built(build: Awaitable[ImageRef | Toolchain], names: dict[str, str] | None = None) -> dict:
    """The build's result as JSON; its failure (a RUN step, an unknown FROM) as a 400 the client shows. Both
    name the client's paths, not this host's copies (`names`)."""
    try:
        built = dataclasses.asdict(await build)
    except Exception as e:
        text = _named(str(e), names)
        log.warning("image build failed: %s", text)
        raise HTTPException(400, f"image build failed: {type(e).__name__}: {text}") from e
    if "note" in built:  # a prebuilt image built from the task's Dockerfile says so, naming it
        built["note"] = _named(built["note"], names)
    return built


def _named(text: str, names: dict[str, str] | None) -> str:
    for here, there in (names or {}).items():
        text = text.replace(here, there or here)
    return text


def _say(msg: str) -> None:
    log.info("image: %s", msg)
