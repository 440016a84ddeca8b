"""envd's directory watchers (filesystem.Filesystem's CreateWatcher, GetWatcherEvents, RemoveWatcher, and
the streaming WatchDir): a listing of the directory, taken inside the sandbox as its agent every POLL_S
seconds, compared with the one before. Polling rather than inotify: the sandbox's image need not carry
inotify-tools, and nothing of the host watches the sandbox's files. So an entry created and removed
between two listings is not seen, several writes between two are one WRITE, a rename is a REMOVE and a
CREATE, and a write that changes neither size nor mtime (nanoseconds) is not seen (docs/e2b.md)."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb

from furlong.sandbox import listing
from furlong.sandbox.base import Sandbox, SandboxError, Snapshotting

POLL_S = 0.2
MAX_PENDING = 10_000  # events kept for a client that does not collect them; past it, later ones are dropped
State = dict[str, tuple[str, int, int, float]]  # name (relative to the watched directory) -> type, mode, size, mtime


async def snapshot(box: Sandbox, path: str, recursive: bool) -> State:
    """The directory's entries now, read by find as the agent. cwd="/": the agent's shell state is left alone."""
    depth = "-mindepth 1" if recursive else "-mindepth 1 -maxdepth 1"
    q = shlex.quote(path)
    res = await box.exec(
        f"test -d {q} || {{ echo 'No such directory' >&2; exit 2; }}; find {q} {depth} -printf '{listing.FORMAT}'",
        cwd=listing.OUTSIDE_SHELL_STATE,
        timeout_s=30,
    )
    if res.exit_code != 0:
        err = res.stderr.strip() or "failed"
        raise ConnectError(Code.NOT_FOUND if "No such" in err else Code.INVALID_ARGUMENT, f"{path}: {err}")
    if res.truncated:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, f"{path}: too many entries to watch")
    root = path.rstrip("/") + "/"
    return {e.path.removeprefix(root): (e.type, e.mode, e.size, e.mtime) for e in listing.parse(res.stdout)}


def changes(before: State, after: State) -> list[pb.FilesystemEvent]:
    """What turned `before` into `after`: removals, then creations, then writes and mode changes (a
    directory's own mtime moves with its entries: no WRITE for it, as inotify gives none)."""
    events = [pb.FilesystemEvent(name=n, type=pb.EventType.REMOVE) for n in sorted(before.keys() - after.keys())]
    events += [pb.FilesystemEvent(name=n, type=pb.EventType.CREATE) for n in sorted(after.keys() - before.keys())]
    for name in sorted(after.keys() & before.keys()):
        (kind, mode, size, mtime), (_, mode0, size0, mtime0) = after[name], before[name]
        if kind != "dir" and (size, mtime) != (size0, mtime0):
            events.append(pb.FilesystemEvent(name=name, type=pb.EventType.WRITE))
        elif mode != mode0:
            events.append(pb.FilesystemEvent(name=name, type=pb.EventType.CHMOD))
    return events


class Watcher:
    """One watched directory: its last listing, the events not yet collected, and the task polling it."""

    def __init__(self, box: Sandbox, sandbox_id: str, path: str, recursive: bool, seen: State) -> None:
        self.box, self.sandbox_id, self.path, self.recursive = box, sandbox_id, path, recursive
        self.seen = seen
        self.pending: asyncio.Queue[pb.FilesystemEvent] = asyncio.Queue(MAX_PENDING)
        self.error: ConnectError | None = None  # why it stopped (the directory or the sandbox went)
        self.task: asyncio.Task[None] | None = None

    def start(self, forget: Callable[[], object]) -> None:
        self.task = asyncio.create_task(self._poll(forget))

    async def _poll(self, forget: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if isinstance(self.box, Snapshotting) and self.box.paused:
                continue  # frozen: nothing changes, and a listing would wait for the thaw
            try:
                now = await snapshot(self.box, self.path, self.recursive)
            except ConnectError as e:
                self.error = e
                return
            except SandboxError as e:  # closed or dead: nothing more to watch
                self.error = ConnectError(Code.NOT_FOUND, f"{self.path}: {e}")
                forget()
                return
            for event in changes(self.seen, now):
                if not self.pending.full():
                    self.pending.put_nowait(event)
            self.seen = now

    def drain(self) -> list[pb.FilesystemEvent]:
        """The events since the last drain; once it has stopped and they are all given, why it stopped."""
        events = []
        while not self.pending.empty():
            events.append(self.pending.get_nowait())
        if not events and self.error is not None:
            raise self.error
        return events

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
