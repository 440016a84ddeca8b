"""Several engine instances behind one Engine (furlong.engine.base).

* Placement: a request whose prompt extends an earlier request's prompt + output (a later turn of the
  same episode) goes back to the instance that served that one, so its prefix cache holds the
  conversation; any other request (a new episode) goes to the live instance with the fewest requests in
  flight. The protocol carries no episode id, so stickiness is inferred from token prefixes
  (`PrefixIndex`); it is only a hint: a wrong guess costs a cache miss, never a wrong sample.
* Failure: a background task polls GET /health; an instance that does not answer `unhealthy_after`
  polls in a row, or whose connection fails during a request, is taken out. Its in-flight requests are
  restarted from their prompt on another live instance, so the Generation returned is wholly that
  instance's (ids, logprobs, token versions): never a splice of two.
* The last live instance is never taken out for slow health answers (polls that time out): with nowhere
  else to send its requests, taking it out would fail them all at once, while a merely slow engine (busy
  cores, loading weights) answers them in the end. A dead one is still taken out (refused connections, on a
  poll or a request); a hung one keeps its requests until the client's timeout (RemoteEngine's timeout_s).
* Recovery: a taken-out instance is still polled; after `readmit_after` healthy polls in a row its relay
  pulls the newest weights (it missed every update while out) and it is put back only if it then holds
  at least the live instances' version, paused if the router is paused. A restarted server on the same
  address comes back the same way. Where a weight link manages membership (the broadcast group, whose
  engines have no relay to pull with), `readmit_after=0` leaves it to the link: `take_out` / `readmit`.
* Weights: sync / update_weights / pause / resume fan out to every live instance; the router's
  weight_version is the lowest live instance's.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from furlong.engine.base import EngineError, EngineTimedOut, EngineUnavailable, Generation, SamplingParams
from furlong.engine.remote import RemoteEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
_MOD = (1 << 61) - 1  # a Mersenne prime: 61-bit polynomial hashes of token prefixes
_BASE = 1_000_003


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """hashes[n] is the hash of tokens[:n]; one pass, so every prefix length can be looked up in O(1)."""
    out, h = [0], 0
    for t in tokens:
        h = (h * _BASE + int(t) + 1) % _MOD
        out.append(h)
    return out


class PrefixIndex:
    """Which instance served each recent conversation (prompt + output), found again by the longest one
    that a new prompt extends. Bounded: the least recently used entries go first."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[tuple[int, int], int] = OrderedDict()  # (length, hash) -> instance index
        self._lengths: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._owners)

    def lookup(self, hashes: list[int], usable: Callable[[int], bool]) -> tuple[tuple[int, int], int] | None:
        """The (key, instance) of the longest recorded sequence that is a prefix of the prompt whose
        `_prefix_hashes` these are, among instances `usable` accepts."""
        for length in sorted((n for n in self._lengths if n < len(hashes)), reverse=True):
            key = (length, hashes[length])
            owner = self._owners.get(key)
            if owner is not None and usable(owner):
                self._owners.move_to_end(key)
                return key, owner
        return None

    def record(self, tokens: Sequence[int], owner: int, replaces: tuple[int, int] | None = None) -> None:
        """Remember `tokens` as served by `owner`; the episode's previous entry (`replaces`) is done with."""
        if replaces is not None and replaces in self._owners:
            self._drop(replaces)
        key = (len(tokens), _prefix_hashes(tokens)[-1])
        if key not in self._owners:
            self._lengths[key[0]] += 1
        self._owners[key] = owner
        self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._drop(next(iter(self._owners)))

    def _drop(self, key: tuple[int, int]) -> None:
        del self._owners[key]
        self._lengths[key[0]] -= 1
        if not self._lengths[key[0]]:
            del self._lengths[key[0]]


class Instance:
    """One engine behind the router, with its counters (cumulative, but `in_flight`)."""

    def __init__(self, index: int, engine: RemoteEngine) -> None:
        self.index, self.engine = index, engine
        self.live, self.reason, self.strikes, self.healthy_out = True, "", 0, 0
        self.down = asyncio.Event()  # set when taken out: wakes the requests waiting on it
        self.requests = self.in_flight = self.failures = self.retries = self.sticky = self.readmitted = 0

    @property
    def name(self) -> str:
        return f"engine{self.index} ({self.engine.url})"


@dataclass(frozen=True)
class RouterSettings:
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    unhealthy_after: int = 2  # consecutive failed polls; a refused connection during a request is enough
    readmit_after: int = 3  # consecutive healthy polls before a taken-out instance is put back; 0: never
    prefix_entries: int = 4096  # conversations remembered for sticky routing


