"""Task families: a `generate(seed, out)` function that writes one Harbor task per seed.

A family directory holds `family.toml` (description, train_seeds and heldout_seeds as half-open
ranges that must not overlap) and `generate.py`. Instances are generated once into the cache,
keyed by a hash of the family's files, so editing the generator never serves stale instances.
generate.py is never imported here: furlong/tasks/genrun.py runs it in a sandbox, many seeds a run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tomllib
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from furlong.paths import cache_dir
from furlong.sandbox.base import SandboxBackend
from furlong.tasks import genrun
from furlong.tasks.loader import load_harbor
from furlong.tasks.model import Task, TaskError

SPLITS = ("train", "heldout")
FAMILY_KEYS = ("description", "train_seeds", "heldout_seeds")
# Each seed is a generated task directory in the cache: a range far past any run's needs is a typo.
MAX_SEEDS = 100_000


def is_family_dir(path: Path) -> bool:
    return (path / "family.toml").exists()


@dataclass(frozen=True)
class Family:
    name: str
    path: Path
    description: str
    seeds: dict[str, range]
    digest: str  # of the family's files: instances of an edited generator get a new cache dir
    backend: SandboxBackend | None = field(default=None, compare=False)  # runs generate.py; None: bwrap

    @property
    def cache(self) -> Path:
        return cache_dir() / "tasks" / f"{self.name}-{self.digest}"

    def instance(self, seed: int, split: str) -> Task:
        self._generate([seed])
        return self._load(self.cache, seed, split)

    def instances(self, split: str, limit: int | None = None) -> list[Task]:
        if split not in (*SPLITS, "all"):
            raise ValueError(f"split must be one of train, heldout, all; got {split!r}")
        splits = SPLITS if split == "all" else (split,)
        wanted = [(seed, s) for s in splits for seed in self.seeds[s][:limit]]
        self._generate([seed for seed, _ in wanted])
        cache = self.cache
        return [self._load(cache, seed, s) for seed, s in wanted]

    def _load(self, cache: Path, seed: int, split: str) -> Task:
        task = load_harbor(cache / str(seed), task_id=f"{self.name}@{seed}")
        return replace(task, family=self.name, seed=seed, split=split)

    def _generate(self, seeds: list[int]) -> None:
        """Generates the seeds not yet in the cache, up to genrun.BATCH_SEEDS per sandboxed run."""
        cache = self.cache
        missing = [seed for seed in dict.fromkeys(seeds) if not (cache / str(seed)).exists()]
        for i in range(0, len(missing), genrun.BATCH_SEEDS):
            batch = missing[i : i + genrun.BATCH_SEEDS]
            tmp = cache / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                genrun.generate(self.path, batch, tmp, backend=self.backend)
                for seed in batch:
                    try:
                        (tmp / str(seed)).rename(cache / str(seed))
                    except OSError:  # generated concurrently by another process
                        pass
            finally:
                shutil.rmtree(tmp, ignore_errors=True)


def _digest(path: Path) -> str:
    # The prefix retires instances cached before generators ran sandboxed, whose files were never checked.
    digest = hashlib.sha256(b"furlong-genrun-1\0")
    for f in sorted(path.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            digest.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def _seed_range(raw: object, name: str, field: str) -> range:
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, int) for x in raw) and raw[0] < raw[1]):
        raise TaskError(name, "family.toml", f"field 'family.{field}': expected [start, stop) integers, got {raw!r}")
    if raw[1] - raw[0] > MAX_SEEDS:
        raise TaskError(
            name,
            "family.toml",
            f"field 'family.{field}': {raw[1] - raw[0]} seeds in {raw!r}; "
            f"at most {MAX_SEEDS} (each is a generated task)",
        )
    return range(raw[0], raw[1])


def _family_table(path: Path, name: str) -> dict:
    """family.toml's [family] table; any other key, there or at the top level, is an error naming it."""
    if not is_family_dir(path):
        raise TaskError(name, "family.toml", f"missing: {path} is not a task family")
    try:
        raw = tomllib.loads((path / "family.toml").read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TaskError(name, "family.toml", f"unreadable: {exc}") from None
    conf = raw.get("family")
    if not isinstance(conf, dict):
        raise TaskError(name, "family.toml", "missing the [family] table")
    unknown = [k for k in raw if k != "family"] + [f"family.{k}" for k in conf if k not in FAMILY_KEYS]
    if unknown:
        raise TaskError(name, "family.toml", f"unknown key {unknown[0]!r} (known: [family] {', '.join(FAMILY_KEYS)})")
    return conf


def load_family(path: Path, backend: SandboxBackend | None = None) -> Family:
    name = path.name
    conf = _family_table(path, name)
    seeds = {s: _seed_range(conf.get(f"{s}_seeds"), name, f"{s}_seeds") for s in SPLITS}
    train, heldout = seeds["train"], seeds["heldout"]
    if train.start < heldout.stop and heldout.start < train.stop:
        raise TaskError(name, "family.toml", "train_seeds and heldout_seeds overlap")
    if not (path / "generate.py").is_file():
        raise TaskError(name, "generate.py", "missing")
    return Family(
        name=name,
        path=path,
        description=str(conf.get("description", "")),
        seeds=seeds,
        digest=_digest(path),
        backend=backend,
    )
