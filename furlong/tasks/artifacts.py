"""Harbor's artifacts: what a separate verifier receives from the agent's sandbox.

Harbor collects the convention dir /logs/artifacts and each declared `artifacts` entry from the agent's
environment and re-creates each at its own path in the verifier's (harbor's trial/artifact_handler.py).
Here the agent's sandbox packs them with its own `tar`, as the agent: nothing the agent could not read
itself leaves its sandbox, and a path the agent made a symlink is archived as the link, never followed.
What comes out is the agent's data, so it is checked on the host as hostile input before it goes in:

- a member outside its entry, a device, a FIFO or a hard link to outside is left out; a hard link inside
  becomes a copy; setuid, setgid, sticky and group/other write bits are cleared (tarfile's `data` filter,
  which Harbor applies);
- a symlink is kept only if, followed as the kernel would (through the entry's other symlinks too), it
  stays inside its entry's directory: never absolute, never climbing out; an entry that is itself a
  symlink is left out. So no artifact can point the tests at their own files (an expected answer in
  /tests) or elsewhere in the verifier's image;
- all entries together are at most MAX_BYTES.

A missing entry is left out, as Harbor's best-effort collection does. Any other failure (tar failed or ran
out of time, the archive is over the cap or unreadable) raises ArtifactsError: the episode's scorer runs
the same collection in a sandbox no agent touched to say whose doing it was (furlong.envs.harbor).
"""

from __future__ import annotations

import io
import posixpath
import shlex
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass

from furlong.sandbox.base import Sandbox
from furlong.tasks.model import ARTIFACTS_DIR, Artifact, Task

MAX_BYTES = 128 << 20  # every entry's archive together; the init reads files up to 256 MiB
COLLECT_TIMEOUT_S = 120.0
MAX_HOPS = 40  # symlinks followed in one lookup, as Linux allows
SCRATCH = "/tmp/.furlong-artifacts"  # the agent's own: it writes the archives there, as the agent


class ArtifactsError(Exception):
    """The agent's sandbox did not hand its artifacts over (the message says how)."""


@dataclass(frozen=True)
class Collected:
    """One entry's archive, checked: members named from / ("logs/artifacts/x"), ready to unpack at /."""

    artifact: Artifact
    tar: bytes
    is_dir: bool


def entries(task: Task) -> tuple[Artifact, ...]:
    """The collection set: the convention dir (unless declared), then the declared entries. An entry at or
    under an earlier one's path is left out: the earlier one holds it (Harbor keeps the first claim)."""
    declared = [a for a in task.artifacts if a.source != ARTIFACTS_DIR]
    first = next((a for a in task.artifacts if a.source == ARTIFACTS_DIR), Artifact(ARTIFACTS_DIR))
    kept: list[Artifact] = []
    for artifact in (first, *declared):
        if not any(_overlaps(artifact.source, k.source) for k in kept):
            kept.append(artifact)
    return tuple(kept)


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def collect_script(artifacts: Sequence[Artifact]) -> str:
    """The agent's side: each present entry archived to SCRATCH/N.tar, its number printed; absent ones
    skipped. GNU tar exits 1 for a file that changed while it was read (the archive is still whole)."""
    lines = [f"rm -rf {SCRATCH} && mkdir -p {SCRATCH} || exit 2"]
    for n, artifact in enumerate(artifacts):
        src = shlex.quote(artifact.source)
        rel = shlex.quote(artifact.source.lstrip("/") or ".")
        excludes = " ".join(f"--exclude={shlex.quote(p)}" for p in artifact.exclude)
        lines.append(
            f"if [ -e {src} ] || [ -L {src} ]; then tar -c -f {SCRATCH}/{n}.tar -C / {excludes} -- {rel}; "
            f"rc=$?; [ $rc -le 1 ] || exit $rc; echo {n}; fi"
        )
    return "\n".join(lines) + "\n"


async def collect(sandbox: Sandbox, artifacts: Sequence[Artifact]) -> list[Collected]:
    """The entries present in `sandbox`, archived as the agent and checked (the module docstring)."""
    res = await sandbox.exec(collect_script(artifacts), timeout_s=COLLECT_TIMEOUT_S, cwd="/")
    if res.timed_out:
        raise ArtifactsError(f"collecting the artifacts ran out of time ({COLLECT_TIMEOUT_S:g}s)")
    if res.exit_code != 0:
        raise ArtifactsError(f"collecting the artifacts failed (exit {res.exit_code}): {res.stderr.strip()[-500:]}")
    found, total = [], 0
    for word in res.stdout.split():
        if not word.isdigit() or int(word) >= len(artifacts):
            raise ArtifactsError(f"collecting the artifacts printed {word[:40]!r}, not an entry's number")
        data = await sandbox.read_file(f"{SCRATCH}/{word}.tar")
        total += len(data)
        if total > MAX_BYTES:
            raise ArtifactsError(f"the artifacts are over {MAX_BYTES >> 20} MiB")
        found.append(checked(artifacts[int(word)], data))
    await sandbox.exec(f"rm -rf {SCRATCH}", timeout_s=30, cwd="/")
    return [c for c in found if c is not None]


