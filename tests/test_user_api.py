"""The user API (docs/environments.md): a Python environment, extra tools and reward functions, through the
one episode runner, with the worked examples under examples/. Harbor episodes run in real sandboxes."""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run
from examples.guess_number import GuessNumber
from examples.rewards import few_guesses, within_budget
from examples.tools import CALCULATOR, WORD_COUNT
from furlong.agent.episode import run_episode
from furlong.agent.runner import AgentRun, run_outcome
from furlong.agent.tools import ToolRunner
from furlong.engine.base import Generation, SamplingParams
from furlong.envs.rewards import RewardFn, Scorer
from furlong.envs.toolset import Tool
from furlong.envs.user import Action, PythonEnv, PythonSource
from furlong.model.chat import Message, ToolCall, assistant_ids
from furlong.model.loading import load_tokenizer
from tests_support import agent_params

ROOT = Path(__file__).resolve().parent.parent


def _source(factory=GuessNumber, n: int = 3, tools=(CALCULATOR,)) -> PythonSource:
    return PythonSource(factory, "guess", {"train": n, "heldout": 1}, agent_timeout_s=30, tools=tools)


class Scripted:
    """A scripted agent that acts as the model would, through the same ToolRunner: `plan(observations)`
    returns the next (tool, arguments), a str (a turn without a tool call), or None to stop."""

    name = "scripted"

    def __init__(self, plan, timeout_s: float = 5.0):
        self.plan, self.timeout_s, self.seen = plan, timeout_s, []

    async def run(self, spec, tools, timeout_s):
        runner = ToolRunner(tools, self.timeout_s, observation_chars=4000)
        while not runner.finished and (move := self.plan(self.seen)) is not None:
            if isinstance(move, str):
                reply = await runner.reply(move)
                self.seen.append(reply)
                if reply is None:
                    break
            else:
                self.seen.append(await runner.run(ToolCall(*move)))
        return AgentRun(commands=len(self.seen))


def bisect(seen: list) -> tuple | None:
    """Guesses by bisection from the hints seen so far (after asking the calculator for the first one)."""
    if not seen:
        return "calculator", {"expression": "(1 + 100) // 2"}
    low, high, guess = 1, 100, int(seen[0])
    for hint in seen[1:]:
        if hint.startswith("higher"):
            low = guess + 1
        elif hint.startswith("lower"):
            high = guess - 1
        guess = (low + high) // 2
    return "guess", {"number": int(seen[0]) if len(seen) == 1 else guess}


def test_the_example_environment_scores_through_the_runner_with_a_tool_and_a_reward_function():
    specs = _source().instances("train")
    assert [s.id for s in specs] == ["guess/train-0", "guess/train-1", "guess/train-2"]
    assert specs[0].instruction.startswith("I picked a whole number") and specs[0].family == "guess"
    scorer = Scorer([RewardFn("few_guesses", weight=0.2, python=few_guesses)], own="steps")
    agent = Scripted(bisect)
    outcome = run(run_outcome(specs[0], agent, PythonEnv(GuessNumber, [CALCULATOR], scorer)))
    guesses = len(agent.seen) - 1
    assert agent.seen[0] == "50" and agent.seen[-1] == "correct" and 1 <= guesses <= 7
    assert outcome.status == "ok" and outcome.rewards == {"steps": 1.0, "few_guesses": 1 / guesses}
    assert outcome.reward == pytest.approx(1.0 + 0.2 / guesses)
    # the same instance is the same secret: a second episode takes the same guesses
    again = Scripted(bisect)
    assert run(run_outcome(specs[0], again, PythonEnv(GuessNumber, [CALCULATOR]))).reward == 1.0
    assert again.seen == agent.seen


class GuessPolicy:
    """Test double for the policy: answers in text first (the environment reminds it of the tool), then
    guesses one below the secret (told "higher"), then the secret (done: the conversation ends)."""

    def __init__(self, tokenizer, secret: int):
        self.tokenizer, self.secret = tokenizer, secret

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        text = self.tokenizer.decode(list(input_ids))
        if "Use the guess tool" not in text:
            reply = Message("assistant", "Is it 7?")
        else:
            number = self.secret if "higher (" in text else self.secret - 1
            reply = Message("assistant", "", (ToolCall("guess", {"number": number}),))
        ids = assistant_ids(self.tokenizer, reply)
        return Generation(output_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids), finish_reason="stop",
                          weight_version=0, token_weight_versions=tuple(0 for _ in ids), prompt_len=len(input_ids))


