"""Stand-ins for Ubuntu's official images (`ubuntu:24.04`, `22.04`, `20.04`, their code names and dated tags)
where no registry serves them: furlong's Debian base of the nearest release plus a small layer, opt-in
(`images.ubuntu_standins`), since Debian under an Ubuntu tag differs in more than a version.

The nearest release is the Debian one whose glibc is at least the Ubuntu release's, so programs built there
run: noble (glibc 2.39) gets trixie (2.41; also Python 3.13, which TB2's `uvx -p 3.13` finds offline, and
noble's 64-bit time_t package names, libssl3t64...), jammy (2.35) and focal (2.31) get bookworm (2.36).
What the layer makes alike is cheap and cannot mislead a program: noble's `ubuntu` user (uid 1000), and,
for jammy and focal, a system Python that `pip install` may write to (no PEP 668 marker) and an
`unminimize` that has nothing to do. What stays Debian's, and is said in the note: apt's sources (so a
package only Ubuntu names, a PPA, `add-apt-repository` fail), /etc/os-release, and the versions the probe
prints. /etc/lsb-release is not written: a Dockerfile that adds a repository for `$(lsb_release -cs)`
would then add Ubuntu's packages to a Debian system.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from furlong.sandbox.images.standin_recipes import SUITES, Standin

SETTING = "images.ubuntu_standins"
MODES = ("off", "nearest", *SUITES)  # off: a refusal; nearest: per release; a suite: that Debian release for all
# what the probe prints: the Debian release and the versions a program sees (gcc: the compiler `apt-get install
# gcc` gets, whose runtime, gcc-N-base, is in every Debian base)
PROBE = (
    "printf 'Debian %s: glibc %s, Python %s, gcc %s, OpenSSL %s' \"$(cat /etc/debian_version)\" "
    "\"$(getconf GNU_LIBC_VERSION | cut -d' ' -f2)\" "
    "\"$(python3 -c 'import platform; print(platform.python_version())')\" "
    "\"$(dpkg-query -W -f='${Version}\\n' 'gcc-[0-9]*-base' | head -1 | cut -d- -f1)\" "
    "\"$(python3 -c 'import ssl; print(ssl.OPENSSL_VERSION.split()[1])')\""
)
_UNMINIMIZE = (
    "printf '#!/bin/sh\\necho \"furlong: this Debian stand-in is not minimized (man pages and "
    "documentation install as usual); nothing to do\"\\n' > /usr/local/sbin/unminimize "
    "&& chmod 755 /usr/local/sbin/unminimize"
)


@dataclass(frozen=True)
class Release:
    version: str  # 24.04
    name: str  # noble
    suite: str  # the nearest Debian release furlong bootstraps
    has: str  # what the Ubuntu release itself ships
    pep668: bool  # its python3 is marked externally managed
    user: bool  # its image has the `ubuntu` user, uid 1000 (since 23.04)
    unminimize: bool  # its image has /usr/local/sbin/unminimize (24.04 moved it to a package)

    @property
    def label(self) -> str:
        return f"Ubuntu {self.version} ({self.name})"


RELEASES = (
    Release("24.04", "noble", "trixie", "glibc 2.39, Python 3.12, gcc 13, OpenSSL 3.0", True, True, False),
    Release("22.04", "jammy", "bookworm", "glibc 2.35, Python 3.10, gcc 11, OpenSSL 3.0", False, False, True),
    Release("20.04", "focal", "bookworm", "glibc 2.31, Python 3.8, gcc 9, OpenSSL 1.1.1", False, False, True),
)
KNOWN = "ubuntu:24.04|22.04|20.04 (noble, jammy, focal; with images.ubuntu_standins)"


def release(tag: str) -> Release | None:
    """The release an ubuntu tag names: 24.04, noble, noble-20250404 (a dated build); latest and rolling
    name whatever is newest when pulled, so no fixed stand-in is honest for them."""
    for rel in RELEASES:
        if re.fullmatch(rf"({re.escape(rel.version)}|{rel.name}(-\d{{8}}(\.\d+)?)?)", tag):
            return rel
    return None


def suite_for(rel: Release, mode: str) -> str:
    return rel.suite if mode in ("off", "nearest") else mode


def standin(rel: Release, suite: str) -> Standin:
    setup = []
    env: tuple[tuple[str, str], ...] = ()
    if rel.user:
        setup.append("useradd --uid 1000 --user-group --create-home --shell /bin/bash --comment Ubuntu ubuntu")
    if not rel.pep668:  # removed for every tool that reads it (uv too); the variable for pip after an apt upgrade
        setup.append("rm -f /usr/lib/python3*/EXTERNALLY-MANAGED")
        env = (("PIP_BREAK_SYSTEM_PACKAGES", "1"),)
    if rel.unminimize:
        setup.append(_UNMINIMIZE)
    return Standin(
        f"ubuntu-{rel.version}",
        (),
        setup=" && ".join(setup),
        env=env,
        probe=PROBE,
        suite=suite,
        version=rel.version,
        what=f"{rel.label} has {rel.has}",
    )


def differences(rel: Release, suite: str, mode: str) -> tuple[str, ...]:
    """What the stand-in's note says besides the versions: what a Dockerfile for the real image may meet."""
    out = [
        f"apt's sources are Debian {suite}'s: a package only Ubuntu names, a PPA or add-apt-repository fails",
        "/etc/os-release says Debian",
        "python3, git and ca-certificates are preinstalled (the Ubuntu image has none of them)",
    ]
    if mode in SUITES and mode != rel.suite:
        out.append(f"{SETTING}={mode}, not the nearest (Debian {rel.suite})")
    if rel.user:
        out.append("the `ubuntu` user (uid 1000) exists, as in the image")
    if not rel.pep668:
        out.append(
            f"no PEP 668 marker and PIP_BREAK_SYSTEM_PACKAGES=1, so `pip install` into the system Python "
            f"works as on {rel.label}"
        )
    out.append(
        "not minimized: man pages and documentation install"
        + (" (`unminimize` is a no-op)" if rel.unminimize else "; there is no `unminimize` package")
    )
    return tuple(out)


def refusal(ref: str, rel: Release) -> str:
    """The one line for an Ubuntu tag that no registry, cache or import serves while the stand-ins are off."""
    return (
        f"{ref}: no registry serves it here and it is neither cached nor imported; furlong's Debian "
        f"stand-in for it is off ({SETTING}=off; `nearest` builds one from Debian {rel.suite} with a note on "
        f"what differs); or bring the image with `furlong image import {ref} OCI_ARCHIVE`, or "
        f"`furlong image pull {ref}` where its registry is reachable"
    )
