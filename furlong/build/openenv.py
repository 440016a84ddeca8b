"""Builders for train.env.openenv=true and eval.env=openenv: the `openenv` section's server, its instances and
its sessions (furlong.envs.openenv). Light to import: no model, no sandbox."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from furlong.config import OpenEnvConfig
from furlong.envs.openenv import OpenEnvEnvironment, OpenEnvServer, OpenEnvSource, environment_server
from furlong.sandbox.remote.hosts import read_secret


def openenv_server(o: OpenEnvConfig) -> OpenEnvServer:
    """The section's server, with the token its token_file holds."""
    token = read_secret(o.token_file, "openenv.token_file", "token") if o.token_file else None
    return environment_server(o.url, token, o.connect_timeout_s, o.message_timeout_s)


def openenv_source(o: OpenEnvConfig) -> OpenEnvSource:
    return OpenEnvSource(openenv_server(o), o.instances, o.splits, o.instruction, o.agent_timeout_s)


def openenv_environment(o: OpenEnvConfig) -> Callable[[], AbstractAsyncContextManager[OpenEnvEnvironment]]:
    """Each phase's episodes open sessions on the server (nothing starts ahead, nothing to close after)."""
    server = openenv_server(o)

    @contextlib.asynccontextmanager
    async def sessions():
        yield OpenEnvEnvironment(server, o.tool_name)

    return sessions
