"""The hf engine in its own process, served over HTTP, with a weight-sync relay beside it.

    furlong engine serve --model DIR --updates DIR_OR_URL [--host H] [--port P] [--token-file FILE]
    (python -m furlong.engine.server takes the same flags)

This is the shape a multi-host deployment takes: the trainer publishes updates to a directory
(or serves it with `furlong.sync.UpdateServer`); each engine process owns a `Relay` that pulls
and verifies the chain *while the engine keeps generating*, then pauses it only to copy the
rebuilt tensors in. Routes (JSON):

* POST /generate  {"input_ids": [...], "sampling": {...}} -> a Generation (token ids in and out)
* POST /sync      pull the newest published version into the engine -> a SyncReport;
                  409 with the faults when nothing newer could be verified (engine untouched)
* POST /pause, POST /resume, GET /health -> {"weight_version", "paused", "relay", "prefix_cache",
                  "weight_groups"}
* POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group:
  weights broadcast by the trainer over a torch.distributed group, in SGLang's shapes
  (furlong.engine.distributed)
* POST /update_weights_from_tensor: weights handed over in shared memory by a trainer on this host, in
  SGLang's shape (furlong.engine.handover)

When the socket is listening the process prints one line, `furlong-engine listening on URL`,
so a parent that asked for port 0 learns the port. Every route but /health needs `Authorization: Bearer
<token>` (else 401, before the route runs: nothing changed). The token is --token-file's, else
$FURLONG_ENGINE_TOKEN (how a parent passes one, out of the command line), else, on a loopback --host only,
a fresh one written to the cache's engine-token; a non-loopback --host without a token is refused at start,
as `furlong sandbox serve` refuses it. A malformed body gets 400.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from furlong.engine.base import EngineError, SamplingParams
from furlong.engine.distributed import DistributedReceiver, add_distributed_routes
from furlong.engine.handover import add_tensor_route
from furlong.engine.hf import HFEngine
from furlong.engine.serve_args import add_serve_arguments
from furlong.model.loading import load_model
from furlong.paths import cache_dir
from furlong.sync.relay import Relay, SyncFailed
from furlong.sync.serving import (
    SERVER_KEEPALIVE_S,
    bound_socket,
    check_token,
    guarded_app,
    read_token_file,
    require_token_off_loopback,
    write_token,
)
from furlong.sync.transport import UPDATES_TOKEN_ENV, DirectoryTransport, HttpTransport, Transport

READY_PREFIX = "furlong-engine listening on "
ENGINE_TOKEN_ENV = "FURLONG_ENGINE_TOKEN"  # the bearer token every route but /health then requires
OPEN_PATHS = frozenset({"/health"})  # liveness for routers and probes; it changes nothing


class SamplingBody(BaseModel):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None


class GenerateBody(BaseModel):
    input_ids: list[int]
    sampling: SamplingBody = SamplingBody()


class ScoreBody(BaseModel):
    input_ids: list[int]
    start: int
    temperature: float = 1.0


def open_transport(spec: str) -> Transport:
    """An http(s) URL is an UpdateServer; anything else is a published directory."""
    if spec.startswith(("http://", "https://")):
        return HttpTransport(spec, token=os.environ.get(UPDATES_TOKEN_ENV) or None)
    return DirectoryTransport(spec)


def build_app(engine: HFEngine, relay: Relay | None, token: str | None = None) -> FastAPI:
    """The routes over `engine`: the hf engine, or (in a Ray engine actor) any engine with the Engine protocol
    and update_weights, e.g. vLLM or an SGLang server's client, which have no hf prefix cache to report."""
    receiver = DistributedReceiver(engine, secret=token)  # a group's members prove the same token

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.close()

    app = guarded_app("furlong hf engine", token, lifespan=lifespan, open_paths=OPEN_PATHS)

    @app.get("/health")
    async def health() -> dict:
        return _health(engine, relay, receiver)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> dict:
        try:
            sampling = SamplingParams(**body.sampling.model_dump())
            gen = await engine.generate(body.input_ids, sampling)
        except (EngineError, ValueError) as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        return dataclasses.asdict(dataclasses.replace(gen, routes=None))  # routes stay in-process

    @app.post("/score")
    async def score(body: ScoreBody) -> dict:
        try:
            return {"logprobs": await engine.score(body.input_ids, body.start, body.temperature)}
        except (EngineError, ValueError) as e:
            raise HTTPException(status_code=400, detail=str(e)) from None

    @app.post("/sync")
    async def sync() -> dict:
        if relay is None:
            raise HTTPException(status_code=409, detail="this engine was started without --updates")
        try:
            report = await relay.sync_once()
        except SyncFailed as e:
            raise HTTPException(status_code=409, detail={"error": str(e), "faults": list(e.faults)}) from None
        return dataclasses.asdict(report)

    @app.post("/pause")
    async def pause() -> dict:
        await engine.pause()
        return await health()

    @app.post("/resume")
    async def resume() -> dict:
        await engine.resume()
        return await health()

    add_distributed_routes(app, receiver)
    add_tensor_route(app, engine)
    return app


