"""What every envd call shares, over REST and Connect-RPC alike: which sandbox it is for (E2b-Sandbox-Id)
and whether it carries that sandbox's own X-Access-Token."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from furlong.sandbox.base import Sandbox, Snapshotting

Lookup = Callable[[str], Awaitable[Any]]  # sandbox id -> its live record (box, token) or None


def refusal(live: Any, token: str) -> tuple[Code, str] | None:
    """Why a call for `live` (None: no such sandbox) carrying `token` is refused; None where it is not."""
    if live is None:
        return Code.NOT_FOUND, "E2b-Sandbox-Id: no such sandbox"
    if not hmac.compare_digest(token.encode(), live.token.encode()):  # bytes: a non-ASCII token is refused, not a crash
        return Code.UNAUTHENTICATED, "X-Access-Token: missing or wrong for this sandbox"
    return None


async def sandbox_of(lookup: Lookup, ctx: Any) -> Sandbox:
    """The sandbox a Connect-RPC call is for, once its token is checked; a paused one refuses every call."""
    headers = ctx.request_headers
    live = await lookup(headers.get("e2b-sandbox-id", ""))
    if refused := refusal(live, headers.get("x-access-token", "")):
        raise ConnectError(*refused)
    if isinstance(live.box, Snapshotting) and live.box.paused:
        raise ConnectError(Code.FAILED_PRECONDITION, "the sandbox is paused: Sandbox.connect resumes it")
    return live.box
