"""envd's `process.Process` service (Connect-RPC, through the SDK's own generated server classes): Start
streams a command's start event at once, then its output as it writes (Sandbox.exec's on_output), then
its end (foreground and background `commands.run`, PTYs); Connect streams a running one's further output
and end to another handle; SendInput, StreamInput and CloseStdin feed a command started with stdin (or a
PTY); Update resizes a PTY; List names the running ones; SendSignal kills one's whole process group
inside the sandbox. How input and PTYs reach the sandbox: furlong.sandbox.e2b.jobs."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import Process, ProcessASGIApplication

from furlong.sandbox.e2b.envd import Lookup, sandbox_of
from furlong.sandbox.e2b.jobs import Job, event

NO_TIMEOUT_S = 86400.0  # timeout=0 (none): the command runs till it ends or its sandbox closes, a day at most
MAX_INPUT_BYTES = 4 << 20  # one SendInput's data (the SDK sends what the caller gives)


def _input(given: pb.ProcessInput | None) -> bytes:
    if given is None or given.input is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "input: expected stdin or pty data")
    chunk = given.input.value
    if len(chunk) > MAX_INPUT_BYTES:
        raise ConnectError(Code.INVALID_ARGUMENT, f"input: at most {MAX_INPUT_BYTES} bytes at once")
    return chunk


class Processes(Process):
    """The service: each call is routed by E2b-Sandbox-Id and checked against that sandbox's X-Access-Token;
    a pid names a command of that sandbox only (another sandbox's is NOT_FOUND, as an unknown one is)."""

    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup
        self._pids = itertools.count(1)
        self._running: dict[int, Job] = {}

    async def _job(self, selector: pb.ProcessSelector | None, ctx: Any) -> Job:
        await sandbox_of(self._lookup, ctx)
        chosen = selector.selector if selector is not None else None
        job = self._running.get(chosen.value) if chosen is not None and chosen.field == "pid" else None
        if job is None or job.sandbox_id != ctx.request_headers.get("e2b-sandbox-id", ""):
            raise ConnectError(Code.NOT_FOUND, "process: no such running command in this sandbox")
        return job

    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        box = await sandbox_of(self._lookup, ctx)
        cfg = request.process
        if cfg is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "process: expected the command to start")
        size = request.pty.size if request.pty is not None else None
        if request.pty is not None and (size is None or not (0 < size.rows <= 1000 and 0 < size.cols <= 1000)):
            raise ConnectError(Code.INVALID_ARGUMENT, "pty.size: expected rows and cols in 1..1000")
        pid = next(self._pids)
        job = Job(box, ctx.request_headers.get("e2b-sandbox-id", ""), pid, cfg, request.stdin, size)
        self._running[pid] = job
        queue = job.listen()  # before it runs: this stream misses none of its output
        timeout_ms = ctx.timeout_ms
        # the command runs on when this call's client leaves (CommandHandle.disconnect): Connect reattaches
        job.task = asyncio.create_task(
            job.run(timeout_ms / 1000 if timeout_ms else NO_TIMEOUT_S, lambda: self._running.pop(pid, None))
        )
        yield pb.StartResponse(event=event("start", pb.ProcessEvent.StartEvent(pid=pid)))
        async for ev in job.events(queue):
            yield pb.StartResponse(event=ev)

    async def connect(self, request: pb.ConnectRequest, ctx: Any) -> AsyncIterator[pb.ConnectResponse]:
        """A running command's output from now on (what it wrote before is not replayed), then its end."""
        job = await self._job(request.process, ctx)
        queue = job.listen()
        yield pb.ConnectResponse(event=event("start", pb.ProcessEvent.StartEvent(pid=job.pid)))
        async for ev in job.events(queue):
            yield pb.ConnectResponse(event=ev)

    async def list(self, request: pb.ListRequest, ctx: Any) -> pb.ListResponse:
        await sandbox_of(self._lookup, ctx)
        sid = ctx.request_headers.get("e2b-sandbox-id", "")
        return pb.ListResponse(
            processes=[
                pb.ProcessInfo(config=j.config, pid=pid) for pid, j in self._running.items() if j.sandbox_id == sid
            ]
        )

    async def send_signal(self, request: pb.SendSignalRequest, ctx: Any) -> pb.SendSignalResponse:
        job = await self._job(request.process, ctx)
        await job.signal("TERM" if request.signal == pb.Signal.SIGTERM else "KILL")
        return pb.SendSignalResponse()

    async def send_input(self, request: pb.SendInputRequest, ctx: Any) -> pb.SendInputResponse:
        job = await self._job(request.process, ctx)
        await job.send(_input(request.input))
        return pb.SendInputResponse()

    async def stream_input(self, requests: AsyncIterator[pb.StreamInputRequest], ctx: Any) -> pb.StreamInputResponse:
        """The first message names the command (its start event), each later data event is one input."""
        job = None
        async for message in requests:
            kind = message.event.field if message.event is not None else None
            if kind == "start":
                job = await self._job(message.event.value.process, ctx)  # type: ignore[union-attr]
            elif kind == "data":
                if job is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "stream_input: the start event must come first")
                await job.send(_input(message.event.value.input))  # type: ignore[union-attr]
        return pb.StreamInputResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: Any) -> pb.CloseStdinResponse:
        job = await self._job(request.process, ctx)
        await job.close_stdin()
        return pb.CloseStdinResponse()

    async def update(self, request: pb.UpdateRequest, ctx: Any) -> pb.UpdateResponse:
        job = await self._job(request.process, ctx)
        size = request.pty.size if request.pty is not None else None
        if size is None or not (0 < size.rows <= 1000 and 0 < size.cols <= 1000):
            raise ConnectError(Code.INVALID_ARGUMENT, "pty.size: expected rows and cols in 1..1000")
        await job.resize(size)
        return pb.UpdateResponse()


def process_app(lookup: Lookup) -> ProcessASGIApplication:
    return ProcessASGIApplication(Processes(lookup))
