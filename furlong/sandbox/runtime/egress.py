"""What networked sandboxes and image builds borrow from the host when the config asks: its CA certificates
(`images.trust_host_ca`) and its package index and proxy settings (`images.package_mirrors: host`).

Behind a TLS-intercepting proxy (a corporate network, a cluster's egress gateway) or an internal mirror, the
host trusts a CA and knows a mirror that images do not, so `pip install` in a RUN step fails certificate
checks. With these settings every process that may use the network (build steps of both builders, and
sandboxes whose task allows the network) gets them. They are handed over at run time, never written into an
image: the host's pieces are copied into one directory that is bound read-only at MOUNT, and environment
variables name them. So an image stays what its Dockerfile made (a sandbox without network trusts only its
image's CAs), a renewed host bundle needs no rebuild, and the bind's mount point is taken out of every built
layer. Images built with them are still keyed apart (`Egress.key`): what a build fetched depended on whom
it trusted and which index it asked. docs/images.md, "Behind a TLS-intercepting proxy or a package mirror".
"""

from __future__ import annotations

import configparser
import hashlib
import logging
import os
import shutil
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxError

log = logging.getLogger(__name__)
MOUNT = "/run/furlong-host"  # inside: the host's pieces, read-only
CA_FILE, APT_FILE, WGETRC_FILE = "ca-certificates.crt", "apt.conf", "wgetrc"
# The clients that read a CA bundle from the environment: OpenSSL's users (Python's ssl, curl, wget built
# with OpenSSL, uv, Go), pip (else certifi), requests, the curl command, Node (added to its own roots), git.
CA_VARIABLES = (
    "SSL_CERT_FILE",
    "PIP_CERT",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
)
PROXY_VARIABLES = (
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
)
PIP_KEYS = ("index-url", "extra-index-url", "trusted-host", "cert")
LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Egress:
    """What a networked process gets: `directory` (a host directory, bound read-only at MOUNT; None: nothing
    to bind) and `env`, set before the image's own ENV (which wins, as it would in Docker). `key` is what
    image keys record of it, `settings` the same in words (a built image's meta.json has it)."""

    key: str
    env: tuple[tuple[str, str], ...] = ()
    directory: Path | None = None
    settings: str = ""

    def bwrap_args(self) -> list[str]:
        return ["--ro-bind", str(self.directory), MOUNT] if self.directory else []

    def buildah_args(self) -> list[str]:
        return ["--volume", f"{self.directory}:{MOUNT}:ro"] if self.directory else []

    def remove_mount_point(self, tree: Path) -> None:
        """Takes the bind's mount point (an empty directory the sandbox made for it) out of a built tree."""
        if self.directory:
            remove_mount_point(tree, MOUNT)


def remove_mount_point(tree: Path, mount: str) -> None:
    """Takes a bind's mount point `mount` out of a built tree, where it is an empty directory."""
    point = tree / mount.lstrip("/")
    if point.is_dir() and not point.is_symlink() and not any(point.iterdir()):
        point.rmdir()


