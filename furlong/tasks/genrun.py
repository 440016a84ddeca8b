"""Runs a family's generate.py in a sandbox of its own, never in the furlong process.

One run generates many seeds (a process start costs ~50-100 ms; training wants hundreds of instances).
The generator runs in the backend's Python sandbox (furlong.sandbox.base.PythonSpec: no network, an
unprivileged uid, memory and process limits, only the interpreter, furlong and its own family directory
to read), with a time limit per instance. genchild.py, inside, streams each instance back; the host checks
every record (a directory or a regular file, a relative name under a requested seed, size and count
caps) and creates the files itself, so the cache holds only host-owned plain files: no symlink,
device or fifo a generator made can reach it.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from furlong.sandbox.backends import make_backend
from furlong.sandbox.base import PYTHON_LIB, Limits, PythonRun, PythonSpec, SandboxBackend, SandboxError
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
CHILD_SOURCE = (Path(__file__).parent / "genchild.py").read_text()


@functools.cache
def _default_backend() -> SandboxBackend:
    return make_backend("bwrap")


def _spec(family_dir: Path, seeds: list[int]) -> PythonSpec:
    family = f"/families/{family_dir.name}"
    # /out: the child empties it once a quarter full, so an instance at the cap (plus a page per
    # file: a tmpfs counts pages, not bytes) always fits.
    return PythonSpec(
        source=CHILD_SOURCE,
        args=(family, "/out", PYTHON_LIB, *map(str, seeds)),
        read_only=((family, family_dir),),
        limits=Limits(memory_mb=MEMORY_MB, pids=PIDS),
        max_file_bytes=MAX_INSTANCE_BYTES,
        tmp_bytes=TMP_BYTES,
        out_bytes=3 * MAX_INSTANCE_BYTES,
    )


class _Refused(Exception):
    """The generator failed or its output broke a rule; the message is one line for TaskError."""


def generate(
    family_dir: Path,
    seeds: list[int],
    dest: Path,
    timeout_s: float | None = None,
    backend: SandboxBackend | None = None,
) -> None:
    """Writes dest/<seed>/ for every seed (dest must not exist), or raises a one-line TaskError."""
    timeout_s = INSTANCE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        proc = (backend or _default_backend()).run_python(_spec(family_dir, seeds))
    except SandboxError as exc:
        raise TaskError(family_dir.name, "generate.py", f"cannot start the generator sandbox: {exc}") from None
    watchdog = _Watchdog(proc, timeout_s)
    stderr_tail: collections.deque[bytes] = collections.deque(maxlen=64)
    drain = threading.Thread(target=lambda: stderr_tail.extend(iter(lambda: proc.stderr.read(4096), b"")), daemon=True)
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
        proc.release()
    if watchdog.fired:
        problem = (
            f"timed out: no instance finished within {timeout_s:g} s (importing generate.py or "
            f"generating seed {run.pending})"
        )
    elif rc != 0 and (not problem or run.stream_ended):
        problem = _failure(b"".join(stderr_tail), rc)
    if problem:
        raise TaskError(family_dir.name, "generate.py", problem)


class _Watchdog(threading.Thread):
    """Kills the run when no instance finishes within `timeout_s` (progress() restarts the clock)."""

    def __init__(self, proc: PythonRun, timeout_s: float):
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
                self.proc.kill()
                return


def _end(proc: PythonRun, finished: bool) -> int:
    """Its exit status: a run that sent everything gets a moment to exit, any other is killed now."""
    if finished:
        try:
            return proc.wait(EXIT_GRACE_S)
        except TimeoutError:
            pass
    proc.kill()
    return proc.wait()


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
    if not parts or str(raw).startswith("/") or ".." in parts:  # parts: raw is a str
        raise _Refused(f"output entry {raw!r} is not a path inside its seed directory")
    return parts
