"""envd's `process.Process` service (Connect-RPC, through the SDK's own generated server classes), enough
for `commands.run` in the foreground: Start runs the command to its end in the sandbox, then streams its
start, output and end events. Background commands, Connect, input and signals are refused as unimplemented."""

from __future__ import annotations

import hmac
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof

from furlong.sandbox.base import Sandbox

Lookup = Callable[[str], Awaitable[Any]]  # sandbox id -> its live record (box, token) or None
DEFAULT_TIMEOUT_S = 60.0


def _event(kind: str, value: Any) -> pb.StartResponse:
    return pb.StartResponse(event=pb.ProcessEvent(event=Oneof(kind, value)))


async def sandbox_of(lookup: Lookup, ctx: Any) -> Sandbox:
    """The sandbox an envd call is for (E2b-Sandbox-Id), once its X-Access-Token is checked."""
    headers = ctx.request_headers
    live = await lookup(headers.get("e2b-sandbox-id", ""))
    if live is None:
        raise ConnectError(Code.NOT_FOUND, "E2b-Sandbox-Id: no such sandbox")
    if not hmac.compare_digest(headers.get("x-access-token", ""), live.token):
        raise ConnectError(Code.UNAUTHENTICATED, "X-Access-Token: missing or wrong for this sandbox")
    return live.box


class Processes:
    """The service: each call is routed by E2b-Sandbox-Id and checked against that sandbox's X-Access-Token."""

    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup
        self._pids = 0

    async def start(self, request: pb.StartRequest, ctx: Any) -> AsyncIterator[pb.StartResponse]:
        box = await sandbox_of(self._lookup, ctx)
        cfg = request.process
        if request.stdin:
            raise ConnectError(Code.UNIMPLEMENTED, "stdin: commands with input are not supported")
        timeout_ms = ctx.timeout_ms
        result = await box.exec(shlex.join([cfg.cmd, *cfg.args]), cwd=cfg.cwd or None, env=dict(cfg.envs) or None,
                                timeout_s=timeout_ms / 1000 if timeout_ms else DEFAULT_TIMEOUT_S)
        self._pids += 1
        yield _event("start", pb.ProcessEvent.StartEvent(pid=self._pids))
        for stream, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if text:
                yield _event("data", pb.ProcessEvent.DataEvent(output=Oneof(stream, text.encode())))
        status = "timed out" if result.timed_out else f"exit status {result.exit_code}"
        yield _event("end", pb.ProcessEvent.EndEvent(exit_code=result.exit_code, exited=not result.timed_out,
                                                     status=status))

    def _unsupported(self, name: str) -> Callable[..., Any]:
        async def refuse(*_: Any) -> Any:
            raise ConnectError(Code.UNIMPLEMENTED, f"process.Process/{name} is not supported (docs/e2b.md)")
        return refuse

    def __getattr__(self, name: str) -> Any:  # list, connect, update, send_input, send_signal, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return self._unsupported(name)


def process_app(lookup: Lookup) -> ProcessASGIApplication:
    return ProcessASGIApplication(Processes(lookup))
