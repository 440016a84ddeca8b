"""CPU, memory and pid limits for one sandbox through cgroups, v1 (per-controller trees) or v2.

A sandbox's first process writes its own pid into `procs_files` before it drops to the sandbox uid and
starts bwrap, so every process the sandbox ever makes is born inside the limits. The init moves each agent
command into `agent_procs_files`, a nested cgroup whose pids limit is the agent's alone: a fork bomb left
running there cannot take the VERIFIER_PIDS the sandbox keeps beyond it for the init and the verifier.

Layout (S = the sandbox's cgroup, which holds the memory, cpu and total pids limits):
  v2: S/init (the launcher, bwrap, the init, the verifier) and S/agent, siblings, because a v2 cgroup with
      controllers enabled for its children may hold no processes itself;
  v1: S in each controller's tree, holding every process, and S/agent in the pids tree only.
Without a cgroup (rlimits) there is no nested headroom: agent and verifier share one RLIMIT_NPROC.
Pausing freezes S whole (v2 cgroup.freeze; v1 the freezer tree's S, made where that hierarchy is mounted).
A sandbox cgroup's name ends with its maker's owner tag (owner_tags.py), so a later run sweeps those whose
maker died.
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.base import Limits
from furlong.sandbox.runtime.owner_tags import owner_dead, owner_pid, owner_tag, proc_stat

log = logging.getLogger(__name__)
ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")
V1_FREEZER = "freezer"  # optional: without it a v1 sandbox cannot be paused
FREEZE_WAIT_S = 5.0  # how long a freeze may take before it is an error (the kernel freezes task by task)
CFS_PERIOD_US = 100_000
# pids the sandbox keeps beyond the agent's limit: the init and bwrap (3), and the verifier's test run
# (a shell, pytest or uv, and the processes they start)
VERIFIER_PIDS = 64


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


@dataclass(frozen=True)
class Cgroup:
    dirs: list[Path]  # the sandbox's cgroup, holding its limits: one per v1 controller, or a single v2 directory
    v2: bool
    procs_files: list[Path]  # the launcher joins these: every sandbox process is born inside
    agent_procs_files: list[Path]  # the init moves each agent command here: the agent's own pids limit
    freezer: Path | None = None  # v1: the sandbox's directory in the freezer tree, if there is one

    def _tree(self) -> list[Path]:
        """Every directory of this sandbox's cgroups, children before their parent."""
        dirs = [*self.dirs, *([self.freezer] if self.freezer else [])]
        return [*(f.parent for f in self.agent_procs_files + self.procs_files if f.parent not in dirs), *dirs]

    def freeze(self, frozen: bool) -> None:
        """Freezes (or thaws) every process of the sandbox, and returns once the kernel says it is done:
        frozen processes get no CPU and keep their memory. OSError where this cgroup cannot be frozen."""
        if self.v2:
            _set_frozen(self.dirs[0] / "cgroup.freeze", "1" if frozen else "0")
            _await_state(self.dirs[0] / "cgroup.events", f"frozen {int(frozen)}", in_lines=True)
        elif self.freezer is not None:
            _set_frozen(self.freezer / "freezer.state", "FROZEN" if frozen else "THAWED")
            _await_state(self.freezer / "freezer.state", "FROZEN" if frozen else "THAWED")
        else:
            raise OSError(f"no freezer cgroup for {self.dirs[0].name} (cgroup v1 without the freezer hierarchy)")

    def memory_bytes(self) -> int | None:
        """Memory charged to the sandbox now (its writable layer's tmpfs pages included)."""
        return self._first_int(("memory.usage_in_bytes", "memory.current"))

    def cpu_seconds(self) -> float:
        """CPU time the sandbox's processes used so far (user + system), from the processes' own counters."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids():
            try:
                fields = proc_stat(pid)
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])
        return total / ticks

    def pids(self) -> set[int]:
        """Every process of the sandbox, the agent's and the init's."""
        return _procs([d / "cgroup.procs" for d in self._tree()])

    def agent_pids(self) -> set[int]:
        """The processes of agent commands, which the agent's pids limit bounds."""
        return _procs(self.agent_procs_files)

    def _first_int(self, names: tuple[str, ...]) -> int | None:
        """The first of the files `names` (v1's name, then v2's) that one of the sandbox's dirs holds."""
        for name in names:
            for d in self.dirs:
                try:
                    return int((d / name).read_text())
                except (OSError, ValueError):
                    continue
        return None

    def memory_peak_bytes(self) -> int | None:
        return self._first_int(("memory.max_usage_in_bytes", "memory.peak"))

    def kill_all(self, wait_s: float = 2.0) -> None:
        """Kills every process in the cgroup (the fork-bomb-proof way where the kernel offers one)."""
        _kill_tree(self._tree(), wait_s)

    def remove(self) -> None:
        _thaw(self._tree())  # a frozen (v1) process takes its SIGKILL only once thawed
        self.kill_all()
        _remove_tree(self._tree())


