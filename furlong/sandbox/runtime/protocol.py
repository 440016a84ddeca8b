"""The host side of the init's binary protocol (furlong/sandbox/runtime/native/init.c has the layouts).

Every reply must carry the per-sandbox secret and a pending request's random id, and its body must parse
exactly for that request's op: anything else is a protocol violation, which the sandbox treats as death.
Only the init ever saw the secret (it came over the init's stdin, which no agent process can open), so a
reply that passes is the init's. A streaming exec (OP_EXEC_STREAM) also gets chunk replies (status CHUNK)
before its final one; the sandbox checks they belong to a streaming request still running and stay under
its output cap.
"""

from __future__ import annotations

import hmac
import os
import struct
import tarfile
from dataclasses import dataclass

SECRET_LEN, ID_LEN = 32, 16
OP_EXEC, OP_READ, OP_PUT, OP_PING, OP_EXEC_STREAM = 1, 2, 3, 4, 5
OK, ERROR, CHUNK = 0, 1, 2  # reply statuses
STREAMS = ("stdout", "stderr")  # a chunk's stream byte indexes this
AGENT, VERIFIER = 0, 1  # the role a request runs as (init.c: identities)
HEADER = SECRET_LEN + ID_LEN + 1
READ_MAX = 256 << 20  # the init refuses larger files
FRAME_SLACK = 1 << 16


class ProtocolError(Exception):
    """A reply that the init could not have sent: the sandbox is no longer trusted."""


@dataclass(frozen=True)
class Reply:
    id: bytes
    ok: bool
    body: bytes


@dataclass(frozen=True)
class Chunk:
    """Output a streaming exec's command wrote while it ran (never empty)."""

    id: bytes
    stream: str  # "stdout" | "stderr"
    data: bytes


def new_secret() -> bytes:
    return os.urandom(SECRET_LEN)


def new_id() -> bytes:
    return os.urandom(ID_LEN)


def frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _str(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _head(rid: bytes, op: int, role: int) -> bytes:
    return rid + bytes([op, role])


def exec_request(
    rid: bytes, script: str, env: dict[str, str], timeout_s: float, cap: int, role: int = AGENT, stream: bool = False
) -> bytes:
    """`stream`: OP_EXEC_STREAM, whose chunks come before the final reply; else OP_EXEC, the same body."""
    blob = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())
    timeout_ms = max(1, min(int(timeout_s * 1000), 0xFFFFFFFF))
    body = struct.pack("<II", timeout_ms, cap) + _str(script.encode()) + _str(blob)
    return frame(_head(rid, OP_EXEC_STREAM if stream else OP_EXEC, role) + body)


def read_request(rid: bytes, path: str, role: int = AGENT) -> bytes:
    return frame(_head(rid, OP_READ, role) + _str(path.encode()))


def ping_request(rid: bytes) -> bytes:
    return frame(_head(rid, OP_PING, AGENT))


def put_request(rid: bytes, entries: list[tuple[int, int, str, bytes]], role: int = AGENT) -> bytes:
    """entries: (kind 0 dir | 1 file | 2 symlink, mode, absolute path, data or link target)."""
    parts = [_head(rid, OP_PUT, role)]
    for kind, mode, path, data in entries:
        parts += [struct.pack("<BI", kind, mode & 0o7777), _str(path.encode()), _str(data)]
    return frame(b"".join(parts))


def tar_entries(data: bytes, dest: str) -> list[tuple[int, int, str, bytes]]:
    """An uncompressed tar's members as put entries under dest; members that would land outside dest are
    refused. A compressed tar is refused too: its body's size would not bound what it expands to."""
    import io

    out = []
    root = "/" + dest.strip("/") if dest.strip("/") else ""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for m in tar.getmembers():
            name = os.path.normpath(m.name).lstrip("/")
            if name in (".", ""):
                continue
            if name.startswith(".."):
                raise ValueError(f"tar member {m.name!r} points outside {dest}")
            path = f"{root}/{name}"
            if m.isdir():
                out.append((0, m.mode, path, b""))
            elif m.isfile():
                out.append((1, m.mode, path, tar.extractfile(m).read()))  # type: ignore[union-attr]  # a regular file
            elif m.issym():
                out.append((2, 0o777, path, m.linkname.encode()))
            else:
                raise ValueError(f"tar member {m.name!r}: only files, directories and symlinks can be copied in")
    return out


def parse_reply(payload: bytes, secret: bytes) -> Reply | Chunk:
    if len(payload) < HEADER:
        raise ProtocolError(f"reply of {len(payload)} bytes is shorter than its header")
    if not hmac.compare_digest(payload[:SECRET_LEN], secret):
        raise ProtocolError("reply without the sandbox's secret")
    rid, status, body = payload[SECRET_LEN : SECRET_LEN + ID_LEN], payload[SECRET_LEN + ID_LEN], payload[HEADER:]
    if status == CHUNK:
        return _chunk(rid, body)
    if status not in (OK, ERROR):
        raise ProtocolError(f"reply status {status} is none of 0 (ok), 1 (error), 2 (chunk)")
    return Reply(id=rid, ok=status == OK, body=body)


def _chunk(rid: bytes, body: bytes) -> Chunk:
    if len(body) < 2:
        raise ProtocolError(f"chunk of {len(body)} bytes: expected a stream byte and data")
    if body[0] >= len(STREAMS):
        raise ProtocolError(f"chunk for stream {body[0]}, expected 0 (stdout) or 1 (stderr)")
    return Chunk(id=rid, stream=STREAMS[body[0]], data=body[1:])


def max_reply(cap: int) -> int:
    """The largest frame an honest init sends for a command whose output cap is `cap` (or a read)."""
    return HEADER + max(2 * cap, READ_MAX) + FRAME_SLACK


@dataclass(frozen=True)
class ExecReply:
    exit_code: int
    timed_out: bool
    truncated: bool
    duration_s: float
    stdout: bytes
    stderr: bytes


def parse_exec(body: bytes, cap: int) -> ExecReply:
    fixed = struct.calcsize("<iBBQ")
    if len(body) < fixed:
        raise ProtocolError("exec reply too short")
    code, timed_out, truncated, ns = struct.unpack_from("<iBBQ", body)
    if timed_out > 1 or truncated > 1 or not -1 <= code <= 255 + 128:
        raise ProtocolError(f"exec reply out of range: exit {code}, flags {timed_out}/{truncated}")
    streams, at = [], fixed
    for name in ("stdout", "stderr"):
        if len(body) < at + 4:
            raise ProtocolError(f"exec reply has no {name}")
        (n,) = struct.unpack_from("<I", body, at)
        if n > cap + 256 or len(body) < at + 4 + n:
            raise ProtocolError(f"exec reply {name} of {n} bytes exceeds its cap or the frame")
        streams.append(body[at + 4 : at + 4 + n])
        at += 4 + n
    if at != len(body):
        raise ProtocolError(f"exec reply has {len(body) - at} trailing bytes")
    return ExecReply(code, bool(timed_out), bool(truncated), ns / 1e9, streams[0], streams[1])


def parse_ping(body: bytes) -> int:
    if len(body) != 4:
        raise ProtocolError(f"ping reply of {len(body)} bytes, expected 4")
    return struct.unpack("<I", body)[0]
