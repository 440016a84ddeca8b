"""The bwrap backend's Python sandboxes: furlong's own interpreter running untrusted code (a family's
generate.py) that streams its output back, with no image to build first.

The sandbox has every namespace unshared (so no network) and runs as the unprivileged sandbox uid when
furlong is root, with rlimits and (where one can be made) a memory/pids cgroup. It sees only /usr, the
Python installation, the furlong package and the spec's read-only directories, plus small tmpfs /tmp and
/out: no host home, cache, /run or /etc/shadow to read, and no host path to write.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import BinaryIO, cast

import furlong
from furlong.sandbox.base import PYTHON_LIB, PythonSpec, SandboxError
from furlong.sandbox.runtime import cgroups

STAGE = Path("/run/furlong/genmnt")  # as root: where a private mount namespace exposes root-only paths


class HostPythonRun:
    """A running Python sandbox: a bwrap process in a session of its own."""

    def __init__(self, proc: subprocess.Popen, cgroup: cgroups.Cgroup | None):
        self._proc, self._cgroup = proc, cgroup
        self.stdout = cast(BinaryIO, proc.stdout)  # started with stdout=PIPE, stderr=PIPE
        self.stderr = cast(BinaryIO, proc.stderr)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the Python sandbox did not exit within {timeout} s") from None

    def kill(self) -> None:
        # bwrap runs with --die-with-parent in its own pid namespace: killing it ends everything inside.
        try:
            os.killpg(self._proc.pid, 9)
        except ProcessLookupError:
            pass

    def release(self) -> None:
        if self._cgroup is not None:
            self._cgroup.remove()


def start(spec: PythonSpec, bwrap: str, host_uid: int) -> HostPythonRun:
    cgroup = cgroups.create(f"py-{uuid.uuid4().hex[:12]}", spec.limits)
    try:
        proc = subprocess.Popen(
            _command(spec, bwrap, host_uid, cgroup),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        if cgroup:
            cgroup.remove()
        raise SandboxError(f"cannot start the Python sandbox: {exc}") from None
    return HostPythonRun(proc, cgroup)


def _command(spec: PythonSpec, bwrap: str, host_uid: int, cgroup: cgroups.Cgroup | None) -> list[str]:
    """The launcher: [join cgroup, stage root-only paths,] drop uid, rlimits, then bwrap."""
    lib = Path(furlong.__file__).resolve().parent
    binds = [(p, p) for p in _python_paths()] + [(str(lib), f"{PYTHON_LIB}/furlong")]
    binds += [(str(Path(src).resolve()), dst) for dst, src in spec.read_only]
    rlimits = [f"--fsize={spec.max_file_bytes}", "--core=0"]
    if cgroup is None:
        rlimits += [f"--as={spec.limits.memory_mb << 20}", f"--nproc={_nproc_budget(host_uid, spec.limits.pids)}"]
    child = [sys.executable, "-I", "-c", spec.source, *spec.args]
    # the agent's cgroup last: no verifier runs beside host Python, so it keeps the agent's pids limit
    joins = [
        f"echo $$ > {shlex.quote(str(f))}" for f in (cgroup.procs_files + cgroup.agent_procs_files if cgroup else [])
    ]
    if os.geteuid() != 0:
        return _sh(joins, ["prlimit", *rlimits, "--", *_bwrap(bwrap, binds, spec, child)])
    # Root's home is 0700 and bwrap (as the sandbox uid) resolves bind sources by path, so root
    # first bind-mounts each source onto a world-traversable tmpfs in a private mount namespace.
    STAGE.mkdir(parents=True, exist_ok=True)
    for d in (STAGE.parent, STAGE):
        d.chmod(0o755)
    staged = [(str(STAGE / str(i)), dst) for i, (_, dst) in enumerate(binds)]
    mounts = [f"mount -t tmpfs -o size=64k,mode=0755 furlong-gen {STAGE}"]
    mounts += [f"mkdir {s} && mount --bind {shlex.quote(src)} {s}" for (src, _), (s, _) in zip(binds, staged)]
    drop = ["setpriv", f"--reuid={host_uid}", f"--regid={host_uid}", "--clear-groups", "--"]
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        *_sh(joins + mounts, [*drop, "prlimit", *rlimits, "--", *_bwrap(bwrap, staged, spec, child)]),
    ]


def _sh(steps: list[str], argv: list[str]) -> list[str]:
    """argv, after the shell steps (joining the cgroup first, so every later process is in it)."""
    if not steps:
        return argv
    return ["/bin/sh", "-c", " && ".join(steps) + ' && exec "$@"', "furlong-gen", *argv]


def _bwrap(bwrap: str, binds: list[tuple[str, str]], spec: PythonSpec, child: list[str]) -> list[str]:
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "furlong-gen",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--ro-bind",
        "/usr",
        "/usr",
        "--ro-bind-try",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
    ]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    # /tmp first: a checkout or interpreter that lives under the host's /tmp is bound on top of it.
    args += ["--size", str(spec.tmp_bytes), "--tmpfs", "/tmp"]
    for src, dst in sorted(binds, key=lambda b: len(b[1])):  # parents before what is bound inside them
        args += ["--ro-bind", src, dst]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(spec.out_bytes),
        "--tmpfs",
        "/out",
        "--remount-ro",
        "/",
        "--remount-ro",
        "/dev",
        "--chdir",
        "/out",
        "--",
    ]
    return args + child


def _python_paths() -> list[str]:
    """The interpreter's installation (and venv), without paths nested in another one or in /usr."""
    found = [os.path.abspath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable))]
    keep: list[str] = []
    for p in sorted(set(found), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in [*keep, "/usr"]):
            keep.append(p)
    return keep


def _nproc_budget(uid: int, pids: int) -> int:
    """RLIMIT_NPROC counts every process of the uid, so allow what it runs already plus `pids`."""
    count = 0
    for entry in os.scandir("/proc"):
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:
            continue
    return count + pids
