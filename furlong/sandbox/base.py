"""The sandbox contract every backend implements, and the results it hands back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

from furlong.sandbox.changes import Change
from furlong.sandbox.network import NO_NETWORK, NetworkPolicy

DEFAULT_OUTPUT_CAP = 1 << 20  # bytes of stdout (and of stderr) kept per command
BASE_ENV = {  # what every sandbox's environment starts from, before its image's ENV
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "DEBIAN_FRONTEND": "noninteractive",
}
DEFAULT_HOST_UID = 61000  # used only when furlong runs as root; an otherwise unused uid


class SandboxError(RuntimeError):
    """The sandbox could not do what was asked (bad path, failed start)."""


class HostLost(SandboxError):
    """The machine serving the sandbox stopped answering or restarted (a sandbox host died): nothing an
    agent does inside its sandbox can cause this, so its episode is never scored and is run again."""


class SandboxDied(SandboxError):
    """The sandbox process is gone or broke its protocol. Before the agent phase this is an
    infrastructure failure; once the agent has run commands it may be the agent's doing, and the
    episode runner scores it (see furlong.agent.episode)."""


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Limits:
    """Per-sandbox resource limits, enforced by cgroups (rlimits where no cgroup can be made)."""

    cpus: float = 1.0
    memory_mb: int = 2048
    pids: int = 512
    lifetime_s: float = 3600.0
    disk_mb: int = 1024  # the writable layer (a tmpfs): a cap, so a disk fill cannot exhaust memory


@dataclass(frozen=True)
class LayerRef:
    """One read-only layer of an image store, named by content: `digest` is the hash its inputs made (a
    build's recipe and context, a registry's digest), `path` its place relative to the store's root, so
    it means the same on every host with that store. A backend resolves it through a LayerSource."""

    digest: str
    path: str


@dataclass(frozen=True)
class ImageRef:
    """A built image, named by content: read-only layers (top first) plus the ENV / WORKDIR / USER a
    Dockerfile set. Nothing in it is a host path: any host that can fetch the layers can run it."""

    digest: str
    layers: tuple[LayerRef, ...]
    env: tuple[tuple[str, str], ...] = ()
    workdir: str = "/"
    # the final stage's last USER, as written ("" = root): users.resolve_user reads it in the layers
    user: str = ""
    note: str = ""  # how the image differs from what its FROM named (a stand-in), or where it came from
    # what verifier commands get on top of `env`, never the agent's (the verifier toolchain's PATH and
    # variables: furlong.sandbox.images.toolchain); not part of the sandbox, so never sent to a sandbox host
    verifier_env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Prebuilt:
    """A task's prebuilt image (Harbor's `[environment] docker_image`), by reference, with the task's own
    Dockerfile where it has one (furlong.sandbox.images.prebuilt says which serves). `where` names the setting in
    messages ("task 'x': task.toml: environment.docker_image")."""

    ref: str
    dockerfile: Path | None = None
    where: str = "docker_image"


# What a task's image is made from: its Dockerfile, a prebuilt image, or neither (the default base).
ImageSource = Path | Prebuilt | None


@dataclass(frozen=True)
class SyscallPolicy:
    """The seccomp filter: a default deny list (furlong.sandbox.runtime.seccomp), minus what a task allows."""

    enabled: bool = True
    allow: tuple[str, ...] = ()  # syscall names taken off the deny list for this sandbox


@dataclass(frozen=True)
class SandboxSpec:
    """`network`: the policy the sandbox starts with (furlong.sandbox.network); `network_phases`: the others
    it may be switched to later (NetworkSwitching), so the backend sets it up to allow that."""

    image: ImageRef
    network: NetworkPolicy = NO_NETWORK
    limits: Limits = field(default_factory=Limits)
    syscalls: SyscallPolicy = field(default_factory=SyscallPolicy)
    network_phases: tuple[NetworkPolicy, ...] = ()

    @property
    def policies(self) -> tuple[NetworkPolicy, ...]:
        return (self.network, *(p for p in self.network_phases if p != self.network))


PYTHON_LIB = "/furlong/lib"  # where a Python sandbox finds the furlong package (add it to sys.path)


@dataclass(frozen=True)
class PythonSpec:
    """furlong's own interpreter running untrusted code (a family's generate.py), its stdout streamed back:
    no network, an unprivileged uid, nothing of the host's to read but the interpreter, the furlong package
    (under PYTHON_LIB) and `read_only`; /tmp and /out are small tmpfs, /out the working directory."""

    source: str  # run as `python -I -c source *args`
    args: tuple[str, ...] = ()
    read_only: tuple[tuple[str, Path], ...] = ()  # (path inside, host directory)
    limits: Limits = field(default_factory=Limits)  # memory_mb and pids are enforced
    max_file_bytes: int = 64 << 20
    tmp_bytes: int = 64 << 20
    out_bytes: int = 192 << 20


class PythonRun(Protocol):
    """A running Python sandbox. Blocking calls: its reader runs in a thread of its own."""

    stdout: BinaryIO
    stderr: BinaryIO

    @property
    def returncode(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; raises TimeoutError if it has not exited within `timeout`."""

    def kill(self) -> None:
        """Ends it and everything it started."""

    def release(self) -> None:
        """Frees what the backend held for it, once it has exited."""


