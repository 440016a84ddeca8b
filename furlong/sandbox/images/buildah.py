"""Dockerfiles beyond furlong's own subset (multi-stage, COPY --from, ARG, LABEL, USER, heredocs, ADD, ...),
built by buildah (Debian's 1.28: daemonless, no service to run; the command itself: buildah_cli.py) and
unpacked into the image store.

1. Plan: heredocs become plain RUNs (heredoc.py); every FROM and every `COPY --from=IMAGE` that names an
   image rather than a stage is resolved by furlong (ImageStore.parent: an import, the base, a stand-in, a
   registry pull), each resolved image becomes the buildah image `localhost/furlong/<key>` once (its
   layers flattened into one tar: overlay whiteouts applied), and a temporary copy of the Dockerfile
   names those, line for line, so buildah's messages keep the user's line numbers.
2. `buildah bud --isolation chroot --layers --pull=never` with storage under furlong's cache (never the
   system's /var/lib/containers); buildah itself never reaches a registry.
3. The image's tree is read through `buildah mount` (inside `buildah unshare` as a user) and unpacked by
   layerdiff's writer (layertar's checked one) into `<store>/buildah-<key>/upper`, keeping only what
   differs from the final stage's base: the image furlong resolved for its FROM (through stage names:
   `FROM builder` is built on builder's base). The image is that one layer (new and changed entries,
   whiteouts for deletions: an overlay upper directory like a native build's) over the base's layers, so
   a few files added to a python stand-in store kilobytes, not the whole tree again (docs/images.md
   measures it). A final stage FROM scratch has no base: its whole tree is the layer, as every buildah
   image was stored before (meta.json's `stored` says which). Its config gives the env, workdir (made in
   the image where buildah did not) and user (the final stage's last USER, resolved to ids in the sandbox
   by users.py). As root, files keep their owners (a RUN's `chown worker /data`); as an ordinary user
   every one is root's in the sandbox (layertar.py says why).
The image is cached by a hash of the rewritten Dockerfile (the resolved images' keys are in it) and of
the whole build context's content; meta.json names the base's layers, and a base rebuilt since (a
deleted cache: same key, other files) makes the image be built again rather than stacked on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from furlong.sandbox.base import ImageRef, LayerRef, SandboxError
from furlong.sandbox.images import heredoc, offline_uv
from furlong.sandbox.images.buildah_cli import STEP_LINE, Buildah
from furlong.sandbox.images.builds import ImageBuildError, Progress, _locked, _rmtree, _sha
from furlong.sandbox.images.dockerfile import DockerfileError
from furlong.sandbox.images.registry import RegistryError

if TYPE_CHECKING:
    from furlong.sandbox.images.store import ImageStore  # it calls image() below for Dockerfiles it cannot build

FORMAT = "5"  # bump when the export, the key or the meta changes (3: owners kept as root; 4: WORKDIR made;
# 5: only the layer above the final stage's base stored)
_ARG_REF = re.compile(r"\$(?:\{(\w+)(?::-([^}]*))?\}|(\w+))")


@dataclass
class Plan:
    """A Dockerfile made ready for buildah: the rewritten lines, and what error mapping needs."""

    lines: list[str]
    stages: list[list[int]] = field(default_factory=list)  # per stage, each step's line (1-based, FROM first)
    notes: list[str] = field(default_factory=list)  # what the resolved bases really are
    below: ImageRef | None = None  # the image the final stage builds on; None: FROM scratch
    offline: offline_uv.OfflineUv | None = None  # where images.offline_uv rewrote a RUN fetching uv's installer

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# -- planning: the Dockerfile rewritten for buildah --------------------------------------------------
async def plan(store: ImageStore, bh: Buildah, dockerfile: Path, backend, progress: Progress) -> Plan:
    """Resolves every FROM and `COPY --from=IMAGE` through furlong and rewrites them to buildah's names."""
    try:
        text = dockerfile.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise DockerfileError(dockerfile, 0, f"cannot read: {exc}") from exc
    out = Plan(heredoc.convert(dockerfile, text).splitlines())
    global_args: dict[str, str] = {}
    stage_bases: dict[str, ImageRef | None] = {}  # a stage's name -> the image its chain of FROMs starts on
    for step in list(heredoc.instructions(out.lines)):
        line = step.first + 1
        if step.op == "FROM":
            image, alias = _from_parts(dockerfile, line, step.args, global_args)
            out.stages.append([line])
            if image.lower() in stage_bases:
                out.below = stage_bases[image.lower()]
            elif image == "scratch":
                out.below = None
            else:
                image, out.below = await _local(store, bh, dockerfile, line, image, backend, progress, out)
            _replace(out.lines, step, f"FROM {image}" + (f" AS {alias}" if alias else ""))
            if alias:
                stage_bases[alias.lower()] = out.below
        elif not out.stages:
            if step.op != "ARG":
                raise DockerfileError(dockerfile, line, "the first instruction must be FROM (or ARG)")
            global_args.update(_arg_defaults(step.args))
        else:
            out.stages[-1].append(line)
            if step.op in ("COPY", "ADD") and "--from=" in step.args:
                words = shlex.split(step.args, posix=False)
                for n, word in enumerate(words):
                    source = word[len("--from=") :] if word.startswith("--from=") else None
                    if source and source.lower() not in stage_bases and not source.isdigit():
                        name, _ = await _local(store, bh, dockerfile, line, source, backend, progress, out)
                        words[n] = "--from=" + name
                _replace(out.lines, step, f"{step.op} {' '.join(words)}")
            elif step.op == "RUN" and store.offline_uv and not step.args.startswith("["):
                await _offline_uv(store, dockerfile, line, step, backend, progress, out)
    if not out.stages:
        raise DockerfileError(dockerfile, 1, "no FROM instruction")
    return out


