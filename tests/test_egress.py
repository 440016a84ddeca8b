"""Builds and networked sandboxes behind a TLS-intercepting proxy or a mirror (images.trust_host_ca,
images.package_mirrors): a real HTTPS server whose CA only the "host" trusts (a bundle this test names, so
the machine's trust store is never touched), reached from real sandboxes and build steps of both builders.
Certificate checks stay on throughout: without the setting, or with another CA, the same requests fail.
tls_support.py says how a sandbox reaches the server with the default fence in place."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import skips
from conftest import run, spec
from tls_support import TLSServer, make_ca_and_cert, probe_wheel

from furlong.sandbox.runtime import egress
from furlong.sandbox.base import SandboxError
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageBuildError, ImageStore

needs_root = skips.needs_root("the test's HTTPS server needs a network namespace and a veth pair (root)")
CURL_IMAGE, PIP_IMAGE = "buildpack-deps:bookworm-curl", "python:3.11-slim"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("tls")
    (work / "www").mkdir()
    (work / "www" / "hello.txt").write_text("hello over TLS\n")
    probe_wheel(work / "www")
    server = TLSServer(work, work / "www")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lend():
    """egress.host_egress; the directories it makes with trust_host_ca on hold this module's fresh CAs, so
    no one else uses them: they go when the module ends."""
    made = []

    def make(trust_host_ca: bool, bundle: Path | None, package_mirrors: str) -> egress.Egress | None:
        lent = egress.host_egress(trust_host_ca, bundle, package_mirrors)
        if trust_host_ca:
            made.append(lent.directory)
        return lent

    yield make
    for directory in made:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def trusting(tls, lend) -> tuple[ImageStore, BwrapBackend]:
    """A store and backend whose builds and networked sandboxes trust the test CA's bundle."""
    lent = lend(True, tls.ca, "none")
    store = ImageStore(egress=lent)
    return store, BwrapBackend(layers=store, egress=lent)


def fetches(url: str) -> str:
    """curl, wget and Python's urllib fetching `url`, each with its own certificate checks, into /fetched-*."""
    return (f"curl -fsS {url}/hello.txt > /fetched-curl && wget -q -O /fetched-wget {url}/hello.txt && "
            f"python3 -c \"import urllib.request; "
            f"open('/fetched-py', 'wb').write(urllib.request.urlopen('{url}/hello.txt', timeout=20).read())\"")


def download(url: str) -> str:
    """pip downloading the probe wheel from `url`'s index into /wheels (no retries: a refusal is final)."""
    return f"pip download --retries 0 --no-deps -d /wheels --index-url {url}/simple/ furlong-probe"


async def _in_sandbox(backend, image, cmd: str, network: bool = True):
    box = await backend.create(spec(image, network=network))
    try:
        return await box.exec(cmd, timeout_s=120)
    finally:
        await box.close()


def _image(store, backend, name: str):
    return run(store.parent(name, backend, lambda _: None))


@needs_root
def test_a_networked_sandbox_trusts_the_host_ca_only_when_asked(tls, store, backend, trusting, lend,
                                                                tmp_path: Path):
    image = _image(store, backend, CURL_IMAGE)
    curl = f"curl -fsS {tls.url}/hello.txt"
    wget = f"wget -q -O - {tls.url}/hello.txt || wget -O /dev/null {tls.url}/hello.txt"  # quiet, else why it failed
    py = f"python3 -c \"import urllib.request; print(urllib.request.urlopen('{tls.url}/hello.txt').read().decode())\""
    for cmd in (curl, wget, py):
        refused = run(_in_sandbox(backend, image, cmd))
        assert refused.exit_code != 0 and "certificate" in (refused.stdout + refused.stderr).lower(), refused
        served = run(_in_sandbox(trusting[1], image, cmd))
        assert served.exit_code == 0 and served.stdout.strip() == "hello over TLS", served
    other, _, _ = make_ca_and_cert(tmp_path, "192.0.2.1")  # a bundle without the server's CA: still checked
    stranger = BwrapBackend(layers=store, egress=lend(True, other, "none"))
    refused = run(_in_sandbox(stranger, image, py))
    assert refused.exit_code != 0 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr, refused
    offline = run(_in_sandbox(trusting[1], image, f"ls {egress.MOUNT}; env | grep -c CA_BUNDLE", network=False))
    assert "No such file" in offline.stderr and offline.stdout.strip() == "0", "only networked sandboxes get it"


def _dockerfile(tmp_path: Path, text: str) -> Path:
    env = tmp_path / uuid.uuid4().hex[:8] / "environment"
    env.mkdir(parents=True)
    (env / "Dockerfile").write_text(text)
    return env / "Dockerfile"


