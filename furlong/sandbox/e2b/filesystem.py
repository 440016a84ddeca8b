"""envd's `filesystem.Filesystem` service (Connect-RPC, through the SDK's generated server class): Stat,
ListDir, MakeDir, Remove and Move, each done by GNU coreutils/findutils inside the sandbox as its agent, so
what the SDK sees is what the agent could see; and directory watchers (furlong.sandbox.e2b.watch)."""

from __future__ import annotations

import asyncio
import secrets
import shlex
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import Filesystem, FilesystemASGIApplication
from protobuf import Oneof
from protobuf.wkt import Timestamp

from furlong.sandbox import listing
from furlong.sandbox.base import Sandbox, SandboxError
from furlong.sandbox.e2b.envd import Lookup, sandbox_of
from furlong.sandbox.e2b.watch import Watcher, snapshot

KEEPALIVE_S = 1.0  # a WatchDir stream's idle gap before a keepalive
MAX_WATCHERS = 8  # a sandbox's at once: each lists its directory five times a second
TYPES = {"file": pb.FileType.FILE, "dir": pb.FileType.DIRECTORY, "symlink": pb.FileType.SYMLINK}


def _info(e: listing.Entry) -> pb.EntryInfo:
    return pb.EntryInfo(
        name=e.name,
        type=TYPES.get(e.type, pb.FileType.UNSPECIFIED),
        path=e.path,
        size=e.size,
        mode=e.mode,
        permissions=e.permissions,
        owner=e.owner,
        group=e.group,
        modified_time=Timestamp.from_nanos(int(e.mtime * 1e9)),
        symlink_target=e.target,
        is_symlink=e.type == "symlink",
    )


def _code(err: str) -> Code:
    return (
        Code.NOT_FOUND
        if "No such file" in err
        else Code.ALREADY_EXISTS
        if "File exists" in err
        else Code.PERMISSION_DENIED
        if "Permission denied" in err
        else Code.INVALID_ARGUMENT
    )


async def _run(box: Sandbox, cmd: str, path: str) -> str:
    res = await box.exec(cmd, timeout_s=30, cwd=listing.OUTSIDE_SHELL_STATE)  # as a listing: the state untouched
    if res.exit_code == 0:
        return res.stdout
    err = res.stderr.strip()
    raise ConnectError(_code(err), f"{path}: {err or 'failed'}")


async def _stat(box: Sandbox, path: str) -> pb.EntryInfo:
    try:
        return _info(await listing.stat(box, path))
    except SandboxError as e:
        raise ConnectError(_code(str(e)), str(e)) from None


class Files(Filesystem):
    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup
        self._watchers: dict[str, Watcher] = {}

    async def stat(self, request: pb.StatRequest, ctx: Any) -> pb.StatResponse:
        return pb.StatResponse(entry=await _stat(await sandbox_of(self._lookup, ctx), request.path))

    async def list_dir(self, request: pb.ListDirRequest, ctx: Any) -> pb.ListDirResponse:
        box, path = await sandbox_of(self._lookup, ctx), request.path
        try:
            found = await listing.list_dir(box, path, request.depth)
        except SandboxError as e:
            raise ConnectError(_code(str(e)), str(e)) from None
        return pb.ListDirResponse(entries=[_info(e) for e in found])

    async def make_dir(self, request: pb.MakeDirRequest, ctx: Any) -> pb.MakeDirResponse:
        box, path = await sandbox_of(self._lookup, ctx), request.path
        q = shlex.quote(path)
        await _run(box, f"if test -e {q}; then echo 'File exists' >&2; exit 1; fi; mkdir -p -- {q}", path)
        return pb.MakeDirResponse(entry=await _stat(box, path))

    async def remove(self, request: pb.RemoveRequest, ctx: Any) -> pb.RemoveResponse:
        box, path = await sandbox_of(self._lookup, ctx), request.path
        await _stat(box, path)  # NOT_FOUND for a missing path, as envd answers
        await _run(box, f"rm -rf -- {shlex.quote(path)}", path)
        return pb.RemoveResponse()

    async def move(self, request: pb.MoveRequest, ctx: Any) -> pb.MoveResponse:
        box = await sandbox_of(self._lookup, ctx)
        src, dst = request.source, request.destination
        q_src, q_dst = shlex.quote(src), shlex.quote(dst)
        await _run(box, f'mkdir -p -- "$(dirname -- {q_dst})" && mv -T -- {q_src} {q_dst}', src)
        return pb.MoveResponse(entry=await _stat(box, dst))

    async def _watch(self, path: str, recursive: bool, ctx: Any) -> tuple[str, Watcher]:
        """A new watcher of `path` in the caller's sandbox, polling from now, and its id."""
        box = await sandbox_of(self._lookup, ctx)
        sid = ctx.request_headers.get("e2b-sandbox-id", "")
        if sum(w.sandbox_id == sid for w in self._watchers.values()) >= MAX_WATCHERS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS} watchers a sandbox")
        watcher = Watcher(box, sid, path, recursive, await snapshot(box, path, recursive))
        wid = secrets.token_hex(8)
        self._watchers[wid] = watcher
        watcher.start(lambda: self._watchers.pop(wid, None))
        return wid, watcher

    async def _watcher(self, wid: str, ctx: Any) -> Watcher:
        await sandbox_of(self._lookup, ctx)
        watcher = self._watchers.get(wid)
        if watcher is None or watcher.sandbox_id != ctx.request_headers.get("e2b-sandbox-id", ""):
            raise ConnectError(Code.NOT_FOUND, f"watcher {wid!r}: no such watcher in this sandbox")
        return watcher

    async def create_watcher(self, request: pb.CreateWatcherRequest, ctx: Any) -> pb.CreateWatcherResponse:
        wid, _ = await self._watch(request.path, request.recursive, ctx)
        return pb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(self, request: pb.GetWatcherEventsRequest, ctx: Any) -> pb.GetWatcherEventsResponse:
        return pb.GetWatcherEventsResponse(events=(await self._watcher(request.watcher_id, ctx)).drain())

    async def remove_watcher(self, request: pb.RemoveWatcherRequest, ctx: Any) -> pb.RemoveWatcherResponse:
        (await self._watcher(request.watcher_id, ctx)).stop()
        self._watchers.pop(request.watcher_id, None)
        return pb.RemoveWatcherResponse()

    async def watch_dir(self, request: pb.WatchDirRequest, ctx: Any) -> AsyncIterator[pb.WatchDirResponse]:
        """The streaming form (the async SDK's): a start event, then each event as a listing finds it."""
        wid, watcher = await self._watch(request.path, request.recursive, ctx)
        try:
            yield pb.WatchDirResponse(event=Oneof("start", pb.WatchDirResponse.StartEvent()))  # type: ignore[arg-type]
            while watcher.error is None or not watcher.pending.empty():
                try:
                    event = await asyncio.wait_for(watcher.pending.get(), timeout=KEEPALIVE_S)
                except TimeoutError:  # a keepalive: writing it is how a client that left is noticed
                    yield pb.WatchDirResponse(event=Oneof("keepalive", pb.WatchDirResponse.KeepAlive()))  # type: ignore[arg-type]
                    continue
                yield pb.WatchDirResponse(event=Oneof("filesystem", event))  # type: ignore[arg-type]
            raise watcher.error
        finally:
            watcher.stop()
            self._watchers.pop(wid, None)


def filesystem_app(lookup: Lookup) -> FilesystemASGIApplication:
    return FilesystemASGIApplication(Files(lookup))
