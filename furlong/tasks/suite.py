"""A --tasks path as a suite: its tasks and task families, with the broken ones kept as records."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from furlong.sandbox.base import SandboxBackend
from furlong.tasks.family import is_family_dir, load_family
from furlong.tasks.loader import is_task_dir, load_task
from furlong.tasks.model import Task, TaskError, TaskNetwork
from furlong.tasks.network import with_default


@dataclass(frozen=True)
class BrokenTask:
    """A task or family in a suite that could not be loaded: `furlong eval` records it as infra_error."""

    id: str  # the directory's name (a task id, or a family's name)
    path: Path
    cause: TaskError  # names the task, the file and the field
    family: str | None = None  # set when a whole family failed to load or generate

    @property
    def error(self) -> str:
        return str(self.cause)


@dataclass(frozen=True)
class Suite:
    """What a --tasks path holds, in directory order: loaded tasks, and records of the broken ones."""

    entries: list[Task | BrokenTask]

    @property
    def tasks(self) -> list[Task]:
        return [e for e in self.entries if isinstance(e, Task)]

    @property
    def broken(self) -> list[BrokenTask]:
        return [e for e in self.entries if isinstance(e, BrokenTask)]


def load_tasks(
    path: Path,
    split: str = "heldout",
    per_family: int | None = None,
    backend: SandboxBackend | None = None,
    network: TaskNetwork | None = None,
) -> list[Task]:
    """A task, a family, or a directory of both; raises the first broken one's TaskError."""
    suite = load_suite(path, split, per_family, backend, network)
    if suite.broken:
        raise suite.broken[0].cause
    return suite.tasks


def load_suite(
    path: Path,
    split: str = "heldout",
    per_family: int | None = None,
    backend: SandboxBackend | None = None,
    network: TaskNetwork | None = None,
) -> Suite:
    """A task, a family, or a directory of both. Families give instances of `split` (train|heldout|all),
    their generators run on `backend` (None: a default bwrap one). Tasks that name no network mode get
    `network`'s phases (None: offline, furlong's default; furlong.tasks.network).

    A task or family given directly that is broken raises its TaskError (there is nothing else to run).
    In a directory of them, each broken one becomes a BrokenTask and the rest still load, so one bad
    task in a downloaded collection costs one episode, not the run. A directory where nothing loads
    (no task and no family, or only broken ones) raises: there is no run to make.
    """
    suite = _load(Path(path), split, per_family, backend)
    return suite if network is None else Suite(with_default(suite.entries, network))


def _load(path: Path, split: str, per_family: int | None, backend: SandboxBackend | None) -> Suite:
    if not path.is_dir():
        raise TaskError(path.name, str(path), "no such directory")
    if is_task_dir(path):
        return Suite([load_task(path)])
    if is_family_dir(path):
        return Suite(list(load_family(path, backend).instances(split, per_family)))
    entries: list[Task | BrokenTask] = []
    for child in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if is_task_dir(child):
            entries.append(_task_or_broken(child))
        elif is_family_dir(child):
            entries.extend(_family_or_broken(child, split, per_family, backend))
        elif problem := _task_without_config(child):
            entries.append(BrokenTask(child.name, child, TaskError(child.name, "task.toml", problem)))
    if not entries:
        raise TaskError(path.name, str(path), "no tasks or task families found")
    return _runnable(Suite(entries), path)


def _runnable(suite: Suite, path: Path) -> Suite:
    broken = suite.broken
    if suite.tasks:
        return suite
    if len(broken) == 1:
        raise broken[0].cause
    shown = "; ".join(b.error for b in broken[:3]) + ("; ..." if len(broken) > 3 else "")
    raise TaskError(path.name, str(path), f"none of its {len(broken)} tasks and families loaded: {shown}")


def _task_or_broken(path: Path) -> Task | BrokenTask:
    try:
        return load_task(path)
    except TaskError as exc:
        return BrokenTask(path.name, path, exc)


def _family_or_broken(
    path: Path, split: str, per_family: int | None, backend: SandboxBackend | None
) -> list[Task | BrokenTask]:
    try:
        return list(load_family(path, backend).instances(split, per_family))
    except TaskError as exc:  # a bad family.toml, or a generator that fails: the whole family is one record
        return [BrokenTask(path.name, path, exc, family=path.name)]


def _task_without_config(path: Path) -> str | None:
    """Why a directory that has a Harbor task's files but no task.toml is a broken task, not a stray folder."""
    found = [f for f in ("instruction.md", "tests/test.sh", "environment/Dockerfile") if (path / f).is_file()]
    if not found:
        return None
    return f"missing: a Harbor task needs task.toml (the directory has {', '.join(found)})"
