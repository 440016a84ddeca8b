"""The sandbox's compiled helpers, built once from the C sources beside this file.

`init` is each sandbox's pid 1 and command daemon; `launch` puts bwrap into its limits. Both are static
binaries, so they depend on nothing in the image and start in well under a millisecond. `owner` is the
verifier's ownership shim (owner.c), a freestanding shared library the init preloads into verifier
commands only. All are built on first use with the system C compiler (install.sh builds them up front)
into the furlong cache, keyed by a hash of the source and flags, so an edited source is never served stale.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxError

log = logging.getLogger(__name__)
SOURCES = Path(__file__).parent
EXE_FLAGS = ("-O2", "-static", "-s")
# no libc linked or needed (no DT_NEEDED, no symbol versions): one build loads into glibc and musl processes
SHIM_FLAGS = (
    "-O2",
    "-shared",
    "-fPIC",
    "-nostdlib",
    "-ffreestanding",
    "-fno-builtin",
    "-fno-stack-protector",
    "-fvisibility=hidden",
    "-Wl,--hash-style=both",
    "-Wl,-z,now",
    "-s",
)
SHIM_ARCHES = ("x86_64", "aarch64")  # owner.c's system call stubs


@dataclass(frozen=True)
class Helper:
    source: str
    flags: tuple[str, ...]
    suffix: str = ""
    headers: tuple[str, ...] = ()  # what it includes from this directory: part of its build's digest


HELPERS = {
    "init": Helper("init.c", EXE_FLAGS),
    "launch": Helper("launch.c", EXE_FLAGS),
    "owner": Helper("owner.c", SHIM_FLAGS, ".so", ("shim_sys.h",)),
    "statx": Helper("statx.c", SHIM_FLAGS, ".so", ("shim_sys.h",)),  # gVisor sandboxes' (statx.c)
}
NAMES = tuple(HELPERS)


class NativeBuildError(SandboxError):
    """The helpers could not be built: a one-line error naming the missing package."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError(
            "furlong builds its sandbox init once with a C compiler, and none was found: apt-get install gcc libc6-dev"
        )
    return cc


@cache
def binary(name: str) -> Path:
    """The compiled helper `name`, built if missing. Mode 0755: the sandbox uid must be able to exec it."""
    helper = HELPERS.get(name)
    if helper is None:
        raise ValueError(f"no native helper {name!r}; expected one of {NAMES}")
    source = b"".join((SOURCES / name).read_bytes() for name in (helper.source, *helper.headers))
    digest = hashlib.sha256(source + " ".join(helper.flags).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "native"
    exe = out_dir / f"furlong-{name}-{digest}{helper.suffix}"
    if exe.exists():
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o755)
    with open(out_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            _compile(SOURCES / helper.source, helper.flags, exe)
    return exe


@cache
def ownership_shim() -> Path | None:
    """The verifier's ownership shim, or None (with one warning) on an architecture owner.c has no stubs for."""
    machine = os.uname().machine
    if machine not in SHIM_ARCHES:
        log.warning(
            "no ownership shim for %s (only %s): in the verifier phase the agent's and the image's files "
            "show as uid 65533 (docs/sandboxes.md)",
            machine,
            ", ".join(SHIM_ARCHES),
        )
        return None
    return binary("owner")


def _compile(source: Path, flags: tuple[str, ...], exe: Path) -> None:
    tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
    proc = subprocess.run([_compiler(), *flags, "-o", str(tmp), str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(
            f"compiling {source.name} failed (needs gcc and libc6-dev for static glibc):\n"
            + proc.stderr.strip()[-2000:]
        )
    os.chmod(tmp, 0o755)
    tmp.rename(exe)


def build_all() -> None:
    """Builds every helper now (install.sh calls this), exiting with one line if that cannot be done."""
    try:
        for name in ("init", "launch"):
            print(binary(name))
        if shim := ownership_shim():
            print(shim)
    except NativeBuildError as exc:
        sys.exit(f"furlong: {exc}")