async def _offline_uv(
    store: ImageStore, dockerfile: Path, line: int, step: heredoc.Logical, backend, progress: Progress, out: Plan
) -> None:
    """images.offline_uv: a shell-form RUN fetching uv's installer runs with the toolchain's shims first on
    PATH (offline_uv.py); the rewritten line, in the image's key, names the toolchain's key."""
    if (wanted := offline_uv.asked(step.args)) is None:
        return
    out.offline = out.offline or await offline_uv.prepare(store, backend, progress)
    _replace(out.lines, step, f"RUN {out.offline.command(step.args)}")
    out.notes.append(out.offline.note(f"{dockerfile}:{line}", wanted))


def _from_parts(dockerfile: Path, line: int, args: str, global_args: dict[str, str]) -> tuple[str, str]:
    """FROM [--platform=P] IMAGE [AS NAME], with global ARGs substituted; the platform is this machine's."""
    words = [w for w in args.split() if not w.lower().startswith("--platform=")]
    if any(w.startswith("--") for w in words):
        raise DockerfileError(dockerfile, line, f"FROM {args}: only the --platform flag is known")
    if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
        raise DockerfileError(dockerfile, line, f"FROM {args}: expected FROM IMAGE [AS NAME]")
    image = _ARG_REF.sub(lambda m: global_args.get(m[1] or m[3]) or m[2] or "", words[0])
    if not image or "$" in image:
        raise DockerfileError(
            dockerfile,
            line,
            f"FROM {args}: the image name {words[0]!r} is empty once ARGs "
            f"are substituted (give the ARG a default before the first FROM)",
        )
    return image, words[2] if len(words) == 3 else ""


def _arg_defaults(args: str) -> dict[str, str]:
    pairs = {}
    for word in shlex.split(args):
        key, _, value = word.partition("=")
        pairs[key] = value
    return pairs


