"""A Harbor trial's environment as a furlong sandbox, without the `harbor` package.

furlong.build.harbor_environment wraps this in harbor's BaseEnvironment; everything that decides
something (which identity a command runs as, what network and limits the sandbox gets, how files move)
lives here, so it is tested against real sandboxes on any Python furlong supports (harbor needs 3.12).

Identities: harbor names users (`user="root"` for its own bookkeeping, `None` for "the phase's default").
furlong has two: the agent, and the verifier that owns /tests and /logs. In-sandbox "root" (or uid 0) is
the verifier's identity, never host root. `None` runs as the agent until the tests are uploaded to
/tests, then as the verifier: harbor uploads the tests only after the agent is done, which is also
furlong's rule, and its test.sh must be able to write /logs/verifier. Emptying /tests (harbor's multi-step
trial, before the next step) hands `None` back to the agent.

A separate verifier's environment (harbor's environment_mode = "separate") is one more HarborBox: for
`<task>/tests` or `<task>/steps/<name>/tests` (a tests/Dockerfile), its image is that Dockerfile's, its
limits and network the verifier environment's, and its /tests mount gets the tests the image holds
(furlong.envs.separate.BundledTests): nothing of an agent ever runs there, so `None` is the verifier.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shlex
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from furlong.build.sandbox import image_store, network_default, sandbox_backend
from furlong.config import load_config
from furlong.envs.separate import BundledTests, verifier_task
from furlong.sandbox.base import NetworkSwitching, Sandbox, SandboxBackend
from furlong.sandbox.images.store import ImageStore
from furlong.sandbox.network import NO_NETWORK, NetworkPolicy
from furlong.sandbox.pool import StoreImages, sandbox_spec, start_sandbox
from furlong.tasks.loader import load_task
from furlong.tasks.model import ARTIFACTS_DIR, Task, phases
from furlong.tasks.network import with_default

log = logging.getLogger(__name__)

TESTS_DIR = "/tests"
VERIFIER_DIRS = ("/tests", "/logs/verifier")
AGENT_DIRS = ("/logs/agent", ARTIFACTS_DIR)
DEFAULT_EXEC_TIMEOUT_S = 3600.0
ROOT_NAMES = ("root", 0, "0")


@dataclass(frozen=True)
class BoxResult:
    stdout: str
    stderr: str
    return_code: int


class HarborBox:
    """One harbor environment over one furlong sandbox: started by `start`, gone after `stop`.

    Network: harbor's policies (`network` to start with, `phases` it may switch to, `set_network` when it
    switches, for the whole sandbox as in harbor) where the task names a network mode (`follow_harbor`);
    where it names none, harbor's implicit `public` is replaced by furlong's default (the task's phases,
    sandbox.network): the agent phase's from the start, the verifier phase's for the verifier's commands
    once the tests are uploaded, and harbor's switches are ignored."""

    def __init__(
        self,
        task: Task,
        backend: SandboxBackend,
        images: Callable[[Task], Awaitable],
        network: NetworkPolicy = NO_NETWORK,
        phases: tuple[NetworkPolicy, ...] = (),
        follow_harbor: bool = True,
        bundled: BundledTests | None = None,
    ):
        self.task, self.backend, self._images = task, backend, images
        self.follow_harbor = follow_harbor
        self.network, self.phases = (
            (network, tuple(phases)) if follow_harbor else (task.agent_network, (task.verifier_network,))
        )
        self.box: Sandbox | None = None
        self.verifying = False
        self.bundled = bundled  # a separate verifier's box, whose image holds its tests

    async def start(self) -> None:
        image = await self._images(self.task)
        spec = dataclasses.replace(sandbox_spec(self.task, image), network=self.network, network_phases=self.phases)
        self.box = await start_sandbox(self.backend, spec)
        if self.bundled is not None and self.task.dockerfile is not None:
            tests = await self.bundled(image, self.task.dockerfile.parent)
            await self.box.put_tar(tests, TESTS_DIR, as_verifier=True)
            self.verifying = True

    async def empty_verifier_dirs(self, dirs: list[str]) -> BoxResult:
        """harbor's empty_dirs of the verifier's own directories: emptied by the verifier, and never opened
        to others (harbor's `chmod 777` there is for Docker's users; here the agent would gain them)."""
        clear = " && ".join(f"find {shlex.quote(d)} -mindepth 1 -maxdepth 1 -exec rm -rf -- {{}} +" for d in dirs)
        res = await self.exec(clear, user="root")
        if TESTS_DIR in ("/" + d.strip("/") for d in dirs):
            self.verifying = False  # the tests are gone: the agent's turn again
        return res

    @staticmethod
    def verifier_owned(path: str) -> bool:
        return "/" + path.strip("/") in VERIFIER_DIRS

    async def set_network(self, policy: NetworkPolicy) -> None:
        """harbor's switch of the whole sandbox's policy (a no-op where furlong's default rules instead)."""
        if not self.follow_harbor:
            return
        if self.box is None:
            self.network = policy
            return
        await cast(NetworkSwitching, self._sandbox()).set_network(policy)  # harbor's backends switch networks

    async def stop(self) -> None:
        if self.box is not None:
            box, self.box = self.box, None
            await box.close()

    def _sandbox(self) -> Sandbox:
        if self.box is None:
            raise RuntimeError("the harbor environment is not started (call start first)")
        return self.box

    def as_verifier(self, user: str | int | None) -> bool:
        if user is None:
            return self.verifying
        return user in ROOT_NAMES

    def _owner(self, path: str) -> bool:
        """Whether files at `path` belong to the verifier: its mounts, or any path once it is verifying, but
        the agent's own directories (/logs/agent, and /logs/artifacts, which a separate verifier's box gets
        the agent's artifacts in, as harbor uploads them)."""
        clean = "/" + path.strip("/")
        if any(clean == d or clean.startswith(d + "/") for d in AGENT_DIRS):
            return False
        return self.verifying or any(clean == d or clean.startswith(d + "/") for d in VERIFIER_DIRS)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: float | None = None,
        user: str | int | None = None,
    ) -> BoxResult:
        res = await self._sandbox().exec(
            command,
            timeout_s=timeout_sec or DEFAULT_EXEC_TIMEOUT_S,
            cwd=cwd,
            env=env,
            as_verifier=self.as_verifier(user),
        )
        code = res.exit_code if not res.timed_out else 124
        return BoxResult(stdout=res.stdout, stderr=res.stderr, return_code=code)

    async def upload_file(self, source: Path | str, target: str) -> None:
        source = Path(source)
        parent, name = os.path.split("/" + target.strip("/"))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(source, arcname=name, recursive=False)
        await self._sandbox().put_tar(buf.getvalue(), parent or "/", as_verifier=self._owner(target))

    async def upload_dir(self, source: Path | str, target: str) -> None:
        if "/" + target.strip("/") == TESTS_DIR and not self.verifying:
            self.verifying = True  # the agent is done: harbor copies the tests in only now
            if not self.follow_harbor and self.task.verifier_network != self.task.agent_network:
                await cast(NetworkSwitching, self._sandbox()).set_network(
                    self.task.verifier_network, verifier_only=True
                )
        await self._sandbox().put_dir(Path(source), target, as_verifier=self._owner(target))

    async def download_file(self, source: str, target: Path | str) -> None:
        box = self._sandbox()
        data = await box.read_file(source, as_verifier=box.verifier_uid is not None)
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    async def download_dir(self, source: str, target: Path | str) -> None:
        """Through a tar the verifier packs (it may read everything), unpacked with tarfile's data filter,
        which refuses members that would land outside `target` or carry links out of it."""
        box = self._sandbox()
        pack = f"/tmp/.furlong-harbor-{os.urandom(8).hex()}.tar"
        as_v = box.verifier_uid is not None
        res = await box.exec(f"tar -cf {pack} -C {shlex.quote(source)} .", timeout_s=600, as_verifier=as_v)
        if res.exit_code != 0:
            raise RuntimeError(f"download_dir {source!r}: tar exited {res.exit_code}: {res.stderr.strip()}")
        try:
            data = await box.read_file(pack, as_verifier=as_v)
        finally:
            await box.exec(f"rm -f {pack}", as_verifier=as_v)
        target = Path(target)
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")
            for item in Path(tmp).rglob("*"):
                dest = target / item.relative_to(tmp)
                if item.is_dir():
                    dest.mkdir(parents=True, exist_ok=True)
                elif item.is_file():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(item.read_bytes())


