"""The `gvisor` backend: each sandbox is a gVisor container (Debian's `runsc`), so the agent's system calls
meet gVisor's own kernel (the sentry) rather than the host's.

A sandbox's root is the image's layers (their files, owned as inside: LayerSource.layer_files) under an
overlay whose writes go to a tmpfs of `Limits.disk_mb`, both mounted by root in a private mount namespace
(`unshare`), so they vanish with it. The container's first process is furlong's own init
(native/init.c, bound read-only at INIT_PATH), which speaks the same protocol over runsc's stdin and
stdout as in bwrap: shell state, timeouts, output caps and streaming are the bwrap sandbox's
(furlong.sandbox.runtime.bwrap_box), and the host reads the overlay's upper directory for tamper tracking.

Not for agents whose reward matters: runsc 0.0~20221219 lets the agent open the init's stdin and stdout
through /proc/1/fd (it refuses /proc/1/mem and /proc/1/root), so it can read the host's requests (the tests,
as they are copied in) and break the channel, which ends the sandbox (tests/test_attacks.py, its gvisor xfails).
What runsc 0.0~20221219 (Debian 12) lacks shapes the rest (docs/sandboxes.md, "The gvisor backend"):
no ambient capabilities, so there is one identity (no verifier uid: `guarantees` says so and every episode
records integrity_checked: false), and no setfsuid (the init's fallback: native/init.c, no_setfsuid); its pids limit is the host's on the sentry's own threads,
so it is set with headroom and a fork bomb can end the sandbox; no network but `no-network`; no snapshots.
Images are built, and family generators run, on the bwrap backend (`local`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from furlong.sandbox.base import (
    BASE_ENV,
    DEFAULT_OUTPUT_CAP,
    ExecResult,
    Guarantees,
    LayerSource,
    PythonRun,
    PythonSpec,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSpec,
    SnapshotRef,
)
from furlong.sandbox.changes import Change, image_entry, overlay_changes
from furlong.sandbox.runtime import idmap, native, users
from furlong.sandbox.runtime import protocol as proto
from furlong.sandbox.runtime.bwrap_box import BwrapSandbox
from furlong.sandbox.runtime.headroom import agent_caps
from furlong.sandbox.runtime.shell import shell_quote

INIT_PATH = "/.furlong-init"  # where the container sees furlong's init (a read-only bind of the host's binary)
STATX_SHIM = "/.furlong-statx.so"  # native/statx.c, on every command's LD_PRELOAD (x86_64 and aarch64)
STATE_DIR = Path("/run/furlong/gvisor")  # runsc's state and each sandbox's bundle, removed at close
SENTRY_MB = 128  # the sentry's own memory, on top of the sandbox's limit (the host cgroup counts both)
SENTRY_PIDS = 1024  # its threads and ptrace stubs, several per guest process (the host cgroup counts them all)
# the init's capabilities: to take the agent's uid and drop every capability for its commands
INIT_CAPS = ["CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"]


def runsc_executable() -> str:
    if env := os.environ.get("FURLONG_RUNSC"):
        return env
    found = shutil.which("runsc") or shutil.which("runsc", path="/usr/sbin:/usr/bin:/sbin:/bin")
    if found is None:
        raise SandboxError("sandbox.backend=gvisor needs gVisor's runsc: apt-get install runsc (or set FURLONG_RUNSC)")
    return found


class GvisorSandbox:
    """A running gVisor sandbox: the init's channel (a BwrapSandbox over runsc's stdio) and the overlay's
    upper directory, read from the host for ChangeTracking. No verifier identity, no snapshots."""

    verifier_uid: int | None = None  # one identity: `as_verifier` runs as the agent

    def __init__(self, channel: BwrapSandbox, upper: Path, lowers: tuple[Path, ...]):
        self._box, self._upper, self._lowers = channel, upper, lowers
        self.name = channel.name

    @property
    def alive(self) -> bool:
        return self._box.alive

    async def exec(
        self,
        cmd: str,
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        as_verifier: bool = False,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecResult:
        return await self._box.exec(cmd, timeout_s, cwd, env, as_verifier, on_output)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, as_verifier: bool = False) -> None:
        await self._box.write_file(path, data, mode, as_verifier)

    async def read_file(self, path: str, as_verifier: bool = False) -> bytes:
        return await self._box.read_file(path, as_verifier)

    async def put_dir(self, src: Path, dest: str, as_verifier: bool = False) -> None:
        await self._box.put_dir(src, dest, as_verifier)

    async def put_tar(self, data: bytes, dest: str, as_verifier: bool = False) -> None:
        await self._box.put_tar(data, dest, as_verifier)

    async def close(self) -> None:
        await self._box.close()

    async def ping(self) -> int:
        """The init's pid as it sees itself (1): it is the container's first process."""
        return await self._box.ping()

    async def changes(self, roots: Sequence[str]) -> tuple[Change, ...] | None:
        """furlong.sandbox.base.ChangeTracking: the upper directory against the image (ids as inside: the
        container maps none); None once the sandbox is gone."""
        if not self.alive:
            return None
        try:
            found = await asyncio.to_thread(overlay_changes, self._upper, self._lowers, roots)
        except OSError:
            return None
        return found if self.alive else None

    async def image_has(self, paths: Sequence[str]) -> frozenset[str] | None:
        return frozenset(p for p in paths if image_entry(self._lowers, p.lstrip("/")) is not None)


class GvisorBackend:
    name = "gvisor"
    guarantees = Guarantees(verifier_identity=False, tamper_tracking=True)

    def __init__(
        self,
        layers: LayerSource | None = None,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        platform: str = "ptrace",
        local: Callable[[], SandboxBackend] | None = None,
    ):
        if os.geteuid() != 0:
            raise SandboxError("sandbox.backend=gvisor needs root (it mounts each sandbox's root and runs runsc)")
        self._runsc = runsc_executable()
        self._layers, self._make_local = layers, local
        self._local: SandboxBackend | None = None
        self.output_cap, self.platform = output_cap, platform
        self._init = native.binary("init")
        self._statx = native.binary("statx") if os.uname().machine in native.SHIM_ARCHES else None
        self._identities: dict[tuple[str, str], users.Identity] = {}

    @property
    def local(self) -> SandboxBackend:
        """The bwrap backend images are built on and family generators run on (made on first need)."""
        if self._local is None:
            if self._make_local is None:
                raise SandboxError("sandbox.backend=gvisor builds images on the bwrap backend, which was not given")
            self._local = self._make_local()
        return self._local

    @property
    def layers(self) -> LayerSource:
        if self._layers is None:
            self._layers = self.local.layers  # type: ignore[attr-defined]  # the bwrap backend's image store
        return self._layers

    async def create(self, spec: SandboxSpec, from_snapshot: SnapshotRef | None = None) -> Sandbox:
        if from_snapshot is not None:
            raise SandboxError("sandbox.backend=gvisor has no snapshots (sandbox.backend=bwrap has)")
        if any(p.online for p in spec.policies):
            raise SandboxError(
                f"sandbox.backend=gvisor gives sandboxes no network, and this one asks for "
                f"{spec.network.describe()}: use sandbox.backend=bwrap for networked tasks"
            )
        lowers = tuple(self.layers.layer_files(layer) for layer in spec.image.layers)
        agent = self._identity(spec, lowers)
        name = "furlong-" + uuid.uuid4().hex[:12]
        work = STATE_DIR / name
        (work / "bundle" / "rootfs").mkdir(parents=True)
        (work / "rw").mkdir()
        (work / "bundle" / "config.json").write_text(json.dumps(self._config(spec, agent, name)))
        secret = proto.new_secret()
        try:
            proc = await asyncio.create_subprocess_exec(
                *["unshare", "--mount", "--propagation", "private", "sh", "-c", self._script(spec, lowers, work, name)],
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=1 << 16,
            )
            proc.stdin.write(secret)  # type: ignore[union-attr]  # stdin=PIPE
        except OSError as exc:
            self._remove(name, work)
            raise SandboxError(f"cannot start runsc ({self._runsc}): {exc}") from exc
        box = BwrapSandbox(proc, None, self.output_cap, spec.limits.lifetime_s, name, secret)
        box.finish = lambda: self._remove(name, work)
        # the launcher's mount namespace holds the upper layer: reached through its /proc root
        return GvisorSandbox(box, Path(f"/proc/{proc.pid}/root{work}/rw/u"), lowers)

    def _script(self, spec: SandboxSpec, lowers: tuple[Path, ...], work: Path, name: str) -> str:
        """Mounts the capped upper layer and the overlay (in unshare's private namespace), then execs runsc."""
        rw, root = shell_quote(str(work / "rw")), shell_quote(str(work / "bundle" / "rootfs"))
        lower = ":".join(str(p) for p in lowers)
        opts = f"lowerdir={lower},upperdir={work}/rw/u,workdir={work}/rw/w"
        runsc = [self._runsc, "--root", str(STATE_DIR / "state"), f"--platform={self.platform}", "--network=none"]
        runsc += ["run", "--bundle", str(work / "bundle"), name]
        return (
            "set -e\n"
            f"mount -t tmpfs -o size={agent_caps(spec.limits).layer}m,mode=0755 furlong {rw}\n"
            f"mkdir {rw}/u {rw}/w\n"
            f"mount -t overlay overlay -o {shell_quote(opts)} {root}\n"
            "exec " + " ".join(shell_quote(a) for a in runsc) + "\n"
        )

    def _config(self, spec: SandboxSpec, agent: users.Identity, name: str) -> dict[str, Any]:
        """The OCI runtime spec: the init as the container's process (root, INIT_CAPS), the image's ENV and
        WORKDIR, limits as the host's cgroup on the whole sandbox (the sentry's share on top)."""
        env = {**BASE_ENV, "HOME": agent.home, **dict(spec.image.env)}
        binds = [(INIT_PATH, self._init)]
        if self._statx is not None:  # runsc 2022 refuses the statx flag coreutils passes (native/statx.c)
            env["LD_PRELOAD"] = " ".join(p for p in (STATX_SHIM, env.get("LD_PRELOAD", "")) if p)
            binds.append((STATX_SHIM, self._statx))
        # the init leaves uid 0 for INIT_UID: runsc 2022 lets a process of the init's uid signal it (SIGKILL
        # included) and read its /proc/1/environ, where Linux keeps a pid namespace's init out of reach
        init_args = [INIT_PATH, "--agent", f"{agent.uid}:{agent.gid}", "--init-uid", str(idmap.INIT_UID)]
        for gid in agent.groups[:64]:
            init_args += ["--agent-group", str(gid)]
        lim = spec.limits
        caps = dict.fromkeys(("bounding", "effective", "permitted"), INIT_CAPS)
        return {
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs", "readonly": False},
            "hostname": "sandbox",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": init_args,
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": spec.image.workdir,
                "capabilities": caps,
                "noNewPrivileges": True,
                # per process, in the sentry: the host's cgroup would end the whole sandbox instead
                "rlimits": [
                    {"type": "RLIMIT_AS", "hard": lim.memory_mb << 20, "soft": lim.memory_mb << 20},
                    {"type": "RLIMIT_NPROC", "hard": lim.pids, "soft": lim.pids},
                ],
            },
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
                {
                    "destination": "/dev/shm",
                    "type": "tmpfs",
                    "source": "shm",
                    "options": [f"size={agent_caps(lim).shm}m"],
                },
                *({"destination": d, "type": "bind", "source": str(s), "options": ["ro", "bind"]} for d, s in binds),
            ],
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                "cgroupsPath": f"/furlong-gvisor/{name}",
                "resources": {
                    "memory": {"limit": (lim.memory_mb + SENTRY_MB) << 20},
                    "cpu": {"quota": int(lim.cpus * 100_000), "period": 100_000},
                    "pids": {"limit": 4 * lim.pids + SENTRY_PIDS},
                },
            },
        }

    def _identity(self, spec: SandboxSpec, lowers: tuple[Path, ...]) -> users.Identity:
        key = (spec.image.digest, spec.image.user)
        if (known := self._identities.get(key)) is None:
            try:
                known = self._identities[key] = users.resolve_user(spec.image.user, lowers)
            except (users.UserError, OSError) as exc:
                raise SandboxError(f"image {spec.image.digest[:12]}: {exc}") from None
        return known

    def _remove(self, name: str, work: Path) -> None:
        """Ends the container (its sentry and gofer) and removes its bundle; the mounts went with unshare's
        namespace when runsc exited."""
        subprocess.run(
            [self._runsc, "--root", str(STATE_DIR / "state"), "delete", "--force", name],
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(work, ignore_errors=True)

    async def build(self, spec: SandboxSpec, layer: Path) -> Sandbox:
        """Image builds run on the bwrap backend: a build's RUN steps are the task's, never the agent's."""
        return await self.local.build(spec, layer)

    def run_python(self, spec: PythonSpec) -> PythonRun:
        return self.local.run_python(spec)
