"""The rank-group seam: N ranks of one torch.distributed group, each hosting a worker built from a spec.

A distributed trainer's facade lives in the driver process and fans each call out to every rank
(`RankGroup.call`). `LocalRanks` runs the ranks as OS processes on this host; another implementation (Ray
actors) hosts the same worker: `join_group` then `spec.make(rank, world_size)`, in whatever process holds it.

A rank that dies, or whose method raises, breaks the process group (its peers would wait in a collective for
ever), so the group is closed and `RankFailed` raised, naming the rank and how it failed.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorkerSpec(Protocol):
    """A picklable, frozen recipe for one rank's worker (it travels to a fresh process)."""

    @property
    def backend(self) -> str: ...  # gloo | nccl

    def make(self, rank: int, world_size: int) -> Any:
        """The rank's worker, built after the process joined the group."""
        ...


class RankFailed(RuntimeError):
    """A rank died or raised; the group is closed. `reason` is one line; `detail` the rank's traceback."""

    def __init__(self, rank: int, reason: str, detail: str = "") -> None:
        super().__init__(f"rank {rank} {reason}")
        self.rank, self.reason, self.detail = rank, reason, detail


@runtime_checkable
class RankGroup(Protocol):
    world_size: int

    def call(self, method: str, *args: Any) -> list:
        """Every rank runs `worker.method(*args)`; their results in rank order. Raises RankFailed."""
        ...

    def close(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(backend: str, rank: int, world_size: int, addr: str, port: int, timeout_s: float) -> None:
    """Join the process group (nccl: on GPU `rank % device_count` first). `timeout_s` bounds a collective
    whose peer is gone."""
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.update(
        MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _serve(
    spec: WorkerSpec, rank: int, world_size: int, addr: str, port: int, timeout_s: float, conn: Connection
) -> None:
    """A rank process: join, build the worker, then answer (method, args) until told to stop (None)."""
    try:
        join_group(spec.backend, rank, world_size, addr, port, timeout_s)
        worker = spec.make(rank, world_size)
    except BaseException as exc:  # noqa: BLE001  # reported to the driver, which raises it
        conn.send_bytes(pickle.dumps(("err", _one_line(exc), traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ok", None, "")))
    while True:
        try:
            request = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone
            break
        if request is None:
            break
        method, args = request
        try:
            reply = pickle.dumps(("ok", getattr(worker, method)(*args), ""))  # an unpicklable result is an error
        except BaseException as exc:  # noqa: BLE001
            reply = pickle.dumps(("err", _one_line(exc), traceback.format_exc()))
        conn.send_bytes(reply)
    if dist.is_initialized():
        dist.destroy_process_group()


def _death(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"died: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"died: killed by signal {-code}"
    return f"died: exited with status {code}"


class LocalRanks:
    """`world_size` rank processes (spawned: no fork of the driver's threads), pipes to each.

    Results travel pickled (plain bytes, no shared memory). `call_timeout_s`: a call that takes longer
    closes the group and raises RankFailed for the first rank still busy (None: no limit; a dead rank is
    noticed at once either way)."""

    def __init__(
        self, spec: WorkerSpec, world_size: int, *, timeout_s: float = 300.0, call_timeout_s: float | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._call_timeout_s = call_timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(spec, rank, world_size, "127.0.0.1", port, timeout_s, theirs),
                name=f"furlong-rank-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._collect(timeout_s)  # every rank joined and built its worker

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]  # all: the processes are started

    def call(self, method: str, *args: Any) -> list:
        if not self._procs:
            raise RuntimeError("the rank group is closed")
        payload = pickle.dumps((method, args))
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._fail(rank, _death(self._exitcode(rank)))
        return self._collect(self._call_timeout_s)

    def _exitcode(self, rank: int) -> int | None:
        self._procs[rank].join(timeout=5)
        return self._procs[rank].exitcode

    def _collect(self, timeout_s: float | None) -> list:
        """Every rank's reply, or RankFailed for the first rank that died or raised."""
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        while len(results) < self.world_size:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            pending = [c for r, c in enumerate(self._conns) if r not in results]
            ready = wait(pending + [s for s, r in by_sentinel.items() if r not in results], timeout=left)
            if not ready:
                self._fail(min(set(range(self.world_size)) - set(results)), f"did not answer within {timeout_s:g} s")
            for obj in ready:
                if isinstance(obj, Connection):
                    rank = by_conn[id(obj)]
                    try:
                        status, value, detail = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(rank, _death(self._exitcode(rank)))
                    if status == "err":
                        self._fail_raised(rank, value, detail)
                    results[rank] = value
            for obj in ready:  # a process that exited: its last reply (if any) was read above
                if isinstance(obj, int) and by_sentinel[obj] not in results:  # not a Connection: a sentinel
                    rank = by_sentinel[obj]
                    if not self._conns[rank].poll():
                        self._fail(rank, _death(self._exitcode(rank)))
        return [results[r] for r in range(self.world_size)]

    def _fail_raised(self, rank: int, error: str, detail: str) -> None:
        """A rank's error, unless a peer died: then the peer is the cause (a collective with it failed)."""
        time.sleep(0.1)  # a dead peer's exit is reaped within moments of the error it caused
        dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
        if dead:
            self._fail(dead[0], _death(self._procs[dead[0]].exitcode), f"rank {rank} then raised {error}:\n{detail}")
        self._fail(rank, f"raised {error}", detail)

    def _fail(self, rank: int, reason: str, detail: str = "") -> None:
        self._kill()
        raise RankFailed(rank, reason, detail)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Stop every rank (each leaves the group), killing any that does not stop within 30 s."""
        if not self._procs:
            return
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for proc in self._procs:
            proc.join(timeout=max(deadline - time.monotonic(), 0.1))
        self._kill()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
