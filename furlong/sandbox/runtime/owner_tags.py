"""Owner tags: what a sandbox cgroup's name (cgroups.py), or a snapshot store's directory (snapshots.py),
ends with, `@<pid namespace>.<pid>.<start time>` of the furlong process that made it, so that a later run can
tell a thing whose maker is dead (and remove it) from one a live process still uses, or from one whose
maker's pid a later process got. An owner in another pid namespace cannot be checked from here and counts as
alive.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# a name's owner tag (`owner_tag`): the pid namespace, pid and start time of the furlong process that made it
_OWNER = re.compile(r".+@(\d+)\.(\d+)\.(\d+)")


def proc_stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command: [0] the state, [19] the start time (ticks since boot)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _start_time(pid: int | str) -> str | None:
    """The start time of a running process, or None if it is gone (a zombie is gone: its fds are closed)."""
    try:
        fields = proc_stat(pid)
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def owner_tag(pid: int | None = None) -> str:
    """`<pid namespace>.<pid>.<start time>` of this process (or `pid`): the suffix of its cgroups' names."""
    pid = os.getpid() if pid is None else pid
    return f"{os.stat(f'/proc/{pid}/ns/pid').st_ino}.{pid}.{proc_stat(pid)[19]}"


def owner_pid(name: str) -> int | None:
    """The pid of the process a sandbox cgroup's name says made it (None for an untagged one)."""
    m = _OWNER.fullmatch(name)
    return int(m.group(2)) if m else None


def owner_dead(name: str) -> bool:
    """Whether the cgroup's owner is surely dead: its pid in this pid namespace names no process, or a
    later one. Another pid namespace's owner cannot be checked from here, so it counts as alive."""
    m = _OWNER.fullmatch(name)
    if m is None or int(m.group(1)) != os.stat("/proc/self/ns/pid").st_ino:
        return False
    return _start_time(m.group(2)) != m.group(3)
