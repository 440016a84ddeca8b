"""train.env.openenv=true / eval.env=openenv: furlong drives OpenEnv servers with the package's client. On the
package's own echo environment a short `furlong train` scores every episode; through `furlong openenv
serve` the task's tests score each episode across both hops; a session lost mid-episode is infra_error,
never a reward."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run
from openenv_support import TOKEN, GarblingServer, ThreadServer, echo_env, echo_server, furlong_serve
from furlong.agent.runner import AgentRun, run_outcome
from furlong.agent.tools import ToolRunner
from furlong.config import BUNDLED_TASKS
from furlong.envs.openenv import OpenEnvEnvironment, OpenEnvServer, OpenEnvSource
from furlong.model.chat import ToolCall
from furlong.sandbox.pool import FreshSandboxes, StoreImages
from furlong.tasks.family import load_family
from furlong.train.sft import solution_command

REPO = Path(__file__).parent.parent
SPLITS = {"train": "train", "heldout": "heldout"}


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory) -> Path:
    return echo_env(tmp_path_factory.mktemp("echo"))


@pytest.fixture(scope="module")
def echo(echo_dir: Path):
    server = echo_server(echo_dir)
    yield server
    server.kill()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "furlong.cli", *args], capture_output=True, text=True, timeout=900,
                          cwd=REPO)


def test_train_on_the_packages_echo_env_scores_every_episode(echo, tmp_path: Path):
    res = _cli("train", "--config", str(REPO / "recipes" / "openenv-smoke.yaml"), f"openenv.url={echo.url}",
               f"train.run_dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    # eval_before and eval_after: 2 held-out instances each; RL: 2 steps of 2 groups of 2
    assert len(episodes) == 12 and {e["family"] for e in episodes} == {"echo_env"}
    assert all(e["status"] != "infra_error" and e["reward"] is not None for e in episodes), episodes
    assert {e["task"] for e in episodes if e["phase"] == "eval_before"} == {
        "echo_env/heldout/seed-1000000", "echo_env/heldout/seed-1000001"}
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["eval_infra_errors"] == 0 and summary["rl_episodes"]["started"] == 8


def test_one_malformed_reply_while_scoring_is_that_episodes_infra_error_and_the_run_goes_on(tmp_path: Path):
    """Issue 48: a third-party server answers the message that ends one RL episode (furlong's score reads
    it) with garbage. The run trains every step; that episode is infra_error with its traceback, unscored;
    every other episode, its group's other one included, is scored."""
    server = GarblingServer()
    try:
        res = _cli("train", "--config", str(REPO / "recipes" / "openenv-smoke.yaml"), f"openenv.url={server.url}",
                   f"train.run_dir={tmp_path / 'run'}")
    finally:
        server.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    assert server.garbled == 1
    episodes = [json.loads(line) for line in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 12  # eval_before and eval_after: 2 each; RL: 2 steps of 2 groups of 2
    bad = [e for e in episodes if e["status"] == "infra_error"]
    assert len(bad) == 1, [(e["status"], e["error"]) for e in episodes]
    assert (bad[0]["phase"], bad[0]["outcome"], bad[0]["reward"]) == ("rl", "infra_error", None)
    assert bad[0]["error"].startswith("scoring failed: JSONDecodeError"), bad[0]["error"]
    trace = bad[0]["traceback"]
    assert trace.startswith("Traceback") and "in score" in trace and "json.decoder.JSONDecodeError" in trace, trace
    assert all(e["reward"] is not None and e["traceback"] is None for e in episodes if e is not bad[0])
    mate = [e for e in episodes if e["phase"] == "rl" and (e["step"], e["group"]) == (bad[0]["step"], bad[0]["group"])
            and e is not bad[0]]
    assert len(mate) == 1 and mate[0]["status"] != "infra_error"
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["rl_episodes"]["started"] == 8 and summary["eval_infra_errors"] == 0, summary


class Scripted:
    """An agent for any environment: the tool calls it is given, then done; records what it was shown."""

    name = "scripted"

    def __init__(self, *calls: tuple[str, dict], between=None):
        self.calls, self.between = calls, between
        self.opening, self.observations = None, []

    async def run(self, spec, tools, timeout_s):
        self.opening = tools.opening
        runner = ToolRunner(tools, timeout_s=30, observation_chars=4000)  # as a model's calls go
        for n, (name, arguments) in enumerate(self.calls):
            if n and self.between:
                self.between()
            self.observations.append(await runner.run(ToolCall(name, arguments)))
        return AgentRun(commands=len(self.calls))


def test_echo_instances_are_seeds_and_the_tool_is_the_action_schema(echo):
    source = OpenEnvSource(OpenEnvServer(echo.url), {"train": 3, "heldout": 1}, SPLITS)
    train, heldout = source.instances("train"), source.instances("heldout")
    assert [s.reset for s in train] == [(("seed", 0),), (("seed", 1),), (("seed", 2),)]
    assert heldout[0].reset == (("seed", 1_000_000),)
    env = OpenEnvEnvironment(OpenEnvServer(echo.url))
    agent = Scripted(("step", {"message": "hello"}), ("step", {"message": "hi"}))
    outcome = run(run_outcome(train[0], agent, env))
    assert json.loads(agent.opening)["echoed_message"] == "Echo Env environment ready!"
    assert [json.loads(o)["echoed_message"] for o in agent.observations] == ["hello", "hi"]
    assert (outcome.status, outcome.reward) == ("ok", 0.2)  # the env's last reward: min(0.1 * len, 1)
    refused = Scripted(("step", {"text": "x"}))
    bad = run(run_outcome(train[0], refused, env))
    assert refused.observations[0].startswith("error: the environment refused the action")  # the model reads why
    assert (bad.status, bad.reward) == ("ok", 0.0)  # a tool error, not the end of the episode nor a reward


def test_a_session_lost_mid_episode_is_infra_error_never_a_reward(echo_dir: Path):
    server = echo_server(echo_dir)  # its own, to kill
    try:
        spec = OpenEnvSource(OpenEnvServer(server.url), {"train": 1}, SPLITS).instances("train")[0]
        agent = Scripted(("step", {"message": "a long message"}), ("step", {"message": "b"}), between=server.kill)
        outcome = run(run_outcome(spec, agent, OpenEnvEnvironment(OpenEnvServer(server.url, message_timeout_s=10))))
    finally:
        server.kill()
    assert len(agent.observations) == 1
    assert (outcome.status, outcome.reward, outcome.lost) == ("infra_error", None, True), outcome.error


@pytest.fixture(scope="module")
def count_tasks():
    return load_family(BUNDLED_TASKS / "count-in-file").instances("all", 2)


def test_furlong_tasks_through_openenv_serve_are_scored_by_their_tests(backend, store, base_image, count_tasks):
    server = ThreadServer(count_tasks, FreshSandboxes(backend, StoreImages(store, backend)), capacity=1)
    try:
        remote = OpenEnvServer(server.url, token=TOKEN)
        specs = OpenEnvSource(remote, {"train": 2, "heldout": 2}, SPLITS).instances("train")
        train = [t for t in count_tasks if t.split == "train"]
        assert [(s.id, s.family, s.agent_timeout_s) for s in specs] == [
            (t.id, "count-in-file", t.agent_timeout_s) for t in train]
        env = OpenEnvEnvironment(remote)
        solver = Scripted(("bash", {"command": solution_command(train[0])}))
        solved = run(run_outcome(specs[0], solver, env))
        assert solver.opening == train[0].instruction  # the model's prompt: the task's own instruction
        assert solver.observations == ["exit code 0"]
        assert (solved.status, solved.reward) == ("ok", 1.0)
        # one seat: the second episode waits for the first's session to close, it is not refused
        async def together():
            return await asyncio.gather(*(run_outcome(spec, Scripted(), env) for spec in specs))
        assert [(o.status, o.reward) for o in run(together())] == [("ok", 0.0), ("ok", 0.0)]
        # the server stops while the tests would run: lost, unscored
        lost = run(run_outcome(specs[1], Scripted(("bash", {"command": "true"})), _stopping_after_agent(env, server)))
        assert (lost.status, lost.reward, lost.lost) == ("infra_error", None, True), lost.error
    finally:
        server.stop()


def _stopping_after_agent(env: OpenEnvEnvironment, server: ThreadServer) -> OpenEnvEnvironment:
    class Stopping(OpenEnvEnvironment):
        async def open(self, spec, clock):
            episode = await super().open(spec, clock)
            score = episode.score

            async def stop_then_score():
                server.stop()
                return await score()
            episode.score = stop_then_score
            return episode
    return Stopping(env.server)


def test_eval_agent_model_through_openenv_serve(tmp_path: Path, tiny_dir: Path):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    server = furlong_serve(BUNDLED_TASKS / "count-in-file", token, "--per-family", "2", log=tmp_path / "serve.log")
    try:
        res = _cli("eval", "--agent", "model", "--model", str(tiny_dir), "--per-family", "2",
                   "--out", str(tmp_path / "eval.jsonl"), "eval.env=openenv", f"openenv.url={server.url}",
                   f"openenv.token_file={token}")
    finally:
        server.kill()
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert sorted(e["task"] for e in lines) == ["count-in-file@10000", "count-in-file@10001"]  # served held-out ones
    assert all(e["status"] != "infra_error" and e["reward"] is not None for e in lines), lines
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["scored"] == 2 and summary["infra_errors"] == 0
