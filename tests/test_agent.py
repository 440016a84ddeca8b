"""The agent loop's token accounting: tokens, loss mask, logprobs and versions, over real sandboxes."""

from __future__ import annotations

import asyncio

import pytest

from conftest import run
from furlong.agent.episode import run_episode
from furlong.agent.runner import AGENT_GRACE_S
from furlong.engine.base import Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model.chat import Message, ToolCall, assistant_ids, render_text
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.sandbox.pool import FreshSandboxes, fixed_image
from tests_support import agent_params, make_task


@pytest.fixture(scope="module")
def tiny():
    path = init_tiny()
    return load_tokenizer(path), path


class ScriptedPolicy:
    """Test double for the *policy*, not a service: answers with fixed assistant turns so that a
    multi-turn episode happens deterministically. It records every prompt it is given."""

    def __init__(self, tokenizer, turns: list[Message]):
        self.turns = [assistant_ids(tokenizer, m) for m in turns]
        self.prompts: list[list[int]] = []
        self.weight_version = 7

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        self.prompts.append(list(input_ids))
        ids = self.turns[len(self.prompts) - 1]
        return Generation(output_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids), finish_reason="stop",
                          weight_version=7, token_weight_versions=tuple(7 for _ in ids), prompt_len=len(input_ids))


def test_multi_turn_tokens_mask_and_no_retokenization(tiny, backend, base_image, store, tmp_path):
    tokenizer, _ = tiny
    task = make_task(tmp_path, "echo", "Write hi to /app/out.txt",
                     test="grep -q hi /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")
    turns = [Message("assistant", "", (ToolCall("bash", {"command": "mkdir -p /app && cd /app"}),)),
             Message("assistant", "", (ToolCall("bash", {"command": "echo hi > out.txt && cat out.txt"}),)),
             Message("assistant", "<tool_call>{not json}</tool_call>"),
             Message("assistant", "Done.")]
    policy = ScriptedPolicy(tokenizer, turns)
    params = agent_params(max_turns=6, max_context_tokens=4096)
    ep = run(run_episode(task, policy, tokenizer, FreshSandboxes(backend, fixed_image(base_image)), params,
                         SamplingParams(), group_id=3, sample_id=1))
    assert (ep.status, ep.reward, ep.turns, ep.tool_errors) == ("ok", 1.0, 4, 1)
    # each prompt extends the previous prompt plus what was sampled: history is never re-tokenized
    for before, after, sampled in zip(policy.prompts, policy.prompts[1:], policy.turns):
        assert after[: len(before) + len(sampled)] == before + sampled
    assert list(ep.tokens[: len(policy.prompts[-1])]) == policy.prompts[-1]
    # loss mask is 1 exactly on the sampled ids, which carry their logprobs and weight version
    sampled = [t for t, m in zip(ep.tokens, ep.loss_mask) if m]
    assert sampled == [t for turn in policy.turns for t in turn]
    assert {lp for lp, m in zip(ep.rollout_logprobs, ep.loss_mask) if m} == {-0.5}
    assert {v for v, m in zip(ep.token_weight_versions, ep.loss_mask) if not m} == {-1}
    # decoding the tokens reproduces the conversation: the tool results are the real ones
    text = tokenizer.decode(ep.tokens, skip_special_tokens=False)
    assert "exit code 0\nhi" in text and "error: tool call #1: invalid JSON" in text
    assert text.startswith(render_text(tokenizer, [Message("system", params.system_prompt),
                                                   Message("user", task.instruction)]))


def test_real_engine_episode_invariants(tiny, backend, base_image, tmp_path):
    tokenizer, path = tiny
    task = make_task(tmp_path, "any", "Say something", test="echo 0 > /logs/verifier/reward.txt")

    async def go():
        engine = HFEngine(load_model(path), eos_token_ids=())
        try:
            return await run_episode(task, engine, tokenizer, FreshSandboxes(backend, fixed_image(base_image)),
                                     agent_params(max_turns=2, max_new_tokens=24, max_context_tokens=512),
                                     SamplingParams(temperature=1.0, seed=5))
        finally:
            await engine.close()

    ep = run(go())
    assert ep.status in ("ok", "truncated") and ep.reward == 0.0
    assert len(ep.tokens) == len(ep.loss_mask) == len(ep.rollout_logprobs) == len(ep.token_weight_versions)
    assert 0 < ep.response_len <= 48 and not any(ep.loss_mask[: ep.prompt_len])
    assert all(lp < 0 for lp, m in zip(ep.rollout_logprobs, ep.loss_mask) if m)
    assert ep.timing.model_wait > 0 and ep.timing.sandbox_start > 0 and ep.timing.verifier > 0


class SlowEngine(ScriptedPolicy):
    """Test double for a *loaded shared engine*: each turn's reply arrives only after `delay_s`."""

    def __init__(self, tokenizer, turns: list[Message], delay_s: float):
        super().__init__(tokenizer, turns)
        self.delay_s = delay_s

    async def generate(self, input_ids, sampling: SamplingParams) -> Generation:
        await asyncio.sleep(self.delay_s)
        return await super().generate(input_ids, sampling)


def test_agent_timeout_counts_sandbox_work_not_engine_waits(tiny, backend, base_image, tmp_path):
    """A busy engine must not turn an episode into a timeout scored 0; the agent's own commands still
    run against the task's agent timeout."""
    tokenizer, _ = tiny
    sandboxes = FreshSandboxes(backend, fixed_image(base_image))
    params = agent_params(max_turns=3, max_context_tokens=4096)
    write = [Message("assistant", "", (ToolCall("bash", {"command": "echo hi > /tmp/out.txt"}),)),
             Message("assistant", "Done.")]
    task = make_task(tmp_path, "slow-engine", "Write hi", agent_timeout=1.5,
                     test="grep -q hi /tmp/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")
    # 2 waits of 4 s: past the agent timeout and past the runner's hard limit (timeout + grace) alike
    ep = run(run_episode(task, SlowEngine(tokenizer, write, 4.0), tokenizer, sandboxes, params, SamplingParams(),
                         group_id=3, sample_id=1))
    assert 1.5 + AGENT_GRACE_S < 8.0 <= ep.timing.model_wait
    assert (ep.status, ep.reward, ep.turns) == ("ok", 1.0, 2)
    sleepy = [Message("assistant", "", (ToolCall("bash", {"command": "sleep 1; sleep 1; echo hi > /tmp/out.txt"}),)),
              Message("assistant", "Done.")]
    task = make_task(tmp_path, "slow-agent", "Write hi", agent_timeout=1.5, test="echo 1 > /logs/verifier/reward.txt")
    ep = run(run_episode(task, SlowEngine(tokenizer, sleepy, 0.0), tokenizer, sandboxes, params, SamplingParams(),
                         group_id=3, sample_id=1))
    assert ep.status == "timeout" and ep.turns == 1  # the agent's own 2 s of commands still hit the 1.5 s limit