def _replace(lines: list[str], step: heredoc.Logical, text: str) -> None:
    """Puts an instruction on its first line and blanks its continuation lines: the line count holds."""
    lines[step.first] = text
    for n in range(step.first + 1, step.last + 1):
        lines[n] = ""


async def _local(
    store: ImageStore, bh: Buildah, dockerfile: Path, line: int, ref: str, backend, progress: Progress, out: Plan
) -> tuple[str, ImageRef]:
    """The buildah name of the image furlong resolves `ref` to (made once), and that image."""
    try:
        resolved = await store.parent(ref, backend, progress)
    except RegistryError as exc:  # its message names the reference
        raise ImageBuildError(f"{dockerfile}:{line}: FROM {exc}") from None
    except SandboxError as exc:
        raise ImageBuildError(f"{dockerfile}:{line}: FROM {ref}: {exc}") from None
    if resolved.note and resolved.note not in out.notes:
        out.notes.append(resolved.note)
    progress(f"{ref}: as buildah image localhost/furlong/{resolved.digest}")
    dirs = tuple(store.root / layer.path for layer in resolved.layers)
    return await asyncio.to_thread(bh.import_ref, resolved, dirs, store.egress), resolved


# -- building and storing --------------------------------------------------------------------------
def context_digest(context: Path) -> str:
    """Every file of the build context (what COPY and ADD may read): path, mode and content."""
    parts: list[str | bytes] = []
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames.sort()
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            parts.append(f"{os.path.relpath(path, context)}\0{st.st_mode:o}")
            if os.path.islink(path):
                parts.append(os.readlink(path))
            elif os.path.isfile(path):
                parts.append(Path(path).read_bytes())
    return _sha(*parts)


async def image(store: ImageStore, dockerfile: Path, backend, progress: Progress, why: str) -> ImageRef:
    """The task image a full Dockerfile builds (built once, then cached in the store)."""
    bh = Buildah(store.root.parent / "buildah")
    await asyncio.to_thread(bh.check)
    progress(f"{why}: outside furlong's own subset, built by buildah")
    planned = await plan(store, bh, dockerfile, backend, progress)
    key = "buildah-" + _sha(
        FORMAT, planned.text, await asyncio.to_thread(context_digest, dockerfile.parent), *store.egress_parts()
    )
    final = store.root / key
    async with store._locks.setdefault(key, asyncio.Lock()):
        if not await asyncio.to_thread(_stored, store, final, planned):
            await asyncio.to_thread(_build, store, bh, dockerfile, planned, key, progress)
    meta = json.loads((final / "meta.json").read_text())
    below = tuple(LayerRef(digest=layer["digest"], path=layer["path"]) for layer in meta["below"])
    ref = ImageRef(
        digest=key,
        layers=(store.layer(key, final / "upper"), *below),
        env=tuple(tuple(p) for p in meta["env"]),
        workdir=meta["workdir"],
        user=meta["user"],
        note=meta["note"],
    )
    await asyncio.to_thread(store.check_user, ref, str(dockerfile))
    return ref


def _below(store: ImageStore, planned: Plan) -> list[dict]:
    """The final stage's base layers (top first), each with a stamp of its directory: a base deleted and
    built again keeps its key and path but not its files, and the layer above it would no longer fit."""
    layers = planned.below.layers if planned.below else ()
    found = []
    for layer in layers:
        st = os.stat(store.root / layer.path)
        found.append({"digest": layer.digest, "path": layer.path, "stamp": f"{st.st_ino}:{st.st_ctime_ns}"})
    return found


