"""The uvicorn settings the gateway is served with: by `furlong gateway serve`, inside a run
(furlong.gateway.local) and by bench/gateway_overhead.py, so the bench measures what runs."""

from __future__ import annotations

from typing import Any

import uvicorn


def gateway_config(app: Any, **overrides: Any) -> uvicorn.Config:
    return uvicorn.Config(app, **({"log_level": "warning"} | overrides))
