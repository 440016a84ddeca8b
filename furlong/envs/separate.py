"""Harbor's separate verifier (`environment_mode = "separate"`): the tests run in a sandbox of their own,
which receives the agent's artifacts (furlong.tasks.artifacts) and nothing else of the agent's.

Its image is the task's tests/Dockerfile, built with the tests directory as its context, which holds the
tests at /tests itself (Harbor's template: `COPY . /tests/`); or, without one, a fresh sandbox of the
task's own image, into which the tests are copied as in the agent's. Its limits and network are the
verifier environment's ([verifier.environment], else [environment]).

/tests is a verifier mount in every furlong sandbox (docs/sandboxes.md), which hides what an image holds
there, so the image's own /tests is read from its layers on this host (`BundledTests`) and copied into the
mount: the tests that run are exactly the ones the image holds (where the image store is on this host).

The verifier's sandbox is the task's: its image not building, or the sandbox not starting, is never the
agent's doing (`VerifierUnavailable`: the episode is unscored).

What the verifier trusts there: the agent never ran in that sandbox, so its only trace is the artifacts.
They are placed as the sandbox's agent uid (as the agent's files are in a shared sandbox; as the verifier
when the image's USER is not root, which could not create them), so furlong.tasks.integrity's rule
applies to exactly them: an artifact landing where the tests' toolchain lives counts as tampering, data
anywhere else never does, and what the tests themselves change never counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from furlong.envs.base import describe
from furlong.sandbox.base import HostLost, ImageRef, LayerSource, Sandbox
from furlong.sandbox.images.flatten import subtree_tar
from furlong.sandbox.pool import sandbox_spec
from furlong.sandbox.tarball import tar_dir
from furlong.tasks import artifacts
from furlong.tasks.model import TESTS_DIR, Task, TaskNetwork


class VerifierUnavailable(Exception):
    """The separate verifier's image or sandbox could not be had: the task's or the host's failure."""


def verifier_task(phase: Task) -> Task:
    """The task as its separate verifier's sandbox is made: that environment's image, limits and network."""
    sep = phase.separate
    assert sep is not None
    # no agent runs there: every command (the artifacts' placing, the tests) has the tests' network
    tests = TaskNetwork(agent=phase.verifier_network, verifier=phase.verifier_network)
    return dataclasses.replace(
        phase, dockerfile=sep.dockerfile, network=tests, limits=sep.limits, syscalls=sep.syscalls
    )


class BundledTests:
    """An image's own /tests as a tar (owner-only modes, as furlong puts tests in), read from its layers
    once per image. Without this host's image store (sandbox hosts that build images themselves), the
    Dockerfile's context directory stands in: what Harbor's template, `COPY . /tests/`, puts there."""

    def __init__(self, layers: LayerSource | None):
        self.layers = layers
        self._cache: dict[str, bytes] = {}

    async def __call__(self, image: ImageRef, context: Path) -> bytes:
        if self.layers is None:
            return await asyncio.to_thread(tar_dir, context, 0o700)
        if image.digest not in self._cache:
            dirs = [self.layers.layer_dir(layer) for layer in image.layers]
            tests = await asyncio.to_thread(subtree_tar, dirs, TESTS_DIR.strip("/"), 0o700)
            if tests is None:
                raise VerifierUnavailable(
                    f"the verifier's image has no {TESTS_DIR} directory (tests/Dockerfile should COPY the tests there)"
                )
            self._cache[image.digest] = tests
        return self._cache[image.digest]


@dataclasses.dataclass(frozen=True)
class VerifierBox:
    """A started separate verifier sandbox, its image, and the tests for /tests (None: the task's own)."""

    sandbox: Sandbox
    image: ImageRef
    tests: bytes | None


async def verifier_image(phase: Task, sandboxes, bundled: BundledTests) -> tuple[Task, ImageRef, bytes | None]:
    """The phase's verifier task, its image, and the tests its image holds (None: the task's own go in)."""
    vt = verifier_task(phase)
    image = await sandboxes.image(vt)
    sep = vt.separate
    assert sep is not None  # verifier_task keeps the phase's separate environment
    tests = await bundled(image, sep.dockerfile.parent) if sep.bundled_tests and sep.dockerfile else None
    return vt, image, tests


async def start_verifier(phase: Task, sandboxes, bundled: BundledTests) -> VerifierBox:
    """The phase's verifier sandbox, started (`sandboxes`: furlong.envs.harbor.SandboxSource)."""
    try:
        vt, image, tests = await verifier_image(phase, sandboxes, bundled)
        box = await sandboxes.acquire(sandbox_spec(vt, image))
    except (HostLost, VerifierUnavailable):
        raise
    except Exception as exc:
        raise VerifierUnavailable(f"the verifier's sandbox did not start: {describe(exc)}") from exc
    return VerifierBox(box, image, tests)


Wrapped = TypeVar("Wrapped", bound=Sandbox)  # what `wrap` makes of the verifier's sandbox


async def hand_over(
    phase: Task,
    agent_box: Sandbox,
    release: Callable[[], Awaitable[None]] | None,
    sandboxes,
    bundled: BundledTests,
    wrap: Callable[[Sandbox], Wrapped],
) -> tuple[VerifierBox | None, Wrapped | None, str]:
    """The agent's artifacts collected and placed in a new verifier sandbox: (that sandbox, the wrapped
    sandbox the tests are to use, "") or (None, None, what went wrong) where it may be the agent's doing.
    `release` (the agent's sandbox's last use, as Harbor stops it) runs once the artifacts are out.
    Raises VerifierUnavailable where it cannot be the agent's."""
    try:
        collected = await artifacts.collect(agent_box, artifacts.entries(phase))
    except HostLost:
        raise
    except artifacts.ArtifactsError as exc:
        return None, None, f"artifacts: {exc}"
    except Exception as exc:  # noqa: BLE001 -- the agent's sandbox failing is judged as the tests' no-reward is
        return None, None, f"artifacts: {describe(exc)}"
    if release is not None:
        await release()
    vbox = await start_verifier(phase, sandboxes, bundled)
    guard = wrap(vbox.sandbox)
    try:
        await artifacts.place(guard, collected, as_verifier=getattr(guard, "agent_uid", 0) != 0)
    except HostLost:
        await vbox.sandbox.close()
        raise
    except Exception as exc:  # noqa: BLE001 -- what the agent's artifacts may cause: judged by a control run
        await vbox.sandbox.close()
        return None, None, f"placing the artifacts in the verifier's sandbox: {describe(exc)}"
    return vbox, guard, ""
