"""Building one image layer the store's own way (furlong.sandbox.images.store; the verifier toolchain's too): a
Dockerfile's steps after FROM run as root in one build sandbox whose overlay upper directory becomes the layer
(ENV, USER and WORKDIR recorded, COPY's content put in, each RUN run, a RUN fetching uv's installer given the
toolchain's uv with images.offline_uv), then an optional probe whose output says what the layer provides. The
finished layer's owners are sealed and its meta written beside it; it is renamed into place under the
store's build lock, so concurrent builders of one key keep one copy. A failed step is an ImageBuildError
naming the Dockerfile's line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.sandbox.base import BASE_ENV, ImageRef, Limits, SandboxSpec
from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.images import offline_uv
from furlong.sandbox.images.builds import ImageBuildError, _locked, _rmtree
from furlong.sandbox.network import PUBLIC

if TYPE_CHECKING:
    from furlong.sandbox.images.store import ImageStore  # the store the layer is built in (its root, egress, timeout)

BUILD_LIMITS = Limits(cpus=2.0, memory_mb=4096, pids=2048, lifetime_s=3600)


async def build_layer(
    store: ImageStore,
    final: Path,
    parent: ImageRef,
    dockerfile: Path,
    steps,
    backend,
    progress,
    label: str,
    probe: str = "",
    extra: dict | None = None,
    offline: offline_uv.OfflineUv | None = None,
) -> None:
    """Builds the layer at `final` in `store`: `steps` (the parsed `dockerfile`) after FROM run over `parent`
    in one build sandbox of `backend`, then `probe` (its output: the meta's "provides"); the layer's owners
    sealed, its meta written, and the directory renamed into place unless another process built it meanwhile.
    `extra`: more keys for the meta. A failed build leaves nothing behind."""
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    _rmtree(tmp)
    (tmp / "upper").mkdir(parents=True)
    started = time.monotonic()
    try:
        env, workdir, user, provides = await _run_steps(
            tmp / "upper", parent, dockerfile, steps, backend, progress, label, probe, offline, store.build_timeout_s
        )
    except BaseException:
        _rmtree(tmp)  # a failed build leaves nothing behind
        raise
    if store.egress:
        store.egress.remove_mount_point(tmp / "upper")
    await asyncio.to_thread(store._seal, tmp / "upper")
    meta = {
        "env": env,
        "workdir": workdir,
        "user": user,
        "dockerfile": str(dockerfile),
        **(extra or {}),
        **({"egress": store.egress.settings} if store.egress else {}),
        "seconds": round(time.monotonic() - started, 1),
    }
    (tmp / "meta.json").write_text(json.dumps({**meta, "provides": provides} if probe else meta))
    with _locked(store.root / f".{final.name}.lock"):
        if (final / "meta.json").exists():  # another process built it meanwhile
            _rmtree(tmp)
        else:
            _rmtree(final)
            tmp.rename(final)


async def _run_steps(
    upper: Path,
    parent: ImageRef,
    dockerfile: Path,
    steps,
    backend,
    progress,
    label: str,
    probe: str,
    offline: offline_uv.OfflineUv | None,
    timeout_s: float,
):
    """Runs the steps after FROM in one build sandbox, as root (a USER other than root goes to buildah);
    then `probe`, whose output is returned."""
    env: list[tuple[str, str]] = []
    workdir, user = parent.workdir, parent.user
    spec = SandboxSpec(image=parent, network=PUBLIC, limits=BUILD_LIMITS)
    box = await backend.build(spec, upper)
    try:
        for n, step in enumerate(steps[1:], 2):
            progress(f"{label}: step {n}/{len(steps)} {step.op} {step.args[:60]}")
            seen = {**BASE_ENV, **dict(parent.env), **dict(env)}  # what $VAR means at this step
            if step.op == "ENV":
                env += [(k, df.expand(v, seen)) for k, v in df.env_pairs(dockerfile, step)]
            elif step.op == "USER":
                user = df.expand(step.args, seen)
            elif step.op == "WORKDIR":
                workdir = df.next_workdir(workdir, step.args, seen)
                await _must(box, f"mkdir -p {shlex.quote(workdir)}", dockerfile, step, dict(env), "/", timeout_s)
            elif step.op == "COPY":
                await box.put_tar(df.copy_tar(dockerfile.parent, step, workdir, dockerfile), "/")
            else:
                await _run(box, df.run_command(step), dockerfile, step, dict(env), workdir, offline, timeout_s)
        # cwd given: the probe must not save a shell state into the layer (it would set every later
        # sandbox's first cwd and PATH); the state dir is removed all the same
        provides = (await box.exec(probe, timeout_s=60, env=dict(env), cwd="/")).stdout.strip() if probe else ""
        await box.exec("rm -rf /run/furlong-shell", timeout_s=30, cwd="/")
    finally:
        await box.close()
    return env, workdir, user, provides


async def _run(
    box,
    cmd: str,
    dockerfile: Path,
    step,
    env: dict,
    cwd: str,
    offline: offline_uv.OfflineUv | None,
    timeout_s: float,
) -> None:
    """A RUN step; one fetching uv's installer with images.offline_uv on gets the toolchain's uv: its
    directory is copied in for the step alone (a bind would need a sandbox of its own per step)."""
    if offline is None or offline_uv.asked(cmd) is None:
        return await _must(box, cmd, dockerfile, step, env, cwd, timeout_s)
    await box.put_dir(offline.directory, offline_uv.MOUNT)
    await _must(box, offline.command(cmd), dockerfile, step, env, cwd, timeout_s)
    await _must(box, f"rm -rf {offline_uv.MOUNT}", dockerfile, step, {}, "/", timeout_s)  # not in the layer


async def _must(box, cmd: str, dockerfile: Path, step, env: dict, cwd: str, timeout_s: float) -> None:
    res = await box.exec(cmd, timeout_s=timeout_s, cwd=cwd, env=env)
    if not res.ok:
        why = "timed out" if res.timed_out else f"exited {res.exit_code}"
        raise ImageBuildError(f"{dockerfile}:{step.line}: {step.op} {why}:\n{(res.stdout + res.stderr)[-2000:]}")
