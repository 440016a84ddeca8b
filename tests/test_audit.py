"""`furlong audit`: every exploit of the library earns reward on a fixture task built to be hackable by it
and nothing on one built not to be, through furlong's real runner, sandboxes and verifier; the reward
channel and the tampering exploits are defeated by furlong's machinery (tests/fixtures/audit: one image)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run
from rich.console import Console

from furlong.audit.clues import clues
from furlong.audit.exploits import EXPLOITS
from furlong.audit.run import TaskAudit, audit
from furlong.eval.run import harbor_env
from furlong.tasks.loader import load_task

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "audit"
PYTEST_TASK = "pytest-rootdir"  # its verifier's pytest comes from the toolchain layer
FAIL_OPEN = "fail-open-report"  # its tests pass unless their report, on the agent's disk, names a problem
# each exploit's fixture built to be hackable by it; `sound` is built to be hackable by none
HACKABLE_BY = {
    "python-startup-hook": "trusts-tools",
    "pth-hook": "trusts-tools",
    "path-shadow": "trusts-tools",
    "ld-preload": "trusts-tools",
    "bash-shadow": "trusts-tools",
    "pytest-plugin": PYTEST_TASK,
    "shell-startup": "login-shell",
    "git-history": "git-reflog",
    "leftover-answer": "build-leftover",
    "empty-outputs": "exit-status-only",
    "blank-named-files": "agent-expected",
    "delete-tool": "skips-without-tool",
    "conftest": PYTEST_TASK,
    "hold-ports": "status-only-service",
    "fill-disk": FAIL_OPEN,
}
CAUGHT_BY_TAMPER = (
    "python-startup-hook", "pth-hook", "conftest", "path-shadow", "ld-preload", "bash-shadow", "pytest-plugin"
)
# furlong's own machinery: no task can make them pay
REWARD_CHANNEL = ("reward-file", "logs-symlink", "fill-logs")
# they starve the verifier where furlong keeps its share (pids, memory: SysV shared memory included) or where
# the agent cannot (the clock): no task can make them pay, not even one whose tests pass when their checker
# cannot run
STARVE_MACHINERY = ("starve-pids", "hold-memory", "pin-shm", "clock-change")
KINDS = ("reward-channel", "tests", "answers", "weak-checks", "resources")
# fail-open-report with memory_mb = 1024 and its report in the verifier's own /logs/verifier: only a checker
# killed for memory could make it pay, as every agent-writable tmpfs filled once did (docs/audit.md)
SMALL_FAIL_OPEN = "fail-open-1024"
FILLS = ("fill-disk", "fill-logs")


def _small_fail_open(root: Path) -> Path:
    task = shutil.copytree(FIXTURES / FAIL_OPEN, root / SMALL_FAIL_OPEN)
    (task / "task.toml").write_text((task / "task.toml").read_text() + "\n[environment]\nmemory_mb = 1024\n")
    test = task / "tests" / "test.sh"
    test.write_text(test.read_text().replace("/tmp/scan-report.txt", "/logs/verifier/scan-report.txt"))
    return task


@pytest.fixture(scope="module")
def audited(backend, store, tmp_path_factory) -> dict[str, TaskAudit]:
    """The whole library on `sound`; on each other fixture task, the exploits built to pay there (the
    reward channel's on reward-on-pass-only, the starving ones on the fail-open tasks too), at concurrency 2:
    about 80 episodes, one image build."""
    dirs = [*sorted(FIXTURES.iterdir()), _small_fail_open(tmp_path_factory.mktemp("audit"))]
    tasks = {d.name: load_task(d) for d in dirs}
    plan: dict[str, list[str]] = {name: [] for name in tasks}
    plan["sound"] = list(EXPLOITS)
    plan["reward-on-pass-only"] = list(REWARD_CHANNEL)
    plan["bash-env"] = ["shell-startup"]
    plan[FAIL_OPEN] = list(STARVE_MACHINERY)
    plan[SMALL_FAIL_OPEN] = list(FILLS)
    for exploit, task in HACKABLE_BY.items():
        plan[task].append(exploit)

    async def go():
        env = await harbor_env(list(tasks.values()), backend, store, Console(quiet=True))
        return [r for n, names in plan.items() for r in await audit([tasks[n]], names, env, 2, lambda _: None)]

    return {r.task: r for r in run(go())}


def _by(result: TaskAudit) -> dict:
    return {a.agent: a for a in result.attempts}


@pytest.mark.parametrize("exploit", sorted(HACKABLE_BY))
def test_each_exploit_earns_on_the_task_built_for_it_with_evidence(audited, exploit):
    result = audited[HACKABLE_BY[exploit]]
    assert result.verdict == "hackable", result
    found = {a.agent: a for a in result.findings()}
    assert exploit in found, (exploit, _by(result)[exploit])
    assert found[exploit].touched, "the evidence names what the exploit changed"
    assert found[exploit].status == "ok" and found[exploit].verifier_exit_code is not None


def test_no_exploit_earns_on_the_sound_task_and_tampering_is_caught(audited):
    result = audited["sound"]
    attempts = _by(result)
    assert result.verdict == "not_hackable" and result.findings() == ()
    assert set(attempts) == {"oracle", "noop", *EXPLOITS}
    assert attempts["oracle"].reward == 1.0
    assert all(a.reward == 0.0 for name, a in attempts.items() if name != "oracle"), attempts  # none unscored
    assert attempts["fill-logs"].status == "ok", attempts["fill-logs"]  # /logs/artifacts: a mount of its own
    for name in CAUGHT_BY_TAMPER:
        assert attempts[name].caught and attempts[name].tampered_paths, attempts[name]
    assert not any(attempts[name].caught for name in HACKABLE_BY if name not in CAUGHT_BY_TAMPER)


def test_start_up_files_pay_only_where_the_tests_read_them_and_bash_env_is_caught(audited):
    """The verifier runs `bash test.sh`: neither a login nor an interactive shell, so /etc/profile, bash.bashrc
    and ~/.bashrc are never read (shell-startup earns nothing on `sound`, above), only the file $BASH_ENV
    names, if the verifier's environment sets it: tamper detection covers that file (`bash-env`)."""
    shell = _by(audited["bash-env"])["shell-startup"]
    assert audited["bash-env"].verdict == "not_hackable" and shell.caught and shell.reward == 0.0, shell
    assert shell.tampered_paths == ("/etc/profile",) and "/etc/profile" in shell.touched
    (receipt,) = shell.receipts
    assert receipt.tampered_paths == ("/etc/profile",) and receipt.tamper_checked


def test_every_exploit_says_what_it_tries_and_what_to_fix():
    table = (ROOT / "docs" / "audit.md").read_text()
    for name, exploit in EXPLOITS.items():
        assert f"| `{name}` | {exploit.kind.replace('-', ' ')} |" in table, f"{name}: not in docs/audit.md's table"
        assert exploit.__doc__ and exploit.hint and exploit.kind in KINDS, name
        assert name in HACKABLE_BY or name in REWARD_CHANNEL or name in STARVE_MACHINERY, f"{name}: no fixture task"


def test_the_reward_channel_exploits_never_pay(audited):
    """furlong's verifier owns /logs/verifier: an agent's reward file, a background writer or a symlink there
    earns nothing, even from tests that write a reward only on success."""
    result = audited["reward-on-pass-only"]
    assert result.verdict == "not_hackable" and {a.agent for a in result.attempts} == {"oracle", "noop", *REWARD_CHANNEL}


def test_a_starved_verifier_never_pays_even_where_its_tests_fail_open(audited):
    """The fail-open task pays when its checker's report cannot be written (fill-disk, above), but the pids and
    the memory the agent's processes hold leave the checker running (scored 0 as any wrong answer, not
    unscored), SysV shared memory segments go once no process has them attached (pin-shm pins nothing), and
    the agent cannot set the clock."""
    result = _by(audited[FAIL_OPEN])
    for name in STARVE_MACHINERY:
        assert result[name].reward == 0.0 and result[name].status == "ok", result[name]
    (pids,) = result["starve-pids"].touched
    assert int(re.findall(r"\d+", pids)[0]) > 100, pids  # it held the agent's pids (512 by default)
    (memory,) = result["hold-memory"].touched
    assert int(re.findall(r"\d+", memory)[0]) > 256, memory  # of the sandbox's 2048 MiB
    (shm,) = result["pin-shm"].touched
    assert int(re.findall(r"\d+", shm)[0]) > 2048, shm  # made and detached past the limit: none stayed
    clock = result["clock-change"]
    assert clock.touched == () and "clock unchanged: date -s failed" in clock.agent_output, clock


def test_full_agent_disks_leave_a_small_sandboxs_checker_its_memory_and_its_reward_file(audited):
    """Every agent-writable tmpfs filled (fill-disk) in a 1 GiB sandbox: their caps leave the verifier its
    reserve, so the 256 MiB checker runs and names the problem (it was OOM-killed, and this fail-open task
    paid). A full /logs/artifacts (fill-logs) leaves the reward file room: scored as usual, not broken."""
    result = audited[SMALL_FAIL_OPEN]
    attempts = _by(result)
    assert result.verdict == "not_hackable" and attempts["oracle"].reward == 1.0, attempts
    for name in FILLS:
        assert (attempts[name].reward, attempts[name].status) == (0.0, "ok"), attempts[name]
        assert attempts[name].verifier_exit_code == 0, attempts[name]
    filled = " ".join(attempts["fill-disk"].touched)
    assert all(d in filled for d in ("/tmp", "/dev/shm", "/logs/agent", "/logs/artifacts")), filled


def test_a_noop_that_passes_is_the_finding_and_a_broken_oracle_is_not_hackable(audited):
    noop = audited["noop-passes"]
    assert noop.verdict == "hackable" and [a.agent for a in noop.findings()] == ["noop"]
    assert noop.to_json()["findings"][0]["hint"].startswith("doing nothing earns reward")
    broken = audited["broken-oracle"]
    assert broken.verdict == "broken" and [a.agent for a in broken.attempts] == ["oracle", "noop"]


def test_clues_are_the_paths_tools_and_literals_the_tests_name():
    found = clues(load_task(FIXTURES / "skips-without-tool"))
    assert found.paths == ("/app/answer.txt", "/tmp/want") and found.tools == ("cmp",)
    assert found.literals == ("cmp missing: check skipped",)
    assert clues(load_task(FIXTURES / "agent-expected")).paths == ("/app/out.txt", "/app/expected.txt")
    assert clues(load_task(FIXTURES / "status-only-service")).ports == ("8765",)


def test_the_command_takes_the_verifier_toolchain_for_every_task_as_eval_does(tmp_path):
    """eval.verifier_toolchain=true stacks the toolchain on every task's image: each receipt names it."""
    out = tmp_path / "audit.jsonl"
    cmd = ["audit", "--tasks", str(FIXTURES / "sound"), "--exploits", "reward-file", "--out", str(out)]
    res = subprocess.run([sys.executable, "-m", "furlong.cli", *cmd, "eval.verifier_toolchain=true"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["verdict"] == "not_hackable" and len(line["attempts"]) == 3
    assert all("+" in a["receipts"][0]["image_digest"] for a in line["attempts"]), line["attempts"]


def test_the_command_exits_1_on_a_hackable_task_and_writes_a_line_per_task(tmp_path):
    tasks = tmp_path / "tasks"
    for name in ("sound", "exit-status-only"):
        shutil.copytree(FIXTURES / name, tasks / name)
    out = tmp_path / "audit.jsonl"
    cmd = [sys.executable, "-m", "furlong.cli", "audit", "--tasks", str(tasks), "--exploits", "empty-outputs"]
    res = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = {d["task"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert {t: d["verdict"] for t, d in lines.items()} == {"sound": "not_hackable", "exit-status-only": "hackable"}
    assert lines["exit-status-only"]["hackable_by"] == ["empty-outputs"]
    assert "exit-status-only: hackable by empty-outputs" in res.stderr  # the console: progress
    bad = subprocess.run([*cmd[:-1], "no-such"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown exploit 'no-such'; known: all, reward-file" in bad.stderr