def _set_frozen(path: Path, value: str) -> None:
    path.write_text(value)


def _await_state(path: Path, want: str, in_lines: bool = False) -> None:
    deadline = time.monotonic() + FREEZE_WAIT_S
    while True:
        text = path.read_text()
        if (want in text.splitlines()) if in_lines else text.strip() == want:
            return
        if time.monotonic() > deadline:
            raise OSError(f"{path}: still not {want!r} after {FREEZE_WAIT_S:.0f}s")
        time.sleep(0.0005)


def _thaw(tree: list[Path]) -> None:
    for d in tree:
        for name, value in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
            if (d / name).exists():
                _write(d / name, value)


def _kill_tree(tree: list[Path], wait_s: float = 2.0) -> None:
    """Kills every process in the cgroup directories `tree` (a sandbox's, children first)."""
    if (tree[-1] / "cgroup.kill").exists():  # v2
        _write(tree[-1] / "cgroup.kill", "1")
    # Without cgroup.kill (v1), pids.max bounds a fork bomb, so a kill loop converges.
    deadline = time.monotonic() + wait_s
    while (pids := _procs([d / "cgroup.procs" for d in tree])) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(POLL_S)


# A process just killed leaves its cgroup within a millisecond or so: polled this often, a sandbox's close
# waits for that, not for a coarse sleep (10 ms steps made 8 ms of a close's p50: bench/sandbox_cold_start.py)
POLL_S = 0.001
REMOVE_WAIT_S = 0.5


def _remove_tree(tree: list[Path]) -> bool:
    """Removes the cgroup directories `tree`, children first (a cgroup with children cannot be removed);
    whether all went. A process just killed leaves its cgroup a moment later, hence the retries."""
    deadline = time.monotonic() + REMOVE_WAIT_S
    for d in tree:
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
    return not any(d.exists() for d in tree)


def _procs(files: list[Path]) -> set[int]:
    found: set[int] = set()
    for f in files:
        try:
            found.update(int(p) for p in f.read_text().split())
        except OSError:  # removed meanwhile
            pass
    return found


# An untagged cgroup (from an earlier version) is removed only once empty and this old: its launcher enters
# it milliseconds after making it, so an empty one this old was left by a killed run.
STALE_AFTER_S = 60.0
_swept: set[Path] = set()


def sweep(parent: Path, older_than_s: float = STALE_AFTER_S) -> int:
    """Removes the sandbox cgroups under `parent` that dead furlong processes left; returns how many.
    A tagged one goes once its owner is dead, its processes killed first (a live owner's, another host's
    or a training run's, are never touched); an untagged one only once empty and `older_than_s` old (the
    kernel refuses to remove a cgroup with processes)."""
    removed, now = 0, time.time()
    try:
        children = [d for d in parent.iterdir() if d.is_dir()]
    except OSError:
        return 0
    for d in children:
        try:
            tree = [*(c for c in d.iterdir() if c.is_dir()), d]  # a sandbox's init and agent cgroups first
            if owner_dead(d.name):
                _thaw(tree)
                _kill_tree(tree)
                removed += _remove_tree(tree)
            elif (
                owner_pid(d.name) is None
                and now - d.stat().st_mtime >= older_than_s
                and not any((c / "cgroup.procs").read_text().strip() for c in tree)
            ):
                removed += _remove_tree(tree)
        except OSError:  # entered, or removed by another run, since the check
            continue
    return removed


def sweep_dead() -> int:
    """Sweeps every directory this process makes sandbox cgroups in (see `sweep`); how many went."""
    return sum(sweep(parent) for parent in sandbox_parents())


def _sweep_once(parent: Path) -> None:
    if parent not in _swept:
        _swept.add(parent)
        if removed := sweep(parent):
            log.info("removed %d sandbox cgroups left in %s by dead runs", removed, parent)


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError as exc:
        log.debug("cgroup write %s=%s failed: %s", path, value, exc)
        return False


def create(name: str, limits: Limits) -> Cgroup | None:
    """Makes a cgroup with the limits, or None where this process may not (then rlimits apply, and no
    pids are kept for the verifier beyond the agent's).

    As root: under this process's own cgroup. As an ordinary user: under a delegated subtree
    (`delegated_base()`); the launcher then writes its pid into `procs_files`, which a user may do
    for its own processes once it owns the target (v2 also wants the common ancestor owned: it is).
    """
    name = f"{name}@{owner_tag()}"  # a later sweep removes it once this process is dead
    try:
        if os.geteuid() != 0:
            return _create_delegated(name, limits)
        v2 = _v2_mount()
        if v2 is not None and v2 == ROOT:
            return _create_v2(v2, name, limits)
        return _create_v1(name, limits)
    except OSError as exc:
        log.warning("no cgroup for sandbox limits (%s); falling back to rlimits", exc)
        return None


