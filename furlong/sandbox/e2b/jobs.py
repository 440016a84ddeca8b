"""One command started through envd's process service: the script it runs in the sandbox (with a stdin
pipe or a pseudo-terminal where asked), the task that runs it, and the streams it fans its events out to
(the Start call's, and every Connect's since).

Input reaches the command through a named pipe inside the sandbox (`/tmp/.furlong-e2b-PID.in`): the
command's stdin is its read end, and a `sleep` of the command's own process group holds a write end open
so the command sees no EOF between two inputs; each input is a `cat` into the pipe, and closing stdin
ends the holder. A PTY is util-linux `script` inside the sandbox, reading that pipe: the terminal is
allocated inside the sandbox's own devpts (bwrap's `--dev`), by the agent, so nothing of the host's is
handed in. Every piece runs as the sandbox's agent, through Sandbox.exec, in that sandbox only."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
from collections.abc import AsyncIterator, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from protobuf import Oneof

from furlong.sandbox.base import ExecResult, Sandbox, SandboxError

CAPPED = re.compile(rb"\n\[\.\.\. furlong: (\d+) bytes truncated \.\.\.\]\n")  # init.c's MARKER
HOLD_S = 2147483647  # the write end's holder sleeps until it is killed
NO_PTY = "echo 'furlong: a PTY needs util-linux script and stty in the sandbox image' >&2; exit 127"
INPUT_TIMEOUT_S = 10.0  # a command that reads none of its input leaves the pipe full: the write gives up


def event(kind: str, value: Any) -> pb.ProcessEvent:
    return pb.ProcessEvent(event=Oneof(kind, value))  # type: ignore[arg-type]  # kind: a field name


def data(stream: str, chunk: bytes) -> pb.ProcessEvent:
    return event("data", pb.ProcessEvent.DataEvent(output=Oneof(stream, chunk)))  # type: ignore[arg-type]


def unstreamed(final: str, streamed: int) -> bytes:
    """What a stream's capped result holds past the `streamed` bytes its chunks gave (the first `cap`). The
    bwrap backend keeps the first and last half of the cap around a marker counting the bytes dropped
    between (init.c), so: the part of that last half the chunks did not reach, after a marker for any bytes
    neither holds. Nothing where the marker is not where that layout puts it (no truncation, or a head
    that was not UTF-8): then the SDK's output is what was streamed."""
    raw = final.encode()
    found = CAPPED.match(raw, streamed // 2)
    if found is None:
        return b""
    tail = raw[found.end() :]
    start = found.start() + int(found.group(1))  # where the last half begins in the command's whole output
    if start < streamed:
        return tail[streamed - start :]
    gap = start - streamed
    return (f"\n[... furlong: {gap} bytes truncated ...]\n".encode() if gap else b"") + tail


def script(base: str, cfg: pb.ProcessConfig, stdin: bool, pty: pb.PTY.Size | None) -> str:
    """The command line run (as the agent) for one command: `base.pid` names its process group while it runs;
    with stdin or a PTY, `base.in` is its input pipe and `base.hold` the pid of that pipe's holder; with a
    PTY, `base.tty` names its terminal and `base.pty` the pid of the terminal's session leader."""
    cmd = shlex.join([cfg.cmd, *cfg.args])
    if pty is not None:
        inside = f"stty rows {pty.rows} cols {pty.cols}; tty > {base}.tty; echo $$ > {base}.pty; exec {cmd}"
        cmd = f"SHELL=/bin/bash script -qfec {shlex.quote(inside)} /dev/null"
    if stdin or pty is not None:
        cmd = (
            f"rm -f {base}.in && mkfifo -m 600 {base}.in || exit 127; "
            f"(exec sleep {HOLD_S} >{base}.in 2>/dev/null) & echo $! > {base}.hold; {cmd} <{base}.in"
        )
    inner = f"echo $$ > {base}.pid; {cmd}; rc=$?; "
    if pty is not None:  # checked first: no pipe, no holder is left behind for a terminal there cannot be
        inner = f"{{ command -v script && command -v stty; }} >/dev/null || {{ {NO_PTY}; }}; {inner}"
    if stdin or pty is not None:
        inner += f"kill $(cat {base}.hold) 2>/dev/null; "
    inner += f"rm -f {base}.pid {base}.in {base}.hold {base}.tty {base}.pty; exit $rc"
    # The shell that runs this line reports a killed child ("line 1: PID Killed setsid -w bash -c ...") on its
    # own stderr: that goes to /dev/null, the command's stderr through fd 3 to where it was going.
    return f"{{ setsid -w bash -c {shlex.quote(inner)} 2>&3 3>&-; }} 3>&2 2>/dev/null"


def waiting_for(path: str, test: str = "-s") -> str:
    """Shell: wait (up to 4 s) for a file the command's script makes as it starts: a call may come first."""
    return f"for _ in $(seq 200); do test {test} {path} && break; sleep 0.02; done"


class Job:
    """A started command: its config, its input's state and the streams listening to its events."""

    def __init__(
        self, box: Sandbox, sandbox_id: str, pid: int, cfg: pb.ProcessConfig, stdin: bool, pty: pb.PTY.Size | None
    ):
        self.box, self.sandbox_id, self.pid, self.config = box, sandbox_id, pid, cfg
        self.base = f"/tmp/.furlong-e2b-{pid}"
        self.pty_size, self.pty, self.stdin = pty, pty is not None, stdin
        self.stdin_open = stdin or self.pty  # a PTY takes input always; closing it is stdin's alone
        self.ended = False
        self._listeners: list[asyncio.Queue[pb.ProcessEvent | Exception | None]] = []
        self._input_lock = asyncio.Lock()  # inputs reach the pipe in the order they came
        self._inputs = 0
        self.task: asyncio.Task[None] | None = None

    def listen(self) -> asyncio.Queue[pb.ProcessEvent | Exception | None]:
        queue: asyncio.Queue[pb.ProcessEvent | Exception | None] = asyncio.Queue()
        self._listeners.append(queue)
        return queue

    async def events(self, queue: asyncio.Queue[pb.ProcessEvent | Exception | None]) -> AsyncIterator[pb.ProcessEvent]:
        """The events a listener gets from now on, till the command's end; it stops listening when it leaves."""
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise ConnectError(Code.UNAVAILABLE, f"process {self.pid}: {item}")
                yield item
        finally:
            self._listeners.remove(queue)

    def _publish(self, item: pb.ProcessEvent | Exception | None) -> None:
        for queue in self._listeners:
            queue.put_nowait(item)

    async def run(self, timeout_s: float, forget: Callable[[], object]) -> None:
        """Runs the command to its end, whoever listens; `forget` is called as it ends, before its end event."""
        streamed = {"stdout": 0, "stderr": 0}
        out = "pty" if self.pty else "stdout"

        def on_output(stream: str, chunk: bytes) -> None:
            streamed[stream] += len(chunk)
            self._publish(data(out if stream == "stdout" else stream, chunk))

        cfg = self.config
        result: ExecResult | None = None
        failure: Exception = SandboxError("its run was cancelled")  # what listeners get where no result came
        try:
            result = await self.box.exec(
                script(self.base, cfg, self.stdin, self.pty_size),
                cwd=cfg.cwd or None,
                env=dict(cfg.envs) or None,
                timeout_s=timeout_s,
                on_output=on_output,
            )
            if result.timed_out:  # killed by exec: its script's own cleanup never ran
                with contextlib.suppress(SandboxError):
                    await self.box.exec(self._cleanup, cwd="/", timeout_s=10)
        except SandboxError as e:  # the sandbox was closed or died under it
            failure = e
        finally:  # whatever ended it, every listener's stream ends and the pid is let go
            self.ended = True
            forget()
            if result is not None:
                self._finish(result, streamed, out)
            else:
                self._publish(failure)
                self._publish(None)

    def _finish(self, result: ExecResult, streamed: dict[str, int], out: str) -> None:
        for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if result.truncated and (rest := unstreamed(text, streamed[stream])):
                self._publish(data(out if stream == "stdout" else stream, rest))
        status = "timed out" if result.timed_out else f"exit status {result.exit_code}"
        end = pb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=not result.timed_out, status=status)
        self._publish(event("end", end))
        self._publish(None)

    async def send(self, chunk: bytes) -> None:
        """Writes `chunk` to the command's input pipe (through a file: exec has no stdin of its own)."""
        async with self._input_lock:
            if not self.stdin_open or self.ended:
                raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid}: its stdin is closed")
            self._inputs += 1
            staged = f"{self.base}.input-{self._inputs}"
            await self.box.write_file(staged, chunk, mode=0o600)
            res = await self.box.exec(
                f"{waiting_for(self.base + '.in', '-p')}; test -p {self.base}.in || {{ echo 'the command has ended' >&2; rm -f {staged}; exit 3; }}; "
                f"timeout {INPUT_TIMEOUT_S:g} cat {staged} > {self.base}.in; rc=$?; rm -f {staged}; exit $rc",
                cwd="/",
                timeout_s=INPUT_TIMEOUT_S + 5,
            )
        if res.exit_code == 124:
            raise ConnectError(Code.DEADLINE_EXCEEDED, f"process {self.pid}: it read none of its input")
        if res.exit_code != 0:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid}: {res.stderr.strip() or 'ended'}")

    async def close_stdin(self) -> None:
        async with self._input_lock:
            if not self.stdin or self.ended:
                raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid}: it has no open stdin")
            self.stdin_open = False
            hold = f"{self.base}.hold"
            await self.box.exec(f"{waiting_for(hold)}; kill $(cat {hold}) 2>/dev/null; true", cwd="/", timeout_s=10)

    async def resize(self, size: pb.PTY.Size) -> None:
        if not self.pty or self.ended:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid}: not a running PTY")
        tty = f"{self.base}.tty"
        res = await self.box.exec(
            f'{waiting_for(tty)}; stty -F "$(cat {tty})" rows {size.rows} cols {size.cols}', cwd="/", timeout_s=10
        )
        if res.exit_code != 0:
            raise ConnectError(Code.FAILED_PRECONDITION, f"process {self.pid}: resize: {res.stderr.strip()}")

    async def signal(self, sig: str) -> None:
        """Kills the command's whole process group (and its terminal's session, where it has one)."""
        f, pty = f"{self.base}.pid", f"{self.base}.pty"
        inner = f"test -s {pty} && kill -s {sig} -- -$(cat {pty}) 2>/dev/null; " if self.pty else ""
        await self.box.exec(
            f"{waiting_for(f)}; {inner}kill -s {sig} -- -$(cat {f}); {self._cleanup}", cwd="/", timeout_s=10
        )

    @property
    def _cleanup(self) -> str:
        """Shell: removes the command's files, which its script leaves behind when it is killed."""
        return f"rm -f {self.base}.*"
