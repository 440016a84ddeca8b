"""Images: a bootstrapped Debian base rootfs, plus one layer per task Dockerfile, cached by content hash.

A layer is the overlay upper directory left by running the Dockerfile's steps in a build sandbox
(which may use the network); sandboxes stack it read-only over the base. The base is built with
mmdebstrap, as root or (in a user namespace from the user's subuid range) as an ordinary user. As root,
layers are owned by root on disk and sandboxes see them through read-only id-mapped views (layers.py),
so the sandbox uid cannot write them; as a user, they belong to the user, which is the sandbox's uid.
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
from furlong.sandbox import layers, rootless
from furlong.sandbox.base import ImageRef, Limits, SandboxError, SandboxSpec

FORMAT = "4"  # bump when the layout or the base recipe changes, so old caches are not reused
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


def _rmtree(path: Path) -> None:
    """Removes a build's tree, also as an ordinary user, whose overlay work dirs are mode 000 and
    whose image may hold read-only directories (root ignores modes; an owner must chmod first)."""
    if not path.exists():
        return
    if os.geteuid() != 0 and not path.is_symlink():
        os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):  # top-down: each child is opened before descent
            for name in dirnames:
                child = os.path.join(dirpath, name)
                if not os.path.islink(child):
                    os.chmod(child, 0o700)
    shutil.rmtree(path, ignore_errors=True)


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
        check_traversable(self.root, self.host_uid)  # build sandboxes write layers under it by path
        if layers.supported():
            layers.sweep()

    # -- base ---------------------------------------------------------------------------------
    def base_key(self) -> str:
        return "base-" + _sha(FORMAT, "bookworm", "minbase", ",".join(BASE_PACKAGES), self.mirror)

    def base(self, progress: Progress | None = None) -> ImageRef:
        """The base image, bootstrapped the first time (about half a minute)."""
        key = self.base_key()
        final = self.root / key
        if not (final / "meta.json").exists():
            with _locked(self.root / f".{key}.lock"):
                if not (final / "meta.json").exists():
                    self._bootstrap(final, progress or (lambda _: None))
        return ImageRef(key=key, layers=(self._view(final / "rootfs"),))

    def _bootstrap(self, final: Path, progress: Progress) -> None:
        if problem := rootless.base_build_problem():
            raise ImageBuildError(problem)
        tmp = final.with_name(final.name + ".tmp")
        _rmtree(tmp)
        rootfs = tmp / "rootfs"
        rootfs.mkdir(parents=True)
        started = time.monotonic()
        self._mmdebstrap_into(rootfs, progress)
        progress("finishing base rootfs")
        (rootfs / "etc/apt/apt.conf.d/99furlong").write_text(APT_CONF)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        (rootfs / "logs").mkdir(exist_ok=True)
        meta = {"key": final.name, "packages": BASE_PACKAGES, "seconds": round(time.monotonic() - started, 1),
                "builder": f"mmdebstrap {rootless.mmdebstrap_mode()}"}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(final)

    def _mmdebstrap_into(self, rootfs: Path, progress: Progress) -> None:
        """Bootstraps into a tar stream unpacked by this process, so every file belongs to this uid
        (root, or the user: the uid the sandbox maps to its root). /dev is left out: bwrap makes one."""
        cmd = ["mmdebstrap", rootless.mmdebstrap_mode(), "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
               "bookworm", "-", self.mirror]
        untar = ["tar", "-x", "-p", "--no-same-owner", "--numeric-owner", "--exclude=./dev/*", "-C", str(rootfs)]
        boot = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tar = subprocess.Popen(untar, stdin=boot.stdout, stderr=subprocess.PIPE, text=True)
        boot.stdout.close()  # tar holds the pipe now; mmdebstrap sees EPIPE if tar dies
        tail: list[str] = []
        for line in boot.stderr:
            tail = (tail + [line.rstrip()])[-20:]
            progress(f"mmdebstrap: {line.strip()[:100]}")
        tar_err = tar.stderr.read()
        if boot.wait() != 0 or tar.wait() != 0:
            raise ImageBuildError(f"mmdebstrap failed ({boot.returncode}, tar {tar.returncode}):\n"
                                  + "\n".join(tail) + tar_err[-1000:])

    def _view(self, layer: Path) -> Path:
        """As root, the read-only id-mapped view of a root-owned layer; otherwise the layer itself."""
        return layers.readonly_view(layer, self.host_uid) if layers.supported() else layer

    def _seal(self, upper: Path) -> None:
        """As root, hands a built layer to root so the sandbox uid cannot write it (chown clears
        set-id bits, so they are put back)."""
        if os.geteuid() != 0:
            return
        for dirpath, dirnames, filenames in os.walk(upper):
            for name in [".", *dirnames, *filenames]:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                os.lchown(path, 0, 0)
                if st.st_mode & 0o6000 and not os.path.islink(path):
                    os.chmod(path, st.st_mode & 0o7777)

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
        ref = ImageRef(key=key, layers=(await asyncio.to_thread(self._view, final / "upper"), *base.layers),
                       env=tuple(tuple(p) for p in meta["env"]), workdir=meta["workdir"])
        self._resolved[dockerfile] = ref
        return ref

    async def _build_layer(self, final: Path, base: ImageRef, dockerfile: Path, steps, backend, progress) -> None:
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        _rmtree(tmp)
        for d in ("upper", "work"):
            (tmp / d).mkdir(parents=True)
        os.chown(tmp / "upper", self.host_uid, self.host_uid)
        os.chown(tmp / "work", self.host_uid, self.host_uid)
        try:
            env, workdir = await self._run_steps(tmp / "upper", base, dockerfile, steps, backend, progress)
        except BaseException:
            _rmtree(tmp)  # a failed build leaves nothing behind
            raise
        _rmtree(tmp / "work")
        await asyncio.to_thread(self._seal, tmp / "upper")
        (tmp / "meta.json").write_text(json.dumps({"env": env, "workdir": workdir, "dockerfile": str(dockerfile)}))
        with _locked(self.root / f".{final.name}.lock"):
            if (final / "meta.json").exists():  # another process built it meanwhile
                _rmtree(tmp)
            else:
                _rmtree(final)
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
