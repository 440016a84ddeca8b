"""The buildah command as furlong runs it (buildah.py builds Dockerfiles with it): storage of furlong's own
under the image store (never the system's /var/lib/containers), chroot isolation, and, as root, a mount
namespace of its own for every call and a fenced pasta network for RUN steps. `Buildah` makes a resolved
image a buildah image (import_ref), runs `buildah bud` while reporting its steps (bud), and unpacks a built
image's tree, less what the layers below it already show, into a layer directory (export).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import threading
from collections import deque
from pathlib import Path

from furlong.sandbox.base import DEFAULT_HOST_UID, ImageRef
from furlong.sandbox.images import offline_uv
from furlong.sandbox.images.builds import ImageBuildError, Progress, _locked, _sha
from furlong.sandbox.images.flatten import flatten_to_tar
from furlong.sandbox.images.layerdiff import DiffWriter
from furlong.sandbox.images.layertar import UnpackError, apply_tar_output
from furlong.sandbox.runtime import netns
from furlong.sandbox.runtime.egress import Egress, remove_mount_point

STEP_LINE = re.compile(r"^(?:\[(\d+)/\d+\] )?STEP (\d+)/\d+: (\S+)")  # a step's start in bud's output
_NOISE = ("Close_Fd sealing memfd copy",)  # buildah 1.28 prints this on every RUN; it means nothing
_PRIVATE_MOUNTS = ("unshare", "--mount", "--propagation", "private", "--")


def _build_network():
    """RUN steps under chroot isolation share the caller's network namespace: as root that would be the
    host's (its loopback services included), so the build runs inside a fenced pasta namespace, as a
    networked sandbox does. A user's rootless buildah keeps the user's own network (documented)."""
    if os.geteuid() == 0:
        return netns.joined(DEFAULT_HOST_UID)
    return contextlib.nullcontext([])


def _dns() -> list[str]:
    return ["--dns", netns.DNS_FORWARD] if os.geteuid() == 0 else []


class Buildah:
    """buildah with storage of furlong's own: `<home>/storage` and `<home>/run`, overlay driver."""

    def __init__(self, home: Path):
        self.home = home
        (home / "tmp").mkdir(parents=True, exist_ok=True)

    def _buildah(self, *args: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.home / "storage"),
            "--runroot",
            str(self.home / "run"),
            "--storage-driver",
            "overlay",
            *args,
        ]

    def argv(self, *args: str) -> list[str]:
        """As root, buildah runs in a mount namespace of its own: it mounts its containers' layers where it
        runs, and one killed mid-build (a timeout) never unmounts them, so in the host's namespace each
        would stay until reboot and slow every later sandbox start. (A user's buildah has its own already.)"""
        return [*_PRIVATE_MOUNTS, *self._buildah(*args)] if os.geteuid() == 0 else self._buildah(*args)

    def env(self) -> dict[str, str]:
        return {**os.environ, "TMPDIR": str(self.home / "tmp"), "BUILDAH_ISOLATION": "chroot"}

    def run(self, *args: str, timeout_s: float = 600) -> str:
        proc = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout_s, env=self.env())
        if proc.returncode != 0:
            last = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith(_NOISE)][-1:] or ["?"]
            raise ImageBuildError(f"buildah {args[0]} failed ({proc.returncode}): {last[0][:300]}")
        return proc.stdout

    def check(self) -> None:
        """One line naming what keeps buildah from working here, if anything."""
        if shutil.which("buildah") is None:
            raise ImageBuildError("this Dockerfile needs buildah (apt-get install buildah; install.sh does it)")
        if os.geteuid() != 0:
            proc = subprocess.run(self.argv("unshare", "true"), capture_output=True, text=True, env=self.env())
            if proc.returncode != 0:
                why = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                raise ImageBuildError(
                    f"buildah cannot run without root here ({why}): it needs newuidmap "
                    f"(apt-get install uidmap) and a subuid/subgid range for this user"
                )

    def import_ref(self, ref: ImageRef, layer_dirs: tuple[Path, ...], egress: Egress | None = None) -> str:
        """`localhost/furlong/<digest>`: the resolved image (its layers' directories, top first) as a
        buildah image, made once per digest. With `egress`, `<digest>-egress-<hash of its ENV>`, whose ENV
        also names the host's CA bundle and mirrors (where the image sets none of them itself): RUN steps
        see them, and buildah's own step cache, which ignores --volume and --env, never mixes steps run
        with them and without (its chain starts from another image)."""
        lent = _sha(*(f"{k}={v}" for k, v in egress.env)) if egress else ""
        name = f"localhost/furlong/{ref.digest}" + (f"-egress-{lent}" if egress else "")
        if self._imported(name, ref.user):
            return name
        with _locked(self.home / f".import-{ref.digest}.lock"):
            if self._imported(name, ref.user):
                return name
            tar = self.home / "tmp" / f"{ref.digest}.{os.getpid()}.tar"
            try:
                flatten_to_tar(layer_dirs, tar)
                ctr = self.run("from", "scratch").strip()
                try:
                    self.run("add", "--quiet", ctr, str(tar), "/")
                    own = dict(ref.env)
                    added = [(k, v) for k, v in (egress.env if egress else ()) if k not in own]
                    env = [a for k, v in [*ref.env, *added] for a in ("--env", f"{k}={v}")]
                    user = ["--user", ref.user] if ref.user else []  # RUN steps over it run as its USER
                    self.run("config", *env, *user, "--workingdir", ref.workdir or "/", ctr)
                    self.run("commit", "--quiet", ctr, name)
                finally:
                    subprocess.run(self.argv("rm", ctr), capture_output=True, env=self.env())
            finally:
                tar.unlink(missing_ok=True)
        return name

    def _imported(self, name: str, user: str) -> bool:
        """Whether `name` is made, with the USER it should have (one made before USER was carried has none)."""
        proc = subprocess.run(
            self.argv("inspect", "--type", "image", name), capture_output=True, text=True, env=self.env()
        )
        return (
            proc.returncode == 0
            and (json.loads(proc.stdout).get("OCIv1", {}).get("config") or {}).get("User", "") == user
        )

    def bud(
        self,
        dockerfile: Path,
        context: Path,
        tag: str,
        progress: Progress,
        timeout_s: float,
        egress: Egress | None = None,
        offline: offline_uv.OfflineUv | None = None,
    ) -> tuple[int, list[str]]:
        """Runs the build; its exit status and the last lines of its output. `egress`'s directory is bound
        read-only into every RUN step (its environment comes with the FROM images: import_ref), and so is
        `offline`'s (only the rewritten steps look at it)."""
        # --force-rm: a failed build leaves no working container (nor its overlay mount) behind
        cmd = self.argv(
            "bud",
            "--pull=never",
            "--isolation",
            "chroot",
            "--layers",
            "--force-rm",
            *_dns(),
            *(egress.buildah_args() if egress else []),
            *(offline.volume() if offline else []),
            "-f",
            str(dockerfile),
            "-t",
            tag,
            str(context),
        )
        with _build_network() as prefix:
            return self._follow([*prefix, *cmd], progress, timeout_s)

    def _follow(self, cmd: list[str], progress: Progress, timeout_s: float) -> tuple[int, list[str]]:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env(), errors="replace"
        )
        assert proc.stdout is not None  # stdout=PIPE
        timer = threading.Timer(timeout_s, proc.kill)
        timer.start()
        tail: deque[str] = deque(maxlen=60)
        try:
            for line in proc.stdout:
                line = line.rstrip()
                if line.startswith(_NOISE):
                    continue
                tail.append(line)
                if STEP_LINE.match(line):
                    progress(line[:120])
            proc.wait()
        finally:
            timer.cancel()
        return proc.returncode, list(tail)

    def config(self, tag: str) -> dict:
        return json.loads(self.run("inspect", "--type", "image", tag)).get("OCIv1", {}).get("config") or {}

    def export(
        self,
        tag: str,
        rootfs: Path,
        label: str,
        egress: Egress | None = None,
        below: tuple[Path, ...] = (),
        workdir: str = "/",
    ) -> DiffWriter:
        """Unpacks the image's tree into `rootfs` (as this uid's files), less what the layers `below` (top
        first) already show; the device nodes left out, and the mount point buildah made in it for
        `egress`'s directory. `workdir` is made as Docker's WORKDIR does (buildah only made it if a RUN
        used it)."""
        writer = DiffWriter(rootfs, label, below)
        ctr = self.run("from", "--pull=never", "--quiet", tag).strip()
        try:  # mounted and read in one namespace: root's own (buildah unshare refuses root), else the user's
            script = 'set -e; m=$("$@" mount "$0"); exec tar -C "$m" --numeric-owner -cf - .'
            inside = _PRIVATE_MOUNTS if os.geteuid() == 0 else self._buildah("unshare")
            _untar([*inside, "sh", "-c", script, ctr, *self._buildah()], writer, label, self.env())
        finally:
            subprocess.run(self.argv("rm", ctr), capture_output=True, env=self.env())  # its mount went with sh
        if egress:
            egress.remove_mount_point(rootfs)
        remove_mount_point(rootfs, offline_uv.MOUNT)  # bound where images.offline_uv rewrote a step
        try:
            writer.make_dir(workdir)
        except (UnpackError, OSError) as exc:
            raise ImageBuildError(f"{label}: WORKDIR {workdir}: {exc}") from None
        try:
            writer.finish()
        except OSError as exc:
            raise ImageBuildError(f"{label}: storing the built image's layer failed: {exc}") from None
        return writer


def _untar(source: list[str], writer: DiffWriter, label: str, env: dict[str, str]) -> None:
    try:
        code, err = apply_tar_output(source, writer, env)
    except (UnpackError, tarfile.TarError) as exc:
        raise ImageBuildError(f"{label}: unpacking the built image failed: {exc}") from None
    if code not in (0, 1):  # 1: a file changed while read, as GNU tar reports it
        raise ImageBuildError(f"{label}: reading the built image failed: {err.strip()[-300:]}")