class Router:
    """An Engine over several RemoteEngines (see the module docstring). Use one per event loop."""

    def __init__(self, engines: Sequence[RemoteEngine], settings: RouterSettings = RouterSettings()) -> None:
        if not engines:
            raise EngineError("a router needs at least one engine instance")
        self.instances = [Instance(i, e) for i, e in enumerate(engines)]
        self.settings = settings
        self.prefixes = PrefixIndex(settings.prefix_entries)
        self._watcher: asyncio.Task[None] | None = None
        self._paused = False  # so that an instance put back meanwhile is paused too
        # Held by weight operations and by putting an instance back, so that none of them interleave: an
        # instance put back during a sync would miss it and serve the old weights unreported.
        self._weights_lock = asyncio.Lock()

    # -- Engine protocol ---------------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return min(i.engine.weight_version for i in self._live_or_all())

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None) -> Generation:
        """Served by one instance; restarted from the prompt on another if that one fails mid-request."""
        prompt = [int(t) for t in input_ids]
        gen, inst, previous = await self._serve(prompt, lambda i: i.engine.generate(prompt, sampling))
        self.prefixes.record(prompt + list(gen.output_ids), inst.index, replaces=previous)
        return gen

    async def score(self, input_ids: list[int], start: int, temperature: float = 1.0) -> list[float]:
        """Scored by one instance (where its prefix is cached, if anywhere); by another if that one fails."""
        ids = [int(t) for t in input_ids]
        return (await self._serve(ids, lambda i: i.engine.score(ids, start, temperature)))[0]

    async def _serve(
        self, tokens: list[int], call: Callable[[Instance], Awaitable[T]]
    ) -> tuple[T, Instance, tuple[int, int] | None]:
        """`call` on the instance placed for `tokens`, then on others while the one tried is unavailable."""
        self._watch()
        hashes, tried = _prefix_hashes(tokens), set[int]()
        while True:
            inst, previous = self._place(hashes, tried)
            if tried:
                inst.retries += 1
            tried.add(inst.index)
            try:
                return await self._attempt(inst, call), inst, previous
            except EngineUnavailable as e:
                inst.failures += 1
                self._take_out(inst, str(e))

    async def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        await self._fan_out(lambda i: i.engine.update_weights(state_dict, version))

    async def pause(self) -> None:
        self._paused = True
        await self._fan_out(lambda i: i.engine.pause())

    async def resume(self) -> None:
        self._paused = False
        await self._fan_out(lambda i: i.engine.resume())

    async def sync(self) -> dict:
        """Every live instance's relay pulls the newest version; one report in SyncReport's shape (the
        lowest versions, the longest times, every instance's faults), plus `instances_live`."""
        self._watch()
        reports = [r for _, r in await self._fan_out(lambda i: i.engine.sync())]
        lowest = min(reports, key=lambda r: r["engine_version"])
        return {
            "engine_version_before": min(r["engine_version_before"] for r in reports),
            "engine_version": lowest["engine_version"],
            "applied": tuple(lowest["applied"]),
            "bytes_pulled": sum(r["bytes_pulled"] for r in reports),
            "pushed_tensors": max(r["pushed_tensors"] for r in reports),
            **{k: max(r[k] for r in reports) for k in ("stage_s", "drain_s", "pause_s")},
            "recovered": any(r["recovered"] for r in reports),
            "faults": tuple(f for r in reports for f in r["faults"]),
            "instances_live": len(reports),
        }

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        await asyncio.gather(*(i.engine.close() for i in self.instances))

    def metrics(self) -> dict[str, float]:
        """For the step logs: per instance, requests / in flight / failures / retries taken over / sticky
        placements (all since the router started, but in_flight) and whether it is live."""
        out: dict[str, float] = {"router_live": float(len(self.live()))}
        for i in self.instances:
            out.update(
                {
                    f"engine{i.index}_live": float(i.live),
                    f"engine{i.index}_requests": i.requests,
                    f"engine{i.index}_in_flight": i.in_flight,
                    f"engine{i.index}_failures": i.failures,
                    f"engine{i.index}_retries": i.retries,
                    f"engine{i.index}_sticky": i.sticky,
                    f"engine{i.index}_readmitted": i.readmitted,
                }
            )
        return out

    # -- membership, for a weight link that manages it (furlong.train.weights.BroadcastLink) ---------------

    def is_live(self, engine: object) -> bool:
        return self._instance(engine).live

    def take_out(self, engine: object, reason: str) -> None:
        """Stop routing to `engine` now; its in-flight requests restart on another live instance."""
        self._take_out(self._instance(engine), reason)

    async def readmit(self, engine: object) -> bool:
        """Put `engine` back if it is out and holds at least the live instances' weight version (the caller
        has just loaded it); whether it is live."""
        inst = self._instance(engine)
        if not inst.live:
            await self._readmit(inst)
        return inst.live

    def _instance(self, engine: object) -> Instance:
        found = [i for i in self.instances if i.engine is engine]
        if not found:
            raise EngineError(f"{engine!r} is not one of this router's instances")
        return found[0]

    # -- placement and failure ---------------------------------------------------------------------------

    def live(self) -> list[Instance]:
        return [i for i in self.instances if i.live]

    def _live_or_all(self) -> list[Instance]:
        return self.live() or self.instances

    def _place(self, hashes: list[int], tried: set[int]) -> tuple[Instance, tuple[int, int] | None]:
        """The sticky instance if the prompt extends a conversation a usable one served, else the least
        loaded (fewest in flight, then fewest served, then lowest index); and the matched index entry."""
        usable = [i for i in self.live() if i.index not in tried]
        if not usable:
            raise EngineError(
                f"no live engine instance left to serve the request (tried {len(tried)}; "
                + "; ".join(f"{i.name}: {i.reason}" for i in self.instances if not i.live)
                + ")"
            )
        found = self.prefixes.lookup(hashes, lambda n: any(i.index == n for i in usable))
        if found is not None:
            inst = self.instances[found[1]]
            inst.sticky += 1
            return inst, found[0]
        return min(usable, key=lambda i: (i.in_flight, i.requests, i.index)), None

    async def _attempt(self, inst: Instance, call: Callable[[Instance], Awaitable[T]]) -> T:
        """One request on one instance; EngineUnavailable if it fails or is taken out meanwhile (a hung
        instance never answers: the health check's verdict ends the wait)."""
        inst.requests += 1
        inst.in_flight += 1
        request = asyncio.ensure_future(call(inst))
        down = asyncio.ensure_future(inst.down.wait())
        try:
            await asyncio.wait({request, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            inst.in_flight -= 1
            down.cancel()
            if not request.done():
                request.cancel()
        if request.done() and not request.cancelled():
            return request.result()
        raise EngineUnavailable(f"{inst.name} was taken out: {inst.reason}")

    def _take_out(self, inst: Instance, reason: str) -> None:
        if inst.live:
            inst.live, inst.reason = False, reason
            inst.down.set()
            log.warning("router: %s taken out (%s); %d live", inst.name, reason, len(self.live()))

    async def _fan_out(self, op: Callable[[Instance], Awaitable[T]]) -> list[tuple[Instance, T]]:
        """`op` on every live instance at once; an unreachable one is taken out, any other error raised."""
        async with self._weights_lock:
            targets = self.live()
            results = await asyncio.gather(*(op(i) for i in targets), return_exceptions=True)
        done = []
        for inst, res in zip(targets, results):
            if isinstance(res, EngineUnavailable):
                self._take_out(inst, str(res))
            elif isinstance(res, BaseException):
                raise res
            else:
                done.append((inst, res))
        if not done:
            raise EngineError("no live engine instance: " + "; ".join(f"{i.name}: {i.reason}" for i in self.instances))
        return done

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        # One check per instance at a time, each its own task: a hung instance's slow polls (or one being
        # put back) must not hold up the others'.
        checks: dict[int, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(self.settings.health_interval_s)
                for inst in self.instances:
                    if inst.index not in checks or checks[inst.index].done():
                        checks[inst.index] = asyncio.create_task(self._check(inst))
        finally:
            for task in checks.values():
                task.cancel()
            await asyncio.gather(*checks.values(), return_exceptions=True)

    async def _check(self, inst: Instance) -> None:
        try:
            await inst.engine.health(timeout_s=self.settings.health_timeout_s)
        except EngineError as e:
            inst.healthy_out = 0
            if inst.live:
                inst.strikes += 1
                if inst.strikes >= self.settings.unhealthy_after:
                    self._fail_health(inst, e)
            return
        inst.strikes = 0
        if not inst.live and self.settings.readmit_after:
            inst.healthy_out += 1
            if inst.healthy_out >= self.settings.readmit_after:
                inst.healthy_out = 0
                await self._readmit(inst)

    def _fail_health(self, inst: Instance, error: EngineError) -> None:
        """Take out an instance that failed `unhealthy_after` polls in a row, unless it is the last live one
        and only slow: without it every request would fail at once, while a slow engine may still answer
        them (a hung one fails them at the client's timeout, a dead one at once: refused connections)."""
        if isinstance(error, EngineTimedOut) and self.live() == [inst]:
            if inst.strikes == self.settings.unhealthy_after:  # once per slow streak
                log.warning(
                    "router: %s answers /health slowly (%s); kept in as the last live instance", inst.name, error
                )
            return
        self._take_out(inst, f"{inst.strikes} health checks failed, the last: {error}")

    async def _readmit(self, inst: Instance) -> None:
        """Put a recovered instance back once it holds the live instances' weights (it may have missed
        updates, or be a restarted server holding its start weights)."""
        async with self._weights_lock:
            target = min((i.engine.weight_version for i in self.live()), default=inst.engine.weight_version)
            try:
                if inst.engine.weight_version < target:
                    await inst.engine.sync()
                if self._paused:
                    await inst.engine.pause()
            except EngineError as e:
                inst.reason = f"recovered but could not catch up: {e}"
                return
            if inst.engine.weight_version < target:
                inst.reason = f"recovered at weight version {inst.engine.weight_version}, behind the live {target}"
                return
            inst.live, inst.reason, inst.down = True, "", asyncio.Event()
        inst.readmitted += 1
        log.warning(
            "router: %s put back at weight version %d; %d live", inst.name, inst.engine.weight_version, len(self.live())
        )