def test_a_model_sees_the_environments_and_extra_tools_gets_replies_and_stops_when_done(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    spec = _source().instances("train")[1]
    env = GuessNumber()
    env.reset(spec.seed, spec.split)
    params = agent_params(max_turns=8, max_context_tokens=4096, tool_schema_in_prompt=True)
    episode = run(run_episode(spec, GuessPolicy(tokenizer, env.secret), tokenizer,
                              PythonEnv(GuessNumber, [CALCULATOR]), params, SamplingParams(seed=0)))
    prompt = tokenizer.decode(list(episode.tokens[: episode.prompt_len]))
    assert '"name": "guess"' in prompt and '"name": "calculator"' in prompt and '"name": "bash"' not in prompt
    context = tokenizer.decode([t for t, m in zip(episode.tokens, episode.loss_mask) if not m])
    # the text answer reached the environment, whose reminder came back as a user turn; done ended it at 3
    assert "Use the guess tool" in context and "higher (6 guesses left)" in context and "correct" in context
    assert (episode.status, episode.reward, episode.turns, episode.tool_errors) == ("ok", 1.0, 3, 0)


RECIPE = """train:
  env:
    python: examples.guess_number:GuessNumber
    rewards:
      concise: {python: "examples.rewards:within_budget", weight: 0.1, params: {budget: BUDGET}}
      roomy: {python: "examples.rewards:within_budget", weight: 0.1, params: {budget: 100000}}
      quick_pass: {python: "examples.rewards:passed_in_turns", weight: 0.2, params: {turns: 2}}
"""


@pytest.mark.parametrize("max_turns", [8, 2])
def test_reward_functions_see_the_tests_result_the_agents_tokens_and_their_params_from_the_yaml(
        tiny_dir, tmp_path, max_turns):
    """One function, two budgets from the recipe: a length penalty on the episode's generated tokens; and a
    bonus only where the environment's own reward passed (8 turns: found in 3; 2 turns: not found)."""
    from furlong.build.environment import scorer
    from furlong.config import load_config
    tokenizer, spec = load_tokenizer(tiny_dir), _source().instances("train")[1]
    env = GuessNumber()
    env.reset(spec.seed, spec.split)
    budget = 26
    (tmp_path / "r.yaml").write_text(RECIPE.replace("BUDGET", str(budget)))
    user_env = PythonEnv(GuessNumber, [CALCULATOR], scorer(load_config(tmp_path / "r.yaml").train.env))
    params = agent_params(max_turns=max_turns, max_context_tokens=4096, tool_schema_in_prompt=True)
    episode = run(run_episode(spec, GuessPolicy(tokenizer, env.secret), tokenizer, user_env, params,
                              SamplingParams(seed=0)))
    generated = sum(episode.loss_mask)
    assert budget < generated < 2 * budget  # so the penalty is partial: it did read the token count
    concise = 1 - (generated - budget) / budget
    found = max_turns == 8
    assert episode.turns == (3 if found else 2) and episode.rewards["steps"] == float(found)
    assert episode.rewards == {"steps": float(found), "concise": pytest.approx(concise), "roomy": 1.0,
                               "quick_pass": pytest.approx(2 / 3 if found else 0.0)}
    assert episode.reward == pytest.approx(float(found) + 0.1 * concise + 0.1 + 0.2 * episode.rewards["quick_pass"])


class Undemonstrated(GuessNumber):
    demonstrate = None  # as an environment written without one


def test_a_python_environments_demonstrations_are_played_through_it_for_sft(tiny_dir):
    """Each train instance's demonstrate() moves, through step: the demonstration shows the environment's
    own observations and ends on the secret; one that does not earn 1 is not kept; no demonstrate() is an
    error naming the key."""
    from furlong.train.sft import oracle_demos
    tokenizer, specs = load_tokenizer(tiny_dir), _source(n=3).instances("train")
    params = agent_params(max_turns=8, max_context_tokens=4096, tool_schema_in_prompt=True)
    demos = run(oracle_demos(specs, tokenizer, PythonEnv(GuessNumber, [CALCULATOR]), params, concurrency=2))
    assert [d.task_id for d in demos] == [s.id for s in specs]
    for demo, spec in zip(demos, specs):
        env = GuessNumber()
        env.reset(spec.seed, spec.split)
        shown = tokenizer.decode(list(demo.tokens))
        trained = tokenizer.decode([t for t, m in zip(demo.tokens, demo.loss_mask) if m])
        assert f'"number": {env.secret}' in trained and '"number": 50' in trained  # a bisection, to the secret
        assert "correct" in shown and "correct" not in trained and '"name": "calculator"' in shown

    class Misleading(GuessNumber):
        def demonstrate(self):
            return [Action(tool="guess", arguments={"number": 0})]  # never the secret: steps' reward 0

    assert run(oracle_demos(specs, tokenizer, PythonEnv(Misleading), params, concurrency=2)) == []

    with pytest.raises(TypeError, match="train.env.demonstrations: Undemonstrated has no demonstrate"):
        run(oracle_demos(specs, tokenizer, PythonEnv(Undemonstrated), params, concurrency=2))


class Flaky(GuessNumber):
    """Fails in `step` in the ways a user's environment may: raises, hangs, returns nonsense."""

    def step(self, action: Action):
        n = action.arguments.get("number")
        if n == 1:
            raise KeyError("boom")
        if n == 2:
            import time
            time.sleep(2)
        if n == 3:
            return "three", float("nan"), False
        return super().step(action)


def test_a_failing_step_is_a_tool_error_the_model_sees_and_scores_nothing():
    spec = _source(Flaky).instances("train")[0]
    moves = iter([("guess", {"number": 1}), ("guess", {"number": 2}), ("guess", {"number": 3}),
                  ("guess", {"number": "4"}), ("guess", {}), ("calculator", {"expression": "open(\"x\")"}),
                  ("calculator", {"expression": "2 ** 10"}), ("nope", {})])
    agent = Scripted(lambda seen: next(moves, None), timeout_s=0.5)
    outcome = run(run_outcome(spec, agent, PythonEnv(Flaky, [CALCULATOR])))
    assert agent.seen[0] == "error: the environment's step failed: KeyError: 'boom'"
    assert agent.seen[1] == "error: the environment's step timed out after 0.5s"
    assert agent.seen[2].startswith("error: the environment's step returned (str, nan, bool)")
    assert agent.seen[3] == "error: guess: argument 'number' must be of JSON type integer"
    assert agent.seen[4] == "error: guess needs the arguments ['number']"
    assert agent.seen[5].startswith("error: calculator failed: ValueError: not arithmetic")
    assert agent.seen[6] == "1024"
    assert agent.seen[7] == "error: unknown tool 'nope'; the tools: guess, calculator"
    # every failure was the model's to see; the episode is scored as usual (no guess found the secret)
    assert (outcome.status, outcome.reward) == ("ok", 0.0)


class Moody(GuessNumber):
    def reset(self, seed, split):
        Moody.calls = getattr(Moody, "calls", 0) + 1
        return super().reset(seed, split) + (" again" if Moody.calls > 1 else "")


class Broken(GuessNumber):
    broken = False

    def reset(self, seed, split):
        if Broken.broken:
            raise OSError("dataset unavailable")
        return super().reset(seed, split)


def test_an_environment_that_does_not_reset_to_its_instance_is_infra_error():
    spec = _source(Moody, n=1).instances("train")[0]
    outcome = run(run_outcome(spec, Scripted(bisect), PythonEnv(Moody)))
    assert (outcome.status, outcome.reward) == ("infra_error", None)
    assert "reset must be a function of seed and split" in outcome.error
    spec = _source(Broken, n=1).instances("train")[0]
    Broken.broken = True
    outcome = run(run_outcome(spec, Scripted(bisect), PythonEnv(Broken)))
    assert (outcome.status, outcome.error) == ("infra_error", "the environment did not reset to guess/train-0: "
                                                              "OSError: dataset unavailable")


def _answer_then_guess(answer: str):
    moves = iter([answer, ("guess", {"number": 50})])
    return lambda seen: next(moves, None)


def always_broken(episode):
    return {"not": "a number"}["number"]


def broken_by_answers(episode):
    """Raises on an answer it cannot parse: an agent that learns to answer "boom" must not escape a 0."""
    return float(episode.answer == "42") if episode.answer != "boom" else int(episode.answer)


async def slow(episode):
    await asyncio.sleep(0 if episode.answer is None else 60)
    return 1.0


@pytest.mark.parametrize("fn, answer, status, reward, says", [
    (broken_by_answers, "42", "ok", 1.0, None),
    (always_broken, "42", "infra_error", None, "failed with no agent too"),
    (broken_by_answers, "boom", "agent_broke_sandbox", 0.0, "but not in one no agent touched"),
    (slow, "42", "agent_broke_sandbox", 0.0, "timed out after 0.3s"),
    (lambda episode: math.inf, "42", "infra_error", None, "not a finite number"),
])
def test_a_failing_reward_function_is_never_a_reward_nor_a_way_out_of_a_zero(fn, answer, status, reward, says):
    spec = _source(n=1).instances("train")[0]
    scorer = Scorer([RewardFn("judge", weight=1.0, python=fn, timeout_s=0.3)], own_weight=0.0, own="steps")
    outcome = run(run_outcome(spec, Scripted(_answer_then_guess(answer)), PythonEnv(GuessNumber, (), scorer)))
    assert (outcome.status, outcome.reward) == (status, reward), outcome.error
    if says is not None:
        assert says in outcome.error and "[judge]" in outcome.error
    if fn is always_broken:  # the traceback is in the episode's record, down to the line that raised
        assert "Traceback" in outcome.error and "KeyError: 'number'" in outcome.error
        assert 'return {"not": "a number"}["number"]' in outcome.error


def test_a_python_environment_has_no_sandbox_for_command_tools_or_rewards():
    with pytest.raises(ValueError, match="command tools .* this environment has none"):
        _source(tools=(WORD_COUNT,)).instances("train")
    spec = _source(n=1).instances("train")[0]
    scorer = Scorer([RewardFn("cmd", command="echo 1")], own="steps")
    outcome = run(run_outcome(spec, Scripted(_answer_then_guess("1")), PythonEnv(GuessNumber, (), scorer)))
    assert outcome.status == "infra_error" and "needs a sandbox" in outcome.error
    clash = Tool("guess", "a second guess tool", python=lambda arguments, sandbox: "no")
    with pytest.raises(ValueError, match=re.escape("tools named twice: ['guess']")):
        _source(tools=(CALCULATOR, clash)).instances("train")


def test_the_config_names_the_users_code_and_checks_it_before_the_run():
    from furlong.build.environment import run_env, scorer
    from furlong.config import ConfigError, load_config

    bare = load_config(None, ["train.env.python=examples.guess_number:GuessNumber"]).train
    # one key makes a Python environment the run's one family, with no SFT demonstrations
    assert (bare.families, bare.sft.families, bare.sft.epochs, bare.rl.families, bare.rl.sft_coef) == (
        ("GuessNumber",), (), 0, None, 0.0)
    cfg = load_config(ROOT / "examples" / "guess_number.yaml")
    t = cfg.train  # the example gives its own demonstrations: SFT and RL's anchor show them
    assert (t.families, t.demonstrated(), t.rl.families, t.env.demonstrations) == (
        ("GuessNumber",), ("GuessNumber",), None, True) and t.sft.epochs > 0
    env = run_env(t.env, backend=None, images=None)
    assert env.factory is GuessNumber and env.tools == (CALCULATOR,)
    assert [(f.name, f.weight, f.python, f.params) for f in env.scorer.fns] == [
        ("few_guesses", 0.2, few_guesses, {}), ("concise", 0.1, within_budget, {"budget": 48})]
    for overrides, says in [
        (["train.env.python=examples.guess_number:GuessNumber", "train.rl.sft_coef=1"], "train.rl.sft_coef"),
        (["train.env.python=examples.guess_number:GuessNumber", "train.sft.epochs=2"], "train.sft.epochs"),
        (["train.env.rewards.tests.python=examples.rewards:few_guesses"], "reserved"),
        (["train.env.rewards.both.python=a:b", "train.env.rewards.both.command=ls"], "exactly one of"),
        (["train.env.python=examples"], 'expected "module:factory"'),
        (["train.env.demonstrations=true"], "a Python environment's"),
        (['train.env.rewards.c={command: "echo 1", params: {n: 1}}'], "only a python function sees them"),
    ]:
        with pytest.raises(ConfigError, match=says):
            load_config(None, overrides)
    python_cmd = load_config(None, ["train.env.python=examples.guess_number:GuessNumber",
                                    'train.env.rewards.c.command="echo 1"'])
    with pytest.raises(ConfigError, match=r"\['c'\] are commands, which run in a sandbox"):
        scorer(python_cmd.train.env)
    for key, value, says in [("tools", "[examples.tools:nothing]", "has no 'nothing'"),
                             ("tools", "[examples.rewards:few_guesses]", "is not a furlong.envs.toolset.Tool"),
                             ("python", "examples.missing:Env", "cannot import 'examples.missing'")]:
        with pytest.raises(ConfigError, match=re.escape(says)):
            bad = load_config(None, [f"train.env.{key}={value}"])
            run_env(bad.train.env, backend=None, images=None)
    undemonstrated = load_config(None, ["train.env.python=test_user_api:Undemonstrated",
                                        "train.env.demonstrations=true"])
    with pytest.raises(ConfigError, match=r"train.env.demonstrations: test_user_api:Undemonstrated has no demon"):
        run_env(undemonstrated.train.env, backend=None, images=None)


def test_furlong_eval_runs_a_python_environments_instances():
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--agent", "noop", "--split", "all",
                          "--per-family", "2", "train.env.python=examples.guess_number:GuessNumber"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["episodes"] == summary["scored"] == 4 and summary["mean_reward"] == 0.0
    assert sorted(summary["per_task"]) == [f"GuessNumber/{s}-{i}" for s in ("heldout", "train") for i in (0, 1)]
    oracle = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--agent", "oracle",
                             "train.env.python=examples.guess_number:GuessNumber"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert oracle.returncode == 2 and "has no oracle solution" in oracle.stderr
