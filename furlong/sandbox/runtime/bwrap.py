"""The default backend: bubblewrap, a copy-on-write root over shared read-only image layers.

Each sandbox is a fresh set of namespaces (user, mount, pid, net, ipc, uts, cgroup) whose root is an
overlay over the image with its writes in a size-capped tmpfs, so nothing one episode writes is seen by
the next. It runs as an unprivileged host uid: the compiled launcher (native/launch.c) joins the
sandbox's cgroups, drops to that uid, enters a user namespace mapping many uids (furlong.sandbox.runtime.idmap)
and mounts the capped tmpfs there before bwrap runs in it, because root plus a user namespace could still
write host /proc/sys. The sandbox's pid 1 is the compiled init (native/init.c), exec'd from a host fd so
the image never sees or supplies it; it runs the agent's commands as the agent's uid without any
capability, and the verifier's as a uid of its own that owns the /tests and /logs mounts, with the
ownership shim (native/owner.c) preloaded so the agent's files look root's to it, as in Docker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from furlong.paths import cache_dir
from furlong.sandbox.base import (
    BASE_ENV,
    DEFAULT_HOST_UID,
    DEFAULT_OUTPUT_CAP,
    Guarantees,
    LayerSource,
    PythonSpec,
    SandboxError,
    SandboxSpec,
    SnapshotRef,
)
from furlong.sandbox.runtime import cgroups, childwatch, hostpython, idmap, native, netns, seccomp, users
from furlong.sandbox.runtime import protocol as proto
from furlong.sandbox.runtime.bwrap_argv import (
    INIT_CAPS,
    OWNER_SHIM,
    bwrap_executable,
    dev_args,
    env_args,
    init_argv,
    networked,
    verifier_mounts,
)
from furlong.sandbox.runtime.bwrap_box import BwrapSandbox, WritableLayer, remove_tree
from furlong.sandbox.runtime.egress import Egress, through_proxy
from furlong.sandbox.runtime.egress_proxy import EgressProxy, Gate
from furlong.sandbox.runtime.headroom import agent_caps
from furlong.sandbox.runtime.netcontrol import NetworkControl, controlled, first_rules
from furlong.sandbox.runtime.snapshots import DEFAULT_MAX_MB, DEFAULT_TTL_S, SnapshotStore
from furlong.timing import mark

log = logging.getLogger(__name__)
OOM_ADJ_INIT = -500  # as root: bwrap and the init are the OOM killer's last choice; agent processes are 1000


def writable_layer_bytes(spec: SandboxSpec) -> int:
    """The tmpfs cap: disk_mb, but never so much that the agent's files leave the init or the verifier no room.

    Its pages are charged to the sandbox's memory cgroup, so a disk fill plus a memory bomb still ends
    with the OOM killer taking agent processes (oom_score_adj 1000) while the init keeps its headroom and
    the verifier its reserve (furlong.sandbox.runtime.headroom).
    """
    return agent_caps(spec.limits).layer << 20


class BwrapBackend:
    name = "bwrap"

    def __init__(
        self,
        host_uid: int = DEFAULT_HOST_UID,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        seccomp: bool = True,
        layers: LayerSource | None = None,
        many_uids: bool = True,
        egress: Egress | None = None,
        proxy: EgressProxy | None = None,
        snapshot_ttl_s: float = DEFAULT_TTL_S,
        snapshot_max_mb: int = DEFAULT_MAX_MB,
    ):
        self._layers = layers  # given, never made here: an ImageStore builds through backends like this one
        self.egress = egress  # the host's CAs and mirrors for networked sandboxes (builds included)
        self.proxy = proxy or EgressProxy()  # controlled sandboxes' gates (its thread starts on first need)
        self._gated: Egress | None = None  # `egress` through the proxy, written on first need
        self.seccomp = seccomp  # the global switch (config sandbox.seccomp); a spec may also turn it off
        self.host_uid = host_uid if os.geteuid() == 0 else os.geteuid()
        self.output_cap = output_cap
        self._bwrap = bwrap_executable()
        childwatch.install()  # a pidfd per live sandbox, not a thread (Python 3.11): bench/sandbox_density.py
        childwatch.raise_fd_limit()
        self._launch = str(native.binary("launch"))
        # a networked sandbox's launcher runs again inside pasta (see launcher), as the sandbox uid: by fd
        self._launch_fd = os.open(self._launch, os.O_PATH | os.O_CLOEXEC)
        # Exec'd inside as /proc/self/fd/N: never a path in the image, and opened before any uid drop.
        self._init_fd = os.open(native.binary("init"), os.O_PATH | os.O_CLOEXEC)
        shim = native.ownership_shim()
        self._shim_fd = os.open(shim, os.O_PATH | os.O_CLOEXEC) if shim else None
        self._upper_mnt = cache_dir() / "native" / "upper"
        self._upper_mnt.mkdir(parents=True, exist_ok=True)
        self._layer_fds: dict[Path, int] = {}
        self._identities: dict[tuple[str, str], users.Identity] = {}  # (image digest, USER) -> who that is
        self._snapshot_limits = (snapshot_ttl_s, snapshot_max_mb)
        self._snapshots: SnapshotStore | None = None  # made on first need
        # None: one uid per sandbox, the verifier's the agent's (idmap.problem(), or many_uids=False)
        self.subids = idmap.sub_ids() if many_uids else None
        if self.subids is None and many_uids:
            log.warning("sandboxes have one uid, so the verifier runs as the agent: %s", idmap.problem())
        # build sandboxes track no changes (their writes are the caller's layer), but no episode runs in one
        self.guarantees = Guarantees(verifier_identity=self.subids is not None, tamper_tracking=True)

    def _fd(self, layer: Path) -> int:
        # Layers are handed to bwrap as /proc/self/fd paths, opened once per layer; a layer rebuilt or
        # re-imported at the same path is a new directory, so a cached fd must still be that path's.
        fd = self._layer_fds.get(layer)
        if fd is not None and not _same_file(fd, layer):
            os.close(fd)
            fd = None
        if fd is None:
            fd = self._layer_fds[layer] = os.open(layer, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return fd

    @property
    def snapshots(self) -> SnapshotStore:
        if self._snapshots is None:
            self._snapshots = SnapshotStore(cache_dir() / "snapshots", *self._snapshot_limits, group=self.host_uid)
        return self._snapshots

    @property
    def layers(self) -> LayerSource:
        if self._layers is None:
            raise SandboxError("the bwrap backend was given no layer source (layers=, an ImageStore)")
        return self._layers

    def _egress(self, spec: SandboxSpec) -> Egress | None:
        """What the sandbox borrows from the host: nothing offline; through its gate when controlled."""
        if not any(p.online for p in spec.policies):
            return None
        if not controlled(spec.policies):
            return self.egress
        if self._gated is None:
            self._gated = through_proxy(self.egress, netns.PROXY_URL)
        return self._gated

    def bwrap_args(
        self,
        spec: SandboxSpec,
        extra: list[str] | None = None,
        seccomp_fd: int | None = None,
        init_args: tuple[str, ...] = (),
        verifier: bool = False,
        home: str = BASE_ENV["HOME"],
        shim_fd: int | None = None,
        snapshot_fds: tuple[int, ...] = (),
    ) -> tuple[list[str], list[int]]:
        """bwrap's argv and the fds it needs. Many uids (self.subids): bwrap runs as root of the launcher's
        user namespace and makes no other; `verifier` adds the verifier's mounts, and the ownership shim read
        from `shim_fd` (one of this start's own: bwrap reads it to its end). `home` is the agent's HOME (its
        USER's), unless the image's ENV sets one (Docker's rule). `snapshot_fds`: layers over the image's (top
        first), opened for this start alone (a snapshot's are not kept open like an image's)."""
        layer_fds = [*snapshot_fds, *(self._fd(self.layers.layer_dir(layer)) for layer in spec.image.layers)]
        fds = [*layer_fds, self._init_fd]
        args = [
            self._bwrap,
            *self._namespaces(spec),
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--hostname",
            "sandbox",
            "--cap-drop",
            "ALL",
            "--clearenv",
        ]
        if self.subids is not None:
            for cap in INIT_CAPS:
                args += ["--cap-add", cap]
        egress = self._egress(spec)
        args += env_args({**BASE_ENV, "HOME": home, **dict(egress.env if egress else ()), **dict(spec.image.env)})
        for fd in reversed(layer_fds):  # bwrap stacks --overlay-src bottom first; ImageRef lists the top first
            args += ["--overlay-src", f"/proc/self/fd/{fd}"]
        upper = self._upper_mnt
        args += extra or ["--overlay", f"{upper}/u", f"{upper}/w", "/"]
        caps = agent_caps(spec.limits)
        args += dev_args(caps)
        if verifier:
            args += verifier_mounts(caps, shim_fd)
            if shim_fd is not None:
                init_args = (*init_args, "--verifier-preload", OWNER_SHIM)
                fds.append(shim_fd)
        if networked(spec):
            args += ["--ro-bind", str(netns.resolv_conf(controlled(spec.policies))), "/etc/resolv.conf"]
            args += egress.bwrap_args() if egress else []
        if seccomp_fd is not None:  # the init applies it to every command, once it has taken its identity
            init_args = (*init_args, "--seccomp", str(seccomp_fd))
            fds.append(seccomp_fd)
        args += ["--chdir", spec.image.workdir, "--", f"/proc/self/fd/{self._init_fd}", *init_args]
        return args, fds

    def _namespaces(self, spec: SandboxSpec) -> list[str]:
        # never IPC: the sandbox's is the launcher's, whose limits it set (native/launch.c --ipc); a networked
        # sandbox keeps pasta's network namespace (see launcher)
        own = [
            "--unshare-pid",
            "--unshare-uts",
            "--unshare-cgroup-try",
            *([] if networked(spec) else ["--unshare-net"]),
        ]
        if self.subids is None:  # bwrap's own user namespace, one uid
            ipc = [] if self._launcher_ipc(spec) else ["--unshare-ipc"]
            return ["--unshare-user", *ipc, *own, "--disable-userns", "--uid", "0", "--gid", "0"]
        # the launcher's user namespace; seccomp refuses unshare/clone of a new one to the sandbox
        return own

    def _launcher_ipc(self, spec: SandboxSpec) -> bool:
        """Whether the launcher makes the sandbox's IPC namespace and sets its limits (launch.c --ipc). Not for an
        ordinary user's one-uid sandbox without network: the launcher's own user namespace maps no root, so the
        namespace's sysctls are no one's to write; bwrap makes it with the kernel's defaults. There the agent
        runs as the verifier's uid and can end the verifier's checker directly anyway (docs/sandboxes.md)."""
        return self.subids is not None or os.geteuid() == 0 or networked(spec)

    def _build_caps(self, upper: Path | None) -> bool:
        """Whether a build sandbox's steps get BUILD_CAPS: with many uids (as a user, see _own_layer)."""
        return upper is not None and self.subids is not None

    def _own_layer(self, layer: Path) -> None:
        """As an ordinary user, gives the user (the sandbox's root) every file a build left to another of its
        uids (host subordinate ids): a stored layer holds only the user's own files, which the user can
        read and remove, as a buildah build's export does. Done in the sandbox's own id mapping."""
        find = shutil.which("find") or "/usr/bin/find"
        assert self.subids is not None  # _build_caps: only with subordinate ids
        proc = subprocess.run(
            [
                self._launch,
                *self.subids.launcher_args(),
                "--",
                find,
                str(layer),
                "(",
                "!",
                "-user",
                "0",
                "-o",
                "!",
                "-group",
                "0",
                ")",
                "-exec",
                "chown",
                "-h",
                "0:0",
                "{}",
                "+",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise SandboxError(
                f"build layer {layer}: giving its files to this user failed: {proc.stderr.strip()[-300:]}"
            )

    def _identity(self, spec: SandboxSpec, lowers: tuple[Path, ...]) -> users.Identity:
        """Who the image's USER is (ids inside the sandbox); one line when this host cannot run it."""
        # by USER too: a task's [agent] user runs an image as another user than its own USER
        key = (spec.image.digest, spec.image.user)
        if (known := self._identities.get(key)) is None:
            try:
                known = users.resolve_user(spec.image.user, lowers)
            except (users.UserError, OSError) as exc:
                raise SandboxError(f"image {spec.image.digest[:12]}: {exc}") from None
            self._identities[key] = known
        if known.uid in idmap.RESERVED_UIDS:
            raise SandboxError(
                f"image {spec.image.digest[:12]}: USER {spec.image.user} is uid {known.uid}, which "
                f"furlong keeps for its own init and verifier (uids {idmap.RESERVED_UIDS}): "
                "give the user another uid"
            )
        if (known.uid, known.gid) != (0, 0) and self.subids is None:
            raise SandboxError(
                f"image {spec.image.digest[:12]}: USER {spec.image.user} needs sandboxes with many "
                f"uids, and these have one: {idmap.problem()}"
            )
        return known

    def launcher(
        self,
        args: list[str],
        cgroup: cgroups.Cgroup | None,
        spec: SandboxSpec,
        capped_upper: bool = True,
        verifier_ns_fd: int | None = None,
        gate: Gate | None = None,
    ) -> list[str]:
        """The launcher's argv: join the cgroup, cap the writable layer, drop to the sandbox uid, exec bwrap
        (inside pasta's network namespace when the sandbox has network: pasta runs as the sandbox uid;
        with a `gate`, its ports are the only way out)."""
        # The sandbox's IPC namespace is the launcher's (bwrap's only where the launcher cannot set its limits,
        # _launcher_ipc): only there can its limits be set (launch.c --ipc). pasta gives the command it runs an
        # IPC namespace of its own: inside it, a second launcher makes the sandbox's.
        ipc = ["--ipc"] if self._launcher_ipc(spec) else []
        if networked(spec):
            ports = (gate.tcp_port, gate.udp_port) if gate else None
            args = [f"/proc/self/fd/{self._launch_fd}", *ipc, "--", *args]
            args = netns.wrap(
                args, self.host_uid, in_userns=self.subids is not None, gate=ports, rules=first_rules(spec.network)
            )
            ipc = []
        root = os.geteuid() == 0
        opts = [self._launch, *ipc]
        for procs in cgroup.procs_files if cgroup else []:
            opts += ["--cgroup", str(procs)]
        if root:
            opts += ["--oom-adj", str(OOM_ADJ_INIT), "--uid", str(self.host_uid)]
        if self.subids is not None:
            opts += self.subids.launcher_args()
            if verifier_ns_fd is not None:
                opts += ["--verifier-ns", str(verifier_ns_fd), str(idmap.VERIFIER_UID)]
        if capped_upper:
            opts += ["--upper", str(self._upper_mnt), str(writable_layer_bytes(spec))]
        if cgroup is None:  # weaker: RLIMIT_NPROC counts every process of the uid, not of this sandbox
            opts += ["--rlimit-as", str(spec.limits.memory_mb << 20), "--rlimit-nproc", str(spec.limits.pids)]
        return [*opts, "--", *args]

    async def create(self, spec: SandboxSpec, from_snapshot: SnapshotRef | None = None) -> BwrapSandbox:
        """A fresh sandbox whose writes go to a capped tmpfs, gone when it closes; `from_snapshot` (one of
        this backend's, over spec.image) lies under them, read-only (furlong.sandbox.runtime.snapshots)."""
        if from_snapshot is None:
            return await self._start(spec, None)
        lowers = await asyncio.to_thread(self.snapshots.layers, from_snapshot, spec.image.digest)
        try:
            box = await self._start(spec, None, snapshot=lowers)
        except BaseException:
            self.snapshots.release(from_snapshot)
            raise
        box.restored = from_snapshot
        return box

    async def build(self, spec: SandboxSpec, layer: Path) -> BwrapSandbox:
        """A sandbox whose writes persist in `layer`: it is the overlay's upper directory, so it must be
        the sandbox uid's, beside a work directory of the same filesystem (removed at close)."""
        work = layer.with_name(f".{layer.name}.work")
        work.mkdir()
        for d in (layer, work):
            os.chown(d, self.host_uid, self.host_uid)
        try:
            box = await self._start(spec, layer, work)
        except BaseException:
            remove_tree(work)
            raise
        box.scratch = work
        if self._build_caps(layer) and os.geteuid() != 0:
            box.finish = lambda: self._own_layer(layer)
        return box

    def run_python(self, spec: PythonSpec) -> hostpython.HostPythonRun:
        return hostpython.start(spec, self._bwrap, self.host_uid)

    def _shim_copy(self) -> int | None:
        """A fresh fd on the ownership shim for one sandbox's verifier (bwrap reads it to the end), from the
        file opened when this backend was made (a rebuilt one is not picked up); None without a shim."""
        if self._shim_fd is None:
            return None
        return os.open(f"/proc/self/fd/{self._shim_fd}", os.O_RDONLY | os.O_CLOEXEC)

    def _resolve(self, spec: SandboxSpec, upper: Path | None) -> tuple[tuple[Path, ...], users.Identity, int | None]:
        """What a start checks before anything needs undoing, each a one-line error: the network's pieces, the
        layers (opened once, cached by _fd), who the agent is (build steps run as root), the syscall filter."""
        t = time.perf_counter()  # its phases (furlong.timing.mark) for bench/sandbox_cold_start.py
        if networked(spec):
            netns.check(self.host_uid)
        lowers = tuple(self.layers.layer_dir(layer) for layer in spec.image.layers)
        for lower in lowers:
            self._fd(lower)
        t = mark("layers", t)
        agent = users.ROOT if upper is not None else self._identity(spec, lowers)
        t = mark("identity", t)
        seccomp_fd = seccomp.filter_fd(spec.syscalls) if self.seccomp else None
        mark("seccomp", t)
        return lowers, agent, seccomp_fd

    async def _start(
        self, spec: SandboxSpec, upper: Path | None, work: Path | None = None, snapshot: tuple[Path, ...] = ()
    ) -> BwrapSandbox:
        name = uuid.uuid4().hex[:12]
        lowers, agent, seccomp_fd = self._resolve(spec, upper)
        t = time.perf_counter()  # its phases (furlong.timing.mark) for bench/sandbox_cold_start.py
        cgroup = await asyncio.to_thread(cgroups.create, name, spec.limits)  # None where none can be made
        t = mark("cgroup", t)
        rw_fds = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in (upper, work)] if upper else []  # type: ignore[arg-type]  # work comes with upper
        extra = ["--overlay", *(f"/proc/self/fd/{fd}" for fd in rw_fds), "/"] if upper else None
        agent_fds = [os.open(f, os.O_WRONLY | os.O_CLOEXEC) for f in _agent_procs(cgroup)]
        rw_fds += agent_fds
        verifier = self.subids is not None and upper is None  # a build sandbox has no verifier
        # an fd number reserved for the launcher, which puts the verifier's user namespace there
        vns_fd = os.open(os.devnull, os.O_RDONLY) if verifier else None
        rw_fds += [vns_fd] if vns_fd is not None else []
        # bwrap's monitor keeps its status fd (and closes every other): the init, which closes the write
        # end, sees the pipe's end when bwrap goes
        parent_pipe = list(os.pipe()) if verifier else []
        rw_fds += parent_pipe
        init_args = init_argv(
            agent_fds,
            idmap.VERIFIER_UID if verifier else None,
            vns_fd,
            (agent.uid, agent.gid),
            parent_pipe[0] if parent_pipe else None,
            agent.groups if self.subids else (),
            build=self._build_caps(upper),
            restored=bool(snapshot),
        )
        shim_fd = self._shim_copy() if verifier else None
        rw_fds += [shim_fd] if shim_fd is not None else []
        snapshot_fds = tuple(os.open(d, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for d in snapshot)
        rw_fds += snapshot_fds
        args, fds = self.bwrap_args(spec, extra, seccomp_fd, init_args, verifier, agent.home, shim_fd, snapshot_fds)
        if parent_pipe:
            args[1:1] = ["--json-status-fd", str(parent_pipe[1])]
        fds += [*rw_fds, self._launch_fd]
        to_close = rw_fds + ([seccomp_fd] if seccomp_fd is not None else [])
        t = mark("argv", t)
        proc, secret, gate = await self._spawn(spec, args, fds, to_close, cgroup, upper is None, vns_fd)
        t = mark("spawn", t)
        box = BwrapSandbox(proc, cgroup, self.output_cap, spec.limits.lifetime_s, name, secret)
        box.verifier_uid = idmap.VERIFIER_UID if verifier else None
        box.agent_uid = agent.uid
        box.fixed_network = spec.network
        if gate is not None:
            box.network = NetworkControl(gate, box.verifier_uid, spec.network, spec.network, first_rules(spec.network))
        if upper is None:  # a build's upper is the caller's layer, not a tmpfs in the launcher's namespace
            box.writes = WritableLayer(self._upper_mnt, lowers, snapshot)
            box.origin = (self, spec)
        mark("box", t)
        return box

    async def _spawn(
        self,
        spec: SandboxSpec,
        args: list[str],
        fds: list[int],
        to_close: list[int],
        cgroup: cgroups.Cgroup | None,
        capped_upper: bool,
        vns_fd: int | None,
    ) -> tuple[asyncio.subprocess.Process, bytes, Gate | None]:
        """Starts the launcher (then bwrap) with its `fds`, and hands it the protocol's secret; the fds in
        `to_close` are closed here either way (the child has its copies), and the cgroup removed on failure."""
        secret = proto.new_secret()
        gate = None
        try:
            if controlled(spec.policies):
                gate = await self.proxy.open(spec.network)
            proc = await asyncio.create_subprocess_exec(
                *self.launcher(args, cgroup, spec, capped_upper, vns_fd, gate),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=fds,
                limit=1 << 16,
            )
            proc.stdin.write(secret)  # type: ignore[union-attr]  # stdin=PIPE
        except BaseException as exc:
            if cgroup:
                cgroup.remove()
            if gate is not None:
                await gate.close()
            if isinstance(exc, OSError):
                raise SandboxError(f"cannot start bwrap ({self._bwrap}): {exc}") from exc
            raise
        finally:
            for fd in to_close:
                os.close(fd)
        return proc, secret, gate


def _agent_procs(cgroup: cgroups.Cgroup | None) -> list[Path]:
    """The cgroup.procs files the init moves each agent command into (a nested pids limit), if any.
    Opened here, by the host: the kernel checks the opener's credentials and cgroup namespace."""
    return list(cgroup.agent_procs_files) if cgroup is not None else []


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
