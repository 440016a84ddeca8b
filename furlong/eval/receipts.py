"""`furlong eval --verify-receipts FILE`: a run's receipts (furlong.tasks.receipt) checked against its tasks as
they are now.

For each receipt of each episode record (`furlong eval --out` lines, or a run's episodes.jsonl), the task is
found again under the tasks directory (a family's instance regenerated from its seed), and the digests the
verifier would record today are recomputed: the tests as they would be copied into /tests, and the image they
would run in (from the image store: a Dockerfile that changed builds its new image, as `furlong eval` would).
A receipt whose digests match is `ok`; one that differs is `changed`, naming the fields; a task that is gone
is `changed` too (field `task`). Receipts whose backend gave no integrity check say so: tampering was never
looked for in that episode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from furlong.envs.separate import BundledTests, verifier_image
from furlong.metrics.episodes import read_jsonl
from furlong.sandbox.base import ImageRef
from furlong.tasks.family import Family, is_family_dir, load_family
from furlong.tasks.loader import is_task_dir, load_task
from furlong.tasks.model import Task, TaskError, phases
from furlong.tasks.receipt import Receipt, digest_tests
from furlong.tasks.verifier import tests_tar

FIELDS = ("image_digest", "tests_digest")  # what the task directory and image store still decide
TOOLCHAIN = "+"  # an image digest with the verifier toolchain stacked on it (furlong.sandbox.images.toolchain.stack)


@dataclass(frozen=True)
class Check:
    """One receipt, rechecked; or one episode record that has none."""

    line: int  # of the record in the file, from 1
    task: str
    step: str | None
    verdict: str  # ok | changed | no_receipt
    changed: tuple[str, ...] = ()  # the fields that differ (FIELDS), or ("task",) where it is gone
    detail: str = ""  # what differs (was, now), or why there is no receipt
    tamper_checked: bool = True  # False: the episode's backend gave no integrity check

    def line_text(self) -> str:
        where = f"{self.task}" + (f" step {self.step}" if self.step else "")
        text = f"line {self.line}: {where}: {self.verdict}"
        if self.changed:
            text += f" ({', '.join(self.changed)})"
        if self.detail:
            text += f": {self.detail}"
        if not self.tamper_checked:
            text += " [the sandbox backend gave no integrity check: tampering was not looked for]"
        return text


Images = Callable[[Task], Awaitable[ImageRef]]


class TaskFinder:
    """A record's task under `root` (a task, a family, or a directory of them), as the run loaded it."""

    def __init__(self, root: Path, backend=None):
        self.root, self.backend = Path(root), backend
        self._tasks: dict[str, Task] | None = None
        self._families: dict[str, Family] = {}

    def find(self, record: dict) -> Task:
        task_id, family = str(record.get("task")), record.get("family")
        if family:
            seed = record.get("seed")
            if seed is None and "@" in task_id:
                seed = int(task_id.rsplit("@", 1)[1])
            if seed is None:
                raise TaskError(task_id, "record", "a family instance's record names no seed")
            return self._family(family).instance(int(seed), record.get("split") or "heldout")
        tasks = self._index()
        if task_id not in tasks:
            raise TaskError(task_id, str(self.root), "no such task here")
        return tasks[task_id]

    def _family(self, name: str) -> Family:
        if name not in self._families:
            path = self.root if is_family_dir(self.root) and self.root.name == name else self.root / name
            if not is_family_dir(path):
                raise TaskError(name, str(self.root), "no such task family here")
            self._families[name] = load_family(path, self.backend)
        return self._families[name]

    def _index(self) -> dict[str, Task]:
        if self._tasks is None:
            dirs = [self.root] if is_task_dir(self.root) else sorted(p for p in self.root.iterdir() if is_task_dir(p))
            self._tasks = {}
            for d in dirs:
                try:
                    task = load_task(d)
                except TaskError:
                    continue  # a task that no longer loads is reported as gone, by the record that names it
                self._tasks[task.id] = task
        return self._tasks


async def check_file(path: Path, finder: TaskFinder, images: Images, bundled: BundledTests) -> list[Check]:
    """Every receipt of every record in `path`, rechecked; a record without one is `no_receipt`."""
    checks: list[Check] = []
    for n, record in enumerate(read_jsonl(path), 1):
        raw = record.get("receipts") or []
        if not raw:
            why = "a record from before receipts" if "receipts" not in record else "its tests never ran"
            checks.append(Check(n, str(record.get("task")), None, "no_receipt", detail=why))
            continue
        receipts = [Receipt.from_json(r, f"{path}: line {n}") for r in raw]
        try:
            task = finder.find(record)
        except TaskError as exc:
            checks += [Check(n, str(record.get("task")), r.step, "changed", ("task",), str(exc)) for r in receipts]
            continue
        for receipt in receipts:
            checks.append(await check_receipt(n, task, receipt, images, bundled))
    return checks


async def check_receipt(line: int, task: Task, receipt: Receipt, images: Images, bundled: BundledTests) -> Check:
    """One receipt against what the verifier would record for `task` today."""
    if TOOLCHAIN in receipt.image_digest and not task.verifier_toolchain:
        task = dataclasses.replace(
            task, verifier_toolchain=True
        )  # the run opted every task in (eval.verifier_toolchain)
    steps = phases(task)
    names = [s.name for s in task.steps]
    if receipt.step is not None and receipt.step not in names:
        return Check(line, task.id, receipt.step, "changed", ("task",), "the task has no such step now")
    phase = steps[names.index(receipt.step)] if receipt.step is not None else steps[0]
    now = await current(task, phase, images, bundled)
    was = {"image_digest": receipt.image_digest, "tests_digest": receipt.tests_digest}
    changed = tuple(f for f in FIELDS if was[f] != now[f])
    detail = "; ".join(f"{f} was {was[f]}, now {now[f]}" for f in changed)
    verdict = "changed" if changed else "ok"
    return Check(line, task.id, receipt.step, verdict, changed, detail, receipt.tamper_checked)


async def current(task: Task, phase: Task, images: Images, bundled: BundledTests) -> dict[str, str]:
    """The image and tests digests a run of `phase`'s tests would record now (furlong.envs.harbor's choice:
    the task's own image, or its separate verifier's with the tests that image holds)."""
    if phase.separate is None:
        image, tests = await images(task), None
    else:
        _, image, tests = await verifier_image(phase, _Lookup(images), bundled)
    return {"image_digest": image.digest, "tests_digest": digest_tests(tests_tar(phase) if tests is None else tests)}


class _Lookup:
    """An image lookup as a SandboxSource's `image` (what furlong.envs.separate asks of one)."""

    def __init__(self, images: Images):
        self._images = images

    async def image(self, task: Task) -> ImageRef:
        return await self._images(task)


def summary(checks: list[Check]) -> dict[str, int]:
    return {
        "records": len({c.line for c in checks}),
        "receipts": sum(c.verdict != "no_receipt" for c in checks),
        "ok": sum(c.verdict == "ok" for c in checks),
        "changed": sum(c.verdict == "changed" for c in checks),
        "no_receipt": sum(c.verdict == "no_receipt" for c in checks),
        "tamper_unchecked": sum(c.verdict != "no_receipt" and not c.tamper_checked for c in checks),
    }
