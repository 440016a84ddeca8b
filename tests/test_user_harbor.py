"""Extra tools and reward functions on Harbor tasks, in real sandboxes: command tools run as the agent with
their arguments quoted, host tools cannot borrow the verifier's identity, reward functions run as the
verifier inside the tests' integrity check, and their failures follow the rule of furlong.envs.rewards.
`furlong eval` builds them from the config (train.env)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run
from examples.tools import CALCULATOR, WORD_COUNT
from furlong.agent.runner import run_outcome
from furlong.envs.harbor import HarborEnv
from furlong.envs.rewards import RewardFn, Scorer
from furlong.envs.toolset import Tool
from furlong.sandbox.pool import FreshSandboxes, fixed_image
from test_user_api import Scripted
from tests_support import make_task

ROOT = Path(__file__).resolve().parent.parent
WRITE_PROBE = "touch /logs/verifier/probe 2>/dev/null && echo 1 || echo 0"
REWARD_IF_DONE = "test -f /tmp/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt"


async def as_verifier(arguments, sandbox):
    return (await sandbox.exec("id -u", as_verifier=True)).stdout  # what a host tool must not be able to do


async def probe(arguments, sandbox):
    """Writes where only the verifier may (its /logs/verifier mount): a host tool acts as the agent."""
    return (await sandbox.exec(WRITE_PROBE)).stdout.strip()


async def words(episode) -> float:
    """Reads the agent's file as the verifier; 0 when there is none (an untouched sandbox)."""
    res = await episode.sandbox.exec("cat /tmp/words 2>/dev/null | wc -w")
    return float(res.stdout)


def moves(*planned):
    it = iter(planned)
    return lambda seen: next(it, None)


def _env(backend, base_image, tools=(), fns=(), tests_weight=1.0) -> HarborEnv:
    return HarborEnv(FreshSandboxes(backend, fixed_image(base_image)), tools, Scorer(fns, tests_weight))


def test_extra_tools_run_as_the_agent_and_rewards_as_the_verifier(backend, base_image, tmp_path):
    task = make_task(tmp_path, "t", "Write some words.", REWARD_IF_DONE)
    tools = (WORD_COUNT, CALCULATOR, Tool("escalate", "x", python=as_verifier), Tool("probe", "x", python=probe))
    fns = (RewardFn("words", weight=0.1, python=words), RewardFn("verifier", weight=0.0, command=WRITE_PROBE))
    agent = Scripted(moves(("bash", {"command": "printf 'a b c' > /tmp/words; touch /tmp/done"}),
                           ("word_count", {"path": "/tmp/words"}),
                           ("word_count", {"path": "/tmp/words; touch /tmp/injected"}),
                           ("bash", {"command": "test -e /tmp/injected; echo $?"}),
                           ("calculator", {"expression": "6 * 7"}),
                           ("escalate", {}), ("probe", {}), ("bash", {"command": WRITE_PROBE})))
    outcome = run(run_outcome(task, agent, _env(backend, base_image, tools, fns, tests_weight=0.5)))
    assert agent.seen[1] == "exit code 0\n3"
    assert agent.seen[2].startswith("exit code 1")  # the argument was one quoted word, not a second command
    assert agent.seen[3] == "exit code 0\n1" and agent.seen[4] == "42"
    assert agent.seen[5].startswith("error: escalate failed: TypeError") and "as_verifier" in agent.seen[5]
    assert agent.seen[6] == "0" and agent.seen[7] == "exit code 0\n0"  # the agent cannot write the verifier's mount
    assert outcome.rewards == {"tests": 1.0, "words": 3.0, "verifier": 1.0}  # the reward command can
    assert (outcome.status, outcome.reward) == ("ok", pytest.approx(0.5 * 1.0 + 0.1 * 3.0))


def what_the_tests_gave(episode) -> float:
    """The tests' result as a reward function sees it: 10 * their reward, plus 1 where they passed."""
    return 10 * episode.tests + float(episode.passed) + 100 * episode.usage.turns  # a scripted agent: 0 turns


