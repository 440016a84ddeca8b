"""A task's prebuilt image: Harbor's `[environment] docker_image`, never silently furlong's default base.

Harbor 0.25 runs a task with `docker_image` on that image, pulled, and builds `environment/Dockerfile` instead
only with `--force-build` (environments/definition.py, should_use_prebuilt_docker_image). Here, in order:

1. the image itself: imported by hand under that name, cached by digest from an earlier pull, or pulled now
   from its registry (furlong.sandbox.images.registry), whatever furlong's stand-ins are;
2. else the task's own Dockerfile, built as Harbor's `--force-build` would (a task's docker_image is that
   Dockerfile built and pushed: `harbor admin build --update-config`), with a note saying why;
3. else furlong's stand-in for the reference, where one exists and may serve (python:3.12-slim;
   ubuntu:24.04 with images.ubuntu_standins), its note saying what differs;
4. else one line naming the task's setting, the image and what to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from furlong.sandbox.base import ImageRef, Prebuilt
from furlong.sandbox.images import imports, registry, standins
from furlong.sandbox.images.builds import ImageBuildError, Progress
from furlong.sandbox.images.dockerfile import DockerfileError

log = logging.getLogger(__name__)


async def image(store, source: Prebuilt, backend, progress: Progress) -> ImageRef:
    """The image `source` names, from `store` (an ImageStore), as the module's docstring orders."""
    ref = source.ref
    exact, why = await asyncio.to_thread(_exact, store, ref, progress)
    if exact is not None:
        await asyncio.to_thread(store.check_user, exact, f"{source.where} {ref!r}")
        return exact
    if source.dockerfile is not None:
        note = f"{ref}: not pulled ({why}); built from {source.dockerfile} instead"
        progress(note)
        try:
            built = await store.image(source.dockerfile, backend, progress)
        except (ImageBuildError, DockerfileError) as exc:  # say why the Dockerfile was built at all
            raise ImageBuildError(f"{source.where}: {note}, which failed: {exc}") from None
        return dataclasses.replace(built, note="; ".join(n for n in (note, built.note) if n))
    choice = standins.resolve(ref, store.ubuntu_standins)
    if choice is not None and choice.allowed(store.standin_versions):
        return await store.standin_image(choice, backend, progress)
    if choice is not None:  # a stand-in that may not serve says why in its own line
        why = choice.refusal(store.standin_versions)
    else:
        why = (
            f"{ref}: {why}; furlong has no stand-in for it; bring it with `furlong image import {ref} "
            f"OCI_ARCHIVE`, or `furlong image pull {ref}` where its registry is reachable"
        )
    raise ImageBuildError(f"{source.where}: {why}")


def _exact(store, ref: str, progress: Progress) -> tuple[ImageRef | None, str]:
    """The image itself (imported, cached or pulled), else None and why not."""
    if (meta := imports.find(store.root, ref)) is not None:
        return store.imported_image(meta), ""
    try:
        pulled = store.registry.image(ref, progress, fallback=True)
    except registry.RegistryError as exc:  # an answer that says no (unknown image, auth), or a malformed ref
        return None, str(exc).removeprefix(f"{ref}: ")
    if pulled is None:
        parsed = registry.Reference.parse(ref)
        return None, f"registry {parsed.registry if parsed else ref} unreachable and the image not cached"
    return store.pulled_image(pulled), ""
