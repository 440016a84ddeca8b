"""Which base a Dockerfile's FROM gets where no registry serves it: furlong's Debian base as is, or the
base plus a stand-in layer that installs what the official image has from Debian's packages (built once,
like a task layer).

Two Debian releases are bootstrapped (SUITES), so a tag's version is met where either ships it: Python
3.11 (bookworm) and 3.13 (trixie), gcc 12 / 14, Go 1.19, 1.21-1.23 (bookworm-backports) and 1.24, Node.js
18 / 20, Rust 1.63 / 1.85, OpenJDK 17 / 21 (standin_recipes.py). A tag asking for another version gets the nearest
with a note saying so (`images.standins: nearest`, the default) or a one-line error naming what Debian has
(`exact`); Go always needs its exact release. Every note states the version the stand-in really has
(probed when it is built), in the build log, the layer's meta.json and each eval record's `image_note`.
Ubuntu's tags have stand-ins only with images.ubuntu_standins on (ubuntu.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from furlong.sandbox.images import ubuntu
from furlong.sandbox.images.standin_recipes import (
    BUILDPACK_DEPS,
    FAMILIES,
    PYTHON,
    SUITES,
    Family,
    Standin,
    base_name,
)

__all__ = ["PYTHON", "SUITES", "BaseChoice", "Standin", "pick", "resolve"]
DISTROS = {
    "bookworm": "Debian 12 (bookworm)",
    "bullseye": "Debian 11 (bullseye)",
    "trixie": "Debian 13 (trixie)",
    "focal": "Ubuntu 20.04 (focal)",
    "jammy": "Ubuntu 22.04 (jammy)",
    "noble": "Ubuntu 24.04 (noble)",
}
KNOWN = (
    "debian:bookworm|trixie[-slim]",
    "debian:12|13[.N][-slim]",
    "buildpack-deps:bookworm[-curl|-scm]",
    "furlong/base[-trixie]",
    ubuntu.KNOWN,
    *(f"{repo}:TAG ({fam.label} {', '.join(o.version for o in fam.offers)})" for repo, fam in FAMILIES.items()),
)
# Ubuntu releases whose Python has no PEP 668 marker: a Dockerfile for them runs `pip3 install` as root
_NO_PEP668 = ("focal", "jammy")
# Official-image names are also written with their registry's path; the image is the same one.
_PREFIXES = ("docker.io/library/", "public.ecr.aws/docker/library/", "library/")


@dataclass(frozen=True)
class BaseChoice:
    """What a FROM gets: a plain furlong base (standin None) or a base plus a stand-in layer."""

    asked: str
    standin: Standin | None = None
    asked_version: str = ""  # the version the tag names ("" for none)
    differences: tuple[str, ...] = ()  # how the tag differs from what it gets
    suite: str = "bookworm"  # the Debian release of the base (the stand-in's, when there is one)
    family: Family | None = None
    exact: bool = True  # the stand-in has the release the tag asks for
    registry_first: bool = False  # a reachable registry (or a cached pull) serves the tag before the stand-in
    refused: str = ""  # the one line where a setting keeps this stand-in off (images.ubuntu_standins=off)

    def allowed(self, mode: str) -> bool:
        """Whether this stand-in may serve the tag in `mode` (images.standins)."""
        if self.refused:
            return False
        return self.exact or (mode == "nearest" and not (self.family and self.family.exact_only))

    def refusal(self, mode: str) -> str:
        """The one line for a tag no stand-in may serve: one that is off, or whose version no stand-in has,
        where it may not take the nearest."""
        if self.refused:
            return self.refused
        fam = self.family
        assert fam is not None, "only a stand-in's tag is refused (a plain base has no family)"
        have = ", ".join(f"{o.version} ({o.suite}{'-backports' if o.backports else ''})" for o in fam.offers)
        why = (
            "Go stand-ins need the exact release"
            if fam.exact_only
            else f"images.standins={mode}; nearest would take {self.standin.version} with a note"  # type: ignore[union-attr]
        )
        lacks = (
            f"Debian has no {fam.label} {self.asked_version}"
            if self.asked_version
            else f"the tag names no {fam.label} release"
        )
        return (
            f"{self.asked}: {lacks} (Debian has {have}; {why}); bring the "
            f"image with `furlong image import {self.asked} OCI_ARCHIVE` or `furlong image pull` where its "
            f"registry is reachable"
        )

    def note(self, provides: str) -> str:
        """One line for the build log and the eval record; `provides` is the probe's output."""
        if self.standin is None:
            return ""
        extra = list(self.differences)
        asked = self.asked_version.replace("_", ".").split(".")
        if self.standin.label and self.asked_version and provides.split(".")[: len(asked)] != asked:
            nearest = "" if self.exact else f" (nearest: Debian {self.standin.suite}'s {self.standin.version})"
            extra.insert(0, f"the tag asks for {self.standin.label} {self.asked_version}{nearest}")
        real = f"{self.standin.label} {provides}, " if self.standin.label else (f"{provides}; " if provides else "")
        tail = f"; {'; '.join(extra)}" if extra else ""
        return f"{self.asked}: furlong's {self.standin.name} stand-in ({real}{self.standin.what}){tail}"


