"""The verifier toolchain layer: uv, uvx and pytest for a task's tests, never for its agent (opt-in).

Harbor / Terminal-Bench 2 tests typically fetch uv with `curl ... astral.sh/uv/install.sh | sh`, then
`uv venv`, `uv pip install pytest==8.4.1` and `uvx ... pytest`. A task without internet cannot, so a task
may opt in (`[furlong] verifier_toolchain = true` in task.toml, or `eval.verifier_toolchain=true` for all)
to one cached layer whose files all lie under /opt/furlong/toolchain (HOME):

- `bin/`: uv, uvx (the `uv` wheel's binaries), and `pytest`/`py.test` run by the image's python3;
- `site/`: pytest and pytest-json-ctrf (TB2's pins) and their dependencies; `wheels/`: their wheels;
- `user/`: a user base (PYTHONUSERBASE) whose site-packages holds one `.pth` appending a fallback finder
  (FALLBACK) to the image's python3: a top-level import nothing of the image's finds comes from `site/`;
- `offline/`: `curl`/`wget` answering uv's installer, `apt-get`/`apt` taking `install curl` as done
  (offline_shims.py).

Nothing of the agent's environment names them: the agent's PATH, python and variables are the image's
(ImageRef.env), as under Docker. Only verifier commands get them, through ImageRef.verifier_env
(`verifier_env`): PATH with `bin/` (and `offline/` first, for an offline verifier phase) in front of the
image's PATH, PYTHONUSERBASE, UV_FIND_LINKS and PIP_FIND_LINKS at the wheels, and offline UV_OFFLINE=1,
UV_PYTHON_DOWNLOADS=never (so `uvx -p 3.13` finds the image's python3.13 and never asks the internet) and
PIP_NO_INDEX=1. uv's installer (the offline shim's, or the real one online) links uv into ~/.local/bin and
writes its `env` script there, so `source $HOME/.local/bin/env` works as after a real install.

The wheels are fetched once on the host with pip (its ordinary client and configuration), then installed in
a build sandbox over the python stand-in by furlong's own layer builder; the layer is cached like any other.
The layer only adds files under HOME: one with a file elsewhere, or that would hide a file of the image
below it, is refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from furlong.sandbox.base import BASE_ENV, ImageRef, LayerRef, SandboxError
from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.images import offline_shims, standins
from furlong.sandbox.images.builds import _sha  # the store's own hash, so keys look alike

UV_VERSION = "0.13.9"
PYTEST_VERSION = "8.4.1"  # what TB2's tests pin
CTRF_VERSION = "0.3.5"  # pytest-json-ctrf, which TB2's `uvx ... pytest --ctrf` uses
REQUIREMENTS = (f"uv=={UV_VERSION}", f"pytest=={PYTEST_VERSION}", f"pytest-json-ctrf=={CTRF_VERSION}")
# Windows-only dependency of pytest: never installed here, but `uv add pytest` (TB2's `uv init && uv add`)
# locks for every platform, and offline it must find some colorama among the wheels
LOCK_ONLY = ("colorama==0.4.6",)
HOME, BIN = offline_shims.HOME, offline_shims.UV_BIN
SITE, WHEELS, USER_BASE = f"{HOME}/site", f"{HOME}/wheels", f"{HOME}/user"
PARENT = "python:3.11-slim"  # the stand-in it is built over: the same bookworm python3 as every built image
# the pythons whose user site holds the fallback: the wheels are 3.11's (pytest needs tomli and
# exceptiongroup before 3.11, which they lack)
FALLBACK_PYTHONS = tuple(f"3.{m}" for m in range(11, 16))
FORMAT = "3"  # bump when the recipe's files change

PYTEST_SCRIPT = f"""#!/usr/bin/env python3
# furlong's verifier toolchain: the image's python3 runs its own pytest, else the toolchain's
import sys
sys.path.append("{SITE}")
from pytest import console_main
sys.exit(console_main())
"""
FALLBACK_PTH = "import _furlong_toolchain_fallback\n"
# Loaded by the .pth above from the user site of PYTHONUSERBASE, which only verifier commands set. Appended
# to sys.meta_path, after the finder of sys.path: the image's own modules and distributions always win.
FALLBACK = f'''"""furlong's verifier toolchain: pytest for the image's python3, after the image's own packages."""
import os
import site
import sys
from importlib.machinery import PathFinder

SITE = "{SITE}"


class ToolchainFallback:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if path is not None:  # a submodule: its package's __path__ finds it
            return None
        return PathFinder.find_spec(name, [SITE])

    @staticmethod
    def find_distributions(context=None):  # entry points: pytest-json-ctrf's plugin
        from importlib.metadata import DistributionFinder, MetadataPathFinder
        if context is not None and "path" in vars(context):  # given directories, not sys.path
            return iter(())
        name = context.name if context is not None else None
        return MetadataPathFinder.find_distributions(DistributionFinder.Context(name=name, path=[SITE]))

    @staticmethod
    def invalidate_caches():
        pass


