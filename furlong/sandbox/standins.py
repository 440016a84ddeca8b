"""Which base a Dockerfile's FROM gets where no registry can be reached: the bookworm base as is, or the
base plus a stand-in layer that installs what the official image has (built once, like a task layer).

Only names whose official image is Debian bookworm plus packages Debian also ships are mapped, so a
task sees the same distribution and tools; `python:*` is the one approximation (Debian's Python 3.11
stands in for any 3.x), and the note says so wherever the image is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Official-image names are also written with their registry's path; the image is the same one.
_PREFIXES = ("docker.io/library/", "public.ecr.aws/docker/library/", "library/")
_CURL = ("ca-certificates", "curl", "gnupg", "netbase", "sq", "wget")
_SCM = (*_CURL, "git", "mercurial", "openssh-client", "subversion", "procps")
_BUILDPACK = (*_SCM, "autoconf", "automake", "bzip2", "default-libmysqlclient-dev", "dpkg-dev", "file", "g++",
              "gcc", "imagemagick", "libbz2-dev", "libc6-dev", "libcurl4-openssl-dev", "libdb-dev", "libevent-dev",
              "libffi-dev", "libgdbm-dev", "libglib2.0-dev", "libgmp-dev", "libjpeg-dev", "libkrb5-dev",
              "liblzma-dev", "libmagickcore-dev", "libmagickwand-dev", "libmaxminddb-dev", "libncurses5-dev",
              "libncursesw5-dev", "libpng-dev", "libpq-dev", "libreadline-dev", "libsqlite3-dev", "libssl-dev",
              "libtool", "libwebp-dev", "libxml2-dev", "libxslt-dev", "libyaml-dev", "make", "patch", "unzip",
              "xz-utils", "zlib1g-dev")


@dataclass(frozen=True)
class Standin:
    name: str
    packages: tuple[str, ...]
    setup: str = ""  # shell run after the packages are installed
    env: tuple[tuple[str, str], ...] = ()
    probe: str = ""  # prints what the stand-in really provides (recorded in its meta)
    what: str = ""  # what it is, for the note

    def dockerfile(self) -> str:
        """The stand-in as the Dockerfile it is built from (over furlong's base)."""
        install = (f"apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
                   f"{' '.join(self.packages)} && apt-get clean && rm -rf /var/lib/apt/lists/*")
        lines = ["FROM furlong/base", *(f"ENV {k}={v}" for k, v in self.env), f"RUN {install}"]
        return "\n".join(lines + ([f"RUN {self.setup}"] if self.setup else [])) + "\n"


# The official python image: `python`/`pip` commands, venv, pip usable as root (Debian marks its
# python EXTERNALLY-MANAGED; the official image has no such marker, so the stand-in removes it), and
# the official image's /usr/local/bin/python path, which scripts' shebangs name.
PYTHON = Standin(
    "python", ("python3-pip", "python3-venv", "python3-dev", "python-is-python3"),
    setup=("rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && ln -s /usr/bin/python3 /usr/local/bin/python "
           "&& ln -s /usr/bin/python3 /usr/local/bin/python3"),
    env=(("LANG", "C.UTF-8"),),
    probe="python3 -c 'import platform; print(platform.python_version())'",
    what="Debian bookworm's python3 with pip, venv and headers; no compiler")
STANDINS = {s.name: s for s in (
    PYTHON,
    Standin("buildpack-deps-curl", _CURL, what="Debian bookworm with buildpack-deps' packages"),
    Standin("buildpack-deps-scm", _SCM, what="Debian bookworm with buildpack-deps' packages"),
    Standin("buildpack-deps", _BUILDPACK, what="Debian bookworm with buildpack-deps' packages"),
)}
_DEBIAN_TAG = re.compile(r"(bookworm(-\d{8})?|12(\.\d+)?)(-slim)?")
_PYTHON_VERSION = re.compile(r"3(\.\d+){0,2}|latest")
KNOWN = ("debian:bookworm[-slim]", "debian:12[.N][-slim]", "python:3.X[.Y][-slim][-bookworm|-bullseye]",
         "buildpack-deps:bookworm[-curl|-scm]", "furlong/base")


@dataclass(frozen=True)
class BaseChoice:
    """What a FROM gets: the plain base (standin None) or the base plus a stand-in layer."""

    asked: str
    standin: Standin | None = None
    asked_version: str = ""  # python: the version the tag names ("" for none)
    differences: tuple[str, ...] = ()  # how the tag differs from what it gets

    def note(self, provides: str) -> str:
        """One line for the build log and the eval record; `provides` is the probe's output."""
        if self.standin is None:
            return ""
        extra = list(self.differences)
        asked = self.asked_version.split(".")
        if self.standin is PYTHON and self.asked_version and provides.split(".")[:len(asked)] != asked:
            extra.insert(0, f"the tag asks for Python {self.asked_version}")
        real = f"Python {provides}, " if self.standin is PYTHON else ""
        tail = f"; {'; '.join(extra)}" if extra else ""
        return f"{self.asked}: furlong's {self.standin.name} stand-in ({real}{self.standin.what}){tail}"


def resolve(ref: str) -> BaseChoice | None:
    """The base an image reference maps onto, or None where there is no honest mapping."""
    name, _, digest = ref.partition("@")
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    repo, _, tag = name.partition(":")
    pinned = ("a digest pins one build; the stand-in ignores it",) if digest else ()
    if ref == "furlong/base":
        return BaseChoice(ref)
    if repo == "debian" and _DEBIAN_TAG.fullmatch(tag):
        return BaseChoice(ref)
    if repo == "buildpack-deps" and tag in ("bookworm", "bookworm-curl", "bookworm-scm"):
        suffix = tag.removeprefix("bookworm")
        return BaseChoice(ref, STANDINS["buildpack-deps" + suffix], differences=pinned)
    if repo == "python":
        return _python(ref, tag, pinned)
    return None


def _python(ref: str, tag: str, pinned: tuple[str, ...]) -> BaseChoice | None:
    """python:[3.X[.Y]][-slim][-bookworm|-bullseye] (the official image's Debian variants)."""
    parts = tag.split("-") if tag else []
    version = parts.pop(0) if parts and _PYTHON_VERSION.fullmatch(parts[0]) else ""
    slim = bool(parts) and parts[0] == "slim"
    if slim:
        parts.pop(0)
    distro = parts.pop(0) if parts and parts[0] in ("bookworm", "bullseye") else "bookworm"
    if parts:
        return None
    differences = list(pinned)
    if distro == "bullseye":
        differences.append("Debian 12 (bookworm), not 11 (bullseye)")
    if not slim:
        differences.append("the full (non-slim) image's compilers are not included")
    return BaseChoice(ref, PYTHON, "" if version == "latest" else version, tuple(differences))
