"""The flags of the engine server, shared by `furlong engine serve` and `python -m furlong.engine.server`.

Kept apart from furlong.engine.server (torch, FastAPI) so the CLI can build its parser without loading the
engine, and from furlong.cli so the server starts without importing the CLI.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_serve_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, required=True, help="a local Hugging Face checkpoint directory")
    ap.add_argument("--updates", help="published weight updates: a directory or an UpdateServer URL")
    ap.add_argument("--host", default="127.0.0.1", help="off loopback only with a token (--token-file)")
    ap.add_argument(
        "--token-file",
        type=Path,
        help="file holding the bearer token every route but /health then needs (needed off loopback; "
        "default: $FURLONG_ENGINE_TOKEN, else a fresh token in the cache's engine-token)",
    )
    ap.add_argument("--port", type=int, default=0, help="0: any free port (printed when ready)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--prefix-cache-mb", type=float, default=256, help="prefix cache KV budget (0: off)")
    ap.add_argument("--lora", help='JSON {"rank", "alpha", "targets"}: serve a LoRA-wrapped model')
