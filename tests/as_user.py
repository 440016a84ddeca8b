"""Runs a command as an ordinary user from root, with this Python reachable (used by tests and .ci/run).

`python tests/as_user.py USER [--] CMD...` or `command(user, argv)`. When the interpreter lives under a
directory other users cannot enter (a pyenv under /root, mode 0700), the command runs in a private
mount namespace where a world-readable tmpfs covers that directory and only the interpreter's tree is
bound back in: the user reaches Python, and nothing else of root's home.
"""

from __future__ import annotations

import os
import pwd
import shlex
import subprocess
import sys
from pathlib import Path


def _closed_ancestor(path: Path) -> tuple[Path, Path] | None:
    """The first directory on the way to `path` that others cannot enter, and its child on that way."""
    parts = path.parts
    for i in range(1, len(parts)):
        d = Path(*parts[:i])
        if not d.stat().st_mode & 0o001:
            return d, Path(*parts[: i + 1])
    return None


def command(user: str, argv: list[str], extra_env: dict[str, str] | None = None) -> list[str]:
    pw = pwd.getpwnam(user)
    prefix = Path(os.path.realpath(sys.prefix))
    env = {"HOME": pw.pw_dir, "USER": user, "LOGNAME": user,
           "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           **(extra_env or {})}
    run = ["runuser", "-u", user, "--", "env", *(f"{k}={v}" for k, v in env.items()), *argv]
    closed = _closed_ancestor(prefix)
    if closed is None:
        return run
    parent, child = closed
    script = (f"hold=$(mktemp -d) && mount --bind {shlex.quote(str(child))} \"$hold\" && "
              f"mount -t tmpfs -o mode=755 furlong-as-user {shlex.quote(str(parent))} && "
              f"mkdir -p {shlex.quote(str(child))} && mount --bind \"$hold\" {shlex.quote(str(child))} && "
              f"exec \"$@\"")
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "as-user", *run]


def run(user: str, argv: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(command(user, argv, kw.pop("env", None)), capture_output=True, text=True,
                          timeout=timeout, **kw)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit("usage: python tests/as_user.py USER [--] CMD...")
    user, rest = args[0], args[1:]
    rest = rest[1:] if rest[0] == "--" else rest
    os.execvp("unshare" if _closed_ancestor(Path(os.path.realpath(sys.prefix))) else "runuser",
              command(user, rest))
