"""images.offline_uv: uv's `curl ... astral.sh ... | sh` in a RUN step gets the verifier toolchain's uv, in
furlong's own builder and in buildah, real builds run in real sandboxes; off, the step fails as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run, spec

from furlong.config import load_config
from furlong.sandbox.images import buildah, offline_uv, toolchain
from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.images.buildah import Buildah
from furlong.sandbox.images.store import ImageBuildError, ImageStore

# TB2's form (transaction-log-replay and others); the python stand-in has no curl: the shim answers alone
NATIVE = """\
FROM python:3.11-slim
RUN curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh
ENV PATH="/root/.local/bin:/usr/local/bin:${PATH}"
RUN cp /root/.local/bin/uv /root/.local/bin/uvx /usr/local/bin/
"""
# ARG and a second stage: outside the native subset, so buildah builds it
BUILDAH = """\
FROM python:3.11-slim AS base
FROM base
ARG WHERE=/opt/uv
RUN wget -qO- https://github.com/astral-sh/uv/releases/download/0.5.11/uv-installer.sh | \\
    env UV_INSTALL_DIR=$WHERE sh
RUN curl -LsSf https://astral.sh/uv/install.sh | sh && cp /root/.local/bin/uv* /usr/local/bin/
ENV PATH="/root/.local/bin:${PATH}"
"""
CHECK = ("set -e; uv --version; /usr/local/bin/uvx --version; test -f /root/.local/bin/uv -a ! -L /root/.local/bin/uv;"
         " . /root/.local/bin/env; test ! -e /run/furlong-uv && echo clean")


@pytest.fixture(scope="module")
def uv_store(store: ImageStore) -> ImageStore:
    """The session's store with images.offline_uv on (same root: the stand-in and toolchain are shared)."""
    return ImageStore(store.root, offline_uv=True)


def _task(tmp_path: Path, text: str) -> Path:
    (tmp_path / "environment").mkdir(parents=True)
    (tmp_path / "environment/Dockerfile").write_text(text)
    return tmp_path / "environment/Dockerfile"


def _exec(backend, ref, cmd: str):
    async def go():
        box = await backend.create(spec(ref))
        try:
            return await box.exec(cmd, env=dict(ref.env), timeout_s=60)
        finally:
            await box.close()
    return run(go())


def _versions_and_clean(out: str) -> None:
    lines = out.splitlines()
    assert lines[0].startswith(f"uv {toolchain.UV_VERSION} ") and lines[1].startswith(f"uvx {toolchain.UV_VERSION} ")
    assert lines[2] == "clean", out  # the toolchain's directory is not left in the image


def test_what_the_setting_matches():
    assert offline_uv.asked("curl -LsSf https://astral.sh/uv/0.5.11/install.sh | sh") == "0.5.11"
    assert offline_uv.asked("apt-get install -y curl && curl -sSf https://astral.sh/uv/install.sh | bash") == "latest"
    assert offline_uv.asked("wget -qO- https://github.com/astral-sh/uv/releases/latest/download/uv-installer.sh"
                            " | sh") == "latest"
    assert offline_uv.asked('sh -c "$(curl -fsSL https://astral.sh/uv/0.9.5/install.sh)"') == "0.9.5"
    assert offline_uv.asked("curl -o /tmp/i.sh https://astral.sh/uv/install.sh && sh /tmp/i.sh") == "latest"
    assert offline_uv.asked("curl -LsSf $UV_URL | sh") is None  # a URL in a variable is not seen
    assert offline_uv.asked("pip install uv") is None
    assert load_config().images.offline_uv is False
    assert load_config(overrides=["images.offline_uv=true"]).images.offline_uv is True


def test_native_build_gets_the_toolchains_uv(uv_store: ImageStore, store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, NATIVE)
    ref = run(uv_store.image(path, backend))
    meta = json.loads((uv_store.root / ref.digest / "meta.json").read_text())
    assert meta["builder"] == "furlong" and "in place of the uv 0.5.11" in ref.note
    assert f"Dockerfile:2: uv {toolchain.UV_VERSION} from furlong's verifier toolchain" in meta["offline_uv"]
    res = _exec(backend, ref, CHECK)
    assert res.ok, res.stdout + res.stderr
    _versions_and_clean(res.stdout)
    # off: the key is another one, and the build fails one step later, as it does without the setting
    steps = df.parse(path)
    parent = run(store.parent(steps[0].args, backend, lambda _: None)).digest
    offline = run(offline_uv.prepare(uv_store, backend, lambda _: None))
    assert uv_store.layer_key(path, steps, parent, offline) == ref.digest != store.layer_key(path, steps, parent)
    with pytest.raises(ImageBuildError, match=r"Dockerfile:4: RUN exited 1:\n.*cannot stat '/root/.local/bin/uv'"):
        run(ImageStore(store.root).image(path, backend))


def test_buildah_build_gets_the_toolchains_uv(uv_store: ImageStore, backend, tmp_path: Path):
    path = _task(tmp_path, BUILDAH)
    ref = run(uv_store.image(path, backend))
    meta = json.loads((uv_store.root / ref.digest / "meta.json").read_text())
    assert meta["builder"] == "buildah" and "Dockerfile:4: uv" in ref.note and "the uv latest its" in ref.note
    res = _exec(backend, ref, CHECK + "; /opt/uv/uv --version; test -f /opt/uv/env")
    assert res.ok, res.stdout + res.stderr
    _versions_and_clean(res.stdout)
    # off: the RUN lines stay as written (so buildah's image key is another one), line for line
    bh = Buildah(uv_store.root.parent / "buildah")
    plain, rewritten = (run(buildah.plan(s, bh, path, backend, lambda _: None)) for s in (ImageStore(uv_store.root),
                                                                                          uv_store))
    assert plain.lines[3:6] == BUILDAH.splitlines()[3:6] and len(rewritten.lines) == len(plain.lines)
    assert rewritten.lines[3].startswith(f'RUN export PATH="{offline_uv.MOUNT}/shims:$PATH"') and not rewritten.lines[4]
