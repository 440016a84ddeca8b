"""Base images pulled from a container registry with `skopeo` (no daemon), cached by digest.

`skopeo inspect --raw` asks the registry which manifest a tag names (its sha256 is the image's digest;
for a multi-platform image, the digest of the list, as `docker pull` prints it); `skopeo copy` then
fetches that digest, for this machine's platform, into an OCI layout that `imports.import_image`
unpacks with its checked unpacking. The store keeps each image under its digest (`registry/` in the
image store) and a ref -> digest index (`registry/refs.json`), so a second FROM of the same tag, or of
`name@sha256:...`, downloads nothing, and a cached tag works with no registry at all.

A cached tag is never re-checked by a build: builds stay reproducible and offline. `furlong image pull
REF` (`refresh=True`) asks the registry again and moves the tag to whatever it names now.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.base import SandboxError
from furlong.sandbox.images import imports

log = logging.getLogger(__name__)
Progress = Callable[[str], None]

DOCKER_HUB = "docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REFERENCE = re.compile(
    rf"(?:(?P<host>[A-Za-z0-9.-]+(?::\d+)?|\[[0-9a-fA-F:]+\](?::\d+)?)/)?"
    rf"(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?"
)
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
# skopeo's words for "no answer from the registry" (as opposed to an answer that says no).
_UNREACHABLE = re.compile(
    r"connection refused|i/o timeout|no such host|network is unreachable|no route to host|"
    r"deadline exceeded|TLS handshake timeout|temporary failure in name resolution|"
    r"server misbehaving|connection reset",
    re.IGNORECASE,
)


class RegistryError(SandboxError):
    """A reference that cannot be pulled: the message is one line naming it and why."""


class Unreachable(RegistryError):
    """The registry did not answer (refused, timed out, no route): a cached image may stand in."""


@dataclass(frozen=True)
class Reference:
    """A parsed image reference, normalised as Docker does (`ubuntu` is docker.io/library/ubuntu:latest)."""

    registry: str
    repository: str
    tag: str
    digest: str

    @classmethod
    def parse(cls, ref: str) -> Reference | None:
        m = _REFERENCE.fullmatch(ref)
        if m is None:
            return None
        host, path = m["host"], m["path"]
        if host and not ("." in host or ":" in host or host == "localhost"):
            host, path = None, f"{host}/{path}"  # `library/python`: the first part names no registry
            if _REFERENCE.fullmatch(path) is None:
                return None
        host = host or DOCKER_HUB
        if host == DOCKER_HUB and "/" not in path:
            path = f"library/{path}"
        # With both a tag and a digest, the digest decides (as Docker does); the tag is kept for the log.
        return cls(host, path, m["tag"] or ("" if m["digest"] else "latest"), m["digest"] or "")

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def canonical(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"

    @property
    def loopback(self) -> bool:
        """A registry on this machine (a test's, a local mirror): plain HTTP, as such registries serve."""
        return self.registry.rpartition(":")[0] in _LOOPBACK or self.registry in _LOOPBACK


@dataclass(frozen=True)
class Settings:
    """How to reach registries (config `images.*`; see docs/images.md, "Base images from registries")."""

    prefer_registry: bool = False  # also pull names furlong has a stand-in for (python:*, debian:bookworm...)
    auth_file: Path | None = None  # containers-auth.json; None: skopeo's own defaults
    timeout_s: float = 1800.0  # one pull
    inspect_timeout_s: float = 30.0  # asking a registry what a tag names

    @classmethod
    def from_env(cls, **given) -> Settings:
        """FURLONG_PREFER_REGISTRY=1 and REGISTRY_AUTH_FILE fill in what the config left unset."""
        if not given.get("prefer_registry"):
            given["prefer_registry"] = os.environ.get("FURLONG_PREFER_REGISTRY", "") not in ("", "0", "false")
        if given.get("auth_file") is None and os.environ.get("REGISTRY_AUTH_FILE"):
            given["auth_file"] = Path(os.environ["REGISTRY_AUTH_FILE"])
        return cls(**given)


class FromNames(Collection[str]):
    """What a Dockerfile's FROM may name beyond furlong's mapped names (dockerfile.parse's `imported`):
    an imported name, or any well-formed image reference, which is then pulled."""

    def __init__(self, imported: Collection[str]):
        self.imported = sorted(imported)

    def __contains__(self, ref: object) -> bool:
        return isinstance(ref, str) and (ref in self.imported or Reference.parse(ref) is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.imported)

    def __len__(self) -> int:
        return len(self.imported)


@contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class Registry:
    """The pulled images of one image store, under `root` (the store's `registry/`)."""

    def __init__(self, root: Path, settings: Settings | None = None):
        self.root = root
        self.settings = settings or Settings.from_env()

    # -- the cache ------------------------------------------------------------------------------
    def refs(self) -> dict[str, str]:
        """Canonical tag reference -> the digest it named when last pulled."""
        try:
            return json.loads((self.root / "refs.json").read_text())
        except FileNotFoundError:
            return {}

    def _remember(self, ref: Reference, digest: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with _locked(self.root / ".refs.lock"):
            refs = {**self.refs(), ref.canonical: digest}
            tmp = self.root / f".refs.json.tmp{os.getpid()}"
            tmp.write_text(json.dumps(refs, indent=1, sort_keys=True))
            tmp.rename(self.root / "refs.json")

    def stored(self, digest: str, platform: str = "") -> dict | None:
        """The meta of the image stored for `digest`: the digest a tag named (a list's, for a
        multi-platform image) or the manifest digest of the one platform's image that was unpacked."""
        if (meta := imports.find(self.root, _store_name(digest, platform))) is not None:
            return meta
        if platform or not self.root.exists():
            return None
        for meta_path in self.root.glob("import-*/meta.json"):
            meta = json.loads(meta_path.read_text())
            if meta.get("manifest") == digest and not meta.get("platform"):
                return meta
        return None

    def rootfs(self, meta: dict) -> Path:
        return imports.directory(self.root, meta["name"]) / imports.rootfs_name(meta["id"])

    def listing(self) -> list[tuple[str, str]]:
        """(directory, "pulled REF DIGEST (platform)") for every pulled image, with every tag that names it."""
        by_digest: dict[str, list[str]] = {}
        for ref, digest in self.refs().items():
            by_digest.setdefault(digest, []).append(ref)
        rows = []
        for meta_path in sorted(self.root.glob("import-*/meta.json")):
            meta = json.loads(meta_path.read_text())
            tags = by_digest.get(meta["digest"], []) or [meta["ref"]]
            rows.append(
                (
                    f"registry/{meta_path.parent.name}",
                    f"pulled {', '.join(sorted(tags))}\t{meta['digest']}\t({meta.get('platform') or 'host'})",
                )
            )
        return rows

    # -- resolving a reference -----------------------------------------------------------------
    def image(
        self, ref: str, progress: Progress, refresh: bool = False, platform: str = "", fallback: bool = False
    ) -> dict | None:
        """The stored image `ref` names, pulled first if it is not cached (or if `refresh`). With
        `fallback`, an unreachable registry returns None (the caller has a stand-in, or a Dockerfile) instead
        of failing."""
        parsed = Reference.parse(ref)
        if parsed is None:
            raise RegistryError(
                f"{ref!r}: not an image reference (expected NAME, NAME:TAG or NAME@sha256:HEX, "
                f"lower-case, NAME optionally starting with REGISTRY/ or REGISTRY:PORT/)"
            )
        if parsed.digest:  # a digest names one image for good: nothing to re-check
            if (meta := self.stored(parsed.digest, platform)) is not None:
                return meta
            return self._guarded(
                ref, parsed, None, fallback, lambda: self._fetch(parsed, parsed.digest, platform, progress)
            )
        known = self.refs().get(parsed.canonical)
        cached = self.stored(known, platform) if known else None
        if cached is not None and not refresh:
            return cached
        return self._guarded(ref, parsed, cached, fallback, lambda: self._pull_tag(parsed, platform, progress))

    def _guarded(self, ref: str, parsed: Reference, cached: dict | None, fallback: bool, pull) -> dict | None:
        try:
            return pull()
        except Unreachable as exc:
            if cached is not None:
                log.warning("%s: registry unreachable (%s); using the cached %s", ref, exc, cached["digest"])
                return cached
            if fallback:
                log.warning("%s: registry unreachable (%s) and not cached; the caller's fallback serves", ref, exc)
                return None
            raise RegistryError(
                f"{ref}: registry {parsed.registry} unreachable ({exc}) and the image is not "
                f"cached; bring it by hand with `furlong image import {ref} OCI_ARCHIVE`"
            ) from None

    def _pull_tag(self, ref: Reference, platform: str, progress: Progress) -> dict:
        progress(f"asking {ref.registry} what {ref.canonical} names")
        raw = self._skopeo(
            ["inspect", "--raw", *self._source_flags(ref, "--tls-verify"), f"docker://{ref.canonical}"],
            ref,
            self.settings.inspect_timeout_s,
        )
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        meta = self.stored(digest, platform) or self._fetch(ref, digest, platform, progress)
        self._remember(ref, digest)
        return meta

    def _fetch(self, ref: Reference, digest: str, platform: str, progress: Progress) -> dict:
        """Copies `digest` (for `platform`, else this machine's) into a layout in the store, then imports it."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = _store_name(digest, platform)
        with _locked(self.root / f".pull-{imports.directory(self.root, name).name}.lock"):
            if (meta := self.stored(digest, platform)) is not None:  # another process pulled it meanwhile
                return meta
            tmp = self.root / f".pull-{os.getpid()}-{digest[7:19]}"
            shutil.rmtree(tmp, ignore_errors=True)
            started = time.monotonic()
            try:
                progress(f"pulling {ref.name}@{digest[:19]}")
                self._skopeo(
                    [
                        "copy",
                        "--quiet",
                        *self._source_flags(ref, "--src-tls-verify"),
                        *_platform_flags(platform),
                        f"docker://{ref.name}@{digest}",
                        f"oci:{tmp}:image",
                    ],
                    ref,
                    self.settings.timeout_s,
                )
                manifest = _copied_manifest(tmp, digest)
                meta = imports.import_image(self.root, name, tmp, progress)
            except imports.ImageImportError as exc:
                raise RegistryError(f"{ref.canonical}: the pulled image cannot be used: {exc}") from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            meta = {
                **meta,
                "ref": ref.canonical,
                "digest": digest,
                "platform": platform,
                "manifest": manifest,
                "source": f"docker://{ref.name}@{digest}",
                "seconds": round(time.monotonic() - started, 1),
            }
            (imports.directory(self.root, name) / "meta.json").write_text(json.dumps(meta))
            return meta

    def _source_flags(self, ref: Reference, tls_flag: str) -> list[str]:
        return ([f"{tls_flag}=false"] if ref.loopback else []) + self._auth_flags()

    def _auth_flags(self) -> list[str]:
        if self.settings.auth_file is not None:
            return [f"--authfile={self.settings.auth_file}"]
        runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/containers/{os.geteuid()}"
        try:
            Path(runtime, "containers", "auth.json").stat()
        except PermissionError:
            # skopeo stops at a default credentials file it may not read (/run/containers is made 0700
            # by root's podman or buildah): this user can have no credentials there, so pull anonymously
            # (a file that does not exist holds no credentials).
            return [f"--authfile={self.root / 'no-credentials.json'}"]
        except OSError:
            pass
        return []

    def _skopeo(self, args: list[str], ref: Reference, timeout_s: float) -> bytes:
        if shutil.which("skopeo") is None:
            raise RegistryError(f"{ref.canonical}: pulling needs `skopeo` (apt-get install skopeo, or run install.sh)")
        try:
            done = subprocess.run(
                ["skopeo", f"--command-timeout={int(timeout_s)}s", *args], capture_output=True, timeout=timeout_s + 10
            )
        except subprocess.TimeoutExpired:
            raise Unreachable(f"no answer within {timeout_s:.0f} s") from None
        if done.returncode == 0:
            return done.stdout
        why = _skopeo_message(done.stderr.decode(errors="replace"))
        if _UNREACHABLE.search(why):
            raise Unreachable(why)
        raise RegistryError(f"{ref.canonical}: skopeo {args[0]} failed: {why}")


def _store_name(digest: str, platform: str) -> str:
    """The name an image is imported under in the registry cache (a list's digest covers all platforms)."""
    return f"{digest}+{platform.replace('/', '-')}" if platform else digest


def _platform_flags(platform: str) -> list[str]:
    """`linux/arm64[/v8]` as skopeo's overrides (its default is this machine's platform)."""
    if not platform:
        return []
    os_, _, rest = platform.partition("/")
    arch, _, variant = rest.partition("/")
    return [
        f"--override-os={os_}",
        *([f"--override-arch={arch}"] if arch else []),
        *([f"--override-variant={variant}"] if variant else []),
    ]


def _copied_manifest(layout: Path, digest: str) -> str:
    """The digest of the one platform's manifest skopeo copied (the list's digest names them all)."""
    try:
        return json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    except (OSError, ValueError, KeyError, IndexError):
        return digest  # the import names what is wrong with the layout


def _skopeo_message(stderr: str) -> str:
    """skopeo's `level=fatal msg="..."` line, as one line."""
    for line in reversed(stderr.strip().splitlines()):
        if m := re.search(r'msg="(.*)"', line):
            message = m.group(1).replace('\\"', '"').replace("\\n", " ").replace("\\t", "")
            # The reference is named by furlong's own message already.
            message = re.sub(r'^(Error parsing image name "[^"]*"|initializing source \S+): ', "", message)
            return " ".join(message.split())[:400]
    return " ".join(stderr.split())[-400:] or "no message"
