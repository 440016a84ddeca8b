"""A task suite as downloaded: broken tasks are infra_error lines, not an aborted run, and `--out` says
why each episode scored what it did (the tests' exit code and output, the oracle's last command)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run
from furlong.eval.agents import AgentRun, OracleAgent
from furlong.eval.harness import run_task_episode
from furlong.tasks.loader import load_task
from furlong.tasks.model import TaskError
from furlong.tasks.suite import BrokenTask, load_suite, load_tasks
from furlong.tasks.verifier import OUTPUT_TAIL_CHARS, output_tail
from test_eval import PASS_IF_FILE, task_dir

REPO = Path(__file__).resolve().parent.parent
TEN_MB = "head -c 10000000 /dev/zero | tr '\\0' x; echo; echo {tag} >&2; echo {tag}"


def broken_suite(root: Path) -> Path:
    """3 good tasks (one passes, one's tests fail loudly, one floods), a task with no tests/test.sh,
    one with invalid task.toml, and a family with a bad family.toml."""
    suite = root / "suite"
    task_dir(suite, "good", PASS_IF_FILE, "echo solving; mkdir -p /app && touch /app/done")
    task_dir(suite, "failing", "echo 'expected 42, got 41'; echo 'AssertionError' >&2\n"
             "echo 0 > /logs/verifier/reward.txt; exit 3\n", "echo half a solution; exit 7")
    task_dir(suite, "flood", TEN_MB.format(tag="VERIFIER-END") + "\necho 1 > /logs/verifier/reward.txt\n",
             TEN_MB.format(tag="SOLUTION-END"))
    (task_dir(suite, "no-tests", PASS_IF_FILE) / "tests" / "test.sh").unlink()
    (task_dir(suite, "bad-toml", PASS_IF_FILE) / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n")
    fam = suite / "bad-family"
    fam.mkdir()
    (fam / "family.toml").write_text("[family]\ntrain_seeds = [0, 10]\nheldout_seeds = 'all'\n")
    (fam / "generate.py").write_text("def generate(seed, out): pass\n")
    return suite


def _furlong(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FURLONG_CACHE"}  # the shared image cache
    return subprocess.run([sys.executable, "-m", "furlong.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_suite_with_broken_tasks_runs_the_rest_and_records_why(tmp_path: Path):
    out = tmp_path / "eval.jsonl"
    res = _furlong("eval", "--tasks", str(broken_suite(tmp_path)), "--out", str(out), "--agent", "oracle")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = {line["task"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert len(out.read_text().splitlines()) == 6 and len(lines) == 6
    broken = {"no-tests": "tests/test.sh: missing", "bad-toml": "task.toml: field 'agent.timeout_sec'",
              "bad-family": "family.toml: field 'family.heldout_seeds'"}
    for name, words in broken.items():
        line = lines[name]
        assert (line["status"], line["reward"]) == ("infra_error", None) and words in line["error"], line
        assert line["verifier_exit_code"] is None and line["verifier_output"] is None
        assert f"not loaded: task {name!r}" in res.stderr
    assert lines["bad-family"]["family"] == "bad-family"
    good, failing, flood = lines["good"], lines["failing"], lines["flood"]
    assert (good["reward"], good["status"], good["verifier_exit_code"]) == (1.0, "ok", 0)
    assert (good["agent_exit_code"], good["agent_output"]) == (0, "solving\n")
    assert (failing["reward"], failing["verifier_exit_code"], failing["agent_exit_code"]) == (0.0, 3, 7)
    assert "expected 42, got 41" in failing["verifier_output"] and "AssertionError" in failing["verifier_output"]
    assert "half a solution" in failing["agent_output"]
    assert flood["reward"] == 1.0
    for field, tag in (("verifier_output", "VERIFIER-END"), ("agent_output", "SOLUTION-END")):
        assert len(flood[field]) <= OUTPUT_TAIL_CHARS and flood[field].count(tag) == 2, flood[field][:200]
        assert "chars cut" in flood[field]
    summary = json.loads(res.stdout.splitlines()[-1])
    assert (summary["episodes"], summary["scored"], summary["infra_errors"]) == (6, 3, 3)


def test_nothing_to_run_is_one_error_line(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    for path, words in ((tmp_path / "empty", "no tasks or task families found"),
                        (tmp_path / "nowhere", "no such directory")):
        res = _furlong("eval", "--tasks", str(path))
        assert res.returncode == 2 and words in res.stderr and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_load_suite_keeps_directory_order_and_names_each_broken_file(tmp_path: Path):
    suite = broken_suite(tmp_path)
    (suite / "unconfigured" / "tests").mkdir(parents=True)  # a Harbor task whose task.toml is missing
    (suite / "unconfigured" / "instruction.md").write_text("do it")
    (suite / "notes").mkdir()  # a stray folder is no task
    loaded = load_suite(suite)
    assert [e.id for e in loaded.entries] == ["bad-family", "bad-toml", "failing", "flood", "good", "no-tests",
                                              "unconfigured"]
    assert [t.id for t in loaded.tasks] == ["failing", "flood", "good"]
    files = {b.id: b.cause.file for b in loaded.broken}
    assert files == {"bad-family": "family.toml", "bad-toml": "task.toml", "no-tests": "tests/test.sh",
                     "unconfigured": "task.toml"}
    assert all(isinstance(b, BrokenTask) and b.error.startswith(f"task {b.id!r}: ") for b in loaded.broken)
    with pytest.raises(TaskError) as err:  # the all-or-nothing loader (`furlong image build`) is unchanged
        load_tasks(suite)
    assert err.value.file == "family.toml"


def test_a_directory_where_nothing_loads_is_an_error(tmp_path: Path):
    (task_dir(tmp_path / "one", "t", PASS_IF_FILE) / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match="'t': tests/test.sh: missing"):
        load_suite(tmp_path / "one")
    for name in ("a", "b"):
        (task_dir(tmp_path / "two", name, PASS_IF_FILE) / "task.toml").write_text("[oops")
    with pytest.raises(TaskError, match="none of its 2 tasks and families loaded: task 'a': task.toml"):
        load_suite(tmp_path / "two")


def test_output_tail_keeps_both_streams_ends_within_the_cap():
    assert output_tail("out\n", "err\n") == "out\nerr\n"
    both = output_tail("o" * 50_000 + "OUT-END", "e" * 50_000 + "ERR-END", cap=1000)
    assert len(both) <= 1000 and both.count("OUT-END") == 1 and both.count("ERR-END") == 1
    quiet_stderr = output_tail("o" * 50_000 + "OUT-END", "short err", cap=1000)
    assert len(quiet_stderr) <= 1000 and quiet_stderr.endswith("OUT-ENDshort err")
    assert quiet_stderr.startswith("[... 49") and quiet_stderr.count("o") > 900  # the room stderr left


class MarkerAgent:
    """Leaves a file that makes these tests write no reward: only the agent's sandbox has it."""

    name = "marker"

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        await sandbox.exec("touch /tmp/agent-was-here")
        return AgentRun(commands=1)


NO_REWARD_IF_MARKED = ("if [ -f /tmp/agent-was-here ]; then echo 'in the agent sandbox'; exit 5; fi\n"
                       "echo 'in a clean sandbox'; echo 1 > /logs/verifier/reward.txt\n")


def test_after_a_control_run_the_record_is_the_agents_sandbox_verifier(backend, base_image, tmp_path: Path):
    task = load_task(task_dir(tmp_path, "marked", NO_REWARD_IF_MARKED))
    res = run(run_task_episode(task, MarkerAgent(), backend, base_image))
    assert (res.status, res.reward, res.verifier_exit_code) == ("agent_broke_sandbox", 0.0, 5)
    assert res.verifier_output == "in the agent sandbox\n"
    assert (res.agent_exit_code, res.agent_output) == (None, None)  # this agent reports no last command


def test_a_task_bug_records_the_tests_output(backend, base_image, tmp_path: Path):
    task = load_task(task_dir(tmp_path, "silent", "echo 'forgot the reward'; exit 1\n", "echo solved"))
    res = run(run_task_episode(task, OracleAgent(), backend, base_image))
    assert (res.status, res.reward) == ("infra_error", None) and "task bug" in res.error
    assert (res.verifier_exit_code, res.verifier_output) == (1, "forgot the reward\n")
    assert (res.agent_exit_code, res.agent_output) == (0, "solved\n")
