"""A verifier the agent cannot reach: every forgery of issue 28, tried as a task solution, judged on the host.

Each case is one small task (tests/integrity_support.py) run through both ways an episode is run: `furlong
eval --agent oracle` (the forgery is the task's solve.sh) and the RL episode runner over warm pools (the
forgery is a scripted agent's one command). A forgery writes the wrong answer and attacks the verifier: it
must earn 0, scored (status `ok`, or `reward_tampered` where it replaced what the tests execute). A reach
writes the right answer and attacks the verifier's processes: it must still earn 1, since they are out of
its reach. Honest solutions whose background processes the tests depend on must still earn 1.
"""

from __future__ import annotations

import os
import time

import pytest
from rich.console import Console

from conftest import run
from furlong.config import BUNDLED_TASKS
from furlong.eval.agents import NoopAgent
from furlong.eval.run import run_eval
from furlong.tasks.loader import load_task
from host_support import ThreadHost, remote
from integrity_support import (HONEST, SERVER, SERVER_CHECK, UPDATER, UPDATER_CHECK, WRONG, Case, forgeries, make,
                               reaches, through_eval, through_runner)

QUIET = Console(file=open(os.devnull, "w"))

# The forgeries of what the tests execute or load: scored 0 either because the verifier never runs the
# agent's version (status ok) or because running it is caught (reward_tampered).
TAMPERING = {"python3-replaced", "python3-shadowed", "bash-replaced", "sh-replaced", "mkdir-replaced",
             "pytest-replaced", "pytest-shadowed", "sitecustomize", "pth-file", "ld-so-preload"}
FORGERIES = forgeries()
REACHES = reaches()
# The same tasks without an attack: the right answer earns 1, the wrong one 0 (with python3 and with pytest).
BASELINES = {"honest": (HONEST, 1.0), "wrong": (WRONG, 0.0), "pytest-honest": (HONEST, 1.0),
             "pytest-wrong": (WRONG, 0.0)}
HONEST_BACKGROUND = {"server": (SERVER, SERVER_CHECK), "updater": (UPDATER, UPDATER_CHECK)}


# How a forgery's tests run the checker: through pytest, or through sh (as subprocess's shell=True does).
RUN = {"pytest-replaced": {"pytest": True}, "pytest-shadowed": {"pytest": True},
       "sh-replaced": {"run": "sh -c 'exec python3 \"$0\"'"}}


def _cases() -> list[Case]:
    return [*(Case(f"forge-{n}", WRONG + s, **RUN.get(n, {})) for n, s in FORGERIES.items()),
            *(Case(f"reach-{n}", HONEST + s) for n, s in REACHES.items()),
            *(Case(n, solve, pytest=n.startswith("pytest")) for n, (solve, _) in BASELINES.items()),
            *(Case(n, solve, check) for n, (solve, check) in HONEST_BACKGROUND.items())]


@pytest.fixture(scope="module", params=["bwrap", "remote"])
def episodes(request, backend, store, base_image, tmp_path_factory) -> dict[str, dict[str, tuple[float | None, str, str | None]]]:
    """case -> path ("eval" or "runner") -> (reward, status, error): every case run once each way, on the
    local backend and through a sandbox host (sandbox.backend=remote: the same rules must hold there)."""
    if request.param == "remote":
        host = ThreadHost(backend, base_image, store, capacity=8)
        request.addfinalizer(host.stop)
        backend, store = remote([host.url])
    root = tmp_path_factory.mktemp("integrity")
    tasks = [make(root, case) for case in _cases()]
    started = time.monotonic()
    evals = run(through_eval(tasks, backend, store, QUIET))
    outcomes = run(through_runner(tasks, backend, store))
    print(f"{2 * len(tasks)} episodes in {time.monotonic() - started:.1f}s")
    return {t.id: {"eval": (e.reward, e.status, e.error), "runner": (o.reward, o.status, o.error)}
            for t, e, o in zip(tasks, evals, outcomes)}


@pytest.mark.parametrize("name", FORGERIES)
def test_a_forgery_earns_nothing_and_is_scored(episodes, name: str):
    allowed = {"ok", "reward_tampered"} if name in TAMPERING else {"ok"}
    paid = {path: e for path, e in episodes[f"forge-{name}"].items() if e[0] != 0.0 or e[1] not in allowed}
    assert not paid, paid


@pytest.mark.parametrize("name", REACHES)
def test_the_verifiers_processes_are_out_of_the_agents_reach(episodes, name: str):
    _all_pass(episodes[f"reach-{name}"])


@pytest.mark.parametrize("name", BASELINES)
def test_without_an_attack_the_tests_judge_the_answer(episodes, name: str):
    wrong = {path: e for path, e in episodes[name].items() if e[:2] != (BASELINES[name][1], "ok")}
    assert not wrong, wrong


@pytest.mark.parametrize("name", HONEST_BACKGROUND)
def test_what_the_agents_background_processes_serve_is_visible_to_the_tests(episodes, name: str):
    _all_pass(episodes[name])


def _all_pass(paths: dict[str, tuple[float | None, str, str | None]]) -> None:
    failed = {path: e for path, e in paths.items() if e[:2] != (1.0, "ok")}
    assert not failed, failed


def test_bundled_tasks_that_install_what_the_tests_run_pass_with_their_oracle(backend, store):
    """Honest work that changes what the tests load: a pip-installed package they import, a binary built
    and installed on PATH that they run. Both ways an episode runs, and a do-nothing agent fails."""
    tasks = [load_task(BUNDLED_TASKS / name) for name in ("pip-install-package", "c-build-install")]
    evals = run(through_eval(tasks, backend, store, QUIET))
    outcomes = run(through_runner(tasks, backend, store))
    noop = run(run_eval(tasks, NoopAgent(), backend, store, 2, None, QUIET))
    for task, e, o, n in zip(tasks, evals, outcomes, noop):
        _all_pass({"eval": (e.reward, e.status, e.error), "runner": (o.reward, o.status, o.error)})
        assert (n.reward, n.status) == (0.0, "ok"), (task.id, n.error)