@pytest.mark.parametrize("done", [True, False])
def test_a_reward_function_sees_the_tests_result(backend, base_image, tmp_path, done):
    task = make_task(tmp_path, "t", "Finish.", REWARD_IF_DONE)
    agent = Scripted(moves(("bash", {"command": "touch /tmp/done" if done else "true"})))
    fns = (RewardFn("seen", weight=0.5, python=what_the_tests_gave),)
    outcome = run(run_outcome(task, agent, _env(backend, base_image, fns=fns)))
    assert outcome.rewards == {"tests": float(done), "seen": 11.0 if done else 0.0}
    assert outcome.reward == pytest.approx(float(done) + 0.5 * outcome.rewards["seen"])


def test_a_reward_command_runs_inside_the_tests_integrity_check(backend, base_image, tmp_path):
    """The agent's background process replaces the program the reward command runs while it runs (after
    the tests): the check after the reward functions sees it, so the episode is reward_tampered."""
    task = make_task(tmp_path, "t", "Do it.", REWARD_IF_DONE)
    fns = (RewardFn("slow_id", weight=1.0, command="sleep 2; id -u", timeout_s=30),)
    plant = "touch /tmp/done; (sleep 1; cp /bin/true /usr/bin/id) > /dev/null 2>&1 &"
    outcome = run(run_outcome(task, Scripted(moves(("bash", {"command": plant}))),
                              _env(backend, base_image, (), fns)))
    assert (outcome.status, outcome.reward) == ("reward_tampered", 0.0)
    assert "/usr/bin/id" in outcome.tampered_paths


async def boom_if_planted(episode) -> float:
    res = await episode.sandbox.exec("test -e /tmp/boom")
    if res.exit_code == 0:
        raise RuntimeError("the judge cannot parse this")
    return 1.0


@pytest.mark.parametrize("fn, plant, status, says", [
    (RewardFn("judge", python=boom_if_planted), "touch /tmp/done /tmp/boom", "agent_broke_sandbox",
     "but not in one no agent touched"),
    (RewardFn("judge", python=boom_if_planted), "touch /tmp/done", "ok", None),
    (RewardFn("judge", command="echo checking; exit 3"), "touch /tmp/done", "infra_error",
     "exited 3; output:\nchecking"),
    (RewardFn("judge", command="sleep 5", timeout_s=0.5), "touch /tmp/done", "infra_error", "timed out after 0.5s"),
    (RewardFn("judge", command="echo 1 > /logs/verifier/mine; echo done"), "touch /tmp/done", "infra_error",
     "last line of output is not a number"),
])
def test_reward_function_failures_in_a_sandbox(backend, base_image, tmp_path, fn, plant, status, says):
    task = make_task(tmp_path, "t", "Do it.", REWARD_IF_DONE)
    outcome = run(run_outcome(task, Scripted(moves(("bash", {"command": plant}))),
                              _env(backend, base_image, (), (fn,))))
    assert outcome.status == status, outcome.error
    assert outcome.reward == {"ok": 2.0, "agent_broke_sandbox": 0.0, "infra_error": None}[status]
    if says:
        assert says in outcome.error
    if status == "agent_broke_sandbox":  # the traceback of the agent's episode is its record
        assert "Traceback" in outcome.error and "RuntimeError: the judge cannot parse this" in outcome.error


def test_furlong_eval_adds_the_configs_tools_and_rewards(tmp_path):
    task = make_task(tmp_path, "t", "Do it.", REWARD_IF_DONE, solve="touch /tmp/done")
    res = subprocess.run(
        [sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(task.path), "--agent", "oracle",
         "train.env.tools=[examples.tools:TOOLS]", "train.env.tests_weight=0.5",
         'train.env.rewards.half.command="echo 0.5"', "train.env.rewards.half.weight=1",
         f"eval.out={tmp_path / 'out.jsonl'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["status"] == "ok" and record["rewards"] == {"tests": 1.0, "half": 0.5} and record["reward"] == 1.0
    bad = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(task.path),
                          "train.env.tools=[examples.tools:nothing]"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "train.env.tools: module 'examples.tools' has no 'nothing'" in bad.stderr
