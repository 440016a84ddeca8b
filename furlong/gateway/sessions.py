"""Episodes and their API keys: a key is minted per episode, maps every request to its trajectory, and is
refused once the episode has ended (a harness that keeps calling after its timeout changes nothing).

The gateway's own token (the standalone `furlong gateway serve` key) serves any OpenAI or Anthropic client
at once, each request on its own throwaway trajectory: nothing is recorded, and its requests run
concurrently (an episode's are served one at a time, in order, so its trajectory can be stitched)."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from furlong.gateway.exec import EpisodeTools
from furlong.gateway.trajectory import Trajectory


@dataclass
class Session:
    episode_id: str
    trajectory: Trajectory
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request per episode at a time
    ended: bool = False
    tools: EpisodeTools | None = None  # what its key may run in its world (the exec route); None: nothing
    waited_s: float = 0.0  # seconds its requests spent in the engine, finished ones
    waiting_since: float | None = None  # perf_counter() at the start of the one in the engine now

    def engine_wait_s(self) -> float:
        """Seconds its requests have spent in the engine so far, one in progress included: the harness's
        agent timeout does not count them (furlong.agent.harness), as furlong's own agent's does not."""
        since = self.waiting_since
        return self.waited_s + (0.0 if since is None else time.perf_counter() - since)


class Sessions:
    def __init__(self, token: str, new_trajectory: Callable[[], Trajectory]) -> None:
        self._token = token.encode()
        self._new = new_trajectory
        self._by_key: dict[str, Session] = {}
        self._by_id: dict[str, Session] = {}

    def _open(self, episode_id: str) -> Session:
        session = Session(episode_id, self._new())
        self._by_id[episode_id] = session
        return session

    def is_admin(self, key: str) -> bool:
        # bytes: compare_digest refuses a str with non-ASCII characters (a 500 where a 401 belongs)
        return hmac.compare_digest(key.encode(), self._token)

    def mint(self, episode_id: str | None = None, tools: EpisodeTools | None = None) -> tuple[str, str]:
        """A new episode and its key (`tools`: what the key may run through the exec route). An id already
        used (live or ended) is refused: keys never repeat."""
        episode_id = episode_id or f"ep-{secrets.token_hex(6)}"
        if episode_id in self._by_id:
            raise KeyError(episode_id)
        key = f"fk-{secrets.token_urlsafe(24)}"
        self._by_key[key] = self._open(episode_id)
        self._by_key[key].tools = tools
        return episode_id, key

    def for_key(self, key: str) -> Session | None:
        """The live session `key` opens (a throwaway one for the gateway's token); None if refused."""
        if self.is_admin(key):
            return Session("unrecorded", self._new())
        session = self._by_key.get(key)
        return session if session is not None and not session.ended else None

    def get(self, episode_id: str) -> Session | None:
        return self._by_id.get(episode_id)

    async def end(self, episode_id: str) -> Session | None:
        """End an episode: its key is refused from now on; waits for a request in flight to be recorded."""
        session = self._by_id.get(episode_id)
        if session is None:
            return None
        for key in [k for k, s in self._by_key.items() if s is session]:
            del self._by_key[key]  # first: a request arriving from now on is refused
        async with session.lock:
            session.ended = True
        return session