def checked(artifact: Artifact, data: bytes) -> Collected | None:
    """`data` (the agent's archive of `artifact`) rebuilt from the members that may go in; None when the
    entry itself may not (a symlink, or nothing but refused members)."""
    root = artifact.source.strip("/")
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            members = tar.getmembers()
            top = next((m for m in members if posixpath.normpath(m.name).lstrip("/") == root), None)
            if top is None or not (top.isdir() or top.isfile()):
                return None
            base = root if top.isdir() else posixpath.dirname(root)
            links = {posixpath.normpath(m.name).lstrip("/"): m.linkname for m in members if m.issym()}
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w") as clean:
                for m in members:
                    _copy(tar, m, clean, root, base, links)
            return Collected(artifact, out.getvalue(), top.isdir())
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArtifactsError(f"the archive of {artifact.source} is not a tar: {exc}") from None


def _copy(
    tar: tarfile.TarFile, m: tarfile.TarInfo, clean: tarfile.TarFile, root: str, base: str, links: dict[str, str]
) -> None:
    name = posixpath.normpath(m.name).lstrip("/")
    if not _inside(name, root) or ".." in name.split("/"):
        return
    info = tarfile.TarInfo(name)
    info.mtime, info.mode = m.mtime, _mode(m)
    if m.isdir():
        info.type = tarfile.DIRTYPE
        clean.addfile(info)
    elif m.issym():
        if _link_stays(name, m.linkname, base, links) and name != root:
            info.type, info.linkname = tarfile.SYMTYPE, m.linkname
            clean.addfile(info)
    elif m.isfile() or m.islnk():
        if m.islnk() and not _inside(posixpath.normpath(m.linkname).lstrip("/"), root):
            return
        try:
            body = tar.extractfile(m)
        except KeyError:  # a hard link to a member the archive does not hold
            return
        if body is not None:
            data = body.read()
            info.size = len(data)
            clean.addfile(info, io.BytesIO(data))


def _inside(name: str, root: str) -> bool:
    return not root or name == root or name.startswith(root + "/")


def _mode(m: tarfile.TarInfo) -> int:
    """As tarfile's `data` filter: no setuid, setgid, sticky or group/other write; files owner-readable."""
    mode = m.mode & 0o755
    if m.isfile() or m.islnk():
        mode |= 0o600
        if not mode & 0o100:
            mode &= ~0o011
    return mode


def _link_stays(name: str, target: str, base: str, links: dict[str, str]) -> bool:
    """Whether the symlink `name` -> `target`, followed as the kernel would through the entry's other
    symlinks, ends under `base` without ever climbing out of it."""
    start = _follow("", posixpath.dirname(name), links, base)
    return start is not None and _follow(start, target, links, base) is not None


def _follow(here: str, target: str, links: dict[str, str], base: str, hops: int = 0) -> str | None:
    """The real path (no symlink in it) that `target` reaches from the real directory `here`, or None
    where it is absolute, climbs above `base`, ends outside it, or loops."""
    if target.startswith("/") or hops > MAX_HOPS:
        return None
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if here == base or not _inside(here, base):
                return None
            here = posixpath.dirname(here)
            continue
        step = posixpath.join(here, part) if here else part
        if step in links:
            followed = _follow(here, links[step], links, base, hops + 1)
            if followed is None:
                return None
            step = followed
        here = step
    return here if _inside(here, base) else None


async def place(sandbox: Sandbox, collected: Sequence[Collected], as_verifier: bool) -> None:
    """Each archive unpacked at its entry's path in the verifier's sandbox; a directory entry (but the
    convention dir, made empty with every sandbox) replaces what the image held there, as Harbor's does."""
    for c in collected:
        if c.is_dir and c.artifact.source != ARTIFACTS_DIR:
            await sandbox.exec(f"rm -rf -- {shlex.quote(c.artifact.source)}", timeout_s=60, cwd="/", as_verifier=True)
        await sandbox.put_tar(c.tar, "/", as_verifier=as_verifier)


def unsafe_source(source: str) -> bool:
    """An artifact path that is the verifier's own (its tests, its reward): never an artifact."""
    clean = posixpath.normpath("/" + source.lstrip("/"))
    return any(clean == d or clean.startswith(d + "/") for d in ("/tests", "/logs/verifier"))