def sandbox_parents() -> list[Path]:
    """The directories this process makes sandbox cgroups in (each may not exist yet)."""
    if os.geteuid() != 0:
        return delegated_base() or []
    if _v2_mount() == ROOT:
        return [_v2_base(ROOT)]
    return [ROOT / c / _own_path(c).lstrip("/") / "furlong" for c in (*V1_CONTROLLERS, V1_FREEZER) if _mounted(c)]


def _mounted(controller: str) -> bool:
    return controller in V1_CONTROLLERS or (ROOT / controller / "cgroup.procs").exists()


def _create_v1(name: str, limits: Limits) -> Cgroup:
    return _limit_v1([parent / name for parent in sandbox_parents()], limits)


def _limit_v1(dirs: list[Path], limits: Limits) -> Cgroup:
    """`dirs`: the sandbox's directory in each of V1_CONTROLLERS' trees, in that order, then optionally the
    freezer's."""
    freezer = dirs[3] if len(dirs) > 3 else None
    for d in dirs:
        _sweep_once(d.parent)
        d.mkdir(parents=True, exist_ok=True)
    mem, pids, cpu = dirs[:3]
    limit = str(limits.memory_mb << 20)
    if not _write(mem / "memory.limit_in_bytes", limit):
        raise OSError(f"cannot set {mem}/memory.limit_in_bytes")
    _write(mem / "memory.memsw.limit_in_bytes", limit)  # present only with swap accounting
    if not _write(pids / "pids.max", str(limits.pids + VERIFIER_PIDS)):
        raise OSError(f"cannot set {pids}/pids.max")
    _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
    _write(cpu / "cpu.cfs_quota_us", str(int(limits.cpus * CFS_PERIOD_US)))
    agent = _agent_cgroup(pids / "agent", limits)  # v1 allows processes beside children: the init stays in S
    return Cgroup(
        dirs=dirs[:3],
        v2=False,
        procs_files=[d / "cgroup.procs" for d in dirs],
        agent_procs_files=[agent / "cgroup.procs"],
        freezer=freezer,
    )


def _agent_cgroup(d: Path, limits: Limits) -> Path:
    d.mkdir(exist_ok=True)
    # one more than the task's limit: the init keeps one agent child waiting for the next command (init.c)
    if not _write(d / "pids.max", str(limits.pids + 1)):
        raise OSError(f"cannot set {d}/pids.max (the agent's cgroup)")
    return d


def _create_v2(mount: Path, name: str, limits: Limits) -> Cgroup:
    base = _v2_base(mount)
    base.mkdir(exist_ok=True)
    for level in (base.parent, base):
        _write(level / "cgroup.subtree_control", "+memory +pids +cpu")
    return _limit_v2(base / name, limits)


def _v2_base(mount: Path) -> Path:
    # Controllers can only be enabled for children of a cgroup that has no processes of its own,
    # so sandboxes live under a sibling `furlong` cgroup, not under ours.
    parent = mount / _own_path(None).lstrip("/")
    return (parent.parent if parent != mount else mount) / "furlong"


def _limit_v2(d: Path, limits: Limits) -> Cgroup:
    _sweep_once(d.parent)
    d.mkdir(exist_ok=True)
    if not _write(d / "memory.max", str(limits.memory_mb << 20)):
        raise OSError(f"cannot set {d}/memory.max (memory controller not delegated)")
    _write(d / "memory.swap.max", "0")
    if not _write(d / "pids.max", str(limits.pids + VERIFIER_PIDS)):
        raise OSError(f"cannot set {d}/pids.max (pids controller not delegated)")
    _write(d / "cpu.max", f"{int(limits.cpus * CFS_PERIOD_US)} {CFS_PERIOD_US}")
    if not _write(d / "cgroup.subtree_control", "+pids"):
        raise OSError(f"cannot enable pids in {d}/cgroup.subtree_control")
    cgroup = _nest_v2(d)
    _agent_cgroup(d / "agent", limits)
    return cgroup


def _nest_v2(d: Path) -> Cgroup:
    """S/init and S/agent as siblings: a v2 cgroup whose children have controllers holds no processes."""
    for child in ("init", "agent"):
        (d / child).mkdir(exist_ok=True)
    return Cgroup(
        dirs=[d], v2=True, procs_files=[d / "init" / "cgroup.procs"], agent_procs_files=[d / "agent" / "cgroup.procs"]
    )


