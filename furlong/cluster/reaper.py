"""The Ray processes of one run, found again by a tag in their environment, and a watchdog that stops them
when the driver is gone (even SIGKILLed: Ray stops its head with the driver but leaves its agents running).

    python -m furlong.cluster.reaper TAG DRIVER_PID    (stdin: a pipe from the driver; EOF means it is gone)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TAG_ENV = "FURLONG_RAY_RUN"


def tagged(tag: str, spare: tuple[int, ...] = ()) -> list[int]:
    """Pids of the processes whose environment carries `TAG_ENV=tag`, but this one and `spare`."""
    want, found, skip = f"{TAG_ENV}={tag}".encode(), [], {os.getpid(), *spare}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            if want in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or another user's
            continue
    return found


def sweep(tag: str, spare: tuple[int, ...] = (), grace_s: float = 5.0) -> int:
    """SIGTERM every tagged process, SIGKILL what is left after `grace_s`; how many did not stop."""
    pids = tagged(tag, spare)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while (pids := [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]) and \
                time.monotonic() < deadline:
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
    """The reaper process: it sweeps `tag` once this process closes its pipe, by close() or by dying."""

    def __init__(self, tag: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != TAG_ENV}
        # its own session: a signal to the driver's process group must not take the watchdog with it
        self._proc = subprocess.Popen([sys.executable, "-m", "furlong.cluster.reaper", tag, str(os.getpid())],
                                      stdin=subprocess.PIPE,
                                      env=env, start_new_session=True)

    def close(self, timeout_s: float = 30.0) -> None:
        if self._proc.stdin:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def sweep_until_gone(tag: str, spare: tuple[int, ...] = (), timeout_s: float = 45.0) -> int:
    """Sweeps again while tagged processes remain: a raylet being stopped can still start an agent after
    the pids were read; how many are left at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (left := sweep(tag, spare)) or tagged(tag, spare):
        if time.monotonic() > deadline:
            return left or len(tagged(tag, spare))
        time.sleep(0.2)
    return 0


def main(argv: list[str]) -> int:
    tag, driver = argv[0], int(argv[1])
    sys.stdin.buffer.read()  # returns at EOF: the driver closed the pipe or died
    return 1 if sweep_until_gone(tag, spare=(driver,)) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
