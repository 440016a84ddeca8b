"""The rollout side of RL, sync or async: a deterministic stream of GRPO groups, workers that keep up to
`inflight` of them running, and a buffer of complete groups the trainer takes batches from.

One loop serves both modes; they differ only in two numbers:

* lookahead: groups taken, running or complete never exceed (steps trained + 1 + lookahead) batches' worth.
  Sync has 0 (the next step's groups wait for this step's update: zero overlap), async has max_staleness.
* inflight: groups running at once (sync: one step's worth).

A batch is `tasks_per_step` COMPLETE groups, taken as soon as the buffer holds that many (the oldest
samples first, so they do not go stale). A group whose oldest sampled token is more than `max_staleness`
versions behind the version being trained is never trained: it is dropped (the stream's next group runs
in its place) or re-queued (its task runs again with fresh seeds). Groups are started only while the
steps left need them, so when the last step is trained nothing is left running or unaccounted for.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from furlong.agent.episode import Episode
from furlong.envs.base import EnvSpec
from furlong.rollout.groups import PlannedEpisode, Rollouts, plan_step
from furlong.seeding import mix_seed

OUTCOMES = ("trained", "dropped_stale", "filtered", "infra_error")  # how each started episode ends


@dataclass(frozen=True)
class GroupSpec:
    index: int  # position in the stream: step * tasks_per_step + slot (its episodes' group_id)
    step: int  # the step plan_step planned it for
    slot: int  # its place in plan_step(step).tasks
    attempt: int  # 0, or how many stale copies of this group were re-queued before this one
    task: EnvSpec
    seeds: tuple[int, ...]  # one sampling seed per episode

    def episodes(self) -> list[PlannedEpisode]:
        return [
            PlannedEpisode(self.task, seed, self.index, self.step, self.attempt, s) for s, seed in enumerate(self.seeds)
        ]


class GroupStream:
    """The groups sync mode has always trained, in order: plan_step(step) for step 0, 1, ... flattened."""

    def __init__(self, tasks: Sequence[EnvSpec], tasks_per_step: int, group_size: int, seed: int) -> None:
        self.tasks, self.tasks_per_step, self.group_size, self.seed = tasks, tasks_per_step, group_size, seed

    def spec(self, index: int, attempt: int = 0) -> GroupSpec:
        step, slot = divmod(index, self.tasks_per_step)
        plan = plan_step(self.tasks, step, self.tasks_per_step, self.group_size, self.seed)
        # attempt 0 keeps the seeds sync mode has always used; a re-queued copy samples afresh
        seeds = tuple(
            plan.episode_seed(slot, s) if attempt == 0 else mix_seed(self.seed, step, slot, s, attempt)
            for s in range(self.group_size)
        )
        return GroupSpec(index, step, slot, attempt, plan.tasks[slot], seeds)


@dataclass(frozen=True)
class Group:
    spec: GroupSpec
    episodes: tuple[Episode, ...]

    @property
    def oldest_version(self) -> int | None:
        """The weight version of the group's oldest sampled token (None: nothing was sampled)."""
        return min((e.oldest_version for e in self.episodes if e.oldest_version is not None), default=None)

    def staleness(self, version: int) -> int:
        oldest = self.oldest_version
        return 0 if oldest is None else version - oldest


@dataclass(frozen=True)
class Batch:
    version: int  # the trainer version these groups are trained at
    groups: tuple[Group, ...]  # in stream order
    stale: tuple[Group, ...]  # dropped or re-queued while this batch was gathered
    started: int  # episodes started since the previous batch
    in_flight: int  # episodes started and not yet settled after this batch was taken
    wait_s: float  # how long the trainer waited for it

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g.episodes]

    def with_episodes(self, episodes: Sequence[Episode]) -> Batch:
        """The same batch with `episodes` (in `self.episodes` order) in place of its own, e.g. scored by a
        distillation teacher."""
        it = iter(episodes)
        groups = tuple(replace(g, episodes=tuple(next(it) for _ in g.episodes)) for g in self.groups)
        if next(it, None) is not None or sum(len(g.episodes) for g in groups) != len(episodes):
            raise ValueError(f"{len(episodes)} episodes for a batch of {len(self.episodes)}")
        return replace(self, groups=groups)


