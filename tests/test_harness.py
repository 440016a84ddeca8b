"""Agent programs trained through the gateway (train.agent.harness): scripted harness programs
(tests/harness_support.py) and the example harness (examples/harness_agent.py) run as real subprocesses
against the run's in-process gateway, on the tiny model's hf engine, in real sandboxes. The reward is the
task's tests'; the samples are the gateway's trajectories (loss mask on the sampled ids only, the engine's
logprobs); a key is dead once its episode ends; a harness's own failure is never an infra_error."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
import skips
from conftest import run
from tests_support import agent_params, make_task

from furlong.agent.harness import HarnessAgents, run_harness_episode
from furlong.engine.hf import HFEngine
from furlong.envs.harbor import HarborEnv
from furlong.envs.rewards import RewardFn, Scorer, harness_reported
from furlong.model.loading import load_model, load_tokenizer
from furlong.sandbox.pool import FreshSandboxes, fixed_image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = str(ROOT / "tests" / "harness_support.py")
MKDIR_TEST = "[ -d /app/made ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt"


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return load_tokenizer(tiny_dir), load_model(tiny_dir)


class DyingOn:
    """Test double for a sandbox source: its sandboxes die under a command that names `die-now` (the
    sandbox is closed under it, as when its host kills it), so that command's call raises SandboxDied."""

    def __init__(self, inner):
        self.inner = inner

    async def image(self, task):
        return await self.inner.image(task)

    def reserve(self, task):
        self.inner.reserve(task)

    async def acquire(self, spec_):
        return _Dying(await self.inner.acquire(spec_))


class _Dying:
    def __init__(self, box):
        self.box = box

    def __getattr__(self, name):
        return getattr(self.box, name)

    async def exec(self, cmd, *args, **kwargs):
        if "die-now" in cmd:
            await self.box.close()
        return await self.box.exec(cmd, *args, **kwargs)


class Loaded:
    """Test double for a loaded shared engine: the real engine's reply arrives `delay_s` late."""

    def __init__(self, engine, delay_s: float):
        self.engine, self.delay_s = engine, delay_s

    async def generate(self, input_ids, sampling):
        await asyncio.sleep(self.delay_s)
        return await self.engine.generate(input_ids, sampling)


def _episodes(policy, backend, base_image, task, argv, wait_for: Path | None = None, dying: bool = False,
              delay_s: float = 0.0, scorer=None, **agent):  # fmt: skip
    """One harness episode of `task` (group 7, sample 1) through the one episode runner, and its samples;
    the gateway is kept serving until `wait_for` exists (as a run's gateway serves its other episodes).
    `scorer`: reward functions beside the tests (the episode runs in a HarborEnv)."""
    tokenizer, model = policy
    params = agent_params(**{"max_new_tokens": 8, "max_context_tokens": 512, **agent})

    async def go():
        engine = HFEngine(model, seed=0)
        agents = HarnessAgents(Loaded(engine, delay_s) if delay_s else engine, tokenizer, params, argv)
        try:
            sandboxes = FreshSandboxes(backend, fixed_image(base_image))
            sandboxes = DyingOn(sandboxes) if dying else sandboxes
            env = sandboxes if scorer is None else HarborEnv(sandboxes, scorer=scorer)
            episodes = await run_harness_episode(task, agents, env, group_id=7, step=2, sample_id=1)
            deadline = time.monotonic() + 60
            while wait_for is not None and not wait_for.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return episodes
        finally:
            await agents.close()

    return run(go())


def _report(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _check_samples(episodes, reward):
    for e in episodes:  # every sample carries the episode's reward and group; the mask only on sampled ids
        assert (e.reward, e.group_key, e.sample_id) == (reward, (e.task_id, 2, 7, 0), 1)
        assert len(e.tokens) == len(e.loss_mask) == len(e.rollout_logprobs) == len(e.token_weight_versions)
        assert all((lp == 0.0 and v == -1) for lp, v, m in
                   zip(e.rollout_logprobs, e.token_weight_versions, e.loss_mask, strict=True) if not m)  # fmt: skip
        assert e.gateway is not None and e.gateway.tito_mismatch_tokens == 0


def test_an_oracle_harness_scores_the_tests_reward_with_the_engines_logprobs(policy, backend, base_image, tmp_path):
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    report = tmp_path / "report.json"
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "oracle", str(report), "mkdir -p /app/made"])
    seen = _report(report)
    assert seen["refused"] == [401, 400]  # another key; an empty command
    assert seen["exec"]["status"] == 200 and seen["exec"]["exit_code"] == 0
    assert [e.status for e in eps] == ["ok"] and eps[0].reward == 1.0
    _check_samples(eps, 1.0)
    e = eps[0]
    sampled = [lp for lp, m in zip(e.rollout_logprobs, e.loss_mask, strict=True) if m]
    assert sum(e.loss_mask) == len(seen["logprobs"]) > 0 and sampled == pytest.approx(seen["logprobs"], abs=1e-6)
    assert e.gateway.requests == 1 and e.gateway.gateway_history_rewrites == 0