sys.meta_path.append(ToolchainFallback)
# PYTHONUSERBASE took the place of ~/.local: its user site (pip install --user) is added where Python adds it
_real = os.path.join(os.path.expanduser("~"), ".local", "lib", "python%d.%d" % sys.version_info[:2], "site-packages")
if os.path.isdir(_real):
    site.addsitedir(_real)
'''


class ToolchainError(SandboxError):
    pass


@dataclasses.dataclass(frozen=True)
class Toolchain:
    key: str
    layer: LayerRef  # what sandboxes stack
    provides: str  # e.g. "uv 0.13.9, pytest 8.4.1"


def _recipe(context: str) -> str:
    install = (
        f"PYTHONDONTWRITEBYTECODE=1 pip install --no-cache-dir --no-compile --no-index "
        f"--disable-pip-version-check --root-user-action=ignore --find-links {WHEELS} --target {SITE} "
        f"{' '.join(REQUIREMENTS)}"
    )
    user_lib = f"{USER_BASE}/lib"
    links = " ".join(f"python{v}" for v in FALLBACK_PYTHONS[1:])
    return (
        "\n".join(
            [
                f"FROM {PARENT}",
                f"COPY {context}/home {HOME}",
                (
                    f"RUN {install} && install -m 0755 {SITE}/bin/uv {SITE}/bin/uvx {BIN}/ "
                    f"&& rm -rf {SITE}/bin {SITE}/uv {SITE}/uv-*.dist-info {WHEELS}/uv-*.whl"
                ),
                f"RUN ln -s pytest {BIN}/py.test && for v in {links}; do ln -s python{FALLBACK_PYTHONS[0]} {user_lib}/$v; done",
                f"RUN cd {offline_shims.DIR} && for c in {' '.join(offline_shims.COMMANDS)}; do ln -s shim $c; done",
            ]
        )
        + "\n"
    )


def _files() -> dict[str, str]:
    """The context's scripts, by their path under HOME."""
    user_site = f"user/lib/python{FALLBACK_PYTHONS[0]}/site-packages"
    return {
        "bin/pytest": PYTEST_SCRIPT,
        f"{user_site}/furlong-toolchain.pth": FALLBACK_PTH,
        f"{user_site}/_furlong_toolchain_fallback.py": FALLBACK,
        "offline/shim": offline_shims.shim(),
        "offline/uv-installer.sh": offline_shims.installer(UV_VERSION),
    }


def key(store) -> str:
    parent = store.standin_key(standins.PYTHON)
    return "toolchain-" + _sha(
        FORMAT,
        parent,
        _recipe("ctx"),
        *LOCK_ONLY,
        *(part for item in sorted(_files().items()) for part in item),
        platform.machine(),
    )


def _download(dest: Path) -> None:
    """The wheels, by the host's pip (its index and certificates): builds sandboxes may not reach them."""
    arch = platform.machine()
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "--python-version",
        "3.11",
        "--platform",
        f"manylinux_2_17_{arch}",
        "--platform",
        "any",
        "-d",
        str(dest),
        *REQUIREMENTS,
        *LOCK_ONLY,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stdout + res.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise ToolchainError(f"verifier toolchain: pip download {' '.join(REQUIREMENTS + LOCK_ONLY)} failed: {tail[0]}")


def _context(root: Path, name: str) -> Path:
    """The build context, under the store (COPY reads it): `home/` laid out as HOME, wheels included."""
    ctx = root / name
    shutil.rmtree(ctx, ignore_errors=True)
    (ctx / "home/wheels").mkdir(parents=True)
    _download(ctx / "home/wheels")
    for rel, text in _files().items():
        path = ctx / "home" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        os.chmod(path, 0o755 if text.startswith("#!") else 0o644)
    for d in (ctx / "home").rglob("*"):
        if d.is_dir():
            os.chmod(d, 0o755)
    return ctx


def stray_files(upper: Path) -> list[str]:
    """Entries of the layer other than directories that lie outside HOME (a build's .pyc, a link in a bin
    directory): what the agent would see. Directories the builder leaves (/tmp, /run) are not files."""
    home = upper / HOME.lstrip("/")
    return sorted(str(p) for p in upper.rglob("*") if not (p.is_dir() and not p.is_symlink()) and home not in p.parents)


def hidden_entries(upper: Path) -> list[str]:
    """Whiteouts (char device 0:0) and opaque directories: what would hide files of the image below."""
    found = []
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0:
                found.append(path)
            elif os.path.isdir(path) and not os.path.islink(path):
                attrs = os.listxattr(path, follow_symlinks=False)
                if any(a.endswith("overlay.opaque") for a in attrs):
                    found.append(path)
    return found


async def build(store, backend, progress=lambda _: None) -> Toolchain:
    """The toolchain layer, built the first time (about 10 s plus the download) and cached in the store."""
    name = key(store)
    final = store.root / name
    async with store._locks.setdefault(name, asyncio.Lock()):  # as the store does: one build per key at once
        if not (final / "meta.json").exists():
            await _build(store, backend, progress, name, final)
    meta = json.loads((final / "meta.json").read_text())
    provides = ", ".join(meta.get("provides", "").split("\n"))
    return Toolchain(name, store.layer(name, final / "upper"), provides)


async def _build(store, backend, progress, name: str, final: Path) -> None:
    """Downloads the wheels, builds the layer from its recipe, and refuses one that hides lower files or
    holds any outside HOME (the agent's view of the image must stay the image's)."""
    parent = await store.parent(PARENT, backend, progress)
    ctx = await asyncio.to_thread(_context, store.root, f".{name}-context")
    recipe = store.root / f".{name}.Dockerfile"  # a real file, so a failing step names file:line
    recipe.write_text(_recipe(ctx.name))
    try:
        await store._build_layer(
            final,
            parent,
            recipe,
            df.parse(recipe),
            backend,
            progress,
            label="verifier toolchain",
            probe=f"PYTHONDONTWRITEBYTECODE=1; export PYTHONDONTWRITEBYTECODE; "
            f"{BIN}/uv --version; {BIN}/pytest --version",
            extra={"toolchain": list(REQUIREMENTS)},
        )
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    if hidden := await asyncio.to_thread(hidden_entries, final / "upper"):
        shutil.rmtree(final, ignore_errors=True)
        raise ToolchainError(f"verifier toolchain layer would hide files of the task's image: {hidden[:3]}")
    if stray := await asyncio.to_thread(stray_files, final / "upper"):
        shutil.rmtree(final, ignore_errors=True)
        raise ToolchainError(f"verifier toolchain layer has files outside {HOME}: {stray[:3]}")


def verifier_offline(task) -> bool:
    """Whether the task's verifier phase has no network (its policy: furlong.tasks.model.Task.verifier_network):
    then uv and pip stay offline, and apt-get takes installed packages as installed. The one place this is
    decided."""
    return not task.verifier_network.online


def verifier_env(image_path: str, offline: bool) -> tuple[tuple[str, str], ...]:
    """What verifier commands get on top of the image's environment (`image_path`: the image's PATH). The
    shims come first in every mode: uv's installer is answered by the toolchain's uv, never fetched."""
    path = f"{offline_shims.DIR}:{BIN}:{image_path}"
    env = [("PATH", path), ("PYTHONUSERBASE", USER_BASE), ("UV_FIND_LINKS", WHEELS), ("PIP_FIND_LINKS", WHEELS)]
    if offline:
        env += [("FURLONG_OFFLINE", "1"), ("UV_OFFLINE", "1"), ("UV_PYTHON_DOWNLOADS", "never"), ("PIP_NO_INDEX", "1")]
    return tuple(env)


def stack(image: ImageRef, toolchain: Toolchain, offline: bool) -> ImageRef:
    """The task's image with the toolchain's layer on top. The agent's environment stays the image's; the
    toolchain is in `verifier_env` only (offline: uv and pip told to stay offline)."""
    path = dict(image.env).get("PATH", BASE_ENV["PATH"])
    note = "; ".join(n for n in (image.note, f"verifier toolchain ({toolchain.provides})") if n)
    return dataclasses.replace(
        image,
        digest=f"{image.digest}+{toolchain.key}",
        layers=(toolchain.layer, *image.layers),
        note=note,
        verifier_env=verifier_env(path, offline),
    )


class ToolchainImages:
    """An image lookup (task -> ImageRef) that stacks the toolchain for tasks that opt in; the layer is
    built once, on first need, and a failed build is reported to every task that wanted it."""

    def __init__(self, lookup, store, backend):
        self._lookup, self.store, self.backend = lookup, store, backend
        self._lock = asyncio.Lock()
        self._built: Toolchain | str | None = None

    async def __call__(self, task) -> ImageRef:
        image = await self._lookup(task)
        if not getattr(task, "verifier_toolchain", False):
            return image
        async with self._lock:
            if self._built is None:
                try:
                    self._built = await self.store.toolchain(self.backend)
                except Exception as exc:  # noqa: BLE001  # kept as the reason the toolchain is unavailable
                    self._built = f"verifier toolchain unavailable: {exc}"
        if isinstance(self._built, str):
            raise ToolchainError(self._built)
        return stack(image, self._built, verifier_offline(task))


def opt_in_all(entries: list) -> list:
    """`eval.verifier_toolchain=true`: every loaded task gets the toolchain (broken ones stay as they are)."""
    return [dataclasses.replace(e, verifier_toolchain=True) if hasattr(e, "verifier_toolchain") else e for e in entries]