@runtime_checkable
class Sandbox(Protocol):
    """One fresh, isolated environment for one episode. All methods are async.

    The contract every backend keeps (tests/test_backend_conformance.py checks it on each backend):
    - **Filesystem**: the image's layers under writes of the sandbox's own (at most `Limits.disk_mb`: past
      it a write fails with ENOSPC); no other sandbox sees them, nor does the image or the next episode.
    - **Working directory and shell state**: an agent `exec` without `cwd` runs in bash in the image's
      WORKDIR the first time, and then where the previous such call left it: `cd` and `export` persist
      between calls as in a terminal, also when the command ends the shell (`exit 3`, `set -e`)
      (furlong.sandbox.runtime.shell.wrap builds that script; a backend whose
      commands run as bash scripts reuses it). With `cwd` the command runs there and the saved state is
      left alone. Verifier calls never see the agent's shell state: without `cwd` they start in `/`.
    - **Environment**: BASE_ENV, HOME as the image USER's home, then the image's ENV (which wins), then
      `env` for that command. Output over the backend's cap is cut (`truncated`); invalid UTF-8 decodes
      with replacement. A command past `timeout_s` is killed with what it started (`timed_out`).
    - **Users**: agent calls run as the image's USER (root when none), without capabilities over the
      host. `as_verifier` calls run as the verifier's identity, `verifier_uid` (inside), which the agent's
      processes cannot signal, trace or write as, and which owns /tests and /logs (furlong.sandbox.runtime.bwrap).
      `verifier_uid` is None where the sandbox has one uid only: `as_verifier` then runs as the agent, and
      the backend's `guarantees.verifier_identity` says so.
    - **Limits** (`SandboxSpec.limits`): memory and pids are enforced on what the agent starts (an
      allocation or fork past them fails, the sandbox keeps answering), CPU is shared out, and the sandbox
      is closed `lifetime_s` after it started.
    - **Network**: `SandboxSpec.network`, `no-network` by default: then no interface but loopback, and
      nothing outside the sandbox (the host's loopback included) can be reached.
    - **Tamper tracking**: a backend may also implement `ChangeTracking` (the bwrap backend does): without
      it, the verifier cannot check what the agent changed in the image, and records that it did not
      (furlong.tasks.integrity; the episode's `integrity_checked`).
    - **Snapshots**: optional (`Snapshotting`); a backend without them refuses `create(from_snapshot=...)`.
    - **Failures**: a path that cannot be read or written raises SandboxError; a call on a closed or dead
      sandbox raises SandboxDied (a SandboxError)."""

    @property
    def verifier_uid(self) -> int | None: ...  # read-only: a wrapper may pass its sandbox's through

    async def exec(
        self,
        cmd: str,
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        as_verifier: bool = False,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecResult:
        """Runs `cmd` in bash. With `on_output`, also calls it with ("stdout" | "stderr", bytes) as the command
        writes, in order and before exec returns, up to the output cap per stream (the result's own output
        is capped as without it); None streams nothing."""

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, as_verifier: bool = False) -> None: ...

    async def read_file(self, path: str, as_verifier: bool = False) -> bytes: ...

    async def put_dir(self, src: Path, dest: str, as_verifier: bool = False) -> None: ...

    async def put_tar(self, data: bytes, dest: str, as_verifier: bool = False) -> None:
        """Unpacks a tar (files, directories and symlinks only) under dest."""

    async def close(self) -> None: ...

    @property
    def alive(self) -> bool: ...


@runtime_checkable
class ChangeTracking(Protocol):
    """The optional capability of a Sandbox to say, from the host, what its processes changed in its image."""

    async def changes(self, roots: Sequence[str]) -> tuple[Change, ...] | None:
        """The entries under `roots` (absolute paths inside) that differ from the image, sorted by path,
        uids as seen inside (furlong.sandbox.changes); None where they cannot be read now."""

    async def image_has(self, paths: Sequence[str]) -> frozenset[str] | None:
        """Which of `paths` the image itself holds (no symlink followed); None where it cannot say."""


@dataclass(frozen=True)
class SnapshotRef:
    """A sandbox's filesystem as its agent left it (E2B's keep_memory=False: no process is kept), named by
    content. `layers`: the digests of the snapshot's own layers, top first (a snapshot of a sandbox restored
    from another stacks on that one's); `layers[0]` names it. It holds no host path: the backend that made
    it resolves it, and refuses it once `expires_at` (unix time) has passed or over another image."""

    layers: tuple[str, ...]
    image_digest: str
    size_bytes: int  # of the top layer: what it added to the store
    expires_at: float
    host: str = ""  # a remote backend's: the sandbox host holding it ("" where local)
    token: str = ""  # a remote backend's: what that host wants before it restores it

    @property
    def digest(self) -> str:
        return self.layers[0]


