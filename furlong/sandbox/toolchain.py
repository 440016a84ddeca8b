"""The verifier toolchain layer: uv, uvx and pytest stacked on top of a task's image (opt-in).

Harbor / Terminal-Bench 2 tests typically fetch uv with `curl ... astral.sh/uv/install.sh | sh`, then
`uv venv`, `uv pip install pytest==8.4.1` and `uvx ... pytest`. A task without internet cannot, so a task
may opt in (`[furlong] verifier_toolchain = true` in task.toml, or `eval.verifier_toolchain=true` for all)
to one cached layer holding:

- `/usr/local/bin/uv`, `/usr/local/bin/uvx` (the binaries of the `uv` wheel), also in `/root/.local/bin`
  with the `env` script uv's installer writes, so `source $HOME/.local/bin/env` works;
- pytest and pytest-json-ctrf (TB2's pins) and their dependencies in `/opt/furlong/toolchain/site`, reached
  by the image's python3 through a `.pth` file appended after its own site-packages (so a pytest the image
  installed itself still wins), plus a `pytest` command on PATH;
- their wheels in `/opt/furlong/toolchain/wheels`, which `UV_FIND_LINKS` points uv at; a task without
  internet also gets `UV_OFFLINE=1`, so `uv pip install pytest`, `uvx pytest` and `uv run --with pytest`
  resolve from those wheels instead of failing on the index, and `UV_PYTHON_DOWNLOADS=never`, so
  `uvx -p 3.13` finds the image's python3.13 (the python:3.13 stand-in's) and never asks the internet;
- for a task without internet, `/opt/furlong/toolchain/offline` first on PATH: `curl`/`wget` answering uv's
  installer, `apt-get`/`apt` taking `install curl` as done (offline_shims.py).

The wheels are fetched once on the host with pip (its ordinary client and configuration), then installed in
a build sandbox over the python stand-in by furlong's own layer builder; the layer is cached like any other.
The layer only adds files: one that would hide or delete a file of the image below it is refused.
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

from furlong.sandbox import dockerfile as df
from furlong.sandbox import offline_shims, standins
from furlong.sandbox.base import BASE_ENV, ImageRef, LayerRef, SandboxError
from furlong.sandbox.builds import _sha  # the store's own hash, so keys look alike

UV_VERSION = "0.13.9"
PYTEST_VERSION = "8.4.1"  # what TB2's tests pin
CTRF_VERSION = "0.3.5"  # pytest-json-ctrf, which TB2's `uvx ... pytest --ctrf` uses
REQUIREMENTS = (f"uv=={UV_VERSION}", f"pytest=={PYTEST_VERSION}", f"pytest-json-ctrf=={CTRF_VERSION}")
# Windows-only dependency of pytest: never installed here, but `uv add pytest` (TB2's `uv init && uv add`)
# locks for every platform, and offline it must find some colorama among the wheels
LOCK_ONLY = ("colorama==0.4.6",)
HOME = "/opt/furlong/toolchain"
PARENT = "python:3.11-slim"  # the stand-in it is built over: the same bookworm python3 as every built image
PTH_DIRS = ("/usr/local/lib/python3.11/dist-packages",  # Debian's python3 (bookworm images)
            "/usr/local/lib/python3.13/dist-packages",  # trixie's (the python:3.13 stand-in)
            *(f"/usr/local/lib/python3.{m}/site-packages" for m in (11, 12, 13)))  # the official images' layout
ENV = (("UV_FIND_LINKS", f"{HOME}/wheels"),)
OFFLINE_ENV = (("UV_OFFLINE", "1"), ("UV_PYTHON_DOWNLOADS", "never"))
FORMAT = "2"  # bump when the recipe's files change

PYTEST_SCRIPT = f"""#!/usr/bin/env python3
# furlong's verifier toolchain: the image's python3 runs the toolchain's pytest, unless it has its own.
import sys
sys.path.append("{HOME}/site")
from pytest import console_main
sys.exit(console_main())
"""
# What uv's installer writes to ~/.local/bin/env, so tests that `source $HOME/.local/bin/env` go on.
ENV_SCRIPT = """#!/bin/sh
# add ~/.local/bin to PATH once (written by furlong's verifier toolchain, as uv's installer does)
case ":${PATH}:" in
    *:"$HOME/.local/bin":*) ;;
    *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