def host_egress(trust_host_ca: bool, ca_bundle: Path | None, package_mirrors: str) -> Egress | None:
    """The Egress the config asks for on this host; None when both settings are off. A CA bundle that
    cannot be found or read is a one-line SandboxError."""
    if not trust_host_ca and package_mirrors != "host":
        return None
    files: dict[str, bytes] = {}
    env: list[tuple[str, str]] = []
    key = ["trust_host_ca"] if trust_host_ca else []
    apt = []
    if trust_host_ca:
        files[CA_FILE] = _read_bundle(ca_bundle or default_ca_bundle())
        env += [(name, f"{MOUNT}/{CA_FILE}") for name in CA_VARIABLES]
        # Debian's wget is GnuTLS's, which reads no variable: a startup file names the bundle (/etc/wgetrc
        # is still read)
        files[WGETRC_FILE] = f"ca_certificate = {MOUNT}/{CA_FILE}\n".encode()
        env.append(("WGETRC", f"{MOUNT}/{WGETRC_FILE}"))
        apt.append(f'Acquire::https::CaInfo "{MOUNT}/{CA_FILE}";')
    if package_mirrors == "host":
        pip_env, notes = mirror_env(pip_settings(), os.environ)
        env += pip_env
        apt += apt_proxies()
        key.append("package_mirrors=host")  # not which mirror: a mirror serves the index's packages
        for note in notes:
            log.warning("images.package_mirrors=host: %s", note)
    if apt:
        files[APT_FILE] = ("\n".join(apt) + "\n").encode()
        env.append(("APT_CONFIG", f"{MOUNT}/{APT_FILE}"))  # read before apt.conf.d, which still applies
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    return Egress(
        key=digest, env=tuple(env), directory=_write_directory(files) if files else None, settings=", ".join(key)
    )