@runtime_checkable
class Snapshotting(Protocol):
    """The optional capability of a Sandbox to be snapshotted, forked, paused and resumed (the bwrap
    backend has it). Its backend's `create(spec, from_snapshot=ref)` starts a sandbox from a snapshot."""

    async def snapshot(self) -> SnapshotRef:
        """The filesystem now (the sandbox is frozen while it is copied); running processes are not kept.
        Raises SandboxError past the store's disk cap, naming the cap and its setting."""

    async def fork(self, n: int) -> list[Sandbox]:
        """`n` new sandboxes with this one's filesystem, each with the spec's limits, network policy and
        users exactly as a fresh one (not a network phase this one switched to); none sees another's writes."""

    async def pause(self) -> None:
        """Freezes every process (cgroup freezer): no CPU, memory kept. Until `resume`, every call but
        `resume`, `snapshot` and `close` raises SandboxError; a pause while a call is running is refused."""

    async def resume(self) -> None:
        """Thaws the processes where they stopped."""

    @property
    def paused(self) -> bool: ...


@dataclass(frozen=True)
class Usage:
    """What a sandbox uses now, read from its cgroup: CPU time its live processes used, memory charged."""

    cpu_s: float
    memory_bytes: int
    limits: Limits


@runtime_checkable
class Metered(Protocol):
    """The optional capability of a Sandbox to say what it uses (the bwrap backend has it)."""

    def usage(self) -> Usage | None:
        """None where it has no cgroup (rlimits only) or is closed."""


@runtime_checkable
class NetworkSwitching(Protocol):
    """The optional capability of a Sandbox to change its network policy while it runs (the bwrap and remote
    backends have it), for a task whose agent and verifier phases differ."""

    async def set_network(self, policy: NetworkPolicy, verifier_only: bool = False) -> None:
        """From now on the sandbox has `policy`. With `verifier_only`, only the verifier's commands get it:
        the agent's processes still running keep their network only if it is the same policy, and
        otherwise keep their own loopback alone (where the sandbox has one uid, `verifier_uid` None, they
        share the verifier's). Raises SandboxError where the sandbox was not created able to switch
        (its SandboxSpec named neither policy in `network_phases`) and the policy differs."""


class LayerSource(Protocol):
    """Where a backend gets an image's layers: an ImageStore on this host."""

    def layer_dir(self, layer: LayerRef) -> Path:
        """The layer as a read-only directory on this host."""

    def layer_tar(self, layer: LayerRef) -> bytes:
        """The layer as a tar, for a backend whose sandboxes run on another host."""

    def layer_files(self, layer: LayerRef) -> Path:
        """The layer's own directory on this host, its files owned by the ids they have inside (root's): for
        a backend running as root whose sandboxes map no ids (gvisor), and never writable by a sandbox."""


@dataclass(frozen=True)
class Guarantees:
    """What a backend's sandboxes give the reward's integrity, declared by the backend (`guarantees`) so a
    run says at its start when its rewards are not integrity-checked (furlong.build.sandbox), and every
    episode records whether its own was (`integrity_checked`, furlong.tasks.verifier)."""

    verifier_identity: bool  # `as_verifier` runs as a uid of its own (Sandbox.verifier_uid is not None)
    tamper_tracking: bool  # its sandboxes implement ChangeTracking

    @property
    def integrity(self) -> bool:
        return self.verifier_identity and self.tamper_tracking

    def missing(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, has in (("verifier identity", self.verifier_identity), ("tamper tracking", self.tamper_tracking))
            if not has
        )


NO_GUARANTEES = Guarantees(verifier_identity=False, tamper_tracking=False)


@runtime_checkable
class SandboxBackend(Protocol):
    """Makes fresh sandboxes from images; furlong.sandbox.backends.make_backend picks one by name.
    `guarantees`: what its sandboxes give the reward's integrity (NO_GUARANTEES when neither)."""

    name: str
    guarantees: Guarantees

    async def create(self, spec: SandboxSpec, from_snapshot: SnapshotRef | None = None) -> Sandbox:
        """A fresh sandbox; `from_snapshot` (one of this backend's Snapshotting sandboxes', over spec.image)
        lies under its writes. A backend without snapshots raises SandboxError when given one."""

    async def build(self, spec: SandboxSpec, layer: Path) -> Sandbox:
        """A sandbox whose writes become a new layer over spec.image (a Dockerfile's build steps): once it
        is closed, `layer` (an empty directory on this host, which the caller owns) holds them."""

    def run_python(self, spec: PythonSpec) -> PythonRun:
        """Starts a Python sandbox (family generators); raises SandboxError when it cannot start."""