def _repo_tag(ref: str) -> tuple[str, str, bool]:
    name, _, digest = ref.partition("@")
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    repo, _, tag = name.partition(":")
    return repo, tag, bool(digest)


_DEBIAN_TAGS = {
    "bookworm": re.compile(r"(bookworm(-\d{8})?|12(\.\d+)?)(-slim)?"),
    "trixie": re.compile(r"(trixie(-\d{8})?|13(\.\d+)?)(-slim)?"),
}


def resolve(ref: str, ubuntu_mode: str = "off") -> BaseChoice | None:
    """The base an image reference maps onto, or None where there is no honest mapping. Ubuntu's tags map
    with `ubuntu_mode` (images.ubuntu_standins); `off` keeps their stand-in off, with the line saying so."""
    repo, tag, pinned = _repo_tag(ref)
    differences = ("a digest pins one build; the stand-in ignores it",) if pinned else ()
    if repo == "ubuntu":
        return _ubuntu(ref, tag, differences, ubuntu_mode)
    for suite in SUITES:
        if ref == base_name(suite) or (repo == "debian" and _DEBIAN_TAGS[suite].fullmatch(tag)):
            return BaseChoice(ref, suite=suite)
    if repo == "buildpack-deps" and tag in ("bookworm", "bookworm-curl", "bookworm-scm"):
        return BaseChoice(ref, BUILDPACK_DEPS["buildpack-deps" + tag.removeprefix("bookworm")], differences=differences)
    family = FAMILIES.get(repo)
    return _versioned(ref, tag, family, differences) if family else None


def _ubuntu(ref: str, tag: str, differences: tuple[str, ...], mode: str) -> BaseChoice | None:
    """An Ubuntu release's stand-in (ubuntu.py), pulled first where a registry or the cache serves the tag."""
    rel = ubuntu.release(tag)
    if rel is None:
        return None
    suite = ubuntu.suite_for(rel, mode)
    notes = (*differences, *ubuntu.differences(rel, suite, mode))
    return BaseChoice(
        ref,
        ubuntu.standin(rel, suite),
        rel.version,
        notes,
        suite,
        registry_first=True,
        refused=ubuntu.refusal(ref, rel) if mode == "off" else "",
    )


def _versioned(ref: str, tag: str, family: Family, differences: tuple[str, ...]) -> BaseChoice | None:
    """REPO:[VERSION][-variant...][-distro] of a versioned family, or None for a variant it does not have
    (alpine, windowsservercore...). A release that matches wins wherever it is; otherwise the nearest, on the
    Debian release the tag names when there is an offer on it."""
    words = tag.split("-") if tag else []
    version = words.pop(0) if words and family.version.fullmatch(words[0]) else ""
    distro = ""
    for word in words:
        if word in DISTROS and not distro:
            distro = word
        elif word not in family.variants:
            return None
    version = "" if version == "latest" else version
    standin, exact = pick(family, version)
    on_distro = [o for o in family.offers if o.suite == distro]
    if not exact and on_distro:
        # no release matches: a tag naming its Debian release keeps it (its apt pins name that release's
        # packages), the nearest version Debian ships there
        standin, exact = pick(Family(family.label, tuple(on_distro), family.version), version)
    exact = exact and bool(version or not family.exact_only)  # Go's "latest" is no release Debian names
    notes = list(differences)
    wanted = distro or family.home
    if wanted and wanted != standin.suite:
        notes.append(f"{DISTROS[standin.suite]}, not {DISTROS[wanted]}")
    if wanted in _NO_PEP668:
        standin = replace(standin, env=(*standin.env, ("PIP_BREAK_SYSTEM_PACKAGES", "1")))
        notes.append(
            f"PIP_BREAK_SYSTEM_PACKAGES=1, so `pip install` into the system Python works as on "
            f"{DISTROS[wanted]} (Debian marks it externally managed, PEP 668)"
        )
    if family.full_note and "slim" not in words:
        notes.append(family.full_note)
    if "jre" in words:
        notes.append("a JDK, where the tag asks for a JRE")
    return BaseChoice(
        ref, standin, version, (*notes, *family.extra), standin.suite, family, exact, family.registry_first
    )


def _numbers(version: str) -> list[int]:
    return [int(p) for p in version.replace("_", ".").split(".")]


def pick(family: Family, asked: str) -> tuple[Standin, bool]:
    """The offer for `asked` and whether it is that release: the first that matches at the precision both
    name (3 matches 3.11, 12.2.0 matches 12), else the nearest by version, the newer of two as near."""
    if not asked:
        return family.offers[0], True
    want = _numbers(asked)
    for offer in family.offers:
        have = _numbers(offer.version)
        n = min(len(want), len(have))
        if want[:n] == have[:n]:
            return offer, True

    def distance(offer: Standin) -> tuple[int, int]:
        have = _numbers(offer.version)
        padded = (want + [0] * len(have))[: len(have)]
        scale = [1000 ** (len(have) - 1 - i) for i in range(len(have))]
        value = sum(a * s for a, s in zip(have, scale))
        return abs(sum(a * s for a, s in zip(padded, scale)) - value), -value

    return min(family.offers, key=distance), False