"""


class ToolchainError(SandboxError):
    pass


@dataclasses.dataclass(frozen=True)
class Toolchain:
    key: str
    layer: LayerRef  # what sandboxes stack
    provides: str  # e.g. "uv 0.13.9, pytest 8.4.1"


def _recipe(context: str) -> str:
    install = (f"pip install --no-cache-dir --no-index --disable-pip-version-check --root-user-action=ignore "
               f"--find-links {HOME}/wheels --target {HOME}/site {' '.join(REQUIREMENTS)}")
    pth = " ".join(PTH_DIRS)
    return "\n".join([
        f"FROM {PARENT}",
        f"COPY {context}/wheels {HOME}/wheels",
        f"COPY {context}/pytest /usr/local/bin/pytest",
        f"COPY {context}/env /root/.local/bin/env",
        f"RUN {install} && install -m 0755 {HOME}/site/bin/uv {HOME}/site/bin/uvx /usr/local/bin/ "
        f"&& rm -rf {HOME}/site/bin {HOME}/site/uv {HOME}/site/uv-*.dist-info {HOME}/wheels/uv-*.whl",
        "RUN ln -s pytest /usr/local/bin/py.test && ln -s /usr/local/bin/uv /usr/local/bin/uvx /root/.local/bin/",
        f"RUN for d in {pth}; do mkdir -p $d && echo {HOME}/site > $d/furlong-toolchain.pth; done",
        f"COPY {context}/offline {offline_shims.DIR}",
        f"RUN cd {offline_shims.DIR} && for c in {' '.join(offline_shims.COMMANDS)}; do ln -s shim $c; done",
    ]) + "\n"


def key(store) -> str:
    parent = store.standin_key(standins.PYTHON)
    return "toolchain-" + _sha(FORMAT, parent, _recipe("ctx"), *LOCK_ONLY, PYTEST_SCRIPT, ENV_SCRIPT,
                               offline_shims.shim(), offline_shims.installer(UV_VERSION), platform.machine())


def _download(dest: Path) -> None:
    """The wheels, by the host's pip (its index and certificates): builds sandboxes may not reach them."""
    arch = platform.machine()
    cmd = [sys.executable, "-m", "pip", "download", "--no-cache-dir", "--disable-pip-version-check",
           "--only-binary=:all:", "--python-version", "3.11", "--platform", f"manylinux_2_17_{arch}",
           "--platform", "any", "-d", str(dest), *REQUIREMENTS, *LOCK_ONLY]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stdout + res.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise ToolchainError(f"verifier toolchain: pip download {' '.join(REQUIREMENTS + LOCK_ONLY)} failed: {tail[0]}")


def _context(root: Path, name: str) -> Path:
    """The build context: the wheels and the two scripts, under the store (COPY reads it)."""
    ctx = root / name
    shutil.rmtree(ctx, ignore_errors=True)
    (ctx / "wheels").mkdir(parents=True)
    _download(ctx / "wheels")
    (ctx / "offline").mkdir()
    for fname, text in (("pytest", PYTEST_SCRIPT), ("env", ENV_SCRIPT), ("offline/shim", offline_shims.shim()),
                        ("offline/uv-installer.sh", offline_shims.installer(UV_VERSION))):
        (ctx / fname).write_text(text)
        os.chmod(ctx / fname, 0o755)
    return ctx


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
    """Downloads the wheels, builds the layer from its recipe, and refuses one that hides lower files."""
    parent = await store.parent(PARENT, backend, progress)
    ctx = await asyncio.to_thread(_context, store.root, f".{name}-context")
    recipe = store.root / f".{name}.Dockerfile"  # a real file, so a failing step names file:line
    recipe.write_text(_recipe(ctx.name))
    try:
        await store._build_layer(final, parent, recipe, df.parse(recipe), backend, progress,
                                 label="verifier toolchain", probe="uv --version; pytest --version",
                                 extra={"toolchain": list(REQUIREMENTS)})
    finally:
        shutil.rmtree(ctx, ignore_errors=True)
    if hidden := await asyncio.to_thread(hidden_entries, final / "upper"):
        shutil.rmtree(final, ignore_errors=True)
        raise ToolchainError(f"verifier toolchain layer would hide files of the task's image: {hidden[:3]}")


def stack(image: ImageRef, toolchain: Toolchain, network: bool) -> ImageRef:
    """The task's image with the toolchain on top; without network, uv is told to stay offline and the
    offline shims come first on PATH."""
    path = dict(image.env).get("PATH", BASE_ENV["PATH"])
    offline = (*OFFLINE_ENV, ("PATH", f"{offline_shims.DIR}:{path}"))
    env = image.env + ENV + (() if network else offline)
    note = "; ".join(n for n in (image.note, f"verifier toolchain ({toolchain.provides})") if n)
    return ImageRef(digest=f"{image.digest}+{toolchain.key}", layers=(toolchain.layer, *image.layers), env=env,
                    workdir=image.workdir, user=image.user, note=note)


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
                except Exception as exc:
                    self._built = f"verifier toolchain unavailable: {exc}"
        if isinstance(self._built, str):
            raise ToolchainError(self._built)
        return stack(image, self._built, task.verifier_network.online)


def opt_in_all(entries: list) -> list:
    """`eval.verifier_toolchain=true`: every loaded task gets the toolchain (broken ones stay as they are)."""
    return [dataclasses.replace(e, verifier_toolchain=True) if hasattr(e, "verifier_toolchain") else e
            for e in entries]
