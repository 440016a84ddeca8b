"""Task directories that the real `harbor` writes (`harbor task init`, `harbor init --task`, `harbor task
migrate` of a Terminal-Bench 1.0 task) load in furlong as written and score 1 with their solution, 0 without;
the shapes `harbor task init` writes by default (a separate verifier environment, multi-step tasks) load as
Harbor resolves them, and what furlong cannot run is refused by name;
and harbor's own lint finds nothing wrong with the tasks `furlong tasks import-swe` writes beyond what
furlong means (its [furlong] table, the shared verifier).

harbor runs as in tests/test_harbor_real.py: here with Python 3.12+, else in scripts/harbor_env.sh's chroot.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from rich.console import Console

import swe_support
from conftest import run
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.harness import run_task_episode
from furlong.eval.run import run_eval
from furlong.sandbox.images.toolchain import opt_in_all
from furlong.tasks.loader import load_task
from furlong.sandbox.network import NO_NETWORK, PUBLIC
from furlong.tasks.model import TaskError, TaskNetwork
from furlong.tasks.swe import import_instances
from test_harbor_real import in_harbor

BOTH_PUBLIC = TaskNetwork(PUBLIC, PUBLIC)

QUIET = Console(file=open(os.devnull, "w"))

# harbor's CLI, once per argument list, in one process (each start imports harbor: about a second);
# lint's findings are printed as one JSON line
HARBOR_CLI = """
import contextlib, io, json, sys
from harbor.cli.main import app
for args in json.loads(sys.argv[1]):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            app(args, prog_name="harbor", standalone_mode=False)
    except SystemExit as exc:
        if exc.code and args[0] != "lint":  # lint exits 1 when it finds anything
            raise
    if args[0] == "lint":
        print("LINT " + json.dumps(json.loads(out.getvalue())))
"""

TB1_COMPOSE = """services:
  client:
    build:
      dockerfile: Dockerfile
    image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
    container_name: ${T_BENCH_TASK_DOCKER_CLIENT_CONTAINER_NAME}
    command: [ "sh", "-c", "sleep infinity" ]
    environment:
      - TEST_DIR=${T_BENCH_TEST_DIR}
    volumes:
      - ${T_BENCH_TASK_LOGS_PATH}:${T_BENCH_CONTAINER_LOGS_PATH}
"""


def _tb1_task(root: Path) -> Path:
    task = root / "tb1" / "hello-tb1"
    (task / "tests").mkdir(parents=True)
    (task / "task.yaml").write_text("instruction: Write hello to /app/out.txt\ndifficulty: easy\n"
                                    "max_agent_timeout_sec: 120.0\nmax_test_timeout_sec: 60.0\n")
    (task / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "docker-compose.yaml").write_text(TB1_COMPOSE)
    (task / "solution.sh").write_text("#!/bin/bash\necho hello > /app/out.txt\n")
    (task / "run-tests.sh").write_text("#!/bin/bash\nbash $TEST_DIR/check.sh\n")
    (task / "tests" / "check.sh").write_text("grep -qx hello /app/out.txt\n")
    return task.parent


def _fill_template(task: Path) -> None:
    """What a task's author writes into `harbor task init`'s template; task.toml and test.sh stay harbor's."""
    (task / "instruction.md").write_text("Write hello to /app/hello.txt\n")
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho hello > /app/hello.txt\n")
    (task / "tests" / "test_outputs.py").write_text(
        "from pathlib import Path\n\n\ndef test_outputs():\n    assert Path('/app/hello.txt').read_text() == 'hello\\n'\n")


