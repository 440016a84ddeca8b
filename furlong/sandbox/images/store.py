"""Images: a bootstrapped Debian base rootfs, plus one layer per task Dockerfile, cached by content hash.

A layer is the overlay upper directory left by running the Dockerfile's steps in a build sandbox
(which may use the network); sandboxes stack it read-only over the base. The base is built with
mmdebstrap, as root or (in a user namespace from the user's subuid range) as an ordinary user. As root,
layers are owned by root on disk and sandboxes see them through read-only id-mapped views (layers.py),
so the sandbox uid cannot write them; as a user, they belong to the user, which is the sandbox's uid.

A FROM names the base, the base plus a stand-in layer (standins.py: e.g. `python:*` gets Debian's
python3 with pip and venv), built once like a task layer from an internal Dockerfile, an image
imported by hand (imports.py), or any other reference pulled from its registry (registry.py). A
stand-in's note says what the image really is; ImageRef.note carries it. A task's prebuilt image
(Harbor's docker_image) is resolved by prebuilt.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from furlong.paths import cache_dir, check_traversable
from furlong.sandbox.base import (
    DEFAULT_HOST_UID,
    ImageRef,
    ImageSource,
    LayerRef,
    Prebuilt,
    SandboxError,
)
from furlong.sandbox.images import (
    buildah,
    imports,
    layerbuild,
    layers,
    offline_uv,
    prebuilt,
    registry,
    rootless,
    standins,
    ubuntu,
)
from furlong.sandbox.images import dockerfile as df
from furlong.sandbox.images import toolchain as toolchains
from furlong.sandbox.images.builds import ImageBuildError, Progress, _locked, _rmtree, _sha
from furlong.sandbox.runtime import idmap, users
from furlong.sandbox.runtime.egress import Egress
from furlong.sandbox.tarball import tar_dir

# bump when the layout or the base recipe changes, so old caches are not reused. (Not bumped when native RUN
# steps got their build capabilities: a step that needed one failed before, so no layer was stored from it.)
FORMAT = "4"
BASE_PACKAGES = ("python3", "git", "procps", "ca-certificates")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
APT_CONF = 'APT::Sandbox::User "root";\n'  # apt cannot switch to _apt: only one uid is mapped


def _inside_id(host: int, sub_start: int | None) -> int:
    """A host id a build sandbox wrote -> the id inside: its subordinate range (from `sub_start`, None:
    one id only) is inside 1..COUNT; its root (the sandbox uid) and any id it does not map are root's."""
    if sub_start is not None and sub_start <= host < sub_start + idmap.COUNT:
        return host - sub_start + 1
    return 0


class DefaultStore:
    """The default ImageStore (this host's cache) as a backend's layer source, made on first need: a backend
    that only runs Python (a family's generator, a remote client's run_python) never makes one."""

    def __init__(self, host_uid: int | None = None, egress: Egress | None = None):
        self._args = (host_uid, egress)
        self._store: ImageStore | None = None

    @property
    def store(self) -> ImageStore:
        if self._store is None:
            self._store = ImageStore(host_uid=self._args[0], egress=self._args[1])
        return self._store

    def layer_dir(self, layer: LayerRef) -> Path:
        return self.store.layer_dir(layer)

    def layer_tar(self, layer: LayerRef) -> bytes:
        return self.store.layer_tar(layer)

    def layer_files(self, layer: LayerRef) -> Path:
        return self.store.layer_files(layer)


