"""The uvicorn settings the gateway is served with: by `furlong gateway serve`, inside a run
(furlong.gateway.local) and by bench/gateway_overhead.py, so the bench measures what runs."""

from __future__ import annotations

from typing import Any

import uvicorn

# uvicorn's defaults otherwise (uvloop and httptools where installed); no access log: a line per request is
# work on the event loop every episode waits on, and the gateway's own records say what was asked
GATEWAY_UVICORN: dict[str, Any] = {"log_level": "warning", "access_log": False}


def gateway_config(app: Any, **overrides: Any) -> uvicorn.Config:
    return uvicorn.Config(app, **(GATEWAY_UVICORN | overrides))
