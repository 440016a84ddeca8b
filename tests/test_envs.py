"""A second environment plugs into the seam (furlong.envs.base): a pure-Python one, no sandbox, whose
tools are Python functions and whose score is computed in Python, run through the same Rollouts and
runner a training step uses, and trained on."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from conftest import run
from tests_support import agent_params, grpo
from furlong.agent.tools import ToolRunner
from furlong.engine.base import Generation, SamplingParams
from furlong.agent.runner import AgentRun, run_outcome
from furlong.envs.base import EnvUnavailable, Score, ToolArgumentError
from furlong.timing import Clock
from furlong.model.chat import Message, ToolCall, assistant_ids
from furlong.model.loading import load_model, load_tokenizer
from furlong.rollout.groups import Rollouts, plan_step
from furlong.train.trainer import LocalTrainer


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


@dataclass(frozen=True)
class Sum:
    """An EnvSpec: add two numbers with the add tool, then submit the result."""

    id: str
    a: int
    b: int
    family: str | None = "sums"
    agent_timeout_s: float = 30.0

    @property
    def instruction(self) -> str:
        return f"What is {self.a} + {self.b}? Call add, then submit the sum."


class SumSource:
    def instances(self, split: str) -> list[Sum]:
        return [Sum(f"{split}-{a}-{b}", a, b) for a, b in ((2, 3), (40, 2))]


class SumEpisode:
    """The EpisodeEnv: its state is the submitted answer."""

    def __init__(self, spec: Sum):
        self.spec, self.note, self.seconds, self.calls = spec, None, 0.0, 0
        self.submitted: int | None = None
        self.tools = self  # its own toolbox
        self.schemas = (_tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
                        _tool("submit", {"answer": {"type": "integer"}}))

    async def call(self, name: str, arguments: dict, timeout_s: float) -> str:
        self.calls += 1
        values = {k: arguments.get(k) for k in ("a", "b") if name == "add"} or {"answer": arguments.get("answer")}
        if not all(isinstance(v, int) for v in values.values()):
            raise ToolArgumentError(f"{name} needs integer arguments {sorted(values)}")
        if name == "add":
            return f"sum: {values['a'] + values['b']}"
        self.submitted = values["answer"]
        return "submitted"

    def caused(self, exc: BaseException) -> bool:
        return False  # nothing here can break: an exception is the agent's own

    async def score(self) -> Score:
        return Score(reward=float(self.submitted == self.spec.a + self.spec.b))

    async def close(self) -> None:
        pass


class SumEnv:
    """The Environment: opens a fresh SumEpisode per episode."""

    def __init__(self):
        self.reserved: list[str] = []

    def reserve(self, spec: Sum) -> None:
        self.reserved.append(spec.id)

    async def open(self, spec: Sum, clock: Clock) -> SumEpisode:
        return SumEpisode(spec)


class SumPolicy:
    """Test double for the *policy*: reads the numbers from its prompt, calls add, then submits the sum,
    or the sum + 1 when its turn's seed is odd, so a group holds both rewards. Records what it sampled."""

    def __init__(self, tokenizer):
        self.tokenizer, self.weight_version = tokenizer, 3
        self.sampled: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # (prompt, the ids it answered)

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        text = self.tokenizer.decode(list(input_ids))
        if "submitted" in text:
            reply = Message("assistant", "Done.")
        elif "sum: " in text:
            total = int(re.findall(r"sum: (\d+)", text)[-1])
            reply = Message("assistant", "", (ToolCall("submit", {"answer": total + sampling.seed % 2}),))
        else:
            a, b = re.search(r"What is (\d+) \+ (\d+)\?", text).groups()
            reply = Message("assistant", "", (ToolCall("add", {"a": int(a), "b": int(b)}),))
        ids = assistant_ids(self.tokenizer, reply)
        self.sampled.add((tuple(input_ids), tuple(ids)))
        return Generation(output_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids), finish_reason="stop",
                          weight_version=3, token_weight_versions=tuple(3 for _ in ids), prompt_len=len(input_ids))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


def test_a_python_environment_runs_through_rollouts_and_trains(tiny_dir, tokenizer):
    specs, env, policy = SumSource().instances("train"), SumEnv(), SumPolicy(tokenizer)
    plan = plan_step(specs, 0, tasks_per_step=2, group_size=4, seed=0)
    rollouts = Rollouts(policy, tokenizer, env, agent_params(max_turns=3, max_context_tokens=4096), concurrency=3)
    episodes = run(rollouts.run(plan.episodes(), temperature=1.0))
    # every episode's environment was reserved ahead, as a sandbox would be
    assert len(episodes) == 8 and sorted(env.reserved) == sorted(e.task_id for e in episodes)
    for e in episodes:
        spec = next(s for s in specs if s.id == e.task_id)
        # two sampled turns (add, submit) and a third that ends the episode without a call
        assert e.status in ("ok", "truncated") and e.turns == 3 and e.family == "sums" and e.tool_errors == 0
        sampled = [t for t, m in zip(e.tokens, e.loss_mask) if m]
        assert e.rollout_logprobs == tuple(-0.5 if m else 0.0 for m in e.loss_mask)
        text = tokenizer.decode(list(e.tokens))
        answer = int(re.search(r'"answer": (\d+)', text).group(1))
        assert e.reward == float(answer == spec.a + spec.b)  # scored in Python, from the submitted answer
        assert f"sum: {spec.a + spec.b}" in tokenizer.decode([t for t, m in zip(e.tokens, e.loss_mask) if not m])
        # the loss mask is 1 exactly on what the policy sampled: each run of ones is one of its answers to
        # the tokens before it
        starts = [i for i in range(1, len(e.tokens)) if e.loss_mask[i] and not e.loss_mask[i - 1]]
        ends = [*(i for i in range(1, len(e.tokens)) if not e.loss_mask[i] and e.loss_mask[i - 1]), len(e.tokens)]
        assert len(starts) == 3 and e.prompt_len == starts[0]
        assert all((e.tokens[:i], e.tokens[i:j]) in policy.sampled for i, j in zip(starts, ends))
        assert len(sampled) == sum(j - i for i, j in zip(starts, ends))
    assert {e.reward for e in episodes} == {0.0, 1.0}
    stats = LocalTrainer(load_model(tiny_dir), grpo(filter_zero_variance=False)).train_step(episodes)
    assert stats.episodes_dropped == 0 and stats.reward_mean == sum(e.reward for e in episodes) / 8


