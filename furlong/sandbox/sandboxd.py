"""The daemon that runs as the first process inside every sandbox (stdlib only, Python >= 3.9).

The host passes this file's source with `python3 -I -S -c`, so images need only Debian's python3.
It speaks JSON lines on stdin/stdout: one request per line, one reply per line, matched by "id".
Requests run on their own threads, so a hung command never blocks a read_file.

Commands run through bash with the sandbox's shell state (cwd and exported variables) restored
before and saved after, so `cd` and `export` persist between tool calls as in a terminal, while each
command still costs only a fork+exec (~1 ms) instead of a sandbox start.
"""

import base64
import json
import os
import selectors
import signal
import sys
import threading
import time

# No `subprocess` (its imports cost more than the rest of this daemon's start-up): commands start
# with posix_spawn, and tarfile is imported only when a directory is copied in.

STATE_DIR = "/run/furlong-shell"
MARKER = "\n[... furlong: {n} bytes truncated ...]\n"
_out_lock = threading.Lock()


def _close_inherited_fds() -> None:
    # The host hands bwrap its layers as /proc/self/fd/N paths; those fds must not reach the agent,
    # or it could write through them to the shared read-only image.
    os.closerange(3, 65536)


class CappedBuffer:
    """Keeps the first and last cap/2 bytes of a stream, counting what was dropped in between."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.half - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.half:  # trim rarely: amortised O(1) per byte
                del self.tail[: len(self.tail) - self.half]

    def text(self) -> tuple:
        tail = bytes(self.tail[-self.half :]) if self.tail else b""
        dropped = self.total - len(self.head) - len(tail)
        body = bytes(self.head)
        if dropped > 0:
            body += MARKER.format(n=dropped).encode()
        body += tail
        return body.decode("utf-8", errors="replace"), dropped > 0


def _drain_forever(fds: list) -> None:
    """Reads and discards output of background processes so they never block on a full pipe."""
    sel = selectors.DefaultSelector()
    for fd in fds:
        sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
        for key, _ in sel.select():
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(key.fd)
                os.close(key.fd)


def _wrap(cmd: str, keep_state: bool, env: dict) -> str:
    # The command's processes are the first the OOM killer picks, never this daemon.
    pre = "echo 1000 > /proc/self/oom_score_adj 2>/dev/null\n"
    if not keep_state:
        return pre + cmd
    # One state file, sourced with a builtin: every fork and file here is paid on every tool call.
    restore = f"[ -f {STATE_DIR}/state ] && . {STATE_DIR}/state\n"
    # Variables passed with this request win over the saved shell state.
    overrides = "".join(f"export {k}={_shell_quote(v)}\n" for k, v in env.items())
    save = (f"\n__rc=$?; {{ export -p; printf 'cd -- %q 2>/dev/null\\n' \"$PWD\"; }} > {STATE_DIR}/state 2>/dev/null;"
            " exit $__rc")
    # eval keeps a syntax error in the user's command from skipping the state save.
    return pre + restore + overrides + "eval " + _shell_quote(cmd) + save


def _shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _collect(pid: int, fds: tuple, pidfd: int, timeout: float, cap: int) -> tuple:
    bufs = {fd: CappedBuffer(cap) for fd in fds}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    timed_out, exited = False, False
    while not exited:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            _kill_group(pid)
        for key, _ in sel.select(None if timed_out else left):
            if key.fd == pidfd:
                exited = True
                continue
            _read_into(key.fd, bufs[key.fd], sel)
    for fd in list(bufs):  # whatever the command wrote before exiting is already in the pipe
        if fd in sel.get_map():
            _read_into(fd, bufs[fd], sel, until_empty=True)
    leftover = [fd for fd in bufs if fd in sel.get_map()]
    sel.close()
    return bufs, leftover, timed_out


def _read_into(fd: int, buf: CappedBuffer, sel, until_empty: bool = False) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if not data:
            sel.unregister(fd)
            return
        buf.add(data)
        if not until_empty:
            return


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _spawn(script: str, env: dict) -> tuple:
    """Starts bash in its own session (so a timeout can kill its whole process group)."""
    out_r, out_w = os.pipe()  # non-inheritable: only the dup2'd copies reach the child
    err_r, err_w = os.pipe()
    null = os.open("/dev/null", os.O_RDONLY)
    actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
    try:
        pid = os.posix_spawn("/bin/bash", ["/bin/bash", "-c", script], env, file_actions=actions, setsid=True)
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    return pid, out_r, err_r


def op_exec(req: dict) -> dict:
    start = time.monotonic()
    cwd = req.get("cwd")
    extra = req.get("env") or {}
    script = _wrap(req["cmd"], cwd is None, extra)
    if cwd is not None:
        script = f"cd -- {_shell_quote(cwd)} || exit 1\n" + script
    pid, out_fd, err_fd = _spawn(script, {**os.environ, **extra})
    pidfd = os.pidfd_open(pid)
    try:
        bufs, leftover, timed_out = _collect(pid, (out_fd, err_fd), pidfd, float(req.get("timeout", 60)), int(req["cap"]))
    finally:
        os.close(pidfd)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code < 0:  # killed by a signal: report it the way a shell does
        code = 128 - code
    for fd in (out_fd, err_fd):
        if fd not in leftover:
            os.close(fd)
    if leftover:  # background processes still hold the pipes: keep draining so they never block
        threading.Thread(target=_drain_forever, args=(leftover,), daemon=True).start()
    (out, t1), (err, t2) = bufs[out_fd].text(), bufs[err_fd].text()
    return {"exit_code": 124 if timed_out else code, "stdout": out, "stderr": err,
            "duration_s": time.monotonic() - start, "timed_out": timed_out, "truncated": t1 or t2}


def op_write(req: dict) -> dict:
    path = req["path"]
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(req["data"]))
    os.chmod(path, int(req.get("mode", 0o644)))
    return {}


def op_read(req: dict) -> dict:
    with open(req["path"], "rb") as f:
        return {"data": base64.b64encode(f.read()).decode()}


def op_untar(req: dict) -> dict:
    import io
    import tarfile

    os.makedirs(req["dest"], exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(req["data"]))) as tar:
        tar.extractall(req["dest"])
    return {}


def op_ping(req: dict) -> dict:
    return {"pid": os.getpid()}


OPS = {"exec": op_exec, "write": op_write, "read": op_read, "untar": op_untar, "ping": op_ping}


def _reply(msg: dict) -> None:
    line = (json.dumps(msg) + "\n").encode()
    with _out_lock:
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()


def _handle(req: dict) -> None:
    try:
        result = OPS[req["op"]](req)
        _reply({"id": req["id"], "ok": True, **result})
    except Exception as exc:  # reported to the host, which raises SandboxError
        _reply({"id": req["id"], "ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main() -> None:
    _close_inherited_fds()
    os.makedirs(STATE_DIR, exist_ok=True)
    for line in sys.stdin.buffer:
        req = json.loads(line)
        threading.Thread(target=_handle, args=(req,), daemon=True).start()


if __name__ == "__main__":
    main()
