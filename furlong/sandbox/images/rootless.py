"""What building the base image needs, checked up front so a missing piece is one line naming its fix.

As root the base is bootstrapped directly (`mmdebstrap --mode=root`); as an ordinary user,
`mmdebstrap --mode=unshare` builds it in a user namespace whose ids come from the user's subordinate
ranges (/etc/subuid, /etc/subgid; mapped by newuidmap/newgidmap). Both write a tarball to a pipe,
which is unpacked by the caller as itself: the tree then belongs to the caller.
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

from furlong.sandbox.runtime import idmap

ADMIN_PACKAGES = "mmdebstrap uidmap"  # the one-time Debian packages an administrator installs


def _has_range(path: Path, user: str, uid: int) -> bool:
    return idmap.sub_range(path, (user, str(uid)), at_least=1) is not None


def _userns_problem() -> str | None:
    for path, bad in (
        ("/proc/sys/user/max_user_namespaces", "0"),
        ("/proc/sys/kernel/unprivileged_userns_clone", "0"),
        ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1"),
    ):
        try:
            if Path(path).read_text().strip() == bad:
                key = path.removeprefix("/proc/sys/").replace("/", ".")
                return (
                    f"unprivileged user namespaces are disabled ({key} = {bad}); an administrator runs "
                    f"`sysctl -w {key}={'1' if bad == '0' else '0'}`"
                )
        except OSError:
            continue
    return None


def base_build_problem() -> str | None:
    """One line saying what is missing to build the base image here (and how to fix it), or None."""
    if not shutil.which("mmdebstrap"):
        return f"building the base image needs mmdebstrap: an administrator runs `apt-get install {ADMIN_PACKAGES}`"
    if not shutil.which("tar"):
        return "building the base image needs tar: an administrator runs `apt-get install tar`"
    if os.geteuid() == 0:
        return None
    if not (shutil.which("newuidmap") and shutil.which("newgidmap")):
        return "building the base image without root needs newuidmap: an administrator runs `apt-get install uidmap`"
    uid = os.geteuid()
    user = pwd.getpwuid(uid).pw_name
    for kind in ("uid", "gid"):
        if not _has_range(Path(f"/etc/sub{kind}"), user, uid):
            return (
                f"building the base image without root needs a subordinate {kind} range for {user} in "
                f"/etc/sub{kind}: an administrator runs `usermod --add-subuids 100000-165535 "
                f"--add-subgids 100000-165535 {user}` (any unused range of 65536)"
            )
    return _userns_problem()


def mmdebstrap_mode() -> str:
    return "--mode=root" if os.geteuid() == 0 else "--mode=unshare"
