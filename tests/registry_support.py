"""A real registry for tests: Debian's `docker-registry` on 127.0.0.1, and OCI images made from the base.

Only loopback is ever addressed. The registry keeps its blobs in a directory of its own, so it can be
stopped (to play an unreachable registry) and started again with its images still there.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry:
    """`docker-registry serve` on 127.0.0.1:PORT over plain HTTP, optionally with htpasswd auth."""

    def __init__(self, workdir: Path, storage: Path, htpasswd: Path | None = None):
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = storage
        self.config = workdir / f"registry-{self.port}.yml"
        auth = f"auth:\n  htpasswd:\n    realm: furlong-test\n    path: {htpasswd}\n" if htpasswd else ""
        self.config.write_text(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
                               f"    rootdirectory: {storage}\nhttp:\n  addr: {self.host}\n  secret: furlong-test\n"
                               + auth)
        self.log = workdir / f"registry-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LocalRegistry:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["docker-registry", "serve", str(self.config)], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                return self
            except urllib.error.HTTPError:  # 401 from an authenticating registry: it is up
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"docker-registry exited {self.proc.returncode}: {self.log.read_text()[-500:]}")
                time.sleep(0.1)
        raise RuntimeError(f"docker-registry did not answer on {self.host} within 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


def _blob(blobs: Path, data: bytes, media: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return {"mediaType": media, "digest": f"sha256:{digest}", "size": len(data)}


def _file_blob(blobs: Path, path: Path, media: str) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    size = path.stat().st_size
    path.rename(blobs / h.hexdigest())
    return {"mediaType": media, "digest": f"sha256:{h.hexdigest()}", "size": size}


def _file_layer(name: str, content: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(content.encode()), 0o644
        tar.addfile(info, io.BytesIO(content.encode()))
    return buf.getvalue()


def oci_from_rootfs(rootfs: Path, out: Path, extras: dict[str, str]) -> Path:
    """An OCI layout with one manifest per architecture in `extras` (arch -> the content of /extra):
    each is the whole rootfs as its first layer (shared) plus a layer with that /extra."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    tar = out / "rootfs.tar"
    subprocess.run(["tar", "-C", str(rootfs), "--numeric-owner", "--exclude=./dev/*", "-cf", str(tar), "."],
                   check=True)
    base = _file_blob(blobs, tar, LAYER_TAR)
    manifests = []
    for arch, content in extras.items():
        extra = _blob(blobs, _file_layer("extra", content), LAYER_TAR)
        config = {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": [base["digest"],
                                                                                                extra["digest"]]},
                  "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                     "SEEDED=yes"], "WorkingDir": "/root"}}
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": _blob(blobs, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
                    "layers": [base, extra]}
        desc = _blob(blobs, json.dumps(manifest).encode(), manifest["mediaType"])
        manifests.append({**desc, "platform": {"architecture": arch, "os": "linux"}})
    if len(manifests) > 1:  # a multi-platform image: the layout's one entry is an index of them
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests}
        manifests = [_blob(blobs, json.dumps(index).encode(), index["mediaType"])]
    (out / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
    (out / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return out


def push(layout: Path, dest: str, all_platforms: bool = False) -> None:
    """skopeo copy of a layout's image (or, with all_platforms, its whole index) to a loopback registry."""
    # No credentials: a file that does not exist (skopeo's default may be unreadable to a user, e.g. a
    # /run/containers that root's buildah made 0700).
    cmd = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"--dest-authfile={layout}.no-credentials",
           *(["--all"] if all_platforms else []),
           f"oci:{layout}", f"docker://{dest}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
