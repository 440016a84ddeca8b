"""Receipts (furlong.tasks.receipt): every scored episode records what its reward was computed from, and
`furlong eval --verify-receipts` rechecks a run's receipts against its task directory. Real sandboxes, a
bundled task's image (built once), two episodes in all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run
from rich.console import Console

from furlong.audit.exploits import PathShadow
from furlong.envs.separate import BundledTests
from furlong.eval.harness import run_agent
from furlong.eval.receipts import TaskFinder, check_file, summary
from furlong.eval.run import harbor_env
from furlong.sandbox.pool import StoreImages
from furlong.tasks import verifier
from furlong.tasks.loader import load_task
from furlong.tasks.receipt import Receipt, digest_tests

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "tasks" / "fix-word-counter"  # a plain task (no family) with its own Dockerfile
HEX = 64


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory) -> tuple[Path, Path, dict]:
    """The oracle on a copy of the task through `furlong eval --out`: (the tasks dir, the --out file, its line)."""
    tmp = tmp_path_factory.mktemp("receipts")
    tasks = tmp / "tasks"
    shutil.copytree(TASK, tasks / TASK.name)
    out = tmp / "eval.jsonl"
    res = _cli("eval", "--tasks", str(tasks), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    return tasks, out, line


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "furlong.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_an_honest_episode_has_a_receipt_of_what_scored_it(evaluated):
    tasks, _, line = evaluated
    assert line["status"] == "ok" and line["reward"] == 1.0, line
    (raw,) = line["receipts"]
    receipt = Receipt.from_json(raw, "eval.jsonl")
    task = load_task(tasks / TASK.name)
    assert receipt.tests_digest == digest_tests(verifier.tests_tar(task)) and receipt.tests_digest.startswith("sha256:")
    assert receipt.image_digest.startswith("layer-")  # the task's own Dockerfile's layer, by content
    assert receipt.exit_code == 0 == line["verifier_exit_code"]
    assert receipt.reward_file == "reward.txt" and len(receipt.reward_digest or "") == len("sha256:") + HEX
    assert receipt.tampered_paths == () and receipt.tamper_checked and receipt.backend == "bwrap"
    assert receipt.verifier_uid != receipt.agent_uid  # the verifier's own uid: the agent cannot write as it
    assert receipt.step is None


def test_a_tampering_episode_s_receipt_lists_what_was_tampered_with(backend, store):
    """An agent that shadows python3 on PATH: reward_tampered, and its receipt names the wrapper."""
    task = load_task(TASK)

    async def go():
        env = await harbor_env([task], backend, store, Console(quiet=True))
        return await run_agent(task, PathShadow, env)

    result = run(go())
    assert result.status == "reward_tampered", result
    (receipt,) = result.receipts
    assert "/usr/local/bin/python3" in receipt.tampered_paths and receipt.tamper_checked
    assert receipt.tampered_paths == result.tampered_paths
    assert receipt.tests_digest == digest_tests(verifier.tests_tar(task))


def test_verify_receipts_passes_untouched_and_names_the_changed_tests(evaluated):
    tasks, out, _ = evaluated
    ok = _cli("eval", "--verify-receipts", str(out), "--tasks", str(tasks))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert json.loads(ok.stdout) == {
        "records": 1,
        "receipts": 1,
        "ok": 1,
        "changed": 0,
        "no_receipt": 0,
        "tamper_unchecked": 0,
    }
    assert f"line 1: {TASK.name}: ok" in ok.stderr
    test_sh = tasks / TASK.name / "tests" / "test.sh"
    original = test_sh.read_text()
    test_sh.write_text(original + "# edited after the run\n")
    try:
        bad = _cli("eval", "--verify-receipts", str(out), "--tasks", str(tasks))
    finally:
        test_sh.write_text(original)  # the module's other tests verify against the task as it ran
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert json.loads(bad.stdout)["changed"] == 1
    assert f"{TASK.name}: changed (tests_digest)" in bad.stderr and "image_digest" not in bad.stderr
    gone = _cli("eval", "--verify-receipts", str(out), "--tasks", str(ROOT / "tasks-tb2"))
    assert gone.returncode == 1 and "changed (task)" in gone.stderr, gone.stderr


def test_a_receipt_without_a_tamper_check_says_so_and_a_record_without_one_is_listed(evaluated, backend, store):
    """A backend without change tracking (furlong.sandbox.base.ChangeTracking) records tamper_checked false:
    its receipt still verifies, with the warning; an infra_error's record, whose tests never ran, has none."""
    tasks, out, line = evaluated
    unchecked = dict(line, receipts=[dict(line["receipts"][0], tamper_checked=False)])
    never_ran = dict(line, status="infra_error", reward=None, receipts=[])
    edited = out.with_name("unchecked.jsonl")
    edited.write_text("".join(json.dumps(r) + "\n" for r in (unchecked, never_ran)))
    finder = TaskFinder(tasks, backend)
    checks = run(check_file(edited, finder, StoreImages(store, backend), BundledTests(store)))
    assert [(c.verdict, c.tamper_checked) for c in checks] == [("ok", False), ("no_receipt", True)]
    assert "tampering was not looked for" in checks[0].line_text() and "tests never ran" in checks[1].line_text()
    assert summary(checks)["tamper_unchecked"] == 1