class ImageStore:
    def __init__(
        self,
        root: Path | None = None,
        host_uid: int | None = None,
        mirror: str | None = None,
        build_timeout_s: float = 1800.0,
        pulls: registry.Settings | None = None,
        egress: Egress | None = None,
        standin_versions: str = "nearest",
        offline_uv: bool = False,
        ubuntu_standins: str = "off",
    ):
        self.root = root or cache_dir() / "images"
        # the sandbox uid, as the bwrap backend picks it: the given one as root, else this process's own
        self.host_uid = (DEFAULT_HOST_UID if host_uid is None else host_uid) if os.geteuid() == 0 else os.geteuid()
        self.mirror = mirror or os.environ.get("FURLONG_DEBIAN_MIRROR", DEFAULT_MIRROR)
        self.build_timeout_s = build_timeout_s
        # what build steps borrow from the host (its CAs, its mirrors): the backend that runs them must be
        # given the same (furlong.build.sandbox does); layers built with it are keyed apart
        self.egress = egress
        if standin_versions not in ("nearest", "exact"):
            raise ValueError(f"images.standins: expected nearest or exact, got {standin_versions!r}")
        self.standin_versions = standin_versions  # a tag's version Debian lacks: the nearest, or an error
        if ubuntu_standins not in ubuntu.MODES:
            raise ValueError(f"{ubuntu.SETTING}: expected {' or '.join(ubuntu.MODES)}, got {ubuntu_standins!r}")
        self.ubuntu_standins = ubuntu_standins  # Ubuntu's tags where no registry serves them (ubuntu.py)
        self.offline_uv = offline_uv  # uv's installer in a RUN step: the toolchain's uv (offline_uv.py)
        self._locks: dict[str, asyncio.Lock] = {}
        self._resolved: dict[Path | Prebuilt, ImageRef] = {}  # a task's files do not change within a run
        self._resolving: dict[Path | Prebuilt, asyncio.Future] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        self.registry = registry.Registry(self.root / "registry", pulls)  # images pulled by digest
        check_traversable(self.root, self.host_uid)  # build sandboxes write layers under it by path
        if layers.supported():
            layers.sweep()

    # -- base ---------------------------------------------------------------------------------
    def base_key(self, suite: str = "bookworm") -> str:
        return "base-" + _sha(FORMAT, suite, "minbase", ",".join(BASE_PACKAGES), self.mirror)

    def base(self, progress: Progress | None = None, suite: str = "bookworm") -> ImageRef:
        """The base image of a Debian suite (standins.SUITES), bootstrapped the first time (about half a minute)."""
        if suite not in standins.SUITES:
            raise ImageBuildError(f"no furlong base for Debian {suite!r}; known: {', '.join(standins.SUITES)}")
        key = self.base_key(suite)
        final = self.root / key
        if not (final / "meta.json").exists():
            with _locked(self.root / f".{key}.lock"):
                if not (final / "meta.json").exists():
                    self._bootstrap(final, progress or (lambda _: None), suite)
        return ImageRef(digest=key, layers=(self.layer(key, final / "rootfs"),))

    def _bootstrap(self, final: Path, progress: Progress, suite: str) -> None:
        if problem := rootless.base_build_problem():
            raise ImageBuildError(problem)
        tmp = final.with_name(final.name + ".tmp")
        _rmtree(tmp)
        rootfs = tmp / "rootfs"
        rootfs.mkdir(parents=True)
        started = time.monotonic()
        self._mmdebstrap_into(rootfs, progress, suite)
        progress("finishing base rootfs")
        (rootfs / "etc/apt/apt.conf.d/99furlong").write_text(APT_CONF)
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        (rootfs / "var/cache/apt/archives/partial").mkdir(parents=True)
        (rootfs / "logs").mkdir(exist_ok=True)
        meta = {
            "key": final.name,
            "suite": suite,
            "packages": BASE_PACKAGES,
            "seconds": round(time.monotonic() - started, 1),
            "builder": f"mmdebstrap {rootless.mmdebstrap_mode()}",
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(final)

    def _mmdebstrap_into(self, rootfs: Path, progress: Progress, suite: str) -> None:
        """Bootstraps into a tar stream unpacked by this process, so every file belongs to this uid
        (root, or the user: the uid the sandbox maps to its root). /dev is left out: bwrap makes one."""
        cmd = [
            "mmdebstrap",
            rootless.mmdebstrap_mode(),
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            suite,
            "-",
            self.mirror,
        ]
        untar = ["tar", "-x", "-p", "--no-same-owner", "--numeric-owner", "--exclude=./dev/*", "-C", str(rootfs)]
        boot = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        tar = subprocess.Popen(untar, stdin=boot.stdout, stderr=subprocess.PIPE, text=True)
        assert boot.stdout is not None and boot.stderr is not None and tar.stderr is not None  # PIPEs
        boot.stdout.close()  # tar holds the pipe now; mmdebstrap sees EPIPE if tar dies
        tail: list[str] = []
        for line in boot.stderr:
            tail = (tail + [line.rstrip()])[-20:]
            progress(f"mmdebstrap: {line.strip()[:100]}")
        tar_err = tar.stderr.read()
        if boot.wait() != 0 or tar.wait() != 0:
            raise ImageBuildError(
                f"mmdebstrap failed ({boot.returncode}, tar {tar.returncode}):\n" + "\n".join(tail) + tar_err[-1000:]
            )

    # -- layers: named by digest, found under the root ---------------------------------------------
    def layer(self, digest: str, directory: Path) -> LayerRef:
        """The layer at `directory` (inside the store) as a reference any host with this store resolves."""
        return LayerRef(digest=digest, path=str(directory.relative_to(self.root)))

    def _stored(self, layer: LayerRef) -> Path:
        """The layer's directory in the store; a reference outside it (absolute, `..`) or missing is one line."""
        rel = Path(layer.path)
        if rel.is_absolute() or ".." in rel.parts or not (self.root / rel).is_dir():
            raise SandboxError(f"layer {layer.digest}: {layer.path!r} is not a layer of the image store {self.root}")
        return self.root / rel

    def layer_dir(self, layer: LayerRef) -> Path:
        """The layer as a read-only directory on this host (through the store's id-mapped view as root)."""
        return self._view(self._stored(layer).relative_to(self.root))

    def layer_files(self, layer: LayerRef) -> Path:
        """The layer's directory in the store, owners as inside (furlong.sandbox.base.LayerSource)."""
        return self._stored(layer)

    def layer_tar(self, layer: LayerRef) -> bytes:
        """The layer as a tar of its directory (every entry root's, modes kept), for a sandbox host elsewhere."""
        return tar_dir(self._stored(layer))

    def _view(self, inside: Path) -> Path:
        """As root, the layer at `inside` (relative to the store) seen through the read-only id-mapped view
        of the whole store; otherwise the layer itself. One view per store, never one per layer or build:
        every sandbox start copies the host's mount table into its namespace (about 1 ms per 100 mounts,
        bench/sandbox_bench.py), and views are never detached while a sandbox may use them. A layer built,
        rebuilt or imported later shows through the same view."""
        if not layers.supported():
            return self.root / inside
        return layers.readonly_view(self.root, self.host_uid) / inside

    def _seal(self, upper: Path) -> None:
        """As root, gives a built layer's files their owners as the sandbox saw them, so the sandbox uid
        cannot write the stored layer and the store's view shows them as they were built. The build
        sandbox wrote them as host ids: the sandbox uid for its root, the subordinate range for its other
        ids (a RUN's `chown worker`); anything else is root's (chown clears set-id bits: they are put back)."""
        if os.geteuid() != 0:
            return
        sub = idmap.sub_ids()
        uid_start, gid_start = (sub.uid_start, sub.gid_start) if sub else (None, None)
        done: set[int] = set()  # each inode once (a directory is also its own ".", a hard link is two
        for dirpath, dirnames, filenames in os.walk(upper):  # names): mapping an id twice would give it to root
            for name in [".", *dirnames, *filenames]:
                path = os.path.join(dirpath, name)
                st = os.lstat(path)
                if st.st_ino in done:
                    continue
                done.add(st.st_ino)
                os.lchown(path, _inside_id(st.st_uid, uid_start), _inside_id(st.st_gid, gid_start))
                if st.st_mode & 0o6000 and not os.path.islink(path):
                    os.chmod(path, st.st_mode & 0o7777)

    # the store's own layer builder (layerbuild.py) as a method: the verifier toolchain builds its layer through
    # the store it is given, since layerbuild imports offline_uv, which imports the toolchain
    _build_layer = layerbuild.build_layer

    # -- what a FROM names ----------------------------------------------------------------------
    async def parent(self, ref: str, backend, progress: Progress) -> ImageRef:
        """The image a FROM names: an imported one (exact name first: the user brought it on purpose),
        a base or a base plus a stand-in layer (built once) for the names furlong maps, unless
        `prefer_registry`; else the image pulled from its registry (cached by digest). The stand-ins of
        toolchain images (gcc, node...) and Ubuntu serve only where the registry cannot, one whose version
        differs from the tag's only in `nearest` mode, Ubuntu's only with images.ubuntu_standins (standins.py)."""
        if (meta := imports.find(self.root, ref)) is not None:
            return await asyncio.to_thread(self.imported_image, meta)
        choice = standins.resolve(ref, self.ubuntu_standins)
        usable = choice is not None and choice.allowed(self.standin_versions)
        registry_first = choice is None or (
            ref != standins.base_name(choice.suite)
            and (self.registry.settings.prefer_registry or choice.registry_first or not usable)
        )
        if registry_first and (pulled := await asyncio.to_thread(self._pull, ref, choice, usable, progress)):
            return await asyncio.to_thread(self.pulled_image, pulled)
        if choice is None:
            raise ImageBuildError(f"{ref}: not pulled from a registry, and no furlong stand-in maps it")
        return await self.standin_image(choice, backend, progress)

    async def standin_image(self, choice: standins.BaseChoice, backend, progress: Progress) -> ImageRef:
        """The base `choice` maps onto, plus its stand-in layer (built once) where it has one."""
        base = await asyncio.to_thread(self.base, progress, choice.suite)
        if choice.standin is None:
            return base
        standin = await self._standin(choice.standin, base, backend, progress)
        note = choice.note(standin.note)
        progress(note)
        return ImageRef(digest=standin.digest, layers=standin.layers, env=standin.env, workdir="/", note=note)

    def _pull(self, ref: str, choice: standins.BaseChoice | None, usable: bool, progress: Progress) -> dict | None:
        """The pulled image's meta, or None where the registry cannot serve it and the stand-in may; where
        no stand-in may either (a version Debian lacks, in exact mode), the one line naming what Debian has."""
        try:
            return self.registry.image(ref, progress, fallback=usable)
        except registry.RegistryError:
            if choice is None or usable:
                raise
            raise registry.RegistryError(choice.refusal(self.standin_versions)) from None

    def imported_image(self, meta: dict) -> ImageRef:
        rootfs = imports.directory(self.root, meta["name"]) / imports.rootfs_name(meta["id"])
        return ImageRef(
            digest=f"import-{meta['id']}",
            layers=(self.layer(f"import-{meta['id']}", rootfs),),
            env=tuple(tuple(p) for p in meta.get("env", ())),
            workdir=meta.get("workdir", "/"),
            user=meta.get("user", ""),
            note=f"{meta['name']}: imported by hand from {meta['source']}",
        )

    def pulled_image(self, meta: dict) -> ImageRef:
        return ImageRef(
            digest=f"pulled-{meta['manifest'][7:23]}",
            layers=(self.layer(meta["manifest"], self.registry.rootfs(meta)),),
            env=tuple(tuple(p) for p in meta.get("env", ())),
            workdir=meta.get("workdir", "/"),
            user=meta.get("user", ""),
            note=f"{meta['ref']}: pulled, {meta['digest']}",
        )

    def egress_parts(self) -> list[str]:
        """What a network-built layer's key records of the host's CAs and mirrors: nothing when both are off,
        so the keys of layers built without them never change."""
        return [f"egress {self.egress.key}"] if self.egress else []

    def standin_key(self, standin: standins.Standin) -> str:
        return f"standin-{standin.name}-" + _sha(
            FORMAT, self.base_key(standin.suite), standin.dockerfile(), *self.egress_parts()
        )

    async def _standin(self, standin: standins.Standin, base: ImageRef, backend, progress: Progress) -> ImageRef:
        """The base plus the stand-in's layer (its note: what the probe printed, e.g. 3.11.2)."""
        key = self.standin_key(standin)
        final = self.root / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if not (final / "meta.json").exists():
                recipe = self.root / f".{key}.Dockerfile"  # a real file, so build errors name file:line
                recipe.write_text(standin.dockerfile())
                steps = df.parse(recipe)
                await self._build_layer(
                    final,
                    base,
                    recipe,
                    steps,
                    backend,
                    progress,
                    label=f"{standin.name} stand-in",
                    probe=standin.probe,
                    extra={"standin": standin.name, "packages": standin.packages},
                )
        meta = json.loads((final / "meta.json").read_text())
        return ImageRef(
            digest=key,
            layers=(self.layer(key, final / "upper"), *base.layers),
            env=tuple(tuple(p) for p in meta["env"]),
            note=meta.get("provides", ""),
        )

    def listing(self) -> list[tuple[str, str]]:
        """(directory, what it is) for every image in the store."""
        rows = []
        for meta_path in sorted(self.root.glob("*/meta.json")):
            info = json.loads(meta_path.read_text())
            if "standin" in info:
                what = f"{info['standin']} stand-in ({info.get('provides') or 'Debian bookworm'})"
            elif "name" in info:
                what = f"{info['name']}\timported from {info['source']} ({info['kind']})"
            elif "dockerfile" in info:
                what = info["dockerfile"] + (f"\t{info['note']}" if info.get("note") else "")
            else:
                what = f"{info.get('builder', 'debootstrap')} {info.get('suite', 'bookworm')} minbase"
            rows.append((meta_path.parent.name, what))
        return rows + self.registry.listing()

    # -- Dockerfile layers -------------------------------------------------------------------
    def layer_key(
        self,
        dockerfile: Path,
        steps: list[df.Instruction],
        parent_key: str | None = None,
        offline: offline_uv.OfflineUv | None = None,
    ) -> str:
        """The parent's key (the base unless FROM named a stand-in or an import), the steps, the content
        COPY brings in, and the toolchain that images.offline_uv took uv from (where a step fetched it)."""
        parts: list[str | bytes] = [
            FORMAT,
            parent_key or self.base_key(),
            *self.egress_parts(),
            *([f"offline_uv {offline.key}"] if offline else []),
        ]
        workdir = "/"
        for step in steps[1:]:
            parts.append(f"{step.op} {step.args}")
            if step.op == "WORKDIR":  # for where COPY lands; variables only change the key's inputs, not its use
                workdir = df.next_workdir(workdir, step.args, {})
            if step.op == "COPY":  # the content copied is part of the identity, not just its name
                parts.append(df.copy_tar(dockerfile.parent, step, workdir, dockerfile))
        return "layer-" + _sha(*parts)

    async def image(self, source: ImageSource, backend, progress: Progress | None = None) -> ImageRef:
        """The image for a task: the base (None), its Dockerfile's FROM plus its own layer (built once), or
        its prebuilt image (furlong.sandbox.images.prebuilt).

        Callers asking for the same Dockerfile at once share one lookup: an RL step asks for each new task's
        image once per episode and once per sandbox it reserves, all together, and a lookup costs tens of
        milliseconds of CPU even when the layer is built (the cost the engine then waits for)."""
        progress = progress or (lambda _: None)
        if source is None:
            return await asyncio.to_thread(self.base, progress)
        if source in self._resolved:
            return self._resolved[source]
        pending = self._resolving.get(source)
        if pending is None:
            pending = self._resolving[source] = asyncio.ensure_future(self._resolve(source, backend, progress))
            pending.add_done_callback(lambda _: self._resolving.pop(source, None))
        return await asyncio.shield(pending)  # one caller cancelled must not cancel the others' lookup

    async def _resolve(self, source: Path | Prebuilt, backend, progress: Progress) -> ImageRef:
        if isinstance(source, Prebuilt):
            self._resolved[source] = await prebuilt.image(self, source, backend, progress)
            return self._resolved[source]
        return await self._from_dockerfile(source, backend, progress)

    async def _from_dockerfile(self, dockerfile: Path, backend, progress: Progress) -> ImageRef:
        if why := df.outside_subset(dockerfile):  # multi-stage, ARG, USER worker, heredocs...: buildah
            return await self._by_buildah(dockerfile, backend, progress, why)
        imported = registry.FromNames(await asyncio.to_thread(imports.names, self.root))  # or any reference
        steps = df.parse(dockerfile, imported=imported)
        try:
            parent = await self.parent(steps[0].args, backend, progress)
        except registry.RegistryError as exc:
            raise ImageBuildError(f"{dockerfile}:{steps[0].line}: FROM {exc}") from None
        if (step := df.step_as_user(steps, parent.user)) is not None:  # FROM's image set a USER
            why = f"{dockerfile}:{step.line}: {step.op} as USER {parent.user} (set by {steps[0].args})"
            return await self._by_buildah(dockerfile, backend, progress, why)
        offline, uv_note = await self._offline_uv(dockerfile, steps, backend, progress)
        key = await asyncio.to_thread(self.layer_key, dockerfile, steps, parent.digest, offline)
        final = self.root / key
        async with self._locks.setdefault(key, asyncio.Lock()):
            if not (final / "meta.json").exists():
                await self._build_layer(
                    final,
                    parent,
                    dockerfile,
                    steps,
                    backend,
                    progress,
                    label=dockerfile.parent.parent.name,
                    offline=offline,
                    extra={
                        "base": steps[0].args,
                        "note": parent.note,
                        "builder": "furlong",
                        **({"offline_uv": uv_note} if offline else {}),
                    },
                )
        meta = json.loads((final / "meta.json").read_text())
        ref = ImageRef(
            digest=key,
            layers=(self.layer(key, final / "upper"), *parent.layers),
            env=parent.env + tuple(tuple(p) for p in meta["env"]),
            workdir=meta["workdir"],
            user=meta.get("user", parent.user),
            note="; ".join(n for n in (parent.note, meta.get("offline_uv", "")) if n),
        )
        where = next(
            (f"{dockerfile}:{s.line}" for s in reversed(steps) if s.op == "USER"),
            f"{dockerfile}:{steps[0].line}: FROM {steps[0].args}",
        )
        await asyncio.to_thread(self.check_user, ref, where)
        self._resolved[dockerfile] = ref
        return ref

    async def _offline_uv(
        self, dockerfile: Path, steps, backend, progress: Progress
    ) -> tuple[offline_uv.OfflineUv | None, str]:
        """With images.offline_uv, where a RUN step fetches uv's installer: the toolchain's uv, and the note
        saying so (the version the URL asked for included); else (None, "")."""
        wanted = [(s, v) for s in steps if s.op == "RUN" and (v := offline_uv.asked(df.run_command(s)))]
        if not self.offline_uv or not wanted:
            return None, ""
        offline = await offline_uv.prepare(self, backend, progress)
        return offline, "; ".join(offline.note(f"{dockerfile}:{s.line}", v) for s, v in wanted)

    async def toolchain(self, backend, progress: Progress | None = None) -> toolchains.Toolchain:
        """The verifier toolchain layer (furlong.sandbox.images.toolchain), built once in this store."""
        return await toolchains.build(self, backend, progress or (lambda _: None))

    async def _by_buildah(self, dockerfile: Path, backend, progress: Progress, why: str) -> ImageRef:
        self._resolved[dockerfile] = await buildah.image(self, dockerfile, backend, progress, why)
        return self._resolved[dockerfile]

    def check_user(self, ref: ImageRef, where: str) -> users.Identity:
        """The identity the image's USER names; an image whose USER cannot run is a build error naming
        `where` (the Dockerfile's line), not a failure of every sandbox it would start."""
        try:
            return users.resolve_user(ref.user, [self.root / layer.path for layer in ref.layers])
        except (users.UserError, OSError) as exc:
            raise ImageBuildError(f"{where}: {exc}") from None