class Scheduler:
    def __init__(
        self,
        rollouts: Rollouts,
        stream: GroupStream,
        *,
        temperature: float,
        steps_left: int,
        first_step: int,
        inflight: int,
        lookahead: int,
        max_staleness: int,
        requeue: bool,
        cursor: dict | None = None,
        counted: int = 0,
    ) -> None:
        self.rollouts, self.stream, self.temperature = rollouts, stream, temperature
        self.inflight, self.lookahead, self.max_staleness, self.requeue = inflight, lookahead, max_staleness, requeue
        self._per_step = stream.tasks_per_step
        self._step = first_step  # the step the trainer trains next
        self._taken = first_step * self._per_step  # groups taken into batches, the killed run's included
        self._total = (first_step + steps_left) * self._per_step
        # resume: groups the killed run had started but not trained run first, then the stream goes on
        self._next = cursor["next"] if cursor else first_step * self._per_step
        self._pending: deque[GroupSpec] = deque(stream.spec(i, a) for i, a in (cursor or {}).get("pending", []))
        self._running: dict[asyncio.Task, GroupSpec] = {}
        self._complete: list[Group] = []
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        # resume: `counted` episodes of the re-planned groups were in flight at the killed run's last logged
        # step, so its rows already count them as started; their re-runs are not counted again
        self._started = -counted
        self._closed = False

    def _live(self) -> int:
        """Groups taken, running or complete: every group started that is, or may still be, trained."""
        return self._taken + len(self._running) + len(self._complete)

    def _peek(self) -> GroupSpec:
        return self._pending[0] if self._pending else self.stream.spec(self._next)

    def _window(self, step: int) -> int:
        """How many groups may be live while the trainer trains `step`: sync, the groups of steps up to
        it (the next step's wait for this step's weights); async, `lookahead` steps more."""
        return min(self._total, (step + 1 + self.lookahead) * self._per_step)

    def _fill(self) -> None:
        ahead = self._window(self._step)
        while not self._closed and len(self._running) < self.inflight and self._live() < ahead:
            spec = self._peek()
            if self._pending:
                self._pending.popleft()
            else:
                self._next += 1
            task = asyncio.get_running_loop().create_task(self._run(spec), name=f"group-{spec.index}")
            self._running[task] = spec
            self._started += len(spec.seeds)
            task.add_done_callback(self._done)

    async def _run(self, spec: GroupSpec) -> Group:
        episodes = await self.rollouts.run(spec.episodes(), self.temperature)
        return Group(spec, tuple(episodes))

    def _done(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        if task.cancelled():
            return
        if task.exception() is not None:
            self._error = task.exception()
        else:
            self._complete.append(task.result())
            self._fill()  # a worker is free: the next group starts now, even while the trainer trains
        self._changed.set()

    def _drop_stale(self, version: int) -> list[Group]:
        stale = [g for g in self._complete if g.staleness(version) > self.max_staleness]
        for g in stale:
            self._complete.remove(g)
            if self.requeue:
                self._pending.append(self.stream.spec(g.spec.index, g.spec.attempt + 1))
        return stale

    async def next_batch(self, version: int) -> Batch:
        """The next `tasks_per_step` complete groups within the staleness bound of `version`."""
        start, stale = time.perf_counter(), []
        while True:
            if self._error is not None:
                raise self._error
            stale += self._drop_stale(version)
            self._fill()
            if len(self._complete) >= self._per_step:
                break
            self._changed.clear()
            await self._changed.wait()
        self._complete.sort(key=lambda g: (g.oldest_version is None, g.oldest_version or 0, g.spec.index))
        taken, self._complete = self._complete[: self._per_step], self._complete[self._per_step :]
        self._taken += len(taken)
        if any(g.staleness(version) > self.max_staleness for g in taken):  # by construction; never silently
            raise RuntimeError("a group past max_staleness reached a batch")
        started, self._started = self._started, 0
        in_flight = sum(len(s.seeds) for s in [*self._running.values(), *(g.spec for g in self._complete)])
        return Batch(
            version,
            tuple(sorted(taken, key=lambda g: g.spec.index)),
            tuple(stale),
            started,
            in_flight,
            time.perf_counter() - start,
        )

    def prestart(self) -> None:
        """Starts now, while the trainer trains, the sandboxes of the groups that may start before the next
        call: those the window lets in once `step_done` widens it (re-queued ones first; sync: the next
        step's). Both modes need it: sync starts a step's groups only after the previous step trains, and
        async, bound by the staleness window, starts a step's worth at each `step_done` too, into slots
        the finished groups left free, where their episodes would otherwise wait for cold starts (0.7 s
        each, on 2 busy cores). Their episodes join the rollouts' line of sandbox reservations: the first
        `concurrency` start now, the rest as the episodes ahead of them take slots."""
        room = max(self._window(self._step + 1) - self._live(), 0)
        stream = range(self._next, min(self._next + room, self._total))
        upcoming = [*self._pending, *map(self.stream.spec, stream)][:room]
        self.rollouts.expect([e for spec in upcoming for e in spec.episodes()])

    def step_done(self) -> None:
        """The trainer finished a step and the engine has its weights: later groups may start."""
        self._step += 1
        self._fill()

    def cursor(self) -> dict:
        """What a resumed run needs: the stream position, and the groups started but not yet trained
        (re-planned from scratch on resume: their partial episodes are lost with the killed process)."""
        open_specs = [*self._running.values(), *(g.spec for g in self._complete), *self._pending]
        return {"next": self._next, "pending": sorted([s.index, s.attempt] for s in open_specs)}

    async def close(self) -> None:
        self._closed = True
        for task in self._running:
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