@needs_root
def test_native_build_steps_trust_the_host_ca_only_when_asked(tls, store, backend, trusting, tmp_path: Path):
    nonce = uuid.uuid4().hex  # a fresh layer, so the steps really run
    curl = _dockerfile(tmp_path, f"FROM {CURL_IMAGE}\nENV NONCE={nonce}\nRUN {fetches(tls.url)}\n")
    pip = _dockerfile(tmp_path, f"FROM {PIP_IMAGE}\nENV NONCE={nonce}\nRUN {download(tls.url)}\n")
    for dockerfile, why in ((curl, "SSL certificate problem"), (pip, "CERTIFICATE_VERIFY_FAILED")):
        with pytest.raises(ImageBuildError, match=why):
            run(store.image(dockerfile, backend))
    trusted_store, trusted_backend = trusting
    built = run(trusted_store.image(curl, trusted_backend))
    wheels = run(trusted_store.image(pip, trusted_backend))
    assert built.digest != store.layer_key(curl, _steps(curl), _image(store, backend, CURL_IMAGE).digest)
    seen = run(_in_sandbox(backend, built, "cat /fetched-curl /fetched-wget /fetched-py; env", network=False))
    assert seen.stdout.startswith("hello over TLS\n" * 3) and "SSL_CERT_FILE" not in seen.stdout, seen
    listed = run(_in_sandbox(backend, wheels, "ls /wheels", network=False))
    assert listed.stdout == "furlong_probe-1.0-py3-none-any.whl\n", listed
    for image in (built, wheels):  # the bind's mount point is not part of the layer; its meta says what was lent
        assert not (trusted_store.root / image.layers[0].path / egress.MOUNT.lstrip("/")).exists()
        assert json.loads((trusted_store.root / image.digest / "meta.json").read_text())["egress"] == "trust_host_ca"


def _steps(dockerfile: Path):
    from furlong.sandbox.images import dockerfile as df

    return df.parse(dockerfile)


@needs_root
def test_buildah_steps_trust_the_host_ca_only_when_asked(tls, store, backend, trusting, tmp_path: Path):
    nonce = uuid.uuid4().hex
    dockerfile = _dockerfile(tmp_path, (  # two stages: buildah builds it
        f"FROM {CURL_IMAGE} AS fetch\nARG NONCE={nonce}\nRUN {fetches(tls.url)}\n"
        f"FROM {PIP_IMAGE}\nRUN {download(tls.url)}\n"
        "COPY --from=fetch /fetched-curl /fetched-wget /fetched-py /\n"))
    with pytest.raises(ImageBuildError, match=r"Dockerfile:3: RUN exited 60:[\s\S]*SSL certificate problem"):
        run(store.image(dockerfile, backend))
    trusted_store, trusted_backend = trusting
    image = run(trusted_store.image(dockerfile, trusted_backend))
    seen = run(_in_sandbox(backend, image, "cat /fetched-curl /fetched-wget /fetched-py; ls /wheels; env",
                           network=False))
    assert seen.stdout.startswith("hello over TLS\n" * 3 + "furlong_probe-1.0-py3-none-any.whl\n"), seen
    assert "SSL_CERT_FILE" not in seen.stdout and "APT_CONFIG" not in seen.stdout, "the ENV lent is not kept"
    assert not (trusted_store.root / image.layers[0].path / egress.MOUNT.lstrip("/")).exists()
    assert json.loads((trusted_store.root / image.digest / "meta.json").read_text())["egress"] == "trust_host_ca"


@needs_root
def test_package_mirrors_host_lends_pips_index_and_apts_proxy(tls, store, backend, lend, tmp_path: Path,
                                                              monkeypatch):
    apt_conf = tmp_path / "apt.conf"
    apt_conf.write_text('Acquire::http::Proxy::proxied.example "http://proxy.example:3128";\n')  # not the mirror's
    monkeypatch.setenv("APT_CONFIG", str(apt_conf))  # what `apt-config dump` reads on the host
    monkeypatch.setenv("PIP_INDEX_URL", f"{tls.url}/simple/")
    lent = lend(True, tls.ca, "host")
    mirrored = ImageStore(egress=lent)
    mirrored_backend = BwrapBackend(layers=mirrored, egress=lent)
    image = _image(store, backend, PIP_IMAGE)
    r = run(_in_sandbox(mirrored_backend, image, "pip download --retries 0 --no-deps -d /tmp/w furlong-probe && "
                                                 "apt-config dump | grep -i proxy"))
    assert r.exit_code == 0 and 'Acquire::http::Proxy::proxied.example "http://proxy.example:3128";' in r.stdout, r
    dockerfile = _dockerfile(tmp_path, f"FROM {PIP_IMAGE}\nENV NONCE={uuid.uuid4().hex}\n"
                                       "RUN pip download --retries 0 --no-deps -d /wheels furlong-probe\n")
    built = run(mirrored.image(dockerfile, mirrored_backend))
    listed = run(_in_sandbox(backend, built, "ls /wheels", network=False))
    assert listed.stdout == "furlong_probe-1.0-py3-none-any.whl\n", listed