def _stored(store: ImageStore, final: Path, planned: Plan) -> bool:
    """Whether the image is in the store, over the very base layers it was stored above."""
    try:
        meta = json.loads((final / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("below") == _below(store, planned)


def _build(store: ImageStore, bh: Buildah, dockerfile: Path, planned: Plan, key: str, progress: Progress) -> None:
    final = store.root / key
    with _locked(store.root / f".{key}.lock"):
        if _stored(store, final, planned):  # another process built it meanwhile
            return
        started = time.monotonic()
        temp = bh.home / "tmp" / f"{key}.{os.getpid()}.Dockerfile"
        temp.write_text(planned.text)
        try:
            status, tail = bh.bud(
                temp,
                dockerfile.parent,
                f"localhost/furlong/{key}",
                progress,
                store.build_timeout_s,
                store.egress,
                planned.offline,
            )
        finally:
            temp.unlink(missing_ok=True)
        if status != 0:
            raise _failure(dockerfile, planned, tail, temp, status)
        built = time.monotonic() - started
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        _rmtree(tmp)
        (tmp / "upper").mkdir(parents=True)
        try:
            _store(store, bh, dockerfile, planned, key, tmp, progress, built, started)
        except BaseException:
            _rmtree(tmp)  # a failed export leaves nothing behind
            raise
        _rmtree(final)
        tmp.rename(final)


def _store(
    store: ImageStore,
    bh: Buildah,
    dockerfile: Path,
    planned: Plan,
    key: str,
    tmp: Path,
    progress: Progress,
    built: float,
    started: float,
) -> None:
    """Exports the built image into tmp/upper, above its base, and writes its meta (without the ENV the
    store's egress lent it)."""
    progress(f"{dockerfile}: unpacking the built image into the store")
    config = bh.config(f"localhost/furlong/{key}")
    workdir, egress, below = config.get("WorkingDir") or "/", store.egress, _below(store, planned)
    writer = bh.export(
        f"localhost/furlong/{key}",
        tmp / "upper",
        str(dockerfile),
        egress,
        tuple(store.root / layer["path"] for layer in below),
        workdir,
    )
    if not {"bin/bash", "usr/bin/bash"} & writer.seen.keys():
        raise ImageBuildError(
            f"{dockerfile}: the built image has no /bin/bash, which furlong's sandbox runs commands with"
        )
    stored = (
        f"above {planned.below.digest}: {writer.same} entries the same there left out, {writer.whiteouts} deleted"
        if planned.below
        else "the whole tree: the final stage is FROM scratch"
    )
    meta = {
        "dockerfile": str(dockerfile),
        "builder": "buildah",
        "key": key,
        "env": [
            e.split("=", 1)
            for e in config.get("Env") or []
            if "=" in e and tuple(e.split("=", 1)) not in (egress.env if egress else ())
        ],
        "workdir": workdir,
        "user": str(config.get("User") or ""),
        "labels": config.get("Labels") or {},
        "note": "; ".join(planned.notes),
        "below": below,
        "stored": stored,
        "skipped_devices": writer.skipped,
        "build_seconds": round(built, 2),
        "seconds": round(time.monotonic() - started, 1),
        **({"egress": egress.settings} if egress else {}),
    }
    (tmp / "meta.json").write_text(json.dumps(meta))


def _failure(dockerfile: Path, planned: Plan, tail: list[str], temp: Path, status: int) -> ImageBuildError:
    """One error naming the user's file:line of the failing step, with the tail of buildah's output."""
    text = "\n".join(tail).replace(str(temp), str(dockerfile))[-2000:]
    for n in range(len(tail) - 1, -1, -1):
        if m := STEP_LINE.match(tail[n]):
            text = "\n".join(tail[n:])[-2000:]  # the failing step's own output
            stage, step = int(m[1] or 1), int(m[2])
            if stage <= len(planned.stages) and step <= len(planned.stages[stage - 1]):
                code = re.findall(r"exit status (\d+)", text)
                why = f"exited {code[-1]}" if code else "failed"
                return ImageBuildError(f"{dockerfile}:{planned.stages[stage - 1][step - 1]}: {m[3]} {why}:\n{text}")
    return ImageBuildError(f"{dockerfile}: buildah failed ({status}):\n{text}")
