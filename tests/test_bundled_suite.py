"""The bundled suite, end to end in real sandboxes: the oracle passes every task, a do-nothing agent none."""

from __future__ import annotations

import os

from rich.console import Console

from conftest import run
from furlong.config import BUNDLED_TASKS
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.run import run_eval
from furlong.tasks.suite import load_tasks

QUIET = Console(file=open(os.devnull, "w"))


def _suite():
    # every static task, and two instances of each family from both splits
    return load_tasks(BUNDLED_TASKS, split="all", per_family=2)


def test_suite_has_30_tasks_across_categories_with_families():
    entries = [p for p in BUNDLED_TASKS.iterdir() if p.is_dir()]
    families = [p for p in entries if (p / "family.toml").exists()]
    assert len(entries) >= 30 and len(families) >= 8


def test_oracle_passes_every_task_and_noop_none(backend, store):
    tasks = _suite()
    oracle = run(run_eval(tasks, OracleAgent(), backend, store, 2, None, QUIET))
    failed = {r.task: (r.status, r.reward, r.error) for r in oracle if r.reward != 1.0}
    assert not failed, f"oracle failed: {failed}"
    noop = run(run_eval(tasks, NoopAgent(), backend, store, 2, None, QUIET))
    passed = {r.task: (r.status, r.reward, r.error) for r in noop if r.reward != 0.0}
    assert not passed, f"a do-nothing agent scored on: {passed}"
