"""CPU, memory and pid limits for one sandbox through cgroups, v1 (per-controller trees) or v2.

A sandbox's first process writes its own pid into `procs_files` before it drops to the sandbox uid and
starts bwrap, so every process the sandbox ever makes is born inside the limits.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.base import Limits

log = logging.getLogger(__name__)
ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
CFS_PERIOD_US = 100_000


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in one v1 hierarchy (or in v2 when controller is None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller in names.split(",")):
            return path
    return "/"


def _v2_mount() -> Path | None:
    if (ROOT / "cgroup.controllers").exists():
        return ROOT
    if (ROOT / "unified" / "cgroup.controllers").exists():
        return ROOT / "unified"
    return None


@dataclass
class Cgroup:
    dirs: list[Path]  # one per v1 controller, or a single v2 directory
    v2: bool

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for f in self.procs_files:
            try:
                found.update(int(p) for p in f.read_text().split())
            except OSError:
                pass
        return found

    def memory_peak_bytes(self) -> int | None:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            for d in self.dirs:
                try:
                    return int((d / name).read_text())
                except (OSError, ValueError):
                    continue
        return None

    def kill_all(self, wait_s: float = 2.0) -> None:
        """Kills every process in the cgroup (the fork-bomb-proof way where the kernel offers one)."""
        if self.v2 and (self.dirs[0] / "cgroup.kill").exists():
            _write(self.dirs[0] / "cgroup.kill", "1")
        # Without cgroup.kill (v1), pids.max bounds a fork bomb, so a kill loop converges.
        deadline = time.monotonic() + wait_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError as exc:
        log.debug("cgroup write %s=%s failed: %s", path, value, exc)
        return False


def create(name: str, limits: Limits) -> Cgroup | None:
    """Makes a cgroup with the limits, or None where this process may not (then rlimits apply)."""
    try:
        v2 = _v2_mount()
        if v2 is not None and v2 == ROOT:
            return _create_v2(v2, name, limits)
        return _create_v1(name, limits)
    except OSError as exc:
        log.warning("no cgroup for sandbox limits (%s); falling back to rlimits", exc)
        return None


def _create_v1(name: str, limits: Limits) -> Cgroup:
    dirs = []
    for ctrl in V1_CONTROLLERS:
        d = ROOT / ctrl / _own_path(ctrl).lstrip("/") / "furlong" / name
        d.mkdir(parents=True, exist_ok=True)
        dirs.append(d)
    mem, pids, cpu = dirs
    limit = str(limits.memory_mb << 20)
    if not _write(mem / "memory.limit_in_bytes", limit):
        raise OSError(f"cannot set {mem}/memory.limit_in_bytes")
    _write(mem / "memory.memsw.limit_in_bytes", limit)  # present only with swap accounting
    if not _write(pids / "pids.max", str(limits.pids)):
        raise OSError(f"cannot set {pids}/pids.max")
    _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
    _write(cpu / "cpu.cfs_quota_us", str(int(limits.cpus * CFS_PERIOD_US)))
    return Cgroup(dirs=dirs, v2=False)


def _create_v2(mount: Path, name: str, limits: Limits) -> Cgroup:
    # Controllers can only be enabled for children of a cgroup that has no processes of its own,
    # so sandboxes live under a sibling `furlong` cgroup, not under ours.
    parent = mount / _own_path(None).lstrip("/")
    base = (parent.parent if parent != mount else mount) / "furlong"
    base.mkdir(exist_ok=True)
    for level in (base.parent, base):
        _write(level / "cgroup.subtree_control", "+memory +pids +cpu")
    d = base / name
    d.mkdir(exist_ok=True)
    if not _write(d / "memory.max", str(limits.memory_mb << 20)):
        raise OSError(f"cannot set {d}/memory.max (memory controller not delegated)")
    _write(d / "memory.swap.max", "0")
    if not _write(d / "pids.max", str(limits.pids)):
        raise OSError(f"cannot set {d}/pids.max (pids controller not delegated)")
    _write(d / "cpu.max", f"{int(limits.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")
    return Cgroup(dirs=[d], v2=True)
