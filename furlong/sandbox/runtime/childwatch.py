"""How asyncio learns that a sandbox's process ended, on Python 3.11: by a pidfd on the running loop, as 3.12
and later do by default, instead of 3.11's default ThreadedChildWatcher, which keeps a thread blocked in
waitpid() for every live subprocess: a thread per live sandbox, 1,000 threads for 1,000 paused sandboxes
(bench/sandbox_density.py, docs/sandboxes.md "Density": 1.00 thread, 63 KiB of kernel stack and 35 KiB of
furlong's RSS per sandbox, against 0.01 thread, 47 KiB and 20 KiB with a pidfd each, whose cost is one fd;
starts were not slower). An earlier try kept it for the start's speed and was reverted: it gave none.

`install()` swaps it in for the whole process, once, and only where asyncio would otherwise use its default
(a policy or watcher someone chose is left alone) and the kernel has pidfds (5.3+)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import sys
from asyncio import unix_events

log = logging.getLogger(__name__)


class RunningLoopPidfdWatcher(unix_events.AbstractChildWatcher):
    """Python 3.12's _PidfdChildWatcher: each child's pidfd is a reader on the loop that started it (so it
    serves every loop, asyncio.run's included); no thread, no signal handler."""

    def add_child_handler(self, pid, callback, *args):
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(pid)
        loop._add_reader(pidfd, self._do_wait, loop, pid, pidfd, callback, args)

    def _do_wait(self, loop, pid, pidfd, callback, args):
        loop._remove_reader(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped elsewhere: asyncio's own answer for that
            returncode = 255
            log.warning("child process pid %d exit status already read: will report returncode 255", pid)
        else:
            returncode = os.waitstatus_to_exitcode(status)
        os.close(pidfd)
        callback(pid, returncode, *args)

    def remove_child_handler(self, pid):
        return False  # as 3.12's: the reader goes when the child ends

    def attach_loop(self, loop):
        pass

    def close(self):
        pass

    def is_active(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def install() -> bool:
    """Whether the pidfd watcher is in use now (always on 3.12+, where it is asyncio's own default)."""
    if sys.version_info >= (3, 12):
        return True
    policy = asyncio.get_event_loop_policy()
    current = getattr(policy, "_watcher", None)  # 3.11's policy makes its default lazily: None until then
    if isinstance(current, RunningLoopPidfdWatcher):
        return True
    if type(policy) is not asyncio.DefaultEventLoopPolicy or not (
        current is None or type(current) is unix_events.ThreadedChildWatcher
    ):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):  # an old kernel: keep the threads
        return False
    policy.set_child_watcher(RunningLoopPidfdWatcher())
    return True


def raise_fd_limit(want: int = 1 << 16) -> int:
    """Raise this process's soft RLIMIT_NOFILE toward the hard limit (at most `want`), and return it: a live
    sandbox holds 3-4 fds here, so the common soft limit of 1,024 stops a process at ~250 sandboxes
    (docs/sandboxes.md "Density"). The hard limit is left alone: sandboxes could raise their soft one anyway."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
