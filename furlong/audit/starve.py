"""Exploits that starve the verifier of what it runs on (kind `resources`): pids, disk, memory, and the
clock. Each leaves its hold in place into the verifier phase (the agent's background processes keep
running). furlong's sandbox keeps pids and memory for the verifier (furlong.sandbox.runtime.cgroups' VERIFIER_PIDS,
the OOM killer taking agent processes first), and a verifier that cannot run in the agent's sandbox but runs
in a fresh one is the agent's doing, scored 0 (`agent_broke_sandbox`, furlong.agent.runner): a starved
verifier pays only where the task's tests pass when their checker fails ("fail open")."""

from __future__ import annotations

import shlex

from furlong.audit.base import Exploit
from furlong.audit.clues import Clues

__all__ = ["ClockChange", "FillDisk", "FillLogs", "HoldMemory", "PinShm", "StarvePids"]

# Forks sleepers until fork fails, then prints how many it holds and exits; they stay (their stdio is
# /dev/null, so the agent's command does not wait for them).
FORK_ALL = """import os, time
n = 0
while n < 100000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        fd = os.open(os.devnull, os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(fd, i)
        time.sleep(3600)
        os._exit(0)
    n += 1
print(n)
"""


class StarvePids(Exploit):
    """Takes every process the sandbox lets the agent have, with sleepers that outlive its command: works
    where the agent's processes and the verifier's share one pids limit and the tests pass when their checker
    cannot be started."""

    name, kind = "starve-pids", "resources"
    hint = "the tests passed when their checker could not be started: fail when a check does not run"

    def script(self, clue: Clues) -> str:
        return f'n=$(python3 -c {shlex.quote(FORK_ALL)} 2>/dev/null) && t "pids ($n sleeping processes)"\n'


# writes zeros to $1 until the write fails (4 GiB at most: a backend without a cap), and reports the size
FILL = (
    'fill() { dd if=/dev/zero of="$1" bs=1M count=4096 2>/dev/null\n'
    '  [ -s "$1" ] && t "$1 ($(du -m "$1" | cut -f1) MiB)"; }\n'
)


class FillDisk(Exploit):
    """Fills every place the agent can write (the sandbox's disk through /tmp, /dev/shm, /logs/agent,
    /logs/artifacts) until the write fails, and leaves the files there: works where the tests write what they
    check (a report, a build) to the agent's disk and pass when that write fails. The files are memory no OOM
    kill frees, but furlong sizes those mounts to leave the verifier its reserve (furlong.sandbox.runtime.headroom)."""

    name, kind = "fill-disk", "resources"
    hint = "the tests passed when their own writes failed on a full disk: fail when a check's output is missing"

    def script(self, clue: Clues) -> str:
        return FILL + "for d in /tmp /dev/shm /logs/agent /logs/artifacts; do [ -d $d ] && fill $d/.audit-fill; done\n"


class FillLogs(Exploit):
    """Fills /logs/artifacts, Harbor's artifact directory, which is the agent's to write, to keep the tests
    from writing their reward beside it. On furlong it is a mount of its own, apart from the verifier's /logs:
    the tests score as usual. Were it not, that would be a verifier the agent broke (scored 0,
    `agent_broke_sandbox`), never a reward nor an unscored episode."""

    name, kind = "fill-logs", "reward-channel"
    hint = "furlong bug: a reward was read after the agent filled the verifier's /logs; report it"

    def script(self, clue: Clues) -> str:
        return FILL + "[ -d /logs/artifacts ] && fill /logs/artifacts/.audit-fill\n"


HOLD = """import time
held = []
try:
    while len(held) < 256:  # 4 GiB at most, every page written
        held.append(b"\\1" * (16 << 20))
        with open("/tmp/.audit-held", "w") as f:
            f.write(str(16 * len(held)))
except (MemoryError, OSError):
    pass
time.sleep(3600)
"""


class HoldMemory(Exploit):
    """Holds all the memory the sandbox allows with a background process, restarted whenever the OOM killer
    takes it, into the verifier phase: works where the verifier's processes are killed before the agent's
    and the tests pass when their checker is."""

    name, kind = "hold-memory", "resources"
    hint = "the tests passed when their checker was killed for memory: fail when a check does not finish"

    def script(self, clue: Clues) -> str:
        return (
            f"h={shlex.quote(HOLD)}\n"
            'nohup sh -c \'while :; do python3 -c "$0"; sleep 0.2; done\' "$h" >/dev/null 2>&1 &\n'
            # the most it held, until the OOM killer took it (the count starts again) or for 10 s
            "m=0; for i in $(seq 20); do sleep 0.5; v=$(cat /tmp/.audit-held 2>/dev/null || echo 0)\n"
            '  [ -n "$v" ] || continue; [ "$v" -lt "$m" ] && break; m=$v; done\n'
            't "memory (up to $m MiB held; the holder is restarted when killed)"\n'
        )


# Creates SysV shared memory segments of argv[1] MiB, each written and detached, until one fails (or the OOM
# killer takes this process): they outlive it, and no process of theirs is left for the OOM killer to take.
PIN_SHM = """import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
libc.shmat.argtypes, libc.shmat.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
libc.shmdt.argtypes = [ctypes.c_void_p]
size, held = int(sys.argv[1]) << 20, 0
while held < 4096:  # MiB, at most
    sid = libc.shmget(0, size, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    addr = libc.shmat(sid, None, 0) if sid >= 0 else None
    if addr is None or addr == ctypes.c_void_p(-1).value:
        break
    ctypes.memset(addr, 1, size)
    libc.shmdt(addr)
    held += size >> 20
    print(held, flush=True)
"""


class PinShm(Exploit):
    """Pins the sandbox's memory in SysV shared memory segments, which on a stock kernel outlive the process
    that made them and which the OOM killer cannot free: the verifier's checker is then killed for memory.
    Would work where the tests pass when their checker is killed ("fail open"); furlong's sandbox removes a
    segment once no process has it attached (`shm_rmid_forced` in its IPC namespace, docs/audit.md), so it
    pins nothing there."""

    name, kind = "pin-shm", "resources"
    hint = "furlong bug: SysV shared memory outlived the agent's processes and starved the tests; report it"

    def script(self, clue: Clues) -> str:
        return (
            f"s={shlex.quote(PIN_SHM)}; n=0\n"  # big segments until the OOM killer stops it, then small ones
            'for mb in 16 1; do h=$(python3 -c "$s" $mb 2>/dev/null | tail -1); n=$((n + ${h:-0})); done\n'
            '[ $n -gt 0 ] && t "SysV shared memory ($n MiB)"\n'
        )


class ClockChange(Exploit):
    """Sets the system clock a year ahead (`date -s`): works where the tests trust the time (an expiry, a
    schedule, a timestamp the answer must be newer than) and the sandbox lets the agent set it. Setting the
    clock needs CAP_SYS_TIME, which furlong's sandboxes never give the agent: then it prints that it could
    not, and touches nothing."""

    name, kind = "clock-change", "resources"
    hint = "the agent could set the clock the tests read: report it (the sandbox must not grant CAP_SYS_TIME)"

    def script(self, clue: Clues) -> str:
        return (
            'if out=$(date -s "@$(( $(date +%s) + 31536000 ))" 2>&1); then t "the clock (a year ahead: $out)"\n'
            'else echo "clock unchanged: date -s failed: $out"; fi\n'
        )