def test_tasks_harbor_writes_load_and_run_unchanged(tmp_path: Path, backend, store):
    swe = swe_support.build(tmp_path / "swe")
    swe_tasks = import_instances(swe.instances, swe.repo, tmp_path / "swe-tasks")
    init, tb1 = tmp_path / "init", _tb1_task(tmp_path)
    calls = [["task", "init", "acme/shared", "-p", str(init), "--verifier-mode", "shared", "--description", "hi",
              "--author", "A Person <a@example.com>"],
             ["init", "--task", "acme/meta", "-o", str(init), "--verifier-mode", "shared", "--include-standard-metadata",
              "--include-canary-strings"],
             ["task", "init", "acme/separate", "-p", str(init)],
             ["task", "init", "acme/steps", "-p", str(init), "--steps", "2"],
             ["task", "migrate", "-i", str(tb1), "-o", str(tmp_path / "migrated")],
             ["lint", "--json", *map(str, swe_tasks)]]
    out = in_harbor(["-c", HARBOR_CLI, json.dumps(calls)], [tmp_path], tmp_path)
    findings = json.loads(next(line for line in out.splitlines() if line.startswith("LINT "))[5:])
    assert sorted({(f["rule"], f["message"].split(";")[0]) for f in findings}) == [
        ("shared-verifier", "Verifier shares the agent sandbox"), ("unknown-config-field", "Unknown field 'furlong'")]

    shared, meta = load_task(init / "shared"), load_task(init / "meta")
    for task in (shared, meta):  # harbor's defaults: 600 s each phase, public network
        assert (task.agent_timeout_s, task.verifier_timeout_s, task.network) == (600.0, 600.0, BOTH_PUBLIC)
        assert task.solution is not None and task.dockerfile is not None and task.test_script.is_file()
    # harbor's defaults for a new task: a separate verifier whose image (tests/Dockerfile) holds the tests;
    # with --steps, one per step (steps/<name>/tests/Dockerfile). Their images need the internet
    # (ghcr.io's uv, pip), so here they are loaded, not run (tests/test_harbor_steps.py runs such tasks).
    separate, steps = load_task(init / "separate"), load_task(init / "steps")
    assert separate.separate.bundled_tests and separate.separate.dockerfile == init / "separate/tests/Dockerfile"
    assert [(s.name, s.separate.dockerfile) for s in steps.steps] == [
        (f"step-{n}", init / f"steps/steps/step-{n}/tests/Dockerfile") for n in (1, 2)]

    migrated = load_task(tmp_path / "migrated" / "hello-tb1")
    assert (migrated.agent_timeout_s, migrated.verifier_timeout_s, migrated.format) == (120.0, 60.0, "harbor")
    _fill_template(init / "shared")
    # harbor's template test.sh installs curl and uv, then runs `uvx --with pytest... pytest --ctrf`. Run
    # offline (this machine reaches no astral.sh), its apt-get and curl fail harmlessly and the verifier
    # toolchain's uvx installs pytest from its own wheels (docs/tasks.md, "The offline verifier toolchain");
    # its no-op run is left out (9 s of uvx for little)
    template = dataclasses.replace(load_task(init / "shared"), network=TaskNetwork(NO_NETWORK, NO_NETWORK))
    oracle = run(run_eval(opt_in_all([migrated, template]), OracleAgent(), backend, store, 2, None, QUIET))
    noop = run(run_eval([migrated], NoopAgent(), backend, store, 1, None, QUIET))
    assert [(r.task, r.reward, r.status) for r in oracle + noop] == [
        ("hello-tb1", 1.0, "ok"), ("shared", 1.0, "ok"), ("hello-tb1", 0.0, "ok")]


def test_harbor_network_and_phase_keys(tmp_path: Path):
    """The keys harbor 0.25 writes that decide how a task runs (the network's rules: tests/test_network_policy.py)."""
    def load(toml: str):
        task = tmp_path / "t"
        (task / "tests").mkdir(parents=True, exist_ok=True)
        (task / "tests" / "test.sh").write_text("true\n")
        (task / "instruction.md").write_text("x")
        (task / "task.toml").write_text(toml)
        return load_task(task)

    assert not load('[environment]\nnetwork_mode = "no-network"\nallow_internet = true\n').online
    assert load("[environment]\nallow_internet = true\n").network == BOTH_PUBLIC
    assert load("[agent]\ntimeout_sec = 5\n").network == TaskNetwork()  # no mode named: furlong's default
    assert load('[solution.env]\nGREETING = "hi"\n').solution_env == (("GREETING", "hi"),)
    for toml, problem in [
        ('[environment]\nos = "windows"\n', "furlong's sandboxes are Linux"),
        ('[environment]\nnetwork_mode = "sometimes"\n', "field 'environment.network_mode'"),
        ('[verifier.environment]\ndocker_image = "python:3.12"\n', "'verifier.environment.docker_image'"),
    ]:
        with pytest.raises(TaskError, match=problem):
            load(toml)


def test_solution_env_reaches_the_oracle(backend, base_image, tmp_path: Path):
    task = tmp_path / "greet"
    for d in ("tests", "solution"):
        (task / d).mkdir(parents=True)
    (task / "task.toml").write_text('[solution.env]\nGREETING = "hi there"\n')
    (task / "instruction.md").write_text("Write the greeting to /tmp/greeting")
    (task / "solution" / "solve.sh").write_text('echo "$GREETING" > /tmp/greeting\n')
    (task / "tests" / "test.sh").write_text(
        'grep -qx "hi there" /tmp/greeting && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n')
    assert run(run_task_episode(load_task(task), OracleAgent(), backend, base_image)).reward == 1.0
