"""The Ray processes of one run, found again by a tag in their environment, and a watchdog that stops them
when the driver is gone (even SIGKILLed: Ray stops its head with the driver but leaves its agents running).

The tag alone is not enough: Ray's agents set their process title over the memory that held their
environment, so /proc shows them untagged. The watchdog therefore also remembers, while it waits, every
descendant of a tagged process (the agents are the raylet's children until it dies), by pid and start time.

    python -m furlong.cluster.reaper TAG DRIVER_PID [VAR]   (stdin: a pipe from the driver; EOF means it is gone)

VAR (default FURLONG_RAY_RUN) names the environment variable that carries the tag: an engine actor guards the
server processes it starts with a tag of its own (furlong.cluster.engines.ChildGuard), so they go with it.

Once they are stopped, the weight arenas those processes left in /dev/shm are deleted too.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from furlong.paths import remove_arenas

TAG_ENV = "FURLONG_RAY_RUN"


def tagged(tag: str, spare: tuple[int, ...] = (), var: str = TAG_ENV) -> list[int]:
    """Pids of the processes whose environment carries `var=tag`, but this one and `spare`."""
    want, found, skip = f"{var}={tag}".encode(), [], {os.getpid(), *spare}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


def family(tag: str, spare: tuple[int, ...] = (), var: str = TAG_ENV) -> dict[int, int]:
    """pid -> start time (clock ticks since boot) of the tagged processes and all their descendants."""
    parent, started = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry.name)], started[int(entry.name)] = int(fields[1]), int(fields[19])
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    skip = {os.getpid(), *spare}
    todo, found = [p for p in tagged(tag, spare, var) if p in started], {}
    while todo:
        pid = todo.pop()
        if pid not in found and pid not in skip:
            found[pid] = started[pid]
            todo.extend(children.get(pid, ()))
    return found


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def sweep(
    tag: str, spare: tuple[int, ...] = (), grace_s: float = 5.0, var: str = TAG_ENV, known: dict[int, int] | None = None
) -> int:
    """SIGTERM every tagged process, its descendants and those of `known` (pid -> start time) still
    running, SIGKILL what is left after `grace_s`; how many did not stop."""
    now = family(tag, spare, var)
    pids = [*now, *(p for p, t in (known or {}).items() if p not in now and _start_time(p) == t)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while (
            pids := [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pids:
            break
    return len(pids)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


class Watchdog:
    """The reaper process: it sweeps `tag` (in `var`) once this process closes its pipe, by close() or by dying."""

    def __init__(self, tag: str, var: str = TAG_ENV) -> None:
        env = {k: v for k, v in os.environ.items() if k != var}  # not its own prey
        # its own session: a signal to the driver's process group must not take the watchdog with it
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "furlong.cluster.reaper", tag, str(os.getpid()), var],
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def sweep_until_gone(
    tag: str,
    spare: tuple[int, ...] = (),
    timeout_s: float = 45.0,
    var: str = TAG_ENV,
    known: dict[int, int] | None = None,
) -> int:
    """Sweeps again while tagged processes remain: a raylet being stopped can still start an agent after
    the pids were read; how many are left at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (left := sweep(tag, spare, var=var, known=known)) or tagged(tag, spare, var):
        if time.monotonic() > deadline:
            return left or len(tagged(tag, spare, var))
        time.sleep(0.2)
    return 0


def watch(tag: str, spare: tuple[int, ...], var: str, poll_s: float = 1.0) -> dict[int, int]:
    """Until stdin reaches EOF, the run's processes seen so far (pid -> start time), looked up every
    `poll_s` seconds."""
    known: dict[int, int] = {}
    while True:
        known.update(family(tag, spare, var))
        ready, _, _ = select.select([0], [], [], poll_s)
        if ready and not os.read(0, 4096):
            return known


def main(argv: list[str]) -> int:
    tag, driver, var = argv[0], int(argv[1]), argv[2] if len(argv) > 2 else TAG_ENV
    known = watch(tag, (driver,), var)  # returns at EOF: the driver closed the pipe or died
    known.update(family(tag, (driver,), var))
    left = sweep_until_gone(tag, spare=(driver,), var=var, known=known)
    remove_arenas(set(known))  # a killed trainer actor's weights in /dev/shm (furlong.sync.handover)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