def _health(engine: HFEngine, relay: Relay | None, receiver: DistributedReceiver) -> dict:
    """/health's answer: the weight version, whether paused, and the hf prefix cache's counters (None for an
    engine without one)."""
    s, cache = getattr(engine, "stats", None), getattr(engine, "prefix_cache", None)
    return {
        "weight_version": engine.weight_version,
        "paused": getattr(engine, "paused", False),
        "relay": relay is not None,
        "prefix_cache": None
        if s is None or cache is None
        else {
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "hit_rate": s.prefix_hit_rate,
            "bytes": cache.nbytes,
        },
        "weight_groups": sorted(receiver.groups),
    }


def load_engine(args: argparse.Namespace) -> HFEngine:
    """The hf engine of the server flags in `args` (furlong.engine.serve_args)."""
    model: Any = load_model(args.model)  # or the PeftModel over it: HFEngine runs either
    if args.lora:
        from furlong.model.lora import LoraSpec, wrap_lora

        spec = json.loads(args.lora)
        model = wrap_lora(model, LoraSpec(rank=spec["rank"], alpha=spec["alpha"], targets=tuple(spec["targets"])))
    return HFEngine(
        model.to(args.device),
        eos_token_ids=(),
        max_batch_size=args.max_batch_size,
        prefix_cache_mb=args.prefix_cache_mb,
    )


def given_token(args: argparse.Namespace) -> str | None:
    """The bearer token given to the server: --token-file's, else $FURLONG_ENGINE_TOKEN (EngineProcess and
    `furlong train` pass theirs there, out of the command line); None: make one (loopback --host only)."""
    if args.token_file is not None:
        return read_token_file(args.token_file)
    if env := os.environ.get(ENGINE_TOKEN_ENV):
        return check_token(env, f"${ENGINE_TOKEN_ENV}")
    require_token_off_loopback(args.host, None, "--token-file")
    return None


def made_token() -> str:
    """A fresh token in the cache's engine-token, for the server's local clients to read."""

    def say(line: str) -> None:  # on stderr: stdout is for the ready line
        print(line, file=sys.stderr, flush=True)

    return write_token(cache_dir() / "engine-token", say, "RemoteEngine(url, token=...)")


def serve(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; 0 after a clean shutdown, 1 if the server never started."""
    import uvicorn

    token = given_token(args)  # before the model loads: a refused --host or a bad token file fails at once
    torch.set_num_threads(args.threads)
    engine = load_engine(args)
    token = token or made_token()  # only once the model loaded: a failed start leaves no file
    relay = Relay(open_transport(args.updates), engine) if args.updates else None
    sock = bound_socket(args.host, args.port)
    app = build_app(engine, relay, token)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=SERVER_KEEPALIVE_S)
    )

    async def run() -> None:
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()[:2]
        print(f"{READY_PREFIX}http://{host}:{port}", flush=True)
        await serving

    asyncio.run(run())
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m furlong.engine.server`: the flags of `furlong engine serve`, without the CLI."""
    ap = argparse.ArgumentParser(prog="python -m furlong.engine.server", description=__doc__.splitlines()[0])
    add_serve_arguments(ap)
    try:
        return serve(ap.parse_args(argv))
    except ValueError as e:  # a refused --host or a bad token file: say which, no traceback
        print(f"{ap.prog}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
