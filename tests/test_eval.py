"""Episodes under faults: hung verifiers, missing rewards, dead sandboxes and crashing agents."""

from __future__ import annotations

import asyncio

import json
import os
import signal
from pathlib import Path

from rich.console import Console

from conftest import run
from furlong.eval.agents import AgentRun, NoopAgent, OracleAgent
from furlong.eval.harness import run_task_episode
from furlong.eval.run import run_eval
from furlong.tasks.loader import load_task


def task_dir(root: Path, name: str, test_sh: str, solve_sh: str = "true", agent_timeout: float = 30,
             verifier_timeout: float = 30) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text(f"[agent]\ntimeout_sec = {agent_timeout}\n[verifier]\ntimeout_sec = {verifier_timeout}\n")
    (d / "instruction.md").write_text(f"task {name}")
    (d / "tests" / "test.sh").write_text(test_sh)
    (d / "solution" / "solve.sh").write_text(solve_sh)
    return d


PASS_IF_FILE = "test -f /app/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"


def _episode(backend, image, d: Path, agent=None):
    return run(run_task_episode(load_task(d), agent or OracleAgent(), backend, image))


def test_oracle_scores_one_and_noop_zero_with_timing(backend, base_image, tmp_path: Path):
    d = task_dir(tmp_path, "ok", PASS_IF_FILE, "mkdir -p /app && touch /app/done")
    good = _episode(backend, base_image, d)
    assert (good.reward, good.status, good.error) == (1.0, "ok", None)
    assert good.timing.sandbox_start > 0 and good.timing.agent_commands > 0 and good.timing.verifier > 0
    bad = _episode(backend, base_image, d, NoopAgent())
    assert (bad.reward, bad.status) == (0.0, "ok")


def test_hung_verifier_scores_zero_with_status_timeout(backend, base_image, tmp_path: Path):
    d = task_dir(tmp_path, "hang", "echo 1 > /logs/verifier/reward.txt; sleep 600\n", verifier_timeout=1)
    res = _episode(backend, base_image, d)
    assert (res.reward, res.status) == (0.0, "timeout") and "verifier timed out" in res.error
    assert res.timing.verifier < 10


def test_reward_json_and_missing_reward(backend, base_image, tmp_path: Path):
    d = task_dir(tmp_path, "json", 'echo \'{"reward": 0.5, "style": 1}\' > /logs/verifier/reward.json\n')
    res = _episode(backend, base_image, d)
    assert res.reward == 0.5 and res.rewards == {"reward": 0.5, "style": 1.0}
    # both files: reward.json wins, as in Harbor's verifier; a number written as a string is no reward there
    both = "echo 0 > /logs/verifier/reward.txt; echo '{\"reward\": 1}' > /logs/verifier/reward.json\n"
    assert _episode(backend, base_image, task_dir(tmp_path, "both", both)).reward == 1.0
    res = _episode(backend, base_image, task_dir(tmp_path, "text", "echo '{\"reward\": \"1\"}' > /logs/verifier/reward.json\n"))
    assert res.reward is None and "not a number" in res.error, res
    d = task_dir(tmp_path, "silent", "echo no reward written\n")
    res = _episode(backend, base_image, d)
    assert (res.reward, res.status) == (None, "infra_error") and "neither reward.txt nor reward.json" in res.error


def test_agent_background_service_keeps_running_into_the_verifier(backend, base_image, tmp_path: Path):
    # the solution ends once the server accepts connections (a fixed sleep lost the race on a loaded host)
    serve = ("cd /tmp && (python3 -m http.server 8099 --bind 127.0.0.1 >/dev/null 2>&1 &); "
             "for i in $(seq 300); do (echo > /dev/tcp/127.0.0.1/8099) 2>/dev/null && break; sleep 0.1; done\n")
    probe = ("python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8099/')\" "
             "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    res = _episode(backend, base_image, task_dir(tmp_path, "svc", probe, serve))
    assert res.reward == 1.0


class HostKillerAgent:
    """The sandbox process is killed from the host mid-agent-phase. The runner cannot tell who did it,
    and once the agent phase has started a dead sandbox is scored (see furlong.agent.runner)."""

    name = "host-killer"

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        await sandbox.exec("true")
        os.kill(sandbox.inner._proc.pid, signal.SIGKILL)
        # the init dies a moment after bwrap (its parent-death signal); until then it may still answer
        for _ in range(500):
            if not sandbox.alive:
                break
            await asyncio.sleep(0.01)
        await sandbox.exec("true")
        return AgentRun()


class CrashingAgent:
    name = "crash"

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        raise RuntimeError("agent bug")


class SlowAgent:
    name = "slow"

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        res = await sandbox.exec("touch /app/done 2>/dev/null || (mkdir -p /app && touch /app/done); sleep 600",
                                 timeout_s=timeout_s)
        return AgentRun(commands=1, timed_out=res.timed_out)


def test_sandbox_dead_after_the_agent_started_is_scored_zero(backend, base_image, tmp_path: Path):
    res = _episode(backend, base_image, task_dir(tmp_path, "die", PASS_IF_FILE), HostKillerAgent())
    assert (res.reward, res.status) == (0.0, "agent_broke_sandbox") and "SandboxDied" in res.error


def test_agent_timeout_still_runs_the_verifier(backend, base_image, tmp_path: Path):
    res = _episode(backend, base_image, task_dir(tmp_path, "slow", PASS_IF_FILE, agent_timeout=1), SlowAgent())
    assert res.agent_timed_out and res.status == "timeout" and res.reward == 1.0


def test_a_crashing_episode_does_not_take_down_the_run(backend, store, tmp_path: Path):
    suite = tmp_path / "suite"
    for name in ("a", "b", "c"):
        task_dir(suite, name, PASS_IF_FILE, "mkdir -p /app && touch /app/done")
    tasks = [load_task(suite / n) for n in ("a", "b", "c")]
    out = tmp_path / "eval.jsonl"
    console = Console(file=open(os.devnull, "w"))
    results = run(run_eval(tasks, CrashingAgent(), backend, store, 2, out, console))
    assert [r.status for r in results] == ["infra_error"] * 3 and "agent bug" in results[0].error
    results = run(run_eval(tasks, OracleAgent(), backend, store, 2, out, console))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and {r.reward for r in results} == {1.0}
    assert set(lines[0]) >= {"task", "reward", "status", "timing", "verifier_exit_code", "verifier_output",
                             "agent_exit_code", "agent_output"}
    assert {line["verifier_exit_code"] for line in lines} == {0} and {line["agent_exit_code"] for line in lines} == {0}
    assert set(lines[0]["timing"]) >= {"sandbox_start", "agent_commands", "verifier", "other"}
