"""Images: a debootstrap base rootfs, plus one layer per task Dockerfile, cached by content hash.

A layer is the overlay upper directory left by running the Dockerfile's steps in a build sandbox
(which may use the network); sandboxes stack it read-only over the base.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from furlong.paths import cache_dir, check_traversable
from furlong.sandbox import dockerfile as df
from furlong.sandbox.base import ImageRef, Limits, SandboxError, SandboxSpec

FORMAT = "3"  # bump when the layout or the base recipe changes, so old caches are not reused
BASE_PACKAGES = ("python3", "git", "procps", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BUILD_LIMITS = Limits(cpus=2.0, memory_mb=4096, pids=2048, lifetime_s=3600)
APT_CONF = 'APT::Sandbox::User "root";\n'  # apt cannot switch to _apt: only one uid is mapped

Progress = Callable[[str], None]


class ImageBuildError(SandboxError):
    pass


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    """A cross-process lock, so two runs never build the same image at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class ImageStore:
    def __init__(self, root: Path | None = None, host_uid: int | None = None,
                 mirror: str | None = None, build_timeout_s: float = 1800.0):
        from furlong.sandbox.bwrap import DEFAULT_HOST_UID

        self.root = root or cache_dir() / "images"
        self.host_uid = host_uid if host_uid is not None else (DEFAULT_HOST_UID if os.geteuid() == 0 else os.geteuid())
        self.mirror = mirror or os.environ.get("FURLONG_DEBIAN_MIRROR", DEFAULT_MIRROR)
        self.build_timeout_s = build_timeout_s
        self._locks: dict[str, asyncio.Lock] = {}
        self._resolved: dict[Path, ImageRef] = {}  # a task's files do not change within a run
        self.root.mkdir(parents=True, exist_ok=True)
        check_traversable(self.root, self.host_uid)

    # -- base ---------------------------------------------------------------------------------
    def base_key(self) -> str:
        return "base-" + _sha(FORMAT, "bookworm", "minbase", ",".join(BASE_PACKAGES), self.mirror, str(self.host_uid))

    def base(self, progress: Progress | None = None) -> ImageRef:
        """The base image, built with debootstrap the first time (about a minute)."""
        key = self.base_key()
        final = self.root / key
        if not (final / "meta.json").exists():
            with _locked(self.root / f".{key}.lock"):
                if not (final / "meta.json").exists():
                    self._debootstrap(final, progress or (lambda _: None))
        return ImageRef(key=key, layers=(final / "rootfs",))

    def _debootstrap(self, final: Path, progress: Progress) -> None:
        if os.geteuid() != 0:
            raise ImageBuildError("building the base image needs root (debootstrap); run `furlong image build` as root")
        if not shutil.which("debootstrap"):
            raise ImageBuildError("debootstrap not found: apt-get install debootstrap")
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        rootfs = tmp / "rootfs"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", str(rootfs), self.mirror]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail: list[str] = []
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            progress(f"debootstrap: {line.strip()[:100]}")
        if proc.wait() != 0:
            raise ImageBuildError(f"debootstrap failed ({proc.returncode}):\n" + "\n".join(tail))
        progress("finishing base rootfs")
        (rootfs / "etc/apt/apt.conf.d/99furlong").write_text(APT_CONF)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        (rootfs / "logs").mkdir(exist_ok=True)
        # The sandbox maps this uid to its root, so the tree must belong to it to look root-owned inside.
        subprocess.run(["chown", "-R", "--no-dereference", f"{self.host_uid}:{self.host_uid}", str(rootfs)], check=True)
        meta = {"key": final.name, "packages": BASE_PACKAGES, "seconds": round(time.monotonic() - started, 1)}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(final)

    # -- Dockerfile layers -------------------------------------------------------------------
    def layer_key(self, dockerfile: Path, steps: list[df.Instruction]) -> str:
        parts: list[str | bytes] = [FORMAT, self.base_key()]
        workdir = "/"
        for step in steps[1:]:
            parts.append(f"{step.op} {step.args}")
            if step.op == "WORKDIR":
                workdir = step.args
            if step.op == "COPY":  # the content copied is part of the identity, not just its name
                parts.append(df.copy_tar(dockerfile.parent, step, workdir, dockerfile))
        return "layer-" + _sha(*parts)

    async def image(self, dockerfile: Path | None, backend, progress: Progress | None = None) -> ImageRef:
        """The image for a task: the base, or the base plus its Dockerfile's layer (built once)."""
        base = await asyncio.to_thread(self.base, progress)
        if dockerfile is None:
            return base
        if dockerfile in self._resolved:
            return self._resolved[dockerfile]
        steps = df.parse(dockerfile)
        key = await asyncio.to_thread(self.layer_key, dockerfile, steps)
        final = self.root / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if not (final / "meta.json").exists():
                await self._build_layer(final, base, dockerfile, steps, backend, progress or (lambda _: None))
        meta = json.loads((final / "meta.json").read_text())
        ref = ImageRef(key=key, layers=(final / "upper", *base.layers),
                       env=tuple(tuple(p) for p in meta["env"]), workdir=meta["workdir"])
        self._resolved[dockerfile] = ref
        return ref

    async def _build_layer(self, final: Path, base: ImageRef, dockerfile: Path, steps, backend, progress) -> None:
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for d in ("upper", "work"):
            (tmp / d).mkdir(parents=True)
        os.chown(tmp / "upper", self.host_uid, self.host_uid)
        os.chown(tmp / "work", self.host_uid, self.host_uid)
        try:
            env, workdir = await self._run_steps(tmp / "upper", base, dockerfile, steps, backend, progress)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed build leaves nothing behind
            raise
        shutil.rmtree(tmp / "work", ignore_errors=True)
        (tmp / "meta.json").write_text(json.dumps({"env": env, "workdir": workdir, "dockerfile": str(dockerfile)}))
        with _locked(self.root / f".{final.name}.lock"):
            if (final / "meta.json").exists():  # another process built it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)

    async def _run_steps(self, upper: Path, base: ImageRef, dockerfile: Path, steps, backend, progress):
        env: list[tuple[str, str]] = []
        workdir = "/"
        spec = SandboxSpec(image=base, network=True, limits=BUILD_LIMITS)
        box = await backend.create(spec, upper=upper)
        try:
            for n, step in enumerate(steps[1:], 2):
                progress(f"{dockerfile.parent.parent.name}: step {n}/{len(steps)} {step.op} {step.args[:60]}")
                if step.op == "ENV":
                    env += df.env_pairs(dockerfile, step)
                elif step.op == "WORKDIR":
                    workdir = step.args
                    await self._must(box, f"mkdir -p {workdir}", dockerfile, step, dict(env), "/")
                elif step.op == "COPY":
                    await box.put_tar(df.copy_tar(dockerfile.parent, step, workdir, dockerfile), "/")
                else:
                    await self._must(box, df.run_command(step), dockerfile, step, dict(env), workdir)
        finally:
            await box.close()
        return env, workdir

    async def _must(self, box, cmd: str, dockerfile: Path, step, env: dict, cwd: str) -> None:
        res = await box.exec(cmd, timeout_s=self.build_timeout_s, cwd=cwd, env=env)
        if not res.ok:
            why = "timed out" if res.timed_out else f"exited {res.exit_code}"
            raise ImageBuildError(f"{dockerfile}:{step.line}: {step.op} {why}:\n{(res.stdout + res.stderr)[-2000:]}")
