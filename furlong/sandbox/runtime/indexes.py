"""The hosts a `packages` network reaches: package indexes, as this host knows them.

- Python: PyPI (pypi.org, files.pythonhosted.org: pip's and uv's default), and the host pip's and uv's own
  indexes (pip.conf / PIP_INDEX_URL..., uv.toml / UV_INDEX_URL, UV_DEFAULT_INDEX..., http(s) ones only).
- Debian and Ubuntu: their mirrors and security archives, and every http(s) source in the host's apt lists.
- uv's installer (`curl https://astral.sh/uv/install.sh | sh`) and the interpreters `uvx -p 3.13` fetches:
  astral.sh and the GitHub release hosts they download from.
Read where the sandbox runs (a sandbox host reads its own), so a mirror named on that host is what counts.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

from furlong.sandbox.runtime.egress import pip_settings

PYPI = ("pypi.org", "files.pythonhosted.org")
DISTRIBUTIONS = (
    "deb.debian.org",
    "security.debian.org",
    "archive.ubuntu.com",
    "*.archive.ubuntu.com",
    "security.ubuntu.com",
    "ports.ubuntu.com",
)
UV_INSTALLER = (
    "astral.sh",
    "*.astral.sh",
    "github.com",
    "objects.githubusercontent.com",
    "release-assets.githubusercontent.com",
)
UV_VARIABLES = ("UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX", "UV_PYTHON_INSTALL_MIRROR")
APT_SOURCES = Path("/etc/apt")
_URL = re.compile(r"\bhttps?://[^\s\"'\]]+")


def package_hosts(environ=os.environ, apt: Path = APT_SOURCES) -> tuple[str, ...]:
    """The allowlist entries of `packages`, the defaults first, then this host's own indexes."""
    found = [*PYPI, *DISTRIBUTIONS, *UV_INSTALLER]
    pip = pip_settings(environ)
    urls = [*pip.get("index-url", "").split(), *pip.get("extra-index-url", "").split()]
    urls += [w for name in UV_VARIABLES for w in environ.get(name, "").split()]
    urls += _uv_toml_urls(environ)
    urls += _apt_urls(apt)
    for url in urls:
        parts = urlsplit(url.split("=", 1)[-1])  # UV_INDEX entries may be `name=url`
        if parts.scheme in ("http", "https") and parts.hostname and parts.hostname not in found:
            found.append(parts.hostname.lower())
    return tuple(found)


def _uv_toml_urls(environ) -> list[str]:
    """Index URLs in uv's config files (system, then user; $UV_CONFIG_FILE where set)."""
    home = Path(environ.get("HOME") or Path.home())
    user = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
    files = [Path("/etc/uv/uv.toml"), user / "uv" / "uv.toml"]
    if given := environ.get("UV_CONFIG_FILE"):
        files.append(Path(given))
    urls: list[str] = []
    for path in files:
        try:
            conf = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
            continue  # uv would refuse it too; not ours to judge
        pip = conf.get("pip", {}) if isinstance(conf.get("pip"), dict) else {}
        for table in (conf, pip):
            for key in ("index-url", "extra-index-url", "python-install-mirror"):
                value = table.get(key)
                urls += value if isinstance(value, list) else [value] if isinstance(value, str) else []
        for index in conf.get("index", []) if isinstance(conf.get("index"), list) else []:
            if isinstance(index, dict) and isinstance(index.get("url"), str):
                urls.append(index["url"])
    return [u for u in urls if isinstance(u, str)]


def _apt_urls(root: Path) -> list[str]:
    """The http(s) URLs of the host's apt sources (one-line .list and deb822 .sources files)."""
    files = [
        root / "sources.list",
        *sorted((root / "sources.list.d").glob("*.list")),
        *sorted((root / "sources.list.d").glob("*.sources")),
    ]
    urls: list[str] = []
    for path in files:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("#"):
                continue
            if line.startswith(("deb ", "deb-src ", "URIs:")):
                urls += _URL.findall(line)
    return urls