def test_time_in_a_loaded_engine_does_not_count_against_the_harness_timeout(policy, backend, base_image, tmp_path):
    """The rule furlong's own agent has: a busy engine must not turn an episode into a timeout scored 0. The
    program's one model call takes past the agent timeout; it still solves the task."""
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST, agent_timeout=8)
    report = tmp_path / "report.json"
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "oracle", str(report), "mkdir -p /app/made"],
                    delay_s=10.0)  # fmt: skip
    assert [(e.status, e.reward) for e in eps] == [("ok", 1.0)] and eps[0].timing.model_wait >= 10.0


def test_a_harness_that_does_nothing_scores_0_with_one_unsampled_sample(policy, backend, base_image, tmp_path):
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "nothing", str(tmp_path / "r.json")])
    assert [(e.status, e.reward, e.turns, sum(e.loss_mask)) for e in eps] == [("ok", 0.0, 0, 0)]
    assert len(eps[0].tokens) > 0 and eps[0].gateway.requests == 0


def test_a_crashing_harness_is_scored_by_the_tests_not_an_infra_error(policy, backend, base_image, tmp_path):
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "crash", str(tmp_path / "r.json")])
    assert [(e.status, e.reward) for e in eps] == [("ok", 0.0)] and eps[0].turns == 1
    _check_samples(eps, 0.0)


def test_a_harness_past_its_timeout_is_killed_and_its_key_refused(policy, backend, base_image, tmp_path):
    """The program sleeps past the agent timeout (killed); a child it started in its own session keeps
    calling with the key after the episode ended: every call is a 401, and nothing is recorded."""
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST, agent_timeout=8)
    report = tmp_path / "r.json"
    late = Path(str(report) + ".late")
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "linger", str(report)], wait_for=late)
    assert [(e.status, e.reward) for e in eps] == [("timeout", 0.0)]
    _check_samples(eps, 0.0)
    assert late.exists(), "the harness never started its lingering child (killed before its model turn?)"
    assert _report(late)["late_codes"] == [401] * 6
    assert eps[0].gateway.requests == 1  # what it sent in time, and nothing after


def test_an_abandoned_stream_does_not_stop_the_episode(policy, backend, base_image, tmp_path):
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    report = tmp_path / "r.json"
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "abandon", str(report)])
    assert [e.status for e in eps] == ["ok", "ok"] and len(_report(report)["logprobs"]) > 0
    _check_samples(eps, 0.0)  # two samples: the second request does not extend the first (a new segment)
    assert eps[0].gateway.requests == 2 and eps[0].gateway.gateway_history_rewrites == 1


def test_a_sandbox_that_breaks_under_an_exec_command_is_the_agents_doing(policy, backend, base_image, tmp_path):
    """The blame rule of furlong's own bash tool: the sandbox failing under the agent's command scores 0
    (agent_broke_sandbox), never an unscored infra_error; the harness saw a 503."""
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    report = tmp_path / "r.json"
    eps = _episodes(policy, backend, base_image, task, ["python", SUPPORT, "oracle", str(report), "echo die-now"],
                    dying=True)  # fmt: skip
    assert _report(report)["exec"]["status"] == 503
    assert [(e.status, e.reward) for e in eps] == [("agent_broke_sandbox", 0.0)] and eps[0].error.startswith("sandbox broke during the agent phase: SandboxDied")


def test_mini_swe_agent_runs_unmodified_in_the_episodes_sandbox(policy, backend, base_image, tmp_path):
    """mini-swe-agent's own loop, prompts and LiteLLM model class, its commands in the sandbox through
    examples/mini_swe_agent.py's FurlongEnvironment: the tests score it, the gateway stitched its requests."""
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    eps = _episodes(policy, backend, base_image, task, ["python", str(ROOT / "examples" / "mini_swe_agent.py")],
                    max_context_tokens=4096, max_new_tokens=16)  # fmt: skip
    assert {e.status for e in eps} == {"ok"} and sum(e.response_len for e in eps) > 0
    _check_samples(eps, 0.0)  # the tiny model does not make the directory: the tests say 0
    assert eps[0].gateway.requests >= 1 and eps[0].turns >= 1


def test_a_bad_harness_value_is_a_one_line_error(tmp_path):
    from furlong.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="train.agent.harness.command"):
        load_config(None, ["train.agent.harness.command=[]"])
    with pytest.raises(ValueError, match=r"train.agent.harness.command: 'no-such-harness-program'"):
        HarnessAgents(None, None, agent_params(), ["no-such-harness-program"])  # type: ignore[arg-type]