def test_both_settings_are_off_by_default_and_keyed_apart_when_on(lend, tmp_path: Path):
    assert egress.host_egress(False, None, "none") is None
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(make_ca_and_cert(tmp_path, "192.0.2.1")[0]).read_bytes())
    dockerfile = _dockerfile(tmp_path, "FROM debian:bookworm\nRUN true\n")
    steps = _steps(dockerfile)
    plain = ImageStore()
    keys = {ImageStore(egress=e).layer_key(dockerfile, steps) for e in (
        lend(True, bundle, "none"), lend(False, None, "host"), lend(True, bundle, "host"))}
    assert len(keys) == 3 and plain.layer_key(dockerfile, steps) not in keys
    with pytest.raises(SandboxError, match="holds no PEM certificate"):
        egress.host_egress(True, dockerfile, "none")


def test_pip_settings_are_read_in_pips_order(tmp_path: Path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://a.example/simple\nextra-index-url = file:///opt/wheels "
                    "https://c.example/simple\n[install]\nindex-url = https://b.example/simple\n")
    environ = {"PIP_CONFIG_FILE": str(conf), "HOME": str(tmp_path), "XDG_CONFIG_DIRS": str(tmp_path),
               "PIP_TRUSTED_HOST": "c.example", "https_proxy": "http://proxy.example:3128"}
    env, notes = egress.mirror_env(egress.pip_settings(environ), environ)
    assert dict(env) == {"PIP_INDEX_URL": "https://b.example/simple", "UV_INDEX_URL": "https://b.example/simple",
                         "PIP_EXTRA_INDEX_URL": "https://c.example/simple",
                         "UV_EXTRA_INDEX_URL": "https://c.example/simple", "PIP_TRUSTED_HOST": "c.example",
                         "UV_INSECURE_HOST": "c.example", "https_proxy": "http://proxy.example:3128"}
    assert notes == ["pip extra-index-url file:///opt/wheels is not an http(s) URL; sandboxes do not get it"]


ROOTLESS = r"""
import asyncio, shutil, sys
from pathlib import Path
from furlong.sandbox.runtime import egress
from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.network import PUBLIC
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.images.store import ImageBuildError, ImageStore
url, ca, fetch, dockerfiles = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4:]

async def main():
    for lent in (None, egress.host_egress(True, ca, "none")):
        store = ImageStore(egress=lent)
        backend = BwrapBackend(layers=store, egress=lent)
        box = await backend.create(SandboxSpec(image=store.base(), network=PUBLIC))
        try:
            fetched = await box.exec(fetch, timeout_s=60)
        finally:
            await box.close()
        built = []
        for dockerfile in dockerfiles:
            try:
                built.append((await store.image(Path(dockerfile), backend)).digest.split("-")[0])
            except ImageBuildError:
                built.append("failed")
        print(fetched.exit_code, fetched.stdout.strip().replace(" ", "_"), *built)
        if lent:
            shutil.rmtree(lent.directory)  # it holds the test's CA: no one else's

asyncio.run(main())
"""


@needs_root
def test_an_ordinary_users_sandboxes_and_builds_trust_the_host_ca_only_when_asked(tls, tmp_path: Path):
    import tempfile

    from test_rootless import CI_USER, _ensure_ci_user, run_as

    _ensure_ci_user()
    shared = Path(tempfile.mkdtemp(prefix="furlong-egress-"))
    try:
        shared.chmod(0o755)
        ca = shared / "ca.pem"
        shutil.copy(tls.ca, ca)
        fetch = (f"python3 -c \"import urllib.request; print(urllib.request.urlopen('{tls.url}/hello.txt', "
                 f"timeout=20).read().decode().strip())\"")
        nonce = uuid.uuid4().hex
        native = shared / "native" / "Dockerfile"
        two_stage = shared / "buildah" / "Dockerfile"  # ARG: buildah builds it
        for path, text in ((native, f"FROM debian:bookworm\nENV NONCE={nonce}\nRUN {fetch}\n"),
                           (two_stage, f"FROM furlong/base\nARG NONCE={nonce}\nRUN {fetch}\n")):
            path.parent.mkdir()
            path.write_text(text)
        for p in [shared, *shared.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        res = run_as(CI_USER, [sys.executable, "-c", ROOTLESS, tls.url, str(ca), fetch, str(native),
                               str(two_stage)], timeout=900)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-2:] == ["1  failed failed", "0 hello_over_TLS layer buildah"], res.stdout