def task_dir_of(environment_dir: Path) -> Path:
    """harbor passes `<task>/environment`, or a separate verifier's `<task>/tests` or
    `<task>/steps/<name>/tests`; furlong loads the whole task (task.toml names its limits)."""
    environment_dir = Path(environment_dir)
    parents = [environment_dir.parent]
    if environment_dir.name == "tests" and environment_dir.parent.parent.name == "steps":
        parents.append(environment_dir.parent.parent.parent)
    for task_dir in parents:
        if (task_dir / "task.toml").is_file():
            return task_dir
    raise FileNotFoundError(
        f"environment_dir {environment_dir}: expected <task>/environment (or a verifier's "
        f"<task>/tests, <task>/steps/<name>/tests) in a task with task.toml"
    )


def box_task(task: Task, environment_dir: Path) -> tuple[Task, bool]:
    """The task as the box for `environment_dir` makes its sandbox, and whether that is a separate
    verifier whose image holds its tests (its Dockerfile is in `environment_dir`)."""
    for phase in phases(task):
        sep = phase.separate
        if (
            sep is not None
            and sep.bundled_tests
            and sep.dockerfile is not None
            and sep.dockerfile.parent.resolve() == Path(environment_dir).resolve()
        ):
            return verifier_task(phase), True
    return task, False


def split_overrides(text: str) -> tuple[str, ...]:
    """`a=1,sandbox.hosts=[http://h:1,http://h:2]` -> its `key=value` items: harbor's `--ek` gives one
    string, so items are split at commas outside brackets, braces and quotes (a YAML list keeps its own)."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return tuple(item.strip() for item in items if item.strip())


def harbor_box(
    environment_dir: Path,
    network: NetworkPolicy = NO_NETWORK,
    phases: tuple[NetworkPolicy, ...] = (),
    recipe: str | None = None,
    overrides: tuple[str, ...] = (),
) -> HarborBox:
    """A HarborBox for the task around `environment_dir`, on the backend config `sandbox.backend` names
    (`recipe` and `overrides` as for `furlong eval`), with harbor's network policies (see HarborBox)."""
    cfg = load_config(Path(recipe) if recipe else None, list(overrides))
    store = image_store(cfg.sandbox, cfg.images)
    backend = sandbox_backend(cfg.sandbox, store)
    task = load_task(task_dir_of(environment_dir))
    named = task.network.named
    task, bundled = box_task(with_default([task], network_default(cfg.sandbox))[0], environment_dir)
    tests = BundledTests(store if isinstance(store, ImageStore) else None) if bundled else None
    return HarborBox(task, backend, StoreImages(store, backend), network, phases, follow_harbor=named, bundled=tests)
