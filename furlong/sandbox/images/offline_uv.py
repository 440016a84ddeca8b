"""`images.offline_uv`: a build step's `curl -LsSf https://astral.sh/uv/X/install.sh | sh` gets uv from
furlong's verifier toolchain (toolchain.py) instead of astral.sh, in both builders.

Terminal-Bench 2 Dockerfiles install uv with that line and then `cp /root/.local/bin/uv ...`. Where astral.sh
cannot be reached, curl fails, `| sh` exits 0 on an empty script, and the build fails one step later. With
the setting on, a RUN step whose command names curl or wget and uv's installer URL literally (astral.sh's
`uv/[VERSION/]install.sh`, or a GitHub release's `uv-installer.sh`) runs with DIRECTORY at MOUNT and
MOUNT/shims first on PATH, for that step only:

- `shims/curl` and `shims/wget` are the toolchain's offline shims (offline_shims.SHIM): asked for uv's
  installer they hand out `shims/uv-installer.sh`; any other call goes to the image's own curl/wget;
- `shims/uv-installer.sh` is offline_shims.INSTALLER's build-time form: it COPIES `bin/uv` and `bin/uvx` to
  where uv's installer puts them ($UV_INSTALL_DIR, else $XDG_BIN_HOME, else $HOME/.local/bin) and writes
  the installer's `env` script there: real files, since the mount is gone after the build.

The native builder copies DIRECTORY into its build sandbox for the step and removes it after; buildah binds
it read-only (`bud --volume`) and the step's line is rewritten in the temporary Dockerfile. The toolchain's
uv is its own version, not the one the URL pins: the image's note says which. Layer keys record the
toolchain's key where a step was rewritten, so such an image is never reused for a build without the
setting, nor the other way round.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
from pathlib import Path

from furlong.sandbox.images import offline_shims
from furlong.sandbox.images import toolchain as toolchains
from furlong.sandbox.images.builds import _rmtree

MOUNT = "/run/furlong-uv"
_URL = re.compile(
    r"astral\.sh/uv/(?:([\w.-]+)/)?install\.sh"
    r"|/astral-sh/uv/releases/(?:download/([\w.-]+)|latest/download)/uv-installer\.sh"
)
_FETCH = re.compile(r"(?:^|[\s;&|(`/])(?:curl|wget)\s")
_FLAGS = re.compile(r"((?:--\S+\s+)*)(.*)", re.S)  # RUN's own flags (--mount=..., --network=...) first


def asked(command: str) -> str | None:
    """The uv version the step's installer URL asks for ("latest" where it names none), or None where the
    command does not fetch uv's installer with curl or wget (a URL in a variable is not seen)."""
    if not _FETCH.search(command) or not (m := _URL.search(command)):
        return None
    return m[1] or m[2] or "latest"


@dataclasses.dataclass(frozen=True)
class OfflineUv:
    key: str  # the toolchain's: what layer keys record
    version: str  # the toolchain's uv
    directory: Path  # on the host: shims/{curl,wget,uv-installer.sh}, bin/{uv,uvx}

    def command(self, command: str) -> str:
        """The step's shell command with the shims first on PATH (its own flags kept in front, for buildah)."""
        m = _FLAGS.fullmatch(command)
        assert m is not None, "_FLAGS matches any command"
        return f'{m[1]}export PATH="{MOUNT}/shims:$PATH" FURLONG_OFFLINE_UV={self.key}; {m[2]}'

    def note(self, where: str, wanted: str) -> str:
        return (
            f"{where}: uv {self.version} from furlong's verifier toolchain (images.offline_uv), in place of "
            f"the uv {wanted} its installer URL asks for"
        )

    def volume(self) -> list[str]:
        return ["--volume", f"{self.directory}:{MOUNT}:ro"]


def _make(directory: Path, uv_bin: Path, version: str) -> None:
    """DIRECTORY, made once per toolchain (beside it in the store) and then only read."""
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    _rmtree(tmp)
    (tmp / "shims").mkdir(parents=True)
    (tmp / "bin").mkdir()
    for name in ("uv", "uvx"):
        shutil.copy2(uv_bin / name, tmp / "bin" / name)
    shim = offline_shims.SHIM.replace("shims=DIR", f"shims={MOUNT}/shims")
    # copies, not links to `shim`: the native builder copies the directory in file by file
    scripts = {"curl": shim, "wget": shim, "uv-installer.sh": offline_shims.installer(version, f"{MOUNT}/bin")}
    for name, text in scripts.items():
        (tmp / "shims" / name).write_text(text)
        os.chmod(tmp / "shims" / name, 0o755)
    for d in (tmp, tmp / "shims", tmp / "bin"):
        os.chmod(d, 0o755)
    if directory.exists():  # another process made it meanwhile
        _rmtree(tmp)
    else:
        tmp.rename(directory)


async def prepare(store, backend, progress) -> OfflineUv:
    """The toolchain (built once in the store) and DIRECTORY made from it."""
    tc = await store.toolchain(backend, progress)
    directory = store.root / f".offline-uv-{tc.key}"
    if not directory.is_dir():
        uv_bin = store.root / tc.layer.path / toolchains.BIN.lstrip("/")
        await asyncio.to_thread(_make, directory, uv_bin, toolchains.UV_VERSION)
    return OfflineUv(tc.key, toolchains.UV_VERSION, directory)
