"""Where published weight updates live between the trainer and the engines' relays.

A transport stores opaque payloads (furlong.sync.update framing) by version; it never decodes
them: integrity is the payload digest's job, checked by whoever applies it. Versions are
immutable and strictly increasing; one publisher writes, any number of relays read.

* `InProcessTransport`: a dict, for tests and single-process runs.
* `DirectoryTransport`: one file per version on a local or shared filesystem (NFS, an
  object-store mount). Files are written under a hidden temp name, fsynced, renamed to their
  final name, and the directory is fsynced; only then is the `LATEST` pointer replaced the
  same way. Readers take no locks: every name they look at is a complete file.
* `UpdateServer` + `HttpTransport`: a small HTTP server over a DirectoryTransport (read-only
  but for the full-snapshot request flag) and its streaming client, for engines on hosts that
  do not share the trainer's filesystem. Standard library only (http.server, urllib).

One flag flows upstream: a relay that cannot follow the delta chain calls `request_full()`;
the publisher's next `take_full_request()` sees (and clears) it and publishes a snapshot.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol, Self

from furlong.sync.errors import SyncError
from furlong.sync.update import KINDS

Payload = bytes | bytearray


class TransportError(SyncError):
    """The transport could not store or deliver an update (I/O, network, protocol)."""


class UpdateNotFound(TransportError):
    """The requested version is not (or no longer) stored: never published, or pruned."""


class Transport(Protocol):
    def put(self, version: int, kind: str, payload: bytes | memoryview) -> None: ...  # publisher only; keeps no view
    def latest(self) -> int | None: ...  # newest complete version; None before the first
    def get(self, version: int) -> Payload: ...  # raises UpdateNotFound
    def latest_full_at_or_before(self, version: int) -> int | None: ...
    def request_full(self) -> None: ...  # relay -> publisher: "send a snapshot next"
    def take_full_request(self) -> bool: ...  # publisher: was one asked for? (clears it)


def check_put(version: int, kind: str, latest: int | None) -> None:
    """Shared put() preconditions: a known kind and a strictly newer version."""
    if kind not in KINDS:
        raise ValueError(f"unknown update kind {kind!r}; expected one of {KINDS}")
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if latest is not None and version <= latest:
        # Versions are immutable: re-publishing one would let readers mix two different payloads.
        raise TransportError(f"version {version} is not newer than the latest published {latest}")


class InProcessTransport:
    """Updates in a dict; safe to share between the publisher's and the relays' threads."""

    def __init__(self) -> None:
        self._updates: dict[int, tuple[str, bytes]] = {}
        self._lock = threading.Lock()
        self._want_full = False

    def put(self, version: int, kind: str, payload: bytes | memoryview) -> None:
        with self._lock:
            check_put(version, kind, max(self._updates, default=None))
            self._updates[version] = (kind, bytes(payload))

    def latest(self) -> int | None:
        with self._lock:
            return max(self._updates, default=None)

    def get(self, version: int) -> Payload:
        with self._lock:
            if version not in self._updates:
                raise UpdateNotFound(f"update v{version} is not stored")
            return self._updates[version][1]

    def latest_full_at_or_before(self, version: int) -> int | None:
        with self._lock:
            fulls = [v for v, (k, _) in self._updates.items() if k == "full" and v <= version]
        return max(fulls, default=None)

    def request_full(self) -> None:
        self._want_full = True

    def take_full_request(self) -> bool:
        with self._lock:
            wanted, self._want_full = self._want_full, False
        return wanted


# v00000042.delta.fwu: zero-padded so names sort by version; readers match this exactly, so temp
# files (leading dot) and anything else in the directory are invisible to them.
_NAME = re.compile(r"^v(\d{12})\.(full|delta|adapter)\.fwu$")
LATEST = "LATEST"
WANT_FULL = "WANT_FULL"
_TMP_PREFIX = ".tmp-"


def update_name(version: int, kind: str) -> str:
    return f"v{version:012d}.{kind}.fwu"


class DirectoryTransport:
    """Versioned, atomically published update files in `root` (see the module doc).

    `keep`: if set, prune() runs after every full snapshot is published, keeping that many
    versions before it. Single writer: two publishers on one directory are not coordinated.
    """

    def __init__(self, root: Path | str, *, keep: int | None = None, fsync: bool = True) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.fsync = fsync  # off only for throwaway directories (tests): durability, not atomicity

    def put(self, version: int, kind: str, payload: bytes | memoryview) -> None:
        listed = self.listing()  # not LATEST: a crash may have left a newer file behind it
        check_put(version, kind, listed[-1][0] if listed else None)
        self._write_atomic(update_name(version, kind), payload)
        # The pointer moves only once the file it names is complete and durable.
        self._write_atomic(LATEST, f"{version} {kind}\n".encode())
        if kind == "full" and self.keep is not None:
            self.prune(self.keep)

    def latest(self) -> int | None:
        try:
            text = (self.root / LATEST).read_text()
        except FileNotFoundError:
            return None
        try:
            return int(text.split()[0])
        except (IndexError, ValueError) as e:
            raise TransportError(f"{self.root / LATEST}: unreadable pointer {text!r}") from e

    def get(self, version: int) -> Payload:
        path = self.path_of(version)
        try:
            return path.read_bytes()
        except FileNotFoundError as e:  # pruned between lookup and read
            raise UpdateNotFound(f"{path}: pruned while being read") from e
        except OSError as e:
            raise TransportError(f"{path}: {e}") from e

    def path_of(self, version: int) -> Path:
        """The file holding `version` (one lookup per kind: no directory listing needed)."""
        for kind in KINDS:
            path = self.root / update_name(version, kind)
            if path.is_file():
                return path
        raise UpdateNotFound(f"update v{version} is not in {self.root} (never published or pruned)")

    def latest_full_at_or_before(self, version: int) -> int | None:
        fulls = [v for v, k in self.listing() if k == "full" and v <= version]
        return max(fulls, default=None)

    def listing(self) -> list[tuple[int, str]]:
        """(version, kind) of every complete update file, oldest first."""
        matches = (_NAME.match(entry.name) for entry in os.scandir(self.root))
        return sorted((int(m.group(1)), m.group(2)) for m in matches if m)

    def request_full(self) -> None:
        (self.root / WANT_FULL).touch()

    def take_full_request(self) -> bool:
        try:
            (self.root / WANT_FULL).unlink()
            return True
        except FileNotFoundError:
            return False

    def prune(self, keep: int = 0, *, temp_age_s: float = 3600.0) -> list[str]:
        """Delete updates older than the newest full snapshot, except the `keep` newest of those.

        Nothing at or after the newest full is ever deleted: a relay can always rebuild the
        latest version from it. Also deletes temp files older than `temp_age_s` (left by a
        writer that crashed mid-put). A reader that loses a file it was about to read gets
        UpdateNotFound and falls back to the full snapshot. Returns the deleted names."""
        listed = self.listing()
        fulls = [v for v, k in listed if k == "full"]
        older = [(v, k) for v, k in listed if fulls and v < fulls[-1]]
        doomed = [update_name(v, k) for v, k in older[: max(0, len(older) - keep)]]
        now = time.time()
        for entry in os.scandir(self.root):
            if entry.name.startswith(_TMP_PREFIX) and now - entry.stat().st_mtime > temp_age_s:
                doomed.append(entry.name)
        for name in doomed:
            (self.root / name).unlink(missing_ok=True)
        return doomed

    def _write_atomic(self, name: str, data: bytes | memoryview) -> None:
        """Write `data` to root/name so that readers see either nothing or all of it."""
        tmp = self.root / f"{_TMP_PREFIX}{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.root / name)  # atomic on POSIX filesystems
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync_dir(self.root)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable. Some network filesystems refuse fsync on directories; there the
    rename is as durable as that filesystem makes it, and atomicity does not depend on it."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class UpdateServer:
    """Serves a DirectoryTransport over HTTP from a background thread.

    GET /latest, GET /latest-full?at_or_before=N -> {"version": int | null};
    GET /updates/{version} -> the payload (X-Furlong-Kind header), streamed from disk;
    POST /want-full -> 204 (a relay asking the publisher for a snapshot).
    No authentication: bind to 127.0.0.1 or a private cluster network only."""

    def __init__(self, directory: DirectoryTransport, host: str = "127.0.0.1", port: int = 0):
        self.directory = directory
        self._httpd = ThreadingHTTPServer((host, port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.directory = directory  # type: ignore[attr-defined]  # read by _Handler
        self._thread = threading.Thread(  # short poll: close() waits up to one interval
            target=self._httpd.serve_forever, args=(0.05,), name="furlong-update-server",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a relay pulls several versions per sync

    def do_GET(self) -> None:
        directory: DirectoryTransport = self.server.directory  # type: ignore[attr-defined]
        url = urllib.parse.urlsplit(self.path)
        path, query = url.path, urllib.parse.parse_qs(url.query)
        try:
            if path == "/latest":
                self._json({"version": directory.latest()})
            elif path == "/latest-full":
                bound = int(query.get("at_or_before", [str(2**62)])[0])
                self._json({"version": directory.latest_full_at_or_before(bound)})
            elif path.startswith("/updates/"):
                self._send_update(directory, int(path.removeprefix("/updates/")))
            else:
                self.send_error(404, f"no route {path}")
        except ValueError as e:
            self.send_error(400, str(e))
        except UpdateNotFound as e:
            self.send_error(404, str(e))
        except TransportError as e:  # e.g. an unreadable LATEST pointer
            self.send_error(500, str(e))

    def do_POST(self) -> None:
        if self.path != "/want-full":
            self.send_error(404, f"no route {self.path}")
            return
        self.server.directory.request_full()  # type: ignore[attr-defined]
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send_update(self, directory: DirectoryTransport, version: int) -> None:
        path = directory.path_of(version)
        try:  # an open file survives a concurrent prune
            f = open(path, "rb")  # noqa: SIM115 - closed by the with below, after the 404 case
        except FileNotFoundError as e:
            raise UpdateNotFound(f"{path}: pruned") from e
        with f:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
            self.send_header("X-Furlong-Kind", path.name.split(".")[1])
            self.end_headers()
            shutil.copyfileobj(f, self.wfile, 1 << 20)

    def _json(self, obj: dict[str, Any]) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request on stderr would drown the trainer's logs


class HttpTransport:
    """Client of an UpdateServer; payloads stream into one preallocated buffer.

    Read-only: the publisher writes the served directory directly. Environment proxies are
    ignored on purpose: the server is on the cluster network, never behind a web proxy."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0, chunk: int = 1 << 20) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.chunk = chunk
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def put(self, version: int, kind: str, payload: bytes | memoryview) -> None:
        raise TransportError("HttpTransport is read-only: publish into the served directory")

    def latest(self) -> int | None:
        return self._json("/latest")["version"]

    def latest_full_at_or_before(self, version: int) -> int | None:
        return self._json(f"/latest-full?at_or_before={int(version)}")["version"]

    def get(self, version: int) -> Payload:
        with self._open(f"/updates/{int(version)}") as resp:
            return self._read_body(resp, f"v{version}")

    def request_full(self) -> None:
        with self._open("/want-full", method="POST"):
            pass

    def take_full_request(self) -> bool:
        raise TransportError("HttpTransport is read-only: the publisher polls the directory")

    def _read_body(self, resp: http.client.HTTPResponse, what: str) -> Payload:
        length = resp.getheader("Content-Length")
        if length is None:
            raise TransportError(f"{what}: server sent no Content-Length")
        buf = bytearray(int(length))
        view, got = memoryview(buf), 0
        try:
            while got < len(buf):
                n = resp.readinto(view[got : got + self.chunk])
                if not n:
                    break
                got += n
        except (OSError, http.client.HTTPException) as e:
            raise TransportError(f"{what}: transfer failed after {got} bytes: {e!r}") from e
        if got != len(buf):
            raise TransportError(f"{what}: connection closed after {got} of {len(buf)} bytes")
        return buf

    def _json(self, route: str) -> dict[str, Any]:
        with self._open(route) as resp:
            try:
                return dict(json.loads(self._read_body(resp, route)))
            except ValueError as e:
                raise TransportError(f"{route}: bad JSON from server: {e}") from e

    def _open(self, route: str, method: str = "GET") -> http.client.HTTPResponse:
        req = urllib.request.Request(self.base_url + route, method=method)
        try:
            return self._opener.open(req, timeout=self.timeout_s)  # type: ignore[no-any-return]
        except urllib.error.HTTPError as e:
            if e.code == 404 and route.startswith("/updates/"):
                raise UpdateNotFound(f"{route}: {e.reason}") from e
            raise TransportError(f"{self.base_url}{route}: HTTP {e.code} {e.reason}") from e
        except (OSError, http.client.HTTPException) as e:
            raise TransportError(f"{self.base_url}{route}: {e!r}") from e
