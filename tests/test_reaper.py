"""furlong.cluster.reaper's watchdog on real processes: what a run leaves is stopped when its driver goes,
including a process that does not carry the tag (Ray's agents overwrite their environment with their
process title, so /proc shows them untagged once they run)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from furlong.cluster.reaper import TAG_ENV, Watchdog

# A tagged "raylet": it starts a child with an empty environment (untagged from its first instruction),
# prints the child's pid, and exits after a while, so the child is orphaned as an agent is when the raylet dies.
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen(['sleep', '300'], env={})\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(float(sys.argv[1]))\n")


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_watchdog_stops_an_untagged_descendant_after_its_tagged_parent_is_gone():
    tag = f"reaper-test-{os.getpid()}"
    watchdog = Watchdog(tag)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "2.5"], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, TAG_ENV: tag})
    child = int(parent.stdout.readline())
    bystander = subprocess.Popen(["sleep", "300"], env={})  # untagged, no tagged ancestor: must be left alone
    try:
        assert parent.wait(30) == 0 and _running(child)  # the tagged parent is gone, its child runs on
        assert f"{TAG_ENV}={tag}".encode() not in Path(f"/proc/{child}/environ").read_bytes()
        watchdog.close()
        deadline = time.monotonic() + 30
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child), "the untagged descendant of a tagged process was left running"
        assert bystander.poll() is None, "a process outside the run was stopped"
    finally:
        bystander.kill()
        if _running(child):
            os.kill(child, 9)