def test_a_python_toolbox_reports_bad_calls_to_the_model(tokenizer):
    runner = ToolRunner(SumEpisode(Sum("s", 1, 2)), timeout_s=5, observation_chars=100)
    assert run(runner.run(ToolCall("add", {"a": 1, "b": 2}))) == "sum: 3"
    assert run(runner.run(ToolCall("add", {"a": "one", "b": 2}))) == "error: add needs integer arguments ['a', 'b']"
    assert run(runner.run(ToolCall("bash", {"command": "ls"}))) == "error: unknown tool 'bash'; the tools: add, submit"
    assert runner.errors == 2


class Submitter:
    """A scripted agent for any environment: submits one answer through the tools."""

    name = "submitter"

    def __init__(self, answer: int):
        self.answer = answer

    async def run(self, spec, tools, timeout_s):
        await tools.call("submit", {"answer": self.answer}, timeout_s)
        return AgentRun(commands=1)


class Refusing(SumEnv):
    async def open(self, spec, clock):
        raise EnvUnavailable("session refused: the server is full")


class Judged(SumEnv):
    """Scores every episode with a fixed Score, whatever the answer."""

    def __init__(self, score: Score):
        super().__init__()
        self.fixed = score

    async def open(self, spec, clock):
        episode = SumEpisode(spec)
        episode.score = self._score
        return episode

    async def _score(self) -> Score:
        return self.fixed


def test_the_runners_status_rules_hold_for_any_environment():
    spec = Sum("s", 2, 3)
    ok = run(run_outcome(spec, Submitter(5), SumEnv()))
    assert (ok.status, ok.reward, ok.timing.agent_commands >= 0) == ("ok", 1.0, True)
    assert run(run_outcome(spec, Submitter(4), SumEnv())).reward == 0.0
    refused = run(run_outcome(spec, Submitter(5), Refusing()))
    assert (refused.status, refused.reward, refused.error) == ("infra_error", None, "session refused: the server is full")
    broken = run(run_outcome(spec, Submitter(5), Judged(Score(reward=None, error="scorer crashed"))))
    assert (broken.status, broken.reward, broken.error) == ("infra_error", None, "scorer crashed")
    broke = run(run_outcome(spec, Submitter(5), Judged(Score(reward=None, agent_broke_env=True, error="state gone"))))
    assert (broke.status, broke.reward, broke.error) == ("agent_broke_sandbox", 0.0, "state gone")
    late = run(run_outcome(spec, Submitter(5), Judged(Score(reward=0.0, timed_out=True))))
    assert (late.status, late.reward) == ("timeout", 0.0)
    crashed = run(run_outcome(spec, Submitter("five"), SumEnv()))  # the agent's own code raised
    assert (crashed.status, crashed.reward) == ("infra_error", None) and "agent failed" in crashed.error


def test_harbor_families_are_an_env_source_of_the_runs_instances():
    from furlong.config import BUNDLED_TASKS
    from furlong.envs.harbor import HarborSource
    from furlong.tasks.family import load_family

    families = [load_family(BUNDLED_TASKS / name) for name in ("count-in-file", "number-stats")]
    source = HarborSource(families, {"heldout": 2, "train": 3})
    heldout = source.instances("heldout")
    assert [t.family for t in heldout] == ["count-in-file"] * 2 + ["number-stats"] * 2
    assert [t.id for t in heldout] == [t.id for f in families for t in f.instances("heldout", 2)]
    assert len(source.instances("train")) == 6
    assert not {t.id for t in heldout} & {t.id for t in source.instances("train")}


def test_the_model_sees_the_environments_own_tool_schemas(tokenizer):
    from furlong.agent.episode import run_episode

    params = agent_params(max_turns=3, max_context_tokens=4096, tool_schema_in_prompt=True)
    episode = run(run_episode(Sum("s", 2, 3), SumPolicy(tokenizer), tokenizer, SumEnv(), params, SamplingParams(seed=1)))
    prompt = tokenizer.decode(list(episode.tokens[: episode.prompt_len]))
    assert '"name": "submit"' in prompt and '"name": "add"' in prompt and '"name": "bash"' not in prompt
    assert episode.reward is not None and episode.turns == 3


def test_the_model_reads_the_environments_opening_after_the_instruction(tokenizer):
    """An environment that shows the agent something first (an OpenEnv server's reset observation)."""
    from furlong.agent.episode import run_episode

    class Opening(SumEnv):
        async def open(self, spec, clock):
            episode = SumEpisode(spec)
            episode.opening = "The numbers are small."
            return episode

    params = agent_params(max_turns=3, max_context_tokens=4096)
    episode = run(run_episode(Sum("s", 2, 3), SumPolicy(tokenizer), tokenizer, Opening(), params, SamplingParams(seed=1)))
    prompt = tokenizer.decode(list(episode.tokens[: episode.prompt_len]))
    assert "What is 2 + 3? Call add, then submit the sum.\n\nThe numbers are small." in prompt
    assert episode.reward == 1.0 and episode.turns == 3