def through_proxy(egress: Egress | None, proxy_url: str) -> Egress:
    """What a controlled sandbox gets (furlong.sandbox.runtime.egress_proxy): `egress`'s CA and index settings, and
    every proxy setting naming `proxy_url`, the sandbox's only way out (the host's own proxies are out of
    its reach): the proxy variables (loopback excepted) and apt's, with pipelining off, as the proxy sends
    one request per connection."""
    files: dict[str, bytes] = {}
    apt: list[str] = []
    if egress is not None and egress.directory is not None:
        for path in egress.directory.iterdir():
            files[path.name] = path.read_bytes()
        apt = [
            line
            for line in files.pop(APT_FILE, b"").decode().splitlines()
            if "::proxy" not in line.split(" ", 1)[0].lower()
        ]
    env = [(k, v) for k, v in (egress.env if egress else ()) if k not in PROXY_VARIABLES and k != "APT_CONFIG"]
    env += [(name, proxy_url) for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")]
    env += [(name, ",".join(LOOPBACK)) for name in ("no_proxy", "NO_PROXY")]
    apt += [
        f'Acquire::http::Proxy "{proxy_url}/";',
        f'Acquire::https::Proxy "{proxy_url}/";',
        'Acquire::http::Pipeline-Depth "0";',
    ]
    files[APT_FILE] = ("\n".join(apt) + "\n").encode()
    env.append(("APT_CONFIG", f"{MOUNT}/{APT_FILE}"))
    key = egress.key if egress else ""
    return Egress(
        key=key,
        env=tuple(env),
        directory=_write_directory(files),
        settings=", ".join(x for x in (egress.settings if egress else "", "egress proxy") if x),
    )


def default_ca_bundle() -> Path:
    """The bundle the host's pip and Python verify with: pip's `cert` setting (PIP_CERT or pip.conf), else
    OpenSSL's default file as Python sees it (SSL_CERT_FILE, else e.g. /usr/lib/ssl/cert.pem)."""
    paths = ssl.get_default_verify_paths()
    for candidate in (pip_settings().get("cert"), paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    raise SandboxError(
        "images.trust_host_ca: this host has no CA bundle file that pip or Python use; "
        "name one with images.host_ca_bundle"
    )


def _read_bundle(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SandboxError(f"images.host_ca_bundle: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        raise SandboxError(f"images.host_ca_bundle: {path} holds no PEM certificate")
    return data


def pip_config_files(environ=os.environ) -> list[Path]:
    """pip's config files, lowest precedence first, as pip reads them on Linux: global, user, site, then
    $PIP_CONFIG_FILE (os.devnull there: none at all)."""
    given = environ.get("PIP_CONFIG_FILE")
    if given == os.devnull:
        return []
    xdg_dirs = (environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":")
    home = Path(environ.get("HOME") or Path.home())
    user = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
    files = [
        *(Path(d) / "pip" / "pip.conf" for d in xdg_dirs if d),
        Path("/etc/pip.conf"),
        home / ".pip" / "pip.conf",
        user / "pip" / "pip.conf",
        Path(sys.prefix) / "pip.conf",
    ]
    return files + ([Path(given)] if given else [])


def pip_settings(environ=os.environ) -> dict[str, str]:
    """The host pip's `index-url`, `extra-index-url`, `trusted-host` and `cert` for `pip install`: its
    config files ([global], then [install] over it), then PIP_* variables over those."""
    found: dict[str, str] = {}
    for path in pip_config_files(environ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, UnicodeDecodeError, OSError):
            continue  # pip would refuse this file too; it is not ours to judge
        for section in ("global", "install"):
            for key in PIP_KEYS:
                if parser.has_option(section, key):
                    found[key] = parser.get(section, key).strip()
    for key in PIP_KEYS:
        if value := environ.get("PIP_" + key.upper().replace("-", "_")):
            found[key] = value.strip()
    return found


def mirror_env(pip: dict[str, str], environ) -> tuple[list[tuple[str, str]], list[str]]:
    """Environment for pip and uv from the host pip's settings, plus the host's proxy variables, and notes
    on what was left out: an index that is not an http(s) URL (a host path a sandbox cannot see)."""
    env: list[tuple[str, str]] = []
    notes: list[str] = []
    urls = {}
    for key in ("index-url", "extra-index-url"):
        words = pip.get(key, "").split()
        kept = [w for w in words if urlsplit(w).scheme in ("http", "https")]
        notes += [f"pip {key} {w} is not an http(s) URL; sandboxes do not get it" for w in words if w not in kept]
        notes += [
            f"pip {key} {w} is on host loopback, which sandboxes cannot reach"
            for w in kept
            if urlsplit(w).hostname in LOOPBACK
        ]
        urls[key] = " ".join(kept)
    for key, pip_var, uv_var in (
        ("index-url", "PIP_INDEX_URL", "UV_INDEX_URL"),
        ("extra-index-url", "PIP_EXTRA_INDEX_URL", "UV_EXTRA_INDEX_URL"),
    ):
        if urls[key]:
            env += [(pip_var, urls[key]), (uv_var, urls[key])]
    if trusted := pip.get("trusted-host", "").split():  # the host's own choice, kept as it made it
        env += [("PIP_TRUSTED_HOST", " ".join(trusted)), ("UV_INSECURE_HOST", " ".join(trusted))]
    env += [(name, environ[name]) for name in PROXY_VARIABLES if environ.get(name)]
    return env, notes


def apt_proxies() -> list[str]:
    """The host apt's proxy settings (Acquire::http::Proxy, Acquire::https::Proxy, per-host ones too), as
    apt.conf lines; none where apt is not installed."""
    if shutil.which("apt-config") is None:
        return []
    out = subprocess.run(["apt-config", "dump"], capture_output=True, text=True, timeout=30, check=False).stdout
    return [
        line
        for line in out.splitlines()
        if line.split(" ", 1)[0].lower().split("::")[:3]
        in (["acquire", "http", "proxy"], ["acquire", "https", "proxy"])
    ]


def _write_directory(files: dict[str, bytes]) -> Path:
    """The files in a directory named by their content, readable by the sandbox uid (root's home is not),
    written once: a sandbox starting meanwhile sees the whole directory or none."""
    digest = hashlib.sha256(b"".join(n.encode() + b"\0" + d + b"\0" for n, d in sorted(files.items())))
    base = Path("/run/furlong") if os.geteuid() == 0 else cache_dir()
    final = base / f"egress-{digest.hexdigest()[:16]}"
    if final.is_dir():
        return final
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
        (tmp / name).chmod(0o644)
    tmp.chmod(0o755)
    try:
        tmp.rename(final)
    except OSError:  # another process wrote the same directory first
        shutil.rmtree(tmp, ignore_errors=True)
    return final