def _create_delegated(name: str, limits: Limits) -> Cgroup | None:
    base = delegated_base()
    if base is None:
        return None
    if len(base) == 1 and _v2_mount() == ROOT:
        return _limit_v2(base[0] / name, limits)
    return _limit_v1([d / name for d in base], limits)


# -- delegation to ordinary users ------------------------------------------------------------------
_V2_CONTROLLERS = ("memory", "pids", "cpu")
NO_CGROUP_WARNING = (
    "no delegated cgroup for {user}: sandboxes get RLIMIT_AS per process and RLIMIT_NPROC "
    "shared by all of {user}'s processes, and no CPU cap; an administrator can run "
    "`furlong sandbox delegate --user {user}`"
)
_found: list[Path] | None = None


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid with no passwd entry (containers, CI runners): its number names it
        return str(os.geteuid())


def _owned(d: Path) -> bool:
    try:
        return d.stat().st_uid == os.geteuid() and os.access(d / "cgroup.procs", os.W_OK)
    except OSError:
        return False


def delegated_base() -> list[Path] | None:
    """The cgroup directories this (non-root) user may make sandbox cgroups in, or None.

    v1: the admin's `furlong sandbox delegate` directories, /sys/fs/cgroup/<ctrl>/furlong-<user>.
    v2: the topmost cgroup above this process that the user owns (systemd's user@UID.service or a
    `systemd-run --user --scope -p Delegate=yes` scope, or the admin's /sys/fs/cgroup/furlong-<user>
    when this process was started inside it); sandboxes go in its `furlong-sandboxes` child.
    """
    global _found
    if _found is None:
        try:
            _found = _v2_delegated() if _v2_mount() == ROOT else _v1_delegated()
        except OSError as exc:
            log.debug("delegated cgroup unusable: %s", exc)
    return _found


def _v1_delegated() -> list[Path] | None:
    dirs = [ROOT / c / f"furlong-{_user()}" for c in V1_CONTROLLERS]
    freezer = ROOT / V1_FREEZER / f"furlong-{_user()}"  # optional: pausing needs it
    return (dirs + ([freezer] if _owned(freezer) else [])) if all(_owned(d) for d in dirs) else None


def _v2_delegated() -> list[Path] | None:
    own = ROOT / _own_path(None).lstrip("/")
    top = None
    for d in [own, *own.parents]:
        if d == ROOT or not _owned(d):
            break
        top = d
    if top is None:
        return None
    if not set(_V2_CONTROLLERS[:2]) <= set((top / "cgroup.controllers").read_text().split()):
        raise OSError(f"{top} lacks the memory or pids controller (systemd: Delegate=memory pids cpu)")
    if own == top:  # "no internal processes": this process moves to a leaf before controllers are enabled
        (top / "furlong-host").mkdir(exist_ok=True)
        (top / "furlong-host" / "cgroup.procs").write_text(str(os.getpid()))
    base = top / "furlong-sandboxes"
    base.mkdir(exist_ok=True)
    for level in (top, base):
        for ctrl in _V2_CONTROLLERS:
            _write(level / "cgroup.subtree_control", f"+{ctrl}")
    return [base]


def delegate(user: str) -> list[Path]:
    """As root, once: cgroups the user owns, for sandbox limits when furlong runs as that user."""
    if os.geteuid() != 0:
        raise PermissionError("`furlong sandbox delegate` changes /sys/fs/cgroup ownership: run it as root")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise ValueError(f"no such user: {user}") from None
    made: list[Path] = []
    if _v2_mount() == ROOT:
        for ctrl in _V2_CONTROLLERS:
            _write(ROOT / "cgroup.subtree_control", f"+{ctrl}")
        made.append(
            _hand_over(ROOT / f"furlong-{user}", pw, ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"))
        )
    else:  # v1: one directory per controller hierarchy (a hybrid host's v2 tree has no controllers to delegate)
        for ctrl in (*V1_CONTROLLERS, V1_FREEZER):
            if (ROOT / ctrl / "cgroup.procs").exists():
                made.append(_hand_over(ROOT / ctrl / f"furlong-{user}", pw, ("cgroup.procs", "tasks")))
    if not made:
        raise OSError(f"no cgroup hierarchy with {', '.join(V1_CONTROLLERS)} under {ROOT}")
    return made


def _hand_over(d: Path, pw: pwd.struct_passwd, files: tuple[str, ...]) -> Path:
    # The limit files stay root's, so an administrator's caps on the directory itself hold for the user.
    d.mkdir(exist_ok=True)
    for p in (d, *(d / f for f in files)):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    return d


def no_cgroup_warning() -> str | None:
    """One line for a non-root user without a delegated cgroup, saying which limits still hold."""
    if os.geteuid() == 0 or delegated_base() is not None:
        return None
    return NO_CGROUP_WARNING.format(user=_user())
