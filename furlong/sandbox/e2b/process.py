"""envd's `process.Process` service (Connect-RPC, through the SDK's own generated server classes): Start
streams a command's start event at once, then its output as it writes (Sandbox.exec's on_output), then
its end (foreground and background `commands.run`); List names the running ones; SendSignal kills one's
whole process group inside the sandbox. Connect, input and PTYs are refused as unimplemented."""

from __future__ import annotations

import asyncio
import itertools
import re
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof

from furlong.sandbox.base import Sandbox
from furlong.sandbox.e2b.envd import Lookup, sandbox_of, unsupported

DEFAULT_TIMEOUT_S = 60.0
CAPPED = re.compile(rb"\n\[\.\.\. furlong: (\d+) bytes truncated \.\.\.\]\n")  # init.c's MARKER


def _event(kind: str, value: Any) -> pb.StartResponse:
    return pb.StartResponse(event=pb.ProcessEvent(event=Oneof(kind, value)))  # type: ignore[arg-type]  # kind: a field name


def _data(stream: str, data: bytes) -> pb.StartResponse:
    return _event("data", pb.ProcessEvent.DataEvent(output=Oneof(stream, data)))  # type: ignore[arg-type]  # stdout|stderr


def _unstreamed(final: str, streamed: int) -> bytes:
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


async def _output(
    box: Sandbox, script: str, cfg: pb.ProcessConfig, timeout_s: float, ended: Callable[[], None]
) -> AsyncIterator[pb.StartResponse]:
    """The command's data events as it writes them, then its end event; `ended` is called as the command
    ends, before those last events. Should the client leave, the call is dropped as an awaited one would
    be (the command itself runs on in the sandbox)."""
    events: asyncio.Queue[pb.StartResponse | None] = asyncio.Queue()
    streamed = {"stdout": 0, "stderr": 0}

    def on_output(stream: str, data: bytes) -> None:
        streamed[stream] += len(data)
        events.put_nowait(_data(stream, data))

    async def run():
        try:
            return await box.exec(
                script, cwd=cfg.cwd or None, env=dict(cfg.envs) or None, timeout_s=timeout_s, on_output=on_output
            )
        finally:
            ended()
            events.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (event := await events.get()) is not None:
            yield event
        result = await task
    finally:
        task.cancel()  # a no-op once it is done
    for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if result.truncated and (rest := _unstreamed(text, streamed[stream])):
            yield _data(stream, rest)
    status = "timed out" if result.timed_out else f"exit status {result.exit_code}"
    yield _event(
        "end", pb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=not result.timed_out, status=status)
    )


@dataclass(frozen=True)
class Running:
    box: Sandbox
    sandbox_id: str
    config: pb.ProcessConfig
    pidfile: str  # inside the sandbox: the pid of the command's session leader, so a signal reaches its group


class Processes:
    """The service: each call is routed by E2b-Sandbox-Id and checked against that sandbox's X-Access-Token."""

    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup
        self._pids = itertools.count(1)
        self._running: dict[int, Running] = {}

    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        box = await sandbox_of(self._lookup, ctx)
        cfg = request.process
        if cfg is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process: expected the command to start")
        if request.stdin or request.pty is not None:
            raise ConnectError(Code.UNIMPLEMENTED, "stdin and pty: commands with input are not supported")
        pid = next(self._pids)
        pidfile = f"/tmp/.furlong-e2b-{pid}.pid"
        inner = f"echo $$ > {pidfile}; {shlex.join([cfg.cmd, *cfg.args])}; rc=$?; rm -f {pidfile}; exit $rc"
        timeout_ms = ctx.timeout_ms
        self._running[pid] = Running(box, ctx.request_headers.get("e2b-sandbox-id", ""), cfg, pidfile)

        def forget() -> None:  # once the command has ended, or once the client left
            self._running.pop(pid, None)

        try:
            yield _event("start", pb.ProcessEvent.StartEvent(pid=pid))
            async for event in _output(
                box,
                f"setsid -w bash -c {shlex.quote(inner)}",
                cfg,
                timeout_ms / 1000 if timeout_ms else DEFAULT_TIMEOUT_S,
                forget,
            ):
                yield event
        finally:
            forget()

    async def list(self, request: pb.ListRequest, ctx: Any) -> pb.ListResponse:
        await sandbox_of(self._lookup, ctx)
        sid = ctx.request_headers.get("e2b-sandbox-id", "")
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(config=r.config, pid=pid) for pid, r in self._running.items() if r.sandbox_id == sid
            ]
        )

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any) -> pb.SendSignalResponse:
        await sandbox_of(self._lookup, ctx)
        selector = request.process.selector if request.process is not None else None
        running = self._running.get(selector.value) if selector is not None and selector.field == "pid" else None
        if running is None or running.sandbox_id != ctx.request_headers.get("e2b-sandbox-id", ""):
            raise ConnectError(Code.NOT_FOUND, "process: no such running command in this sandbox")
        sig = "TERM" if request.signal == pb.Signal.SIGTERM else "KILL"
        f = running.pidfile  # listed from the moment Start was called: its command may not have written it yet
        await running.box.exec(
            f"for _ in $(seq 200); do test -s {f} && break; sleep 0.02; done; kill -s {sig} -- -$(cat {f}); rm -f {f}",
            timeout_s=10,
        )
        return pb.SendSignalResponse()

    def __getattr__(self, name: str) -> Any:  # connect, update, send_input, stream_input, close_stdin
        return unsupported("process.Process", name)


def process_app(lookup: Lookup) -> ProcessASGIApplication:
    return ProcessASGIApplication(Processes(lookup))
