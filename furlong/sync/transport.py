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
  but for the full-snapshot request flag) and its streaming, retrying client, for engines on
  hosts that do not share the trainer's filesystem. FastAPI on uvicorn and httpx, like the
  engine server and its clients (furlong.sync.serving); retries are tenacity's.

One flag flows upstream: a relay that cannot follow the delta chain calls `request_full()`;
the publisher's next `take_full_request()` sees (and clears) it and publishes a snapshot.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn, Protocol, Self, TypeVar

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from furlong.sync.errors import SyncError
from furlong.sync.serving import CLIENT_KEEPALIVE_S, BackgroundServer, guarded_app
from furlong.sync.update import KINDS

UPDATES_TOKEN_ENV = "FURLONG_UPDATES_TOKEN"  # an engine server's bearer token for its --updates URL

if TYPE_CHECKING:
    from fastapi import FastAPI

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
    """Serves a DirectoryTransport over HTTP (FastAPI on uvicorn) from a background thread.

    GET /latest, GET /latest-full?at_or_before=N -> {"version": int | null};
    GET /updates/{version} -> the payload (X-Furlong-Kind header), streamed from disk;
    POST /want-full -> 204 (a relay asking the publisher for a snapshot).
    A malformed request gets 400 naming the field, an unknown version 404; neither changes anything.
    `token`: if set, every request must carry `Authorization: Bearer <token>`, or it gets 401 and
    changes nothing. Without one, bind to 127.0.0.1 or a private cluster network only."""

    def __init__(
        self, directory: DirectoryTransport, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
    ) -> None:
        self.directory = directory
        self._served = BackgroundServer(update_app(directory, token), host, port, name="furlong-update-server")

    @property
    def url(self) -> str:
        return self._served.url

    def close(self) -> None:
        self._served.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def update_app(directory: DirectoryTransport, token: str | None = None) -> FastAPI:
    """The UpdateServer's routes over `directory` (see UpdateServer)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = guarded_app("furlong weight updates", token)

    @app.exception_handler(TransportError)
    async def transport_failed(request: Request, exc: TransportError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404 if isinstance(exc, UpdateNotFound) else 500)

    @app.get("/latest")
    def latest() -> dict[str, int | None]:
        return {"version": directory.latest()}

    @app.get("/latest-full")
    def latest_full(at_or_before: int = 2**62) -> dict[str, int | None]:
        return {"version": directory.latest_full_at_or_before(at_or_before)}

    @app.get("/updates/{version}")
    def update(version: int) -> StreamingResponse:
        path = directory.path_of(version)
        try:  # an open file survives a concurrent prune
            f = open(path, "rb")  # closed by _chunks once sent
        except FileNotFoundError as e:
            raise UpdateNotFound(f"{path}: pruned") from e
        headers = {"Content-Length": str(os.fstat(f.fileno()).st_size), "X-Furlong-Kind": path.name.split(".")[1]}
        return StreamingResponse(_chunks(f), media_type="application/octet-stream", headers=headers)

    @app.post("/want-full")
    def want_full() -> Response:
        directory.request_full()
        return Response(status_code=204)

    return app


def _chunks(f: BinaryIO, size: int = 1 << 20) -> Iterator[bytes]:
    with f:
        while piece := f.read(size):
            yield piece


class _Transient(TransportError):
    """One try failed in a way the next may not: a refused, reset or timed-out connection, a transfer cut
    short, HTTP 502-504 (a proxy or a restarting server). Any other answer is final."""


_TRANSIENT_STATUS = frozenset({502, 503, 504})
T = TypeVar("T")


class HttpTransport:
    """Client of an UpdateServer: pooled keep-alive connections, payloads streamed into one
    preallocated buffer, transient failures retried with exponential backoff.

    A request is tried `attempts` times in all, waiting backoff_s, 2 * backoff_s, ... (at most 8 s)
    between tries; then TransportError names the attempts and the last failure. A host that does not
    answer fails each try within connect_timeout_s; only a transfer may take up to timeout_s.
    Read-only: the publisher writes the served directory directly. Environment proxies are ignored on
    purpose: the server is on the cluster network, never behind a web proxy."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 5.0,
        attempts: int = 4,
        backoff_s: float = 0.25,
        token: str | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.base_url = base_url.rstrip("/")
        self.attempts, self.backoff_s = attempts, backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        # A relay pulls several versions per sync over these connections; idle ones are dropped before
        # the server would close them (see furlong.sync.serving).
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            trust_env=False,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_keepalive_connections=8, keepalive_expiry=CLIENT_KEEPALIVE_S),
        )

    def put(self, version: int, kind: str, payload: bytes | memoryview) -> None:
        raise TransportError("HttpTransport is read-only: publish into the served directory")

    def latest(self) -> int | None:
        return self._json("/latest")["version"]

    def latest_full_at_or_before(self, version: int) -> int | None:
        return self._json(f"/latest-full?at_or_before={int(version)}")["version"]

    def get(self, version: int) -> Payload:
        return self._request("GET", f"/updates/{int(version)}", _read_body)

    def request_full(self) -> None:
        self._request("POST", "/want-full", lambda resp, what: None)

    def take_full_request(self) -> bool:
        raise TransportError("HttpTransport is read-only: the publisher polls the directory")

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _json(self, route: str) -> dict[str, Any]:
        body = self._request("GET", route, _read_body)
        try:
            return dict(json.loads(body))
        except ValueError as e:
            raise TransportError(f"{self.base_url}{route}: bad JSON from server: {e}") from e

    def _request(self, method: str, route: str, read: Callable[[httpx.Response, str], T]) -> T:
        retrying = Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.backoff_s, max=8.0),
            retry=retry_if_exception_type(_Transient),
            retry_error_callback=_give_up,
        )
        return retrying(self._try, method, route, read)

    def _try(self, method: str, route: str, read: Callable[[httpx.Response, str], T]) -> T:
        what = self.base_url + route
        try:
            with self._client.stream(method, route) as resp:
                if resp.status_code >= 400:
                    raise _refusal(resp, what, route)
                return read(resp, what)
        except httpx.HTTPError as e:
            raise _Transient(f"{what}: {e!r}") from e


def _give_up(state: RetryCallState) -> NoReturn:
    assert state.outcome is not None  # called only after a failed try
    err = state.outcome.exception()
    raise TransportError(f"gave up after {state.attempt_number} attempts: {err}") from err


def _refusal(resp: httpx.Response, what: str, route: str) -> TransportError:
    """The error an HTTP error reply stands for (the server's one-line detail in it)."""
    resp.read()
    try:
        detail = resp.json()["detail"]
    except (ValueError, KeyError, TypeError):
        detail = resp.text[:200]
    message = f"{what}: HTTP {resp.status_code}: {detail}"
    if resp.status_code in _TRANSIENT_STATUS:
        return _Transient(message)
    if resp.status_code == 404 and route.startswith("/updates/"):
        return UpdateNotFound(message)
    return TransportError(message)


def _read_body(resp: httpx.Response, what: str) -> bytearray:
    length = resp.headers.get("Content-Length")
    if length is None:
        raise TransportError(f"{what}: server sent no Content-Length")
    buf = bytearray(int(length))
    got = 0
    try:
        for piece in resp.iter_raw():  # never past Content-Length: h11 frames the body by it
            buf[got : got + len(piece)] = piece
            got += len(piece)
    except httpx.HTTPError as e:
        raise _Transient(f"{what}: transfer failed after {got} bytes: {e!r}") from e
    if got != len(buf):
        raise _Transient(f"{what}: connection closed after {got} of {len(buf)} bytes")
    return buf
