"""The gateway's HTTP app: OpenAI `/v1/chat/completions` and `/v1/models`, Anthropic `/v1/messages`, and
the episode routes a trainer (or any orchestrator holding the gateway's token) mints and ends keys with.

Every route but /health needs a key: `Authorization: Bearer K` (OpenAI clients) or `x-api-key: K`
(Anthropic clients). A request is read whole, checked, and only then does anything change: a refused one
(401, 400, 413) leaves every trajectory as it was. What the model writes never makes a 500: a malformed tool
call is returned as text. Streaming answers are sent once the turn is sampled (the engines return whole
turns), in each API's event format.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from furlong.engine.base import EngineError, EngineUnavailable
from furlong.gateway import anthropic_api, openai_api
from furlong.gateway.exec import EXEC_ROUTE, EnvironmentFailed
from furlong.gateway.policy import Policy
from furlong.gateway.reply import Reply
from furlong.gateway.request import ChatRequest, RequestError
from furlong.gateway.sessions import Session, Sessions
from furlong.gateway.timing import Phases

MAX_BODY_BYTES = 8 << 20  # a conversation past this is refused (413), not parsed


def _openai_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def _anthropic_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 413: "request_too_large", 503: "overloaded_error"}.get(
        status, "invalid_request_error"
    )
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def _key(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")


async def _body(request: Request, max_bytes: int, phases: Phases | None = None) -> dict[str, Any] | tuple[int, str]:
    """The request's JSON object, or (status, why) for what is refused before anything is read into it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return 413, f"request body over {max_bytes} bytes"
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            return 413, f"request body over {max_bytes} bytes"
    if phases is not None:
        phases.mark("receive")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return 400, f"body: not JSON ({e})"
    if not isinstance(body, dict):
        return 400, "body: expected a JSON object"
    return body


def _sse(lines: Iterator[str]) -> StreamingResponse:
    return StreamingResponse(lines, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def make_app(
    policy: Policy, token: str, *, max_body_bytes: int = MAX_BODY_BYTES, server_timing: bool = False
) -> FastAPI:
    """`server_timing`: each chat answer carries a `Server-Timing` header, its time phase by phase
    (furlong.gateway.timing)."""
    app = FastAPI(title="furlong gateway", docs_url=None, redoc_url=None, openapi_url=None)
    sessions = Sessions(token, policy.trajectory)
    app.state.sessions = sessions

    async def serve(
        request: Request,
        parse: Callable[[dict[str, Any]], ChatRequest],
        error: Callable[..., JSONResponse],
        answer: Callable[[Reply, ChatRequest, str], Any],
        stream: Callable[[Reply, ChatRequest, str], Iterator[str]],
        prefix: str,
    ) -> Response:
        phases = Phases()
        session = sessions.for_key(_key(request))
        if session is None:
            return error(401, "invalid API key (or its episode has ended)")
        body = await _body(request, max_body_bytes, phases)
        if isinstance(body, tuple):
            return error(*body)
        try:
            req = parse(body)
            phases.mark("parse")
            reply = await _generate(policy, session, req, phases)
        except RequestError as e:
            return error(400, str(e), e.param)
        except EngineUnavailable as e:
            return error(503, f"no engine could serve this request: {e}")
        except EngineError as e:
            return error(400, f"the engine refused this request: {e}")
        rid = f"{prefix}{secrets.token_hex(12)}"
        response = _sse(stream(reply, req, rid)) if req.stream else JSONResponse(answer(reply, req, rid))
        phases.mark("serialize")
        if server_timing:
            response.headers["Server-Timing"] = phases.header()
        return response

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(
            request, openai_api.parse_chat, _openai_error, openai_api.completion, openai_api.chunks, "chatcmpl-"
        )

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve(
            request, anthropic_api.parse_messages, _anthropic_error, anthropic_api.message, anthropic_api.events, "msg_"
        )

    _info_routes(app, sessions, policy.name)
    _episode_routes(app, sessions)
    _exec_route(app, sessions)
    return app


def _info_routes(app: FastAPI, sessions: Sessions, model: str) -> None:
    """`/v1/models` (any live key) and `/health` (no key)."""

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if sessions.for_key(_key(request)) is None:
            return _openai_error(401, "invalid API key (or its episode has ended)")
        return JSONResponse(
            {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "furlong"}]}
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}


