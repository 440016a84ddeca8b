"""Task families: a `generate(seed, out)` function that writes one Harbor task per seed.

A family directory holds `family.toml` (description, train_seeds and heldout_seeds as half-open
ranges that must not overlap) and `generate.py`. Instances are generated once into the cache,
keyed by a hash of the family's files, so editing the generator never serves stale instances.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from furlong.paths import cache_dir
from furlong.tasks.loader import load_harbor
from furlong.tasks.model import Task, TaskError

SPLITS = ("train", "heldout")


def is_family_dir(path: Path) -> bool:
    return (path / "family.toml").exists()


@dataclass(frozen=True)
class Family:
    name: str
    path: Path
    description: str
    seeds: dict[str, range]
    generate: Callable[[int, Path], None]
    digest: str  # of the family's files: instances of an edited generator get a new cache dir

    def instance(self, seed: int, split: str) -> Task:
        out = cache_dir() / "tasks" / f"{self.name}-{self.digest}" / str(seed)
        if not out.exists():
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                self.generate(seed, tmp)
            except Exception as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise TaskError(self.name, "generate.py", f"generate({seed}) failed: {exc!r}") from exc
            try:
                tmp.rename(out)
            except OSError:  # generated concurrently by another process
                shutil.rmtree(tmp, ignore_errors=True)
        task = load_harbor(out, task_id=f"{self.name}@{seed}")
        return replace(task, family=self.name, seed=seed, split=split)

    def instances(self, split: str, limit: int | None = None) -> list[Task]:
        if split not in (*SPLITS, "all"):
            raise ValueError(f"split must be one of train, heldout, all; got {split!r}")
        splits = SPLITS if split == "all" else (split,)
        return [self.instance(seed, s) for s in splits for seed in list(self.seeds[s])[:limit]]


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            digest.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def _seed_range(raw: object, name: str, field: str) -> range:
    if not (isinstance(raw, list) and len(raw) == 2 and all(isinstance(x, int) for x in raw) and raw[0] < raw[1]):
        raise TaskError(name, "family.toml", f"field 'family.{field}': expected [start, stop) integers, got {raw!r}")
    return range(raw[0], raw[1])


def load_family(path: Path) -> Family:
    name = path.name
    try:
        conf = tomllib.loads((path / "family.toml").read_text()).get("family")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TaskError(name, "family.toml", f"unreadable: {exc}") from None
    if not isinstance(conf, dict):
        raise TaskError(name, "family.toml", "missing the [family] table")
    seeds = {s: _seed_range(conf.get(f"{s}_seeds"), name, f"{s}_seeds") for s in SPLITS}
    if set(seeds["train"]) & set(seeds["heldout"]):
        raise TaskError(name, "family.toml", "train_seeds and heldout_seeds overlap")
    return Family(name=name, path=path, description=str(conf.get("description", "")),
                  seeds=seeds, generate=_load_generate(path), digest=_digest(path))


def _load_generate(path: Path) -> Callable[[int, Path], None]:
    source = path / "generate.py"
    if not source.is_file():
        raise TaskError(path.name, "generate.py", "missing")
    spec = importlib.util.spec_from_file_location(f"furlong_family_{path.name.replace('-', '_')}", source)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise TaskError(path.name, "generate.py", f"import failed: {exc!r}") from exc
    if not callable(getattr(module, "generate", None)):
        raise TaskError(path.name, "generate.py", "defines no generate(seed, out) function")
    return module.generate
