"""A running bwrap sandbox, as the host sees it: the init's request channel (furlong.sandbox.runtime.protocol) and
the writable layer the host reads changes from. furlong.sandbox.runtime.bwrap starts them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from furlong.sandbox.base import ExecResult, SandboxDied, SandboxError, SandboxSpec, SnapshotRef, Usage
from furlong.sandbox.changes import Change, image_entry, overlay_changes
from furlong.sandbox.network import NO_NETWORK, NetworkPolicy
from furlong.sandbox.runtime import protocol as proto
from furlong.sandbox.runtime.netcontrol import NetworkControl
from furlong.sandbox.runtime.shell import wrap
from furlong.sandbox.runtime.snapshots import SnapshotStore
from furlong.sandbox.tarball import tar_dir
from furlong.timing import mark

log = logging.getLogger(__name__)
REPLY_GRACE_S = 5.0  # how long past a command's own timeout the host waits before calling the sandbox dead
OVERFLOW_UID = 65534  # what the kernel shows for a uid a namespace does not map


@dataclass(frozen=True)
class WritableLayer:
    """Where a sandbox's writes are: the tmpfs the launcher mounted at `mount` in its own mount namespace
    (the host reaches it through /proc/PID/root of the launcher, whose bwrap stays in that namespace),
    over the image's layers (`lowers`, host directories, top first) and a snapshot's, if it was restored."""

    mount: Path
    lowers: tuple[Path, ...]
    snapshot: tuple[Path, ...] = ()

    def changes(self, pid: int, roots: Sequence[str]) -> tuple[Change, ...] | None:
        """What the sandbox changed under `roots`, uids as the sandbox sees them; None if unreadable, and
        for a sandbox restored from a snapshot (its changes against the image are not merged yet)."""
        if self.snapshot:
            return None
        upper = self.upper(pid)
        try:
            uids = _uid_map(pid)
            before = os.stat(upper)
            found = overlay_changes(upper, self.lowers, roots)
            after = os.stat(upper)  # still the same directory: the launcher did not die (and its pid return)
        except OSError:
            return None
        if (before.st_dev, before.st_ino) != (after.st_dev, after.st_ino) or uids is None:
            return None
        return tuple(dataclasses.replace(c, uid=_inside(c.uid, uids)) for c in found)

    def upper(self, pid: int) -> Path:
        """The launcher's view of the tmpfs, or its first child's: pasta, first in a networked sandbox,
        moves itself to an empty root, and the shell it starts execs bwrap in the launcher's namespace."""
        for candidate in (pid, *_children(pid)):
            upper = Path(f"/proc/{candidate}/root{self.mount}/u")
            try:
                if upper.is_dir():
                    return upper
            except OSError:
                continue
        return Path(f"/proc/{pid}/root{self.mount}/u")  # gone: the walk then fails with OSError

    def image_has(self, paths: Sequence[str]) -> frozenset[str]:
        return frozenset(p for p in paths if image_entry(self.lowers, p.lstrip("/")) is not None)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _uid_map(pid: int) -> list[tuple[int, int, int]] | None:
    """The uid map of the sandbox's own user namespace, as (inside, outside, count) with outside in this
    process's view: its init's (pid 1 of the sandbox's pid namespace, along the launcher's first
    children), not a verifier command's, whose namespace maps otherwise."""
    current = pid
    for _ in range(6):  # launcher/bwrap, [pasta, sh, bwrap,] the init
        kids = _children(current)
        if not kids:
            return None
        current = kids[0]
        try:
            status = Path(f"/proc/{current}/status").read_text()
            nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
            if len(nspid) > 1 and nspid[-1] == "1":
                rows = Path(f"/proc/{current}/uid_map").read_text().split("\n")
                return [(int(a), int(b), int(n)) for a, b, n in (r.split() for r in rows if r.strip())]
        except (OSError, StopIteration):
            return None
    return None


def _inside(uid: int, uids: list[tuple[int, int, int]]) -> int:
    for inside, outside, count in uids:
        if outside <= uid < outside + count:
            return inside + uid - outside
    return OVERFLOW_UID


class Origin(Protocol):
    """The backend that made a sandbox, which restores its snapshots (furlong.sandbox.runtime.bwrap.BwrapBackend)."""

    @property
    def snapshots(self) -> SnapshotStore: ...

    async def create(self, spec: SandboxSpec, from_snapshot: SnapshotRef | None = None) -> BwrapSandbox: ...


@dataclass
class _Listener:
    """A streaming exec's caller: its callback, and the bytes each stream sent so far (checked against the cap)."""

    on_output: Callable[[str, bytes], None]
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(proto.STREAMS, 0))
    error: Exception | None = None  # what the callback raised: exec raises it once the command has ended