async def _generate(policy: Policy, session: Session, req: ChatRequest, phases: Phases) -> Reply:
    async with session.lock:
        phases.mark("queue")
        if session.ended:  # ended while this request waited for the one before it
            raise RequestError("episode", f"episode {session.episode_id} has ended")
        session.waiting_since = time.perf_counter()
        try:
            return await policy.reply(session.trajectory, req, phases)
        finally:
            session.waited_s += time.perf_counter() - session.waiting_since
            session.waiting_since = None


def _episode_routes(app: FastAPI, sessions: Sessions) -> None:
    """Mint, read and end episodes: the gateway's own token only (an episode key cannot mint another)."""

    def admin(request: Request) -> bool:
        return sessions.is_admin(_key(request))

    @app.post("/v1/episodes")
    async def mint(request: Request) -> Response:
        if not admin(request):
            return _openai_error(401, "minting an episode needs the gateway's token")
        body = await _body(request, 4096) if request.headers.get("content-length", "0") != "0" else {}
        if isinstance(body, tuple):
            return _openai_error(*body)
        wanted = body.get("episode_id")
        if wanted is not None and (not isinstance(wanted, str) or not wanted or len(wanted) > 128):
            return _openai_error(400, "episode_id: expected a non-empty string of at most 128 characters", "episode_id")
        try:
            episode_id, key = sessions.mint(wanted)
        except KeyError:
            return _openai_error(409, f"episode {wanted!r} exists already", "episode_id")
        return JSONResponse({"episode_id": episode_id, "api_key": key}, 201)

    @app.get("/v1/episodes/{episode_id}")
    async def read(episode_id: str, request: Request) -> Response:
        if not admin(request):
            return _openai_error(401, "reading a trajectory needs the gateway's token")
        session = sessions.get(episode_id)
        if session is None:
            return _openai_error(404, f"no episode {episode_id!r}")
        return JSONResponse({"episode_id": episode_id, "ended": session.ended, **session.trajectory.record_dict()})

    @app.post("/v1/episodes/{episode_id}/end")
    async def end(episode_id: str, request: Request) -> Response:
        if not admin(request):
            return _openai_error(401, "ending an episode needs the gateway's token")
        session = await sessions.end(episode_id)
        if session is None:
            return _openai_error(404, f"no episode {episode_id!r} to end")
        return JSONResponse({"episode_id": episode_id, "ended": True, **session.trajectory.record_dict()})


def _exec_route(app: FastAPI, sessions: Sessions) -> None:
    """`POST /furlong/v1/exec` {command, timeout_s?} -> {exit_code, output}: a command in the episode's world,
    for the episode's own key only (furlong.gateway.exec has the limits and the blame rules)."""

    @app.post(EXEC_ROUTE)
    async def run(request: Request) -> Response:
        session = sessions.for_key(_key(request))
        if session is None:
            return _openai_error(401, "invalid API key (or its episode has ended)")
        if session.tools is None:  # the gateway's token, or an episode minted without a world
            return _openai_error(404, "this key's episode has no environment to run commands in")
        if not session.tools.has_bash:
            return _openai_error(404, "this episode's environment has no bash tool to run commands with")
        body = await _body(request, 1 << 20)
        if isinstance(body, tuple):
            return _openai_error(*body)
        command, timeout_s = body.get("command"), body.get("timeout_s")
        if not isinstance(command, str) or not command.strip():
            return _openai_error(400, "command: expected a non-empty string", "command")
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0
        ):
            return _openai_error(400, "timeout_s: expected a positive number of seconds", "timeout_s")
        try:
            exit_code, output = await session.tools.run(command, timeout_s)
        except EnvironmentFailed as e:
            return _openai_error(503, str(e))
        except Exception as e:  # noqa: BLE001 -- kept on the episode for the runner to judge (furlong.gateway.exec)
            return _openai_error(503, f"the episode's environment failed: {type(e).__name__}: {e}")
        return JSONResponse({"exit_code": exit_code, "output": output})
