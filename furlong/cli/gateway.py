"""`furlong gateway serve`: the OpenAI/Anthropic-compatible gateway on its own (docs/gateway.md)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from furlong.cli.common import console


def cmd_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from furlong.gateway.app import make_app
    from furlong.gateway.build import make_engine_for, make_policy
    from furlong.gateway.serving import GATEWAY_UVICORN
    from furlong.paths import cache_dir
    from furlong.sync.serving import read_token_file, server_token

    token = server_token(
        args.token_file,
        args.host,
        cache_dir() / "gateway-token",
        console.print,
        "the API key OpenAI and Anthropic clients send",
    )
    engine_token = None if args.engine_token_file is None else read_token_file(args.engine_token_file)
    engine = make_engine_for(args.model, args.engine, seed=args.seed, token=engine_token)
    policy = make_policy(
        args.model, engine, name=args.name, tool_format_name=args.tool_format, default_max_tokens=args.max_tokens
    )
    app = make_app(policy, token)
    console.print(
        f"gateway for {policy.name} ({args.engine}, tool calls: {policy.fmt.name}) on http://{args.host}:{args.port}/v1"
    )
    try:
        uvicorn.run(app, host=args.host, port=args.port, **GATEWAY_UVICORN)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            asyncio.run(close())
    return 0


def add_gateway_parser(sub) -> None:
    gw = sub.add_parser("gateway", help="the OpenAI/Anthropic-compatible gateway (docs/gateway.md)")
    gw_sub = gw.add_subparsers(dest="gateway_command", required=True)
    sv = gw_sub.add_parser(
        "serve",
        help="serve /v1/chat/completions, /v1/messages and /v1/models for a model, "
        "recording each episode's token-in/token-out trajectory",
    )
    sv.add_argument("--model", type=Path, required=True, help="a checkpoint directory (its tokenizer and template)")
    sv.add_argument("--engine", default="hf", help="hf | vllm | sglang, or an engine server's URL (default hf)")
    sv.add_argument("--engine-token-file", type=Path, help="the engine server's token, for an --engine URL")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8800, help="port (default 8800)")
    sv.add_argument(
        "--token-file",
        type=Path,
        help="file holding the API key clients send (needed off loopback; default: one is generated)",
    )
    sv.add_argument("--name", help="the model name /v1/models lists (default: the checkpoint directory's name)")
    sv.add_argument(
        "--tool-format",
        default="auto",
        help="tool-call format: auto (from the chat template), hermes, qwen3_coder, llama3, harmony",
    )
    sv.add_argument("--max-tokens", type=int, default=512, help="tokens per turn when a request sets none")
    sv.add_argument("--seed", type=int, default=0, help="seed for requests that bring none (default 0)")