def test_the_example_harness_in_eval_and_a_train_step(tiny_dir, tmp_path):
    """`furlong eval` and a 1-step `furlong train` with examples/harness.yaml: every episode has samples, the
    gateway stitched them without a mismatch, and the run trains on them."""
    import subprocess

    common = ["train.agent.max_new_tokens=8", "train.families=[make-directory]"]
    out = tmp_path / "eval.jsonl"
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--config", "examples/harness.yaml",
                          "--agent", "model", "--model", str(tiny_dir), "--tasks", "tasks/make-directory",
                          "--per-family", "1", "--concurrency", "1", "--out", str(out), *common],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 1 and all(line["agent"] == "harness" and line["status"] != "infra_error" for line in lines)
    assert all(line["gateway"]["requests"] >= 1 and line["gateway"]["tito_mismatch_tokens"] == 0 for line in lines)
    assert all(line["tokens_response"] > 0 for line in lines)
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--config", "examples/harness.yaml",
                          f"train.run_dir={run_dir}", *common, "train.sft.epochs=0", "train.rl.steps=1",
                          "train.rl.tasks_per_step=1", "train.rl.group_size=2", "train.rl.families=[make-directory]",
                          "train.sft.families=[make-directory]", "train.eval.heldout_per_family=1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) >= 2 and all(r["gateway"] is not None and r["gateway"]["tito_mismatch_tokens"] == 0 for r in rl)
    assert all(r["tokens_response"] > 0 for r in rl if r["status"] != "infra_error")



def test_a_harness_reward_counts_only_through_a_reward_function(policy, backend, base_image, tmp_path):
    """A harness reports 0.75 (FURLONG_REWARD_FILE): with a reward function naming it and the tests weighed 0
    it is the episode's reward; without one the tests' 0 stands, whatever the harness says."""
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    argv = ["python", SUPPORT, "report", str(tmp_path / "r.json"), '{"verifiers": 0.75, "other": 9}']
    own = RewardFn("verifiers", python=harness_reported, params={"key": "verifiers"})
    eps = _episodes(policy, backend, base_image, task, argv, scorer=Scorer([own], own_weight=0.0))
    assert [(e.status, e.reward, e.rewards) for e in eps] == [("ok", 0.75, {"tests": 0.0, "verifiers": 0.75})]
    _check_samples(eps, 0.75)
    eps = _episodes(policy, backend, base_image, task, argv)
    assert [(e.status, e.reward) for e in eps] == [("ok", 0.0)]


def test_a_malformed_harness_reward_is_an_infra_error_naming_the_file(policy, backend, base_image, tmp_path):
    task = make_task(tmp_path, "mkdir", "Create the directory /app/made.", test=MKDIR_TEST)
    argv = ["python", SUPPORT, "report", str(tmp_path / "r.json"), '{"verifiers": "high"}']
    eps = _episodes(policy, backend, base_image, task, argv)
    assert [(e.status, e.reward) for e in eps] == [("infra_error", None)]
    assert "FURLONG_REWARD_FILE" in eps[0].error and "finite numbers" in eps[0].error


VERIFIERS_VENV = ROOT / ".venv-verifiers"


@skips.skipif("extra:verifiers", not (VERIFIERS_VENV / "bin" / "python").exists(),
              "no verifiers venv (bash install.sh --verifiers)")  # fmt: skip
def test_a_verifiers_environment_as_the_harness_in_eval(tiny_dir, tmp_path):
    """`furlong eval` with examples/verifiers.yaml: verifiers 0.4.0's own rollout (its Env, chat program,
    interception server and client) under its venv's interpreter, through the run's gateway; the episode's
    rewards hold the reward verifiers computed (the program prints verifiers' trace as its last line),
    weighed beside the tests' as the config says."""
    import subprocess

    out = tmp_path / "eval.jsonl"
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--config", "examples/verifiers.yaml",
                          "--agent", "model", "--model", str(tiny_dir), "--tasks", "tasks/make-directory",
                          "--per-family", "1", "--concurrency", "1", "--out", str(out),
                          "train.agent.max_new_tokens=16", "train.families=[make-directory]"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["agent"] == "harness" and line["status"] == "ok", line
    assert line["gateway"]["requests"] >= 1 and line["gateway"]["tito_mismatch_tokens"] == 0
    assert line["tokens_response"] > 0
    seen = json.loads(line["agent_output"].strip().splitlines()[-1])  # verifiers' own trace, as the program saw it
    assert seen["ok"] and seen["errors"] == [], seen
    info = seen["info"]  # the example's rubric: 0.9 for a command that exited 0, 0.1 for a brief reply
    assert info["reply_chars"] > 0 and seen["reward"] == pytest.approx(0.9 * (info["exit_code"] == 0) + 0.1 * (info["reply_chars"] <= 200))
    assert line["rewards"] == {"tests": line["rewards"]["tests"], "verifiers": pytest.approx(seen["reward"])}
    assert line["reward"] == pytest.approx(line["rewards"]["tests"] + 0.5 * seen["reward"])
