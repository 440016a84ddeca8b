"""The sandbox's two compiled helpers, built once from the C sources beside this file.

`init` is each sandbox's pid 1 and command daemon; `launch` puts bwrap into its limits. Both are static
binaries, so they depend on nothing in the image and start in well under a millisecond. They are built
on first use with the system C compiler (install.sh builds them up front) into the furlong cache, keyed
by a hash of the source, so an edited source is never served stale.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxError

SOURCES = Path(__file__).parent
NAMES = ("init", "launch")
CFLAGS = ("-O2", "-static", "-s")


class NativeBuildError(SandboxError):
    """The helpers could not be built: a one-line error naming the missing package."""


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("furlong builds its sandbox init once with a C compiler, and none was found: "
                               "apt-get install gcc libc6-dev")
    return cc


@cache
def binary(name: str) -> Path:
    """The compiled helper `name`, built if missing. Mode 0755: the sandbox uid must be able to exec it."""
    if name not in NAMES:
        raise ValueError(f"no native helper {name!r}; expected one of {NAMES}")
    source = (SOURCES / f"{name}.c").read_bytes()
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = cache_dir() / "native"
    exe = out_dir / f"furlong-{name}-{digest}"
    if exe.exists():
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(out_dir, 0o755)
    with open(out_dir / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exe.exists():
            _compile(SOURCES / f"{name}.c", exe)
    return exe


def _compile(source: Path, exe: Path) -> None:
    tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
    proc = subprocess.run([_compiler(), *CFLAGS, "-o", str(tmp), str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"compiling {source.name} failed (needs gcc and libc6-dev for static glibc):\n"
                               + proc.stderr.strip()[-2000:])
    os.chmod(tmp, 0o755)
    tmp.rename(exe)


def build_all() -> None:
    """Builds every helper now (install.sh calls this), exiting with one line if that cannot be done."""
    try:
        for name in NAMES:
            print(binary(name))
    except NativeBuildError as exc:
        sys.exit(f"furlong: {exc}")