class BwrapSandbox:
    backend = "bwrap"  # what an episode's receipt names (furlong.tasks.receipt)

    def __init__(self, proc, cgroup, output_cap: int, lifetime_s: float, name: str, secret: bytes):
        self.name = name
        self._proc = proc
        self._cgroup = cgroup
        self._cap = output_cap
        self._secret = secret
        self._pending: dict[bytes, asyncio.Future] = {}
        self._listeners: dict[bytes, _Listener] = {}  # the streaming ones among the pending, until their reply
        self._stderr_tail = b""
        self._closed = False
        self._death: str | None = None
        self.scratch: Path | None = None  # a build's overlay work directory, removed at close
        self.finish: Callable[[], None] | None = None  # a build's last step on its layer, once bwrap is gone
        self.verifier_uid: int | None = None  # the uid `as_verifier` calls run as (inside); None: the agent's
        self.agent_uid = 0  # the uid agent calls run as (inside): the image's USER
        self.writes: WritableLayer | None = None  # None: its writes cannot be read on the host (a build)
        self.fixed_network: NetworkPolicy = NO_NETWORK  # its policy where it has no `network` control
        self.network: NetworkControl | None = (
            None  # a controlled sandbox's gate and phase (furlong.sandbox.runtime.netcontrol)
        )
        self.origin: tuple[Origin, SandboxSpec] | None = None  # None: it cannot be snapshotted (a build)
        self.restored: SnapshotRef | None = None  # the snapshot it was started from, leased until close
        self._paused = False
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_replies())
        self._err_reader = loop.create_task(self._read_stderr())
        self._expiry = loop.call_later(lifetime_s, lambda: loop.create_task(self.close()))

    @property
    def alive(self) -> bool:
        return not self._closed and self._death is None

    async def _read_stderr(self) -> None:
        while chunk := await self._proc.stderr.read(4096):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]

    async def _read_replies(self) -> None:
        out = self._proc.stdout
        try:
            while header := await _read_exact_or_eof(out, 4):
                n = int.from_bytes(header, "little")
                if n > proto.max_reply(self._cap):
                    raise proto.ProtocolError(f"reply frame of {n} bytes")
                reply = proto.parse_reply(await out.readexactly(n), self._secret)
                if isinstance(reply, proto.Chunk):
                    self._deliver(reply)
                    continue
                self._listeners.pop(reply.id, None)  # a chunk after its final reply is a violation
                fut = self._pending.pop(reply.id, None)
                if fut is None:
                    raise proto.ProtocolError("reply to no pending request")
                if not fut.done():
                    fut.set_result(reply)
        except (proto.ProtocolError, asyncio.IncompleteReadError) as exc:
            self._death = f"sandbox init broke its protocol: {exc}"
            self._kill()
        code = await self._proc.wait()
        await asyncio.sleep(0)  # let the stderr reader take the last words
        self._death = self._death or (
            "sandbox closed"
            if self._closed
            else f"sandbox process exited with code {code}: {self._stderr_tail.decode(errors='replace').strip()[-800:]}"
        )
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SandboxDied(self._death))
        self._pending.clear()
        self._listeners.clear()

    def _deliver(self, chunk: proto.Chunk) -> None:
        """Hands a chunk to its exec's callback, in the reader: so every chunk comes before its final reply."""
        listener, fut = self._listeners.get(chunk.id), self._pending.get(chunk.id)
        if listener is None or fut is None:
            raise proto.ProtocolError("chunk for no running streaming exec")
        listener.sent[chunk.stream] += len(chunk.data)
        if listener.sent[chunk.stream] > self._cap:
            raise proto.ProtocolError(f"{chunk.stream} chunks past the output cap of {self._cap} bytes")
        if fut.done() or listener.error is not None:
            return  # its caller stopped waiting, or its callback failed: checked, no longer delivered
        try:
            listener.on_output(chunk.stream, chunk.data)
        except Exception as exc:  # noqa: BLE001 -- the caller's fault, not the sandbox's: the reader goes on
            listener.error = exc

    async def _call(self, request, op: str, wait_s: float, listener: _Listener | None = None) -> proto.Reply:
        if self._death or self._closed:
            raise SandboxDied(self._death or "sandbox is closed")
        if self._paused:
            raise SandboxError(f"sandbox {self.name} is paused: resume() it before {op}")
        rid = proto.new_id()
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        if listener is not None:
            self._listeners[rid] = listener
        try:
            self._proc.stdin.write(request(rid))
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._pending.pop(rid, None)
            self._listeners.pop(rid, None)
            raise SandboxDied(f"sandbox stdin closed: {exc}") from exc
        try:
            reply = await asyncio.wait_for(fut, wait_s)
        except TimeoutError:
            self._pending.pop(rid, None)
            self._listeners.pop(rid, None)
            await self.close()
            raise SandboxDied(f"sandbox init did not answer {op!r} within {wait_s:.0f}s") from None
        if not reply.ok:
            raise SandboxError(f"{op} failed in sandbox: {reply.body.decode(errors='replace')}")
        return reply

    def _violation(self, exc: proto.ProtocolError) -> SandboxDied:
        self._death = f"sandbox init broke its protocol: {exc}"
        self._kill()
        return SandboxDied(self._death)

    async def exec(
        self,
        cmd: str,
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        as_verifier: bool = False,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecResult:
        """`on_output`: called with ("stdout" | "stderr", bytes) as the command writes, up to the output cap
        per stream; an exception it raises ends its calls and is raised here once the command has ended."""
        env = env or {}
        # the verifier never sources or saves the agent's shell state (its PATH, its cwd)
        script = wrap(cmd, "/" if as_verifier and cwd is None else cwd, env)
        role = _role(as_verifier)
        listener = None if on_output is None else _Listener(on_output)
        reply = await self._call(
            lambda rid: proto.exec_request(rid, script, env, timeout_s, self._cap, role, stream=listener is not None),
            "exec",
            timeout_s + REPLY_GRACE_S,
            listener,
        )
        try:
            r = proto.parse_exec(reply.body, self._cap)
        except proto.ProtocolError as exc:
            raise self._violation(exc) from None
        if listener is not None and listener.error is not None:
            raise listener.error
        return ExecResult(
            exit_code=r.exit_code,
            stdout=r.stdout.decode(errors="replace"),
            stderr=r.stderr.decode(errors="replace"),
            duration_s=r.duration_s,
            timed_out=r.timed_out,
            truncated=r.truncated,
        )

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, as_verifier: bool = False) -> None:
        raw = data.encode() if isinstance(data, str) else data
        role = _role(as_verifier)
        await self._call(lambda rid: proto.put_request(rid, [(1, mode, path, raw)], role), "write", 60.0)

    async def read_file(self, path: str, as_verifier: bool = False) -> bytes:
        role = _role(as_verifier)
        return (await self._call(lambda rid: proto.read_request(rid, path, role), "read", 60.0)).body

    async def put_dir(self, src: Path, dest: str, as_verifier: bool = False) -> None:
        await self.put_tar(tar_dir(Path(src)), dest, as_verifier)

    async def put_tar(self, data: bytes, dest: str, as_verifier: bool = False) -> None:
        entries = proto.tar_entries(data, dest)
        if not entries and dest.strip("/"):  # else `dest` is made with the members' parents, and one that
            entries = [(0, 0o755, "/" + dest.strip("/"), b"")]  # exists keeps its mode (/tests: 0700)
        role = _role(as_verifier)
        await self._call(lambda rid: proto.put_request(rid, entries, role), "put", 120.0)

    async def ping(self) -> int:
        reply = await self._call(proto.ping_request, "ping", 30.0)
        try:
            return proto.parse_ping(reply.body)
        except proto.ProtocolError as exc:
            raise self._violation(exc) from None

    async def changes(self, roots: Sequence[str]) -> tuple[Change, ...] | None:
        """What this sandbox changed in its image under `roots` (furlong.sandbox.changes), uids as seen
        inside; None where that cannot be read (a build sandbox, a closed or dead one)."""
        if self.writes is None or not self.alive:
            return None
        found = await asyncio.to_thread(self.writes.changes, self._proc.pid, roots)
        return found if self.alive else None

    async def image_has(self, paths: Sequence[str]) -> frozenset[str] | None:
        """Which of `paths` the sandbox's image holds (an entry of any type, no symlink followed)."""
        if self.writes is None:
            return None
        return await asyncio.to_thread(self.writes.image_has, paths)

    async def set_network(self, policy: NetworkPolicy, verifier_only: bool = False) -> None:
        """furlong.sandbox.base.NetworkSwitching: a controlled sandbox moves to `policy`; any other keeps the
        one it started with, and refuses another."""
        if self.network is None:
            if policy != self.fixed_network:
                raise SandboxError(
                    f"this sandbox started with network {self.fixed_network.describe()} and cannot "
                    f"switch to {policy.describe()}: name it in SandboxSpec.network_phases"
                )
            return
        if not self.alive:
            raise SandboxDied(self._death or "sandbox is closed")
        bwrap = _children(self._proc.pid)  # pasta's child: bwrap, in the sandbox's user and network namespaces
        if not bwrap:
            raise SandboxDied("the sandbox's network namespace is gone")
        await self.network.set(bwrap[0], policy, verifier_only)

    def _kill(self) -> None:
        if self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass

    @property
    def paused(self) -> bool:
        return self._paused

    async def pause(self) -> None:
        """furlong.sandbox.base.Snapshotting.pause: the cgroup freezer, v2 cgroup.freeze or v1 freezer.state."""
        if not self.alive:
            raise SandboxDied(self._death or "sandbox is closed")
        if self._pending:
            raise SandboxError(f"sandbox {self.name}: {len(self._pending)} calls running; pause once they return")
        if self._cgroup is None:
            raise SandboxError(f"sandbox {self.name} cannot be paused: it has no cgroup (rlimits only)")
        try:
            await asyncio.to_thread(self._cgroup.freeze, True)
        except OSError as exc:
            raise SandboxError(f"sandbox {self.name} cannot be paused: {exc}") from None
        self._paused = True

    async def resume(self) -> None:
        if not self.alive:
            raise SandboxDied(self._death or "sandbox is closed")
        if self._paused:
            assert self._cgroup is not None  # pause froze it
            await asyncio.to_thread(self._cgroup.freeze, False)
            self._paused = False

    async def snapshot(self) -> SnapshotRef:
        """furlong.sandbox.base.Snapshotting.snapshot; frozen during the copy where the sandbox can be."""
        if self.origin is None or self.writes is None:
            raise SandboxError(f"sandbox {self.name} cannot be snapshotted (a build sandbox)")
        backend, spec = self.origin
        frozen = not self._paused and self._cgroup is not None and not self._pending
        if frozen:
            await self.pause()
        try:
            if not self.alive:
                raise SandboxDied(self._death or "sandbox is closed")
            below = self.restored.layers if self.restored else ()
            upper = self.writes.upper(self._proc.pid)
            return await asyncio.to_thread(backend.snapshots.capture, upper, spec.image.digest, below)
        except OSError as exc:
            raise SandboxError(f"sandbox {self.name}: snapshot failed: {exc}") from None
        finally:
            if frozen:
                await self.resume()

    async def fork(self, n: int) -> list[BwrapSandbox]:
        """furlong.sandbox.base.Snapshotting.fork: a snapshot, restored `n` times with this sandbox's spec."""
        if n < 1:
            raise ValueError(f"fork: n must be at least 1, got {n}")
        ref = await self.snapshot()
        assert self.origin is not None  # snapshot() refused otherwise
        backend, spec = self.origin
        made = await asyncio.gather(
            *(backend.create(spec, from_snapshot=ref) for _ in range(n)), return_exceptions=True
        )
        failed = [m for m in made if isinstance(m, BaseException)]
        if failed:
            await asyncio.gather(*(m.close() for m in made if isinstance(m, BwrapSandbox)))
            raise failed[0]
        return [m for m in made if isinstance(m, BwrapSandbox)]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._expiry.cancel()
        if self._paused and self._cgroup is not None:  # a frozen process takes SIGKILL only once thawed
            self._paused = False
            try:
                await asyncio.to_thread(self._cgroup.freeze, False)
            except OSError as exc:  # the cgroup's removal below thaws it too
                log.warning("sandbox %s: thaw before close failed: %s", self.name, exc)
        t = time.perf_counter()  # its phases (furlong.timing.mark) for bench/sandbox_cold_start.py
        self._kill()
        if self.network is not None:
            await self.network.gate.close()
        t = mark("close_kill", t)
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
        t = mark("close_cgroup", t)
        try:  # the readers end at EOF, which the init's death brings; bounded all the same
            await asyncio.wait_for(
                asyncio.gather(self._proc.wait(), self._reader, self._err_reader, return_exceptions=True), 5.0
            )
        except TimeoutError:
            log.warning("sandbox %s: bwrap did not exit within 5 s of SIGKILL", self.name)
        mark("close_wait", t)
        if self.scratch is not None:
            await asyncio.to_thread(remove_tree, self.scratch)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            await asyncio.to_thread(finish)
        if self.restored is not None and self.origin is not None:
            self.origin[0].snapshots.release(self.restored)

    def usage(self) -> Usage | None:
        """furlong.sandbox.base.Metered: from the cgroup (CPU time of the processes alive now)."""
        if self._cgroup is None or self.origin is None or not self.alive:
            return None
        memory = self._cgroup.memory_bytes()
        if memory is None:
            return None
        return Usage(self._cgroup.cpu_seconds(), memory, self.origin[1].limits)

    def memory_peak_bytes(self) -> int | None:
        return self._cgroup.memory_peak_bytes() if self._cgroup else None


def _role(as_verifier: bool) -> int:
    return proto.VERIFIER if as_verifier else proto.AGENT


async def _read_exact_or_eof(stream: asyncio.StreamReader, n: int) -> bytes:
    """n bytes, or b"" at a clean end of stream (a partial read raises IncompleteReadError)."""
    try:
        return await stream.readexactly(n)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return b""


def remove_tree(path: Path) -> None:
    """Removes an overlay work directory, also as an ordinary user: the kernel leaves its work/work mode 000."""
    if os.geteuid() != 0:
        for dirpath, dirnames, _ in os.walk(path):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o700)
    shutil.rmtree(path, ignore_errors=True)
