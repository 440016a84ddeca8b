"""envd's `filesystem.Filesystem` service (Connect-RPC, through the SDK's generated server class): Stat,
ListDir, MakeDir, Remove and Move, each done by GNU coreutils/findutils inside the sandbox as its agent, so
what the SDK sees is what the agent could see. Watching is refused as unimplemented."""

from __future__ import annotations

import shlex
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as pb
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from protobuf.wkt import Timestamp

from furlong.sandbox.base import Sandbox
from furlong.sandbox.e2b.envd import Lookup, sandbox_of, unsupported

FORMAT = r"%f\0%y\0%p\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0"  # find -printf: one entry, ten fields
TYPES = {"f": pb.FileType.FILE, "d": pb.FileType.DIRECTORY, "l": pb.FileType.SYMLINK}


def _entries(out: str) -> list[pb.EntryInfo]:
    fields = out.split("\0")[:-1]
    entries = []
    for i in range(0, len(fields) - 9, 10):
        name, kind, path, size, mode, perms, owner, group, mtime, target = fields[i:i + 10]
        entries.append(pb.EntryInfo(
            name=name, type=TYPES.get(kind, pb.FileType.UNSPECIFIED), path=path, size=int(size),
            mode=int(mode, 8), permissions=perms, owner=owner, group=group,
            modified_time=Timestamp.from_nanos(int(float(mtime) * 1e9)),
            symlink_target=target or None, is_symlink=kind == "l"))
    return entries


async def _run(box: Sandbox, cmd: str, path: str) -> str:
    res = await box.exec(cmd, timeout_s=30)
    if res.exit_code == 0:
        return res.stdout
    err = res.stderr.strip()
    code = (Code.NOT_FOUND if "No such file" in err else Code.ALREADY_EXISTS if "File exists" in err
            else Code.PERMISSION_DENIED if "Permission denied" in err else Code.INVALID_ARGUMENT)
    raise ConnectError(code, f"{path}: {err or 'failed'}")


async def _stat(box: Sandbox, path: str) -> pb.EntryInfo:
    found = _entries(await _run(box, f"find {shlex.quote(path)} -maxdepth 0 -printf '{FORMAT}'", path))
    if not found:
        raise ConnectError(Code.NOT_FOUND, f"{path}: no such file or directory")
    return found[0]


class Files:
    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup

    async def stat(self, request: pb.StatRequest, ctx: Any) -> pb.StatResponse:
        return pb.StatResponse(entry=await _stat(await sandbox_of(self._lookup, ctx), request.path))

    async def list_dir(self, request: pb.ListDirRequest, ctx: Any) -> pb.ListDirResponse:
        box, path = await sandbox_of(self._lookup, ctx), request.path
        if (await _stat(box, path)).type != pb.FileType.DIRECTORY:
            raise ConnectError(Code.INVALID_ARGUMENT, f"{path}: not a directory")
        cmd = f"find {shlex.quote(path)} -mindepth 1 -maxdepth {max(1, request.depth)} -printf '{FORMAT}'"
        return pb.ListDirResponse(entries=_entries(await _run(box, cmd, path)))

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

    def __getattr__(self, name: str) -> Any:  # watch_dir, create_watcher, ...
        return unsupported("filesystem.Filesystem", name)


def filesystem_app(lookup: Lookup) -> FilesystemASGIApplication:
    return FilesystemASGIApplication(Files(lookup))
