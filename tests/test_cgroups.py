"""Sandbox cgroups that a killed furlong process left are swept, and nothing else is."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from furlong.sandbox import cgroups
from furlong.sandbox.base import Limits


def _rmdir(d) -> None:
    for _ in range(200):  # a killed process leaves its cgroup a moment after wait() returns
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def test_sweep_removes_empty_stale_cgroups_and_spares_busy_and_new_ones():
    cg = cgroups.create(f"sweeptest-{uuid.uuid4().hex[:8]}", Limits())
    if cg is None:
        pytest.skip("this process may not make cgroups here")
    parent = cg.dirs[0]
    stale, busy = parent / "stale", parent / "busy"
    stale.mkdir()
    busy.mkdir()
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        (busy / "cgroup.procs").write_text(str(sleeper.pid))
        assert cgroups.sweep(parent, older_than_s=3600) == 0  # just made: maybe another run's, about to enter
        assert stale.is_dir()
        assert cgroups.sweep(parent, older_than_s=0) == 1
        assert not stale.exists() and busy.is_dir()  # the kernel keeps a cgroup with processes in it
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        _rmdir(busy)
        _rmdir(stale)
        cg.remove()
    assert not parent.exists()
