"""Runs a family's generate.py in a sandbox of its own, never in the furlong process.

One run generates many seeds (a process start costs ~50-100 ms; training wants hundreds of instances).
The generator runs in bubblewrap with every namespace unshared (so no network), as the unprivileged
sandbox uid when furlong is root, with rlimits and (as root) a memory/pids cgroup, and a time limit
per instance. It sees only /usr, the Python installation, the furlong package and its own family
directory, all read-only, plus small tmpfs /tmp and /out: no host home, cache, /run or /etc/shadow
to read, and no host path to write. genchild.py, inside, streams each instance back; the host checks
every record (a directory or a regular file, a relative name under a requested seed, size and count
caps) and creates the files itself, so the cache holds only host-owned plain files: no symlink,
device or fifo a generator made can reach it.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import furlong
from furlong.sandbox import cgroups
from furlong.sandbox.base import Limits
from furlong.sandbox.bwrap import DEFAULT_HOST_UID, bwrap_executable
from furlong.tasks.model import TaskError

INSTANCE_TIMEOUT_S = 60.0  # for each instance; the first one also covers start-up and importing generate.py
MAX_INSTANCE_BYTES = 64 << 20
MAX_INSTANCE_ENTRIES = 10_000  # files and directories
BATCH_SEEDS = 1024  # seeds per run: they travel as arguments
TMP_BYTES = 64 << 20
MEMORY_MB = 1024  # includes what the tmpfs /tmp and /out hold, where a cgroup counts it
PIDS = 64
MAX_HEADER = 8192
EXIT_GRACE_S = 5.0
STAGE = Path("/run/furlong/genmnt")  # as root: where a private mount namespace exposes root-only paths
CHILD_SOURCE = (Path(__file__).parent / "genchild.py").read_text()


class _Refused(Exception):
    """The generator failed or its output broke a rule; the message is one line for TaskError."""


def generate(family_dir: Path, seeds: list[int], dest: Path, timeout_s: float | None = None) -> None:
    """Writes dest/<seed>/ for every seed (dest must not exist), or raises a one-line TaskError."""
    timeout_s = INSTANCE_TIMEOUT_S if timeout_s is None else timeout_s
    cgroup = cgroups.create(f"gen-{uuid.uuid4().hex[:12]}", Limits(memory_mb=MEMORY_MB, pids=PIDS))
    try:
        proc = subprocess.Popen(_command(family_dir, seeds, cgroup), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        if cgroup:
            cgroup.remove()
        raise TaskError(family_dir.name, "generate.py", f"cannot start the generator sandbox: {exc}") from None
    watchdog = _Watchdog(proc, timeout_s)
    stderr_tail: collections.deque[bytes] = collections.deque(maxlen=64)
    drain = threading.Thread(target=lambda: stderr_tail.extend(iter(lambda: proc.stderr.read(4096), b"")),
                             daemon=True)
    watchdog.start()
    drain.start()
    run = _Run(seeds, dest, watchdog)
    problem = None
    try:
        run.receive(proc.stdout)
    except _Refused as exc:
        problem = str(exc)
    except (OSError, ValueError, RecursionError) as exc:  # ValueError, RecursionError: a malformed record
        problem = f"malformed output ({exc})"
    finally:
        rc = _end(proc, run.finished)
        watchdog.stop()
        drain.join(2.0)
        if cgroup:
            cgroup.remove()
    if watchdog.fired:
        problem = (f"timed out: no instance finished within {timeout_s:g} s (importing generate.py or "
                   f"generating seed {run.pending})")
    elif rc != 0 and (not problem or run.stream_ended):
        problem = _failure(b"".join(stderr_tail), rc)
    if problem:
        raise TaskError(family_dir.name, "generate.py", problem)


class _Watchdog(threading.Thread):
    """Kills the run when no instance finishes within `timeout_s` (progress() restarts the clock)."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float):
        super().__init__(daemon=True)
        self.proc, self.timeout_s, self.fired = proc, timeout_s, False
        self.deadline = time.monotonic() + timeout_s
        self._stopped = threading.Event()

    def progress(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.wait(max(0.0, self.deadline - time.monotonic())):
            if time.monotonic() >= self.deadline and self.proc.returncode is None:  # not yet reaped
                self.fired = True
                _kill(self.proc)
                return


def _end(proc: subprocess.Popen, finished: bool) -> int:
    """Its exit status: a run that sent everything gets a moment to exit, any other is killed now."""
    if finished:
        try:
            return proc.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    _kill(proc)
    return proc.wait()


def _kill(proc: subprocess.Popen) -> None:
    # bwrap runs with --die-with-parent in its own pid namespace: killing it ends everything inside.
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass


def _failure(stderr: bytes, rc: int) -> str:
    last = next((ln.strip() for ln in reversed(stderr.decode(errors="replace").splitlines()) if ln.strip()), "")
    killed = " (killed: over its memory or process limit?)" if rc in (-9, 137) else ""
    return f"the generator process exited with status {rc}{killed}: {last[:500] or 'no output'}"


@dataclass
class _Run:
    """The host side of one run's stream: every record is checked, every file made here."""

    seeds: list[int]
    dest: Path
    watchdog: _Watchdog
    done: int = 0  # seeds complete
    current: Path | None = None
    used: list[int] = field(default_factory=lambda: [0, 0])  # bytes, entries of the current seed
    stream_ended: bool = False  # without an "end" or "error" record
    finished: bool = False  # every seed received, then "end"

    @property
    def pending(self) -> int:
        return self.seeds[min(self.done, len(self.seeds) - 1)]

    def receive(self, stream) -> None:
        self.dest.mkdir(parents=True)
        while True:
            line = stream.readline(MAX_HEADER)
            if not line:
                self.stream_ended = True
                raise _Refused("the generator stopped before sending every instance")
            header = json.loads(line)
            if not isinstance(header, dict) or len(header) > 3:
                raise _Refused("malformed output record")
            if "error" in header:
                raise _Refused(" ".join(str(header["error"]).split())[:1000])
            if "end" in header:
                self._next_seed(None)
                self.finished = True
                return
            if "seed" in header:
                self._next_seed(header["seed"])
            else:
                self._entry(header, stream)

    def _next_seed(self, seed: object) -> None:
        if self.current is not None:
            self.done += 1
            self.watchdog.progress()
        expected = self.seeds[self.done] if self.done < len(self.seeds) else None
        if seed != expected or type(seed) not in (int, type(None)):
            got = "the end of its output" if seed is None else f"seed {seed!r}"
            raise _Refused(f"sent {got} where {'the end' if expected is None else f'seed {expected}'} was due")
        if seed is not None:
            self.current, self.used = self.dest / str(seed), [0, 0]
            self.current.mkdir()

    def _entry(self, header: dict, stream) -> None:
        kinds = [k for k in ("dir", "file") if k in header]
        if self.current is None or len(kinds) != 1:
            raise _Refused("malformed output record")
        rel = _checked_path(header[kinds[0]])
        self.used[1] += 1
        if self.used[1] > MAX_INSTANCE_ENTRIES:
            raise _Refused(f"seed {self.pending} wrote more than {MAX_INSTANCE_ENTRIES} files and directories")
        target = self.current.joinpath(*rel)
        if kinds == ["dir"]:
            target.mkdir(mode=0o755)
            return
        size, mode = header.get("size"), header.get("mode")
        if type(size) is not int or type(mode) is not int or size < 0:
            raise _Refused("malformed file record")
        self.used[0] += size
        if self.used[0] > MAX_INSTANCE_BYTES:
            raise _Refused(f"seed {self.pending} wrote more than {MAX_INSTANCE_BYTES >> 20} MiB")
        data = stream.read(size)
        if len(data) != size:
            self.stream_ended = True
            raise _Refused("the generator stopped in the middle of a file")
        # Only this code creates entries under dest, each once, and never through a link. The parent
        # directory must have come in an earlier record, as genchild.py sends them.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o755 if mode & 0o100 else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def _checked_path(raw: object) -> tuple[str, ...]:
    """A relative path that stays inside its seed directory, as parts."""
    parts = PurePosixPath(raw).parts if isinstance(raw, str) and 0 < len(raw) < 4096 and "\0" not in raw else ()
    if not parts or raw.startswith("/") or ".." in parts:
        raise _Refused(f"output entry {raw!r} is not a path inside its seed directory")
    return parts


def _command(family_dir: Path, seeds: list[int], cgroup: cgroups.Cgroup | None) -> list[str]:
    """The launcher: [join cgroup, stage root-only paths,] drop uid, rlimits, then bwrap."""
    lib = Path(furlong.__file__).resolve().parent
    family = f"/families/{family_dir.name}"
    binds = [(p, p) for p in _python_paths() + [str(lib)]] + [(str(family_dir.resolve()), family)]
    rlimits = [f"--fsize={MAX_INSTANCE_BYTES}", "--core=0"]
    if cgroup is None:
        rlimits += [f"--as={MEMORY_MB << 20}", f"--nproc={_nproc_budget()}"]
    child = [sys.executable, "-I", "-c", CHILD_SOURCE, family, "/out", str(lib.parent), *map(str, seeds)]
    joins = [f"echo $$ > {shlex.quote(str(f))}" for f in (cgroup.procs_files if cgroup else [])]
    if os.geteuid() != 0:
        return _sh(joins, ["prlimit", *rlimits, "--", *_bwrap(binds, child)])
    # Root's home is 0700 and bwrap (as the sandbox uid) resolves bind sources by path, so root
    # first bind-mounts each source onto a world-traversable tmpfs in a private mount namespace.
    STAGE.mkdir(parents=True, exist_ok=True)
    for d in (STAGE.parent, STAGE):
        d.chmod(0o755)
    staged = [(str(STAGE / str(i)), dst) for i, (_, dst) in enumerate(binds)]
    mounts = [f"mount -t tmpfs -o size=64k,mode=0755 furlong-gen {STAGE}"]
    mounts += [f"mkdir {s} && mount --bind {shlex.quote(src)} {s}" for (src, _), (s, _) in zip(binds, staged)]
    uid = str(DEFAULT_HOST_UID)
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return ["unshare", "--mount", "--propagation", "private", "--",
            *_sh(joins + mounts, [*drop, "prlimit", *rlimits, "--", *_bwrap(staged, child)])]


def _sh(steps: list[str], argv: list[str]) -> list[str]:
    """argv, after the shell steps (joining the cgroup first, so every later process is in it)."""
    if not steps:
        return argv
    return ["/bin/sh", "-c", " && ".join(steps) + ' && exec "$@"', "furlong-gen", *argv]


def _bwrap(binds: list[tuple[str, str]], child: list[str]) -> list[str]:
    args = [bwrap_executable(), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--cap-drop", "ALL", "--hostname", "furlong-gen", "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--ro-bind", "/usr", "/usr", "--ro-bind-try", "/etc/ld.so.cache",
            "/etc/ld.so.cache"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / top
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    # /tmp first: a checkout or interpreter that lives under the host's /tmp is bound on top of it.
    args += ["--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    for src, dst in sorted(binds, key=lambda b: len(b[1])):  # parents before what is bound inside them
        args += ["--ro-bind", src, dst]
    # /out: the child empties it once a quarter full, so an instance at the cap (plus a page per
    # file: a tmpfs counts pages, not bytes) always fits.
    args += ["--proc", "/proc", "--dev", "/dev",
             "--size", str(3 * MAX_INSTANCE_BYTES), "--tmpfs", "/out",
             "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", "/out", "--"]
    return args + child


def _python_paths() -> list[str]:
    """The interpreter's installation (and venv), without paths nested in another one or in /usr."""
    found = [os.path.abspath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable))]
    keep: list[str] = []
    for p in sorted(set(found), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in [*keep, "/usr"]):
            keep.append(p)
    return keep


def _nproc_budget() -> int:
    """RLIMIT_NPROC counts every process of the uid, so allow what it runs already plus PIDS."""
    uid, count = os.getuid() if os.geteuid() != 0 else DEFAULT_HOST_UID, 0
    for entry in os.scandir("/proc"):
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:
            continue
    return count + PIDS
