"""The uids and gids a sandbox maps, so the verifier runs as a uid of its own, apart from the agent's.

Inside a sandbox, uid/gid 0 is the agent (it owns the image's files, as root does in a container) and
1..65535 come from a subordinate range on the host: as root, host ids from ROOT_SUB_START (a range no
account uses); as an ordinary user, the user's range in /etc/subuid and /etc/subgid, mapped by the setuid
helpers newuidmap/newgidmap (package uidmap), as rootless Podman does. The verifier runs as
VERIFIER_UID, which the agent's processes (uid 0 without any capability) cannot signal, trace or write as;
the init itself runs as INIT_UID, so a command it starts is out of the agent's reach from its first instant.

A user without a range of 65535 ids still gets sandboxes, with one uid as before: `sub_ids()` is None
and `problem()` says why (the backend logs it once), and the verifier then runs as the agent's uid.
"""

from __future__ import annotations

import os
import pwd
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path

COUNT = 65535  # ids 1..65535 inside: every uid a Dockerfile's useradd picks
ROOT_SUB_START = 1_000_000_000  # as root: host ids 10^9 + 0..65534, far above any account's
VERIFIER_UID = 65533  # inside; its gid is the same number
INIT_UID = 65532  # inside: the init leaves uid 0 (keeping its capabilities), so no agent uid can signal it
RESERVED_UIDS = (INIT_UID, VERIFIER_UID)  # an image's USER may not be one of these


@dataclass(frozen=True)
class SubIds:
    uid_start: int  # host uid of inside uid 1
    gid_start: int
    count: int = COUNT

    def launcher_args(self) -> list[str]:
        return ["--subids", str(self.uid_start), str(self.gid_start), str(self.count)]


def sub_range(path: Path, names: tuple[str, ...], at_least: int = COUNT) -> int | None:
    """The start of the first range of at least `at_least` ids for one of `names` in /etc/subuid or /etc/subgid."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.strip().split(":")
        if len(fields) == 3 and fields[0] in names and fields[1].isdigit() and fields[2].isdigit():
            if int(fields[2]) >= at_least:
                return int(fields[1])
    return None


def _lookup() -> tuple[SubIds | None, str]:
    if os.environ.get("FURLONG_SINGLE_UID") == "1":  # an escape hatch for kernels that refuse the mapping
        return None, "FURLONG_SINGLE_UID=1 is set"
    if os.geteuid() == 0:
        return SubIds(ROOT_SUB_START, ROOT_SUB_START), ""
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    if not (shutil.which("newuidmap") and shutil.which("newgidmap")):
        return None, "newuidmap/newgidmap are missing (an administrator runs `apt-get install uidmap`)"
    starts = [sub_range(Path(f"/etc/sub{kind}"), (name, str(uid))) for kind in ("uid", "gid")]
    uid_start, gid_start = starts
    if uid_start is None or gid_start is None:
        return None, (
            f"{name} has no range of {COUNT} ids in /etc/subuid and /etc/subgid (an administrator runs "
            f"`usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {name}`)"
        )
    return SubIds(uid_start, gid_start), ""


@cache
def sub_ids() -> SubIds | None:
    """The subordinate ranges sandboxes map here, or None: one uid only (see problem())."""
    return _lookup()[0]


def problem() -> str:
    """Why sandboxes here have one uid only ("" when they have many)."""
    return _lookup()[1]
