"""A second sandbox backend plugs in through the protocol alone: image builds, family generators and whole
episodes run on a backend that is not BwrapBackend, and every call they make is a protocol call."""

from __future__ import annotations

import io
import os
import tarfile
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from conftest import run
from furlong.eval.agents import OracleAgent
from furlong.eval.run import run_eval
from furlong.sandbox.backends import KINDS, make_backend
from furlong.sandbox.base import (ExecResult, Guarantees, LayerRef, PythonRun, PythonSpec, Sandbox, SandboxBackend,
                                  SandboxError, SandboxSpec, SnapshotRef)
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.tasks import genrun
from furlong.tasks.loader import load_task
from tests_support import make_task

QUIET = Console(file=open(os.devnull, "w"))


class RecordingSandbox:
    """Delegates every protocol method to a sandbox of another backend and logs the call."""

    def __init__(self, inner: Sandbox, calls: list[str]):
        self._inner, self._calls = inner, calls
        self.verifier_uid = inner.verifier_uid

    async def exec(self, cmd: str, timeout_s: float = 60.0, cwd: str | None = None,
                   env: dict[str, str] | None = None, as_verifier: bool = False) -> ExecResult:
        self._calls.append("exec")
        return await self._inner.exec(cmd, timeout_s=timeout_s, cwd=cwd, env=env, as_verifier=as_verifier)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, as_verifier: bool = False) -> None:
        self._calls.append("write_file")
        await self._inner.write_file(path, data, mode, as_verifier=as_verifier)

    async def read_file(self, path: str, as_verifier: bool = False) -> bytes:
        self._calls.append("read_file")
        return await self._inner.read_file(path, as_verifier=as_verifier)

    async def put_dir(self, src: Path, dest: str, as_verifier: bool = False) -> None:
        self._calls.append("put_dir")
        await self._inner.put_dir(src, dest, as_verifier=as_verifier)

    async def put_tar(self, data: bytes, dest: str, as_verifier: bool = False) -> None:
        self._calls.append("put_tar")
        await self._inner.put_tar(data, dest, as_verifier=as_verifier)

    async def close(self) -> None:
        self._calls.append("close")
        await self._inner.close()

    @property
    def alive(self) -> bool:
        return self._inner.alive


class RecordingBackend:
    """A backend of its own kind that reaches its sandboxes only through another backend's protocol."""

    name = "recording"

    def __init__(self, inner: SandboxBackend):
        self._inner = inner
        self.calls: list[str] = []
        # its sandboxes pass the verifier identity through, but not the inner one's ChangeTracking
        self.guarantees = Guarantees(verifier_identity=inner.guarantees.verifier_identity, tamper_tracking=False)

    async def create(self, spec: SandboxSpec, from_snapshot: SnapshotRef | None = None) -> RecordingSandbox:
        if from_snapshot is not None:
            raise SandboxError("the recording backend has no snapshots")
        self.calls.append("create")
        return RecordingSandbox(await self._inner.create(spec), self.calls)

    async def build(self, spec: SandboxSpec, layer: Path) -> RecordingSandbox:
        self.calls.append("build")
        return RecordingSandbox(await self._inner.build(spec, layer), self.calls)

    def run_python(self, spec: PythonSpec) -> PythonRun:
        self.calls.append("run_python")
        return self._inner.run_python(spec)


def test_an_image_build_and_an_oracle_episode_run_on_another_backend(store, tmp_path: Path):
    backend = RecordingBackend(make_backend("bwrap", layers=store))
    assert isinstance(backend, SandboxBackend) and not isinstance(backend, BwrapBackend)
    task_dir = tmp_path / "seam"
    nonce = uuid.uuid4().hex  # a layer no earlier run has built, so this run builds it
    (task_dir / "environment").mkdir(parents=True)
    (task_dir / "environment" / "greeting.txt").write_text("hello\n")
    (task_dir / "environment" / "Dockerfile").write_text(
        f"FROM furlong/base\nENV NONCE={nonce}\nWORKDIR /app\nCOPY greeting.txt .\nRUN cp greeting.txt built.txt\n")
    task = make_task(tmp_path, "seam", "make /app/answer.txt say hello",
                     'grep -qx hello /app/answer.txt && [ "$(cat /app/built.txt)" = hello ] '
                     "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt",
                     solve="cp /app/built.txt /app/answer.txt")
    [result] = run(run_eval([task], OracleAgent(), backend, store, 1, None, QUIET))
    assert (result.reward, result.status) == (1.0, "ok"), result.error
    assert result.integrity_checked is False, "its sandboxes track no changes: the reward says it was not checked"
    first_close = backend.calls.index("close")
    build_calls = backend.calls[:first_close + 1]
    assert build_calls[0] == "build" and "put_tar" in build_calls and "exec" in build_calls  # COPY, RUN
    episode = backend.calls[first_close + 1:]
    assert episode[0] == "create" and episode[-1] == "close" and episode.count("exec") >= 2  # oracle, verifier
    assert "build" not in episode
    image = run(store.image(task.dockerfile, backend))  # the built layer, as a host elsewhere would fetch it
    with tarfile.open(fileobj=io.BytesIO(store.layer_tar(image.layers[0]))) as layer:
        assert layer.extractfile("app/built.txt").read() == b"hello\n"


def test_a_family_generator_runs_on_another_backend(tmp_path: Path):
    backend = RecordingBackend(make_backend("bwrap"))
    family = Path(__file__).resolve().parent.parent / "tasks" / "count-in-file"
    genrun.generate(family, [0, 1], tmp_path / "out", backend=backend)
    tasks = [load_task(tmp_path / "out" / seed) for seed in ("0", "1")]
    assert backend.calls == ["run_python"]  # one sandboxed run for both seeds
    assert all(t.instruction for t in tasks) and tasks[0].instruction != tasks[1].instruction


def test_an_unknown_backend_is_one_line_naming_the_known_ones():
    with pytest.raises(SandboxError) as err:
        make_backend("firecracker")
    text = str(err.value)
    assert "sandbox.backend" in text and "'firecracker'" in text and all(k in text for k in KINDS) and "\n" not in text


@pytest.mark.parametrize("path", ["/etc", "../..", "no-such-layer"])
def test_a_layer_reference_outside_the_store_is_refused_by_both_resolvers(store, path):
    """A LayerRef comes from an image reference a client may send: it never names a host path."""
    ref = LayerRef("forged", path)
    for resolve in (store.layer_dir, store.layer_tar):
        with pytest.raises(SandboxError, match="is not a layer of the image store"):
            resolve(ref)
