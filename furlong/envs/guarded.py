"""The sandbox an episode's agent and verifier see (GuardedSandbox): the episode's own sandbox behind a thin
wrapper that adds up the time spent in its calls and the commands run, and remembers every exception a call
raised, so the runner can tell a broken sandbox from a bug in the agent's own code. Closing it is refused: the
runner, not the agent, ends an episode. furlong.envs.harbor wraps each episode's sandbox (and a separate
verifier's, a control run's) in one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from furlong.envs.base import exception_chain
from furlong.sandbox.base import ChangeTracking, Sandbox
from furlong.sandbox.changes import Change


class GuardedSandbox:
    """What an agent or the verifier sees: the episode's sandbox, with the time spent in its calls
    added up and every exception a call raised remembered (and re-raised unchanged), so the runner
    can tell a broken sandbox from a bug in the agent's own code."""

    def __init__(self, inner: Sandbox):
        self.inner = inner
        self.seconds = 0.0
        self.commands = 0
        self.errors: list[BaseException] = []

    def caused(self, exc: BaseException) -> bool:
        """Whether `exc`, or an exception it was raised from or while handling, came from a sandbox call."""
        return any(c is e for c in exception_chain(exc) for e in self.errors)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await getattr(self.inner, method)(*args, **kwargs)
        except Exception as exc:
            self.errors.append(exc)
            raise
        finally:
            self.seconds += time.perf_counter() - start
            self.commands += method == "exec"

    @property
    def verifier_uid(self) -> int | None:
        return getattr(self.inner, "verifier_uid", None)

    @property
    def agent_uid(self) -> int:
        return getattr(self.inner, "agent_uid", 0)

    async def exec(
        self,
        cmd: str,
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        as_verifier: bool = False,
        on_output: Callable[[str, bytes], None] | None = None,
    ):
        if on_output is None:
            return await self._call("exec", cmd, timeout_s, cwd, env, as_verifier=as_verifier)
        failed: list[Exception] = []

        def relay(stream: str, data: bytes) -> None:
            if not failed:
                try:
                    on_output(stream, data)
                except Exception as exc:  # noqa: BLE001 -- raised below, outside _call: the caller's, not the sandbox's
                    failed.append(exc)

        result = await self._call("exec", cmd, timeout_s, cwd, env, as_verifier=as_verifier, on_output=relay)
        if failed:
            raise failed[0]
        return result

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644, as_verifier: bool = False) -> None:
        await self._call("write_file", path, data, mode, as_verifier=as_verifier)

    async def read_file(self, path: str, as_verifier: bool = False) -> bytes:
        return await self._call("read_file", path, as_verifier=as_verifier)

    async def put_dir(self, src, dest: str, as_verifier: bool = False) -> None:
        await self._call("put_dir", src, dest, as_verifier=as_verifier)

    async def put_tar(self, data: bytes, dest: str, as_verifier: bool = False) -> None:
        await self._call("put_tar", data, dest, as_verifier=as_verifier)

    async def changes(self, roots: Sequence[str]) -> tuple[Change, ...] | None:
        """The inner sandbox's ChangeTracking, where it has it (None otherwise: no tamper check)."""
        if not isinstance(self.inner, ChangeTracking):
            return None
        return await self._call("changes", roots)

    async def image_has(self, paths: Sequence[str]) -> frozenset[str] | None:
        if not isinstance(self.inner, ChangeTracking):
            return None
        return await self._call("image_has", paths)

    async def close(self) -> None:  # the runner closes the sandbox; an agent cannot end the episode early
        raise RuntimeError("an agent must not close its episode's sandbox")

    @property
    def alive(self) -> bool:
        return self.inner.alive
