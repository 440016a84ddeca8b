"""What each stand-in installs: the official image's tools from Debian's packages, per Debian release.

The versions are those Debian ships (bench/standins_check.py builds each one and records what its probe
prints: bench/results/standins.json); a stand-in's note always states the probed one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUITES = ("bookworm", "trixie")  # the Debian releases furlong bootstraps a base of


@dataclass(frozen=True)
class Standin:
    name: str
    packages: tuple[str, ...]
    setup: str = ""  # shell run after the packages are installed
    env: tuple[tuple[str, str], ...] = ()
    probe: str = ""  # prints the version it really provides (recorded in its meta)
    what: str = ""  # what it is, for the note
    suite: str = "bookworm"  # the Debian release it is built on
    version: str = ""  # the release tags name it by (3.11, 12, 1.22): what `exact` compares
    label: str = ""  # what the version is of, for the note ("Python", "gcc")
    backports: bool = False  # its packages come from <suite>-backports

    def dockerfile(self) -> str:
        """The stand-in as the Dockerfile it is built from (over furlong's base of its suite)."""
        install = (
            f"apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
            f"{' '.join(self.packages)} && apt-get clean && rm -rf /var/lib/apt/lists/*"
        )
        if self.backports:  # the base's own mirror line, for this install only: the image keeps its suite's
            listed = "/etc/apt/sources.list.d/furlong-backports.list"
            install = (
                f"sed -n 's/ {self.suite} main$/ {self.suite}-backports main/p' /etc/apt/sources.list "
                f"> {listed} && {install} && rm {listed}"
            )
        lines = [
            f"FROM {base_name(self.suite)}",
            *(f"ENV {k}={v}" for k, v in self.env),
            *([f"RUN {install}"] if self.packages else []),
        ]
        return "\n".join(lines + ([f"RUN {self.setup}"] if self.setup else [])) + "\n"


def base_name(suite: str) -> str:
    """The FROM name of furlong's plain base of a Debian release."""
    return "furlong/base" if suite == "bookworm" else f"furlong/base-{suite}"


@dataclass(frozen=True)
class Family:
    """An official image whose tags name a version: the versions Debian stands in for, and the tag words."""

    label: str
    offers: tuple[Standin, ...]  # the first is what a tag naming no version gets
    version: re.Pattern
    variants: frozenset[str] = frozenset()  # tag words that change nothing here (slim, jdk...)
    exact_only: bool = False  # a near version is no stand-in (Go: go.mod names the release it needs)
    registry_first: bool = True  # a reachable registry (or a cached pull) serves the tag before the stand-in
    full_note: str = ""  # what a tag without -slim has that the stand-in lacks
    home: str = ""  # the distribution a tag naming none means, when it is not Debian (temurin: Ubuntu)
    extra: tuple[str, ...] = ()  # always said


_CURL = ("ca-certificates", "curl", "gnupg", "netbase", "sq", "wget")
_SCM = (*_CURL, "git", "mercurial", "openssh-client", "subversion", "procps")
_BUILDPACK = (
    *_SCM,
    "autoconf",
    "automake",
    "bzip2",
    "default-libmysqlclient-dev",
    "dpkg-dev",
    "file",
    "g++",
    "gcc",
    "imagemagick",
    "libbz2-dev",
    "libc6-dev",
    "libcurl4-openssl-dev",
    "libdb-dev",
    "libevent-dev",
    "libffi-dev",
    "libgdbm-dev",
    "libglib2.0-dev",
    "libgmp-dev",
    "libjpeg-dev",
    "libkrb5-dev",
    "liblzma-dev",
    "libmagickcore-dev",
    "libmagickwand-dev",
    "libmaxminddb-dev",
    "libncurses5-dev",
    "libncursesw5-dev",
    "libpng-dev",
    "libpq-dev",
    "libreadline-dev",
    "libsqlite3-dev",
    "libssl-dev",
    "libtool",
    "libwebp-dev",
    "libxml2-dev",
    "libxslt-dev",
    "libyaml-dev",
    "make",
    "patch",
    "unzip",
    "xz-utils",
    "zlib1g-dev",
)
# trixie has ncurses 6 only (buildpack-deps:trixie lists libncurses-dev)
_BUILDPACK_TRIXIE = tuple(
    "libncurses-dev" if p == "libncurses5-dev" else p for p in _BUILDPACK if p != "libncursesw5-dev"
)
BUILDPACK_DEPS = {
    s.name: s
    for s in (
        Standin("buildpack-deps-curl", _CURL, what="Debian bookworm with buildpack-deps' packages"),
        Standin("buildpack-deps-scm", _SCM, what="Debian bookworm with buildpack-deps' packages"),
        Standin("buildpack-deps", _BUILDPACK, what="Debian bookworm with buildpack-deps' packages"),
    )
}


def _python(name: str, suite: str, version: str) -> Standin:
    """The official python image's commands: `python`/`pip`, venv, pip usable as root (Debian marks its python
    EXTERNALLY-MANAGED; the official image has no such marker, so the stand-in removes it), and the official
    image's /usr/local/bin/python path, which scripts' shebangs name."""
    return Standin(
        name,
        ("python3-pip", "python3-venv", "python3-dev", "python-is-python3"),
        setup=(
            "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && ln -s /usr/bin/python3 /usr/local/bin/python "
            "&& ln -s /usr/bin/python3 /usr/local/bin/python3"
        ),
        env=(("LANG", "C.UTF-8"),),
        probe="python3 -c 'import platform; print(platform.python_version())'",
        what=f"Debian {suite}'s python3 with pip, venv and headers; no compiler",
        suite=suite,
        version=version,
        label="Python",
    )


PYTHON = _python("python", "bookworm", "3.11")  # its name predates the others': kept, so is its cache key


def _gcc(suite: str, version: str, packages: tuple[str, ...]) -> Standin:
    return Standin(
        f"gcc-{version}",
        (*packages, "gfortran"),
        probe="gcc -dumpfullversion",
        suite=suite,
        version=version,
        label="gcc",
        what=f"Debian {suite}'s gcc, g++ and gfortran with buildpack-deps' packages, in /usr/bin",
    )


def _golang(suite: str, version: str, backports: bool = False) -> Standin:
    """As the official image lays Go out: /usr/local/go, GOPATH=/go, and no toolchain download."""
    return Standin(
        f"golang-{version}",
        (*_SCM, "gcc", "libc6-dev", "make", "pkg-config", f"golang-{version}-go"),
        setup=f"ln -s /usr/lib/go-{version} /usr/local/go && mkdir -p /go/src /go/bin && chmod -R 1777 /go",
        env=(("GOPATH", "/go"), ("GOTOOLCHAIN", "local"), ("PATH", "/go/bin:/usr/local/go/bin:$PATH")),
        probe="go env GOVERSION | sed s/^go//",
        suite=suite,
        version=version,
        label="Go",
        backports=backports,
        what=f"Debian {suite}{'-backports' if backports else ''}'s golang-{version}-go at /usr/local/go",
    )


def _node(suite: str, version: str) -> Standin:
    return Standin(
        f"node-{version}",
        ("nodejs", "npm"),
        probe="node --version | sed s/^v//",
        suite=suite,
        version=version,
        label="Node.js",
        what=f"Debian {suite}'s nodejs and npm; no yarn or corepack",
    )


def _rust(suite: str, version: str) -> Standin:
    """cargo install puts binaries on PATH, as under the official image's CARGO_HOME."""
    return Standin(
        f"rust-{version}",
        ("rustc", "cargo", "gcc", "libc6-dev"),
        env=(("CARGO_HOME", "/usr/local/cargo"), ("PATH", "/usr/local/cargo/bin:$PATH")),
        probe="rustc --version | cut -d' ' -f2",
        suite=suite,
        version=version,
        label="Rust",
        what=f"Debian {suite}'s rustc and cargo; no rustup, clippy or rustfmt",
    )


def _jdk(suite: str, version: str) -> Standin:
    return Standin(
        f"jdk-{version}",
        ("default-jdk-headless", "curl", "wget", "tzdata"),
        env=(("JAVA_HOME", "/usr/lib/jvm/default-java"),),
        probe="java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.version = //p'",
        suite=suite,
        version=version,
        label="Java",
        what=f"Debian {suite}'s OpenJDK (default-jdk-headless)",
    )


_NOT_SLIM = "the full (non-slim) image's buildpack-deps packages are not included"
_JDKS = (_jdk("bookworm", "17"), _jdk("trixie", "21"))
_VERSION = re.compile(r"\d+(\.\d+){0,2}|latest")
FAMILIES = {
    "python": Family(
        "Python",
        (PYTHON, _python("python-3.13", "trixie", "3.13")),
        re.compile(r"3(\.\d+){0,2}|latest"),
        frozenset({"slim"}),
        registry_first=False,
        full_note="the full (non-slim) image's compilers are not included",
    ),
    "gcc": Family("gcc", (_gcc("bookworm", "12", _BUILDPACK), _gcc("trixie", "14", _BUILDPACK_TRIXIE)), _VERSION),
    "golang": Family(
        "Go",
        (
            _golang("bookworm", "1.19"),
            *(_golang("bookworm", f"1.{m}", True) for m in (21, 22, 23)),
            _golang("trixie", "1.24"),
        ),
        re.compile(r"1(\.\d+){0,2}|latest"),
        exact_only=True,
    ),
    "node": Family(
        "Node.js", (_node("bookworm", "18"), _node("trixie", "20")), _VERSION, frozenset({"slim"}), full_note=_NOT_SLIM
    ),
    "rust": Family(
        "Rust",
        (_rust("bookworm", "1.63"), _rust("trixie", "1.85")),
        re.compile(r"1(\.\d+){0,2}|latest"),
        frozenset({"slim"}),
        full_note=_NOT_SLIM,
    ),
    "openjdk": Family("Java", _JDKS, _VERSION, frozenset({"jdk", "jre", "slim"})),
    "eclipse-temurin": Family(
        "Java",
        _JDKS,
        re.compile(r"\d+(\.\d+){0,2}(_\d+)?|latest"),
        frozenset({"jdk", "jre"}),
        home="noble",
        extra=("Debian's OpenJDK build, not Eclipse Temurin's",),
    ),
}
