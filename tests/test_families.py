"""Every model family's tiny variant (furlong.model.families) through furlong's real trainer and hf engine:
step 0 is on-policy (no PPO movement, no clipping, KL to the reference 0), trainer and engine agree on the
sampled tokens' logprobs every step, a published update leaves the engine holding exactly the trainer's
tensors, LoRA trains on the family's own projections, the HF export loads back, and a tool-call episode in the
family's own format parses and re-renders to the sampled ids. Step 1's loss and grad norm are compared with
tests/fixtures/family_metrics.json (the metric-history gate). One model per family, built once."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run
from tests_support import ScriptedTurns, agent_params, grpo, make_task
from transformers import AutoModelForCausalLM

from furlong.agent.episode import Episode, EpisodeTiming, run_episode
from furlong.config import REPO_ROOT
from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model.chat import (
    ChatTemplateError,
    Message,
    ToolCall,
    assistant_ids,
    continuation_ids,
    encode,
    render_prompt_ids,
    render_text,
)
from furlong.model.families import FAMILIES, family, init_family
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.lora import LoraSpec, adapter_state_dict, base_state_dict, trainable_model, wrap_lora
from furlong.model.toolcall import tool_format
from furlong.sandbox.pool import FreshSandboxes, fixed_image
from furlong.train import LocalTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
METRICS = Path(__file__).parent / "fixtures" / "family_metrics.json"
# Step 1's grad norm may move this much (relative) before the gate fails: the same seeds, weights and tokens
# give the same numbers up to the float summation order of the machine's kernels.
BAND = 1e-3
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: init_family(name, root / name) for name in FAMILIES}


def checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().contiguous().cpu().numpy().tobytes()).hexdigest() for k, v in state.items()}


def prompts(tokenizer) -> list[list[int]]:
    asks = ("List the files.", "What is 2 + 3?")
    return [render_prompt_ids(tokenizer, [Message("system", "You are terse."), Message("user", a)]) for a in asks]


async def sample(engine: HFEngine, tokenizer, step: int) -> list[Episode]:
    """Two prompts x two samples, rewarded 1 / 0 within each group so every group has an advantage."""
    episodes = []
    for g, prompt in enumerate(prompts(tokenizer)):
        gens = await asyncio.gather(*(engine.generate(prompt, SamplingParams(
            temperature=TEMPERATURE, max_new_tokens=24, seed=100 * step + 10 * g + i)) for i in range(2)))
        for i, gen in enumerate(gens):
            n, p = len(gen.output_ids), len(prompt)
            episodes.append(Episode(
                task_id="t", group_id=g, sample_id=i, prompt_len=p, tokens=tuple(prompt) + gen.output_ids,
                loss_mask=(0,) * p + (1,) * n, rollout_logprobs=(0.0,) * p + gen.logprobs,
                token_weight_versions=(-1,) * p + gen.token_weight_versions, reward=float(i == 0), status="ok",
                timing=EpisodeTiming(), turns=1))
    return episodes


def rl_steps(directory: Path) -> list:
    """2 GRPO steps: sample with the engine, train, publish the trainer's weights into the engine."""
    tokenizer = load_tokenizer(directory)
    trainer = LocalTrainer(load_model(directory), grpo(lr=1e-3, temperature=TEMPERATURE, kl_coef=0.1),
                           ref_model=load_model(directory))
    found = []

    async def main() -> None:
        async with HFEngine(load_model(directory), deterministic=True, seed=0) as engine:
            for step in range(2):
                stats = trainer.train_step(await sample(engine, tokenizer, step))
                await engine.update_weights(trainer.engine_weights(), stats.version)
                assert checksums(engine.model.state_dict()) == checksums(trainer.model.state_dict())
                found.append((stats, trainer.last_minibatches[0]))

    asyncio.run(main())
    return found


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_rl_steps_on_the_hf_engine(family_dirs, name: str) -> None:
    (first, first_mb), (second, _) = rl_steps(family_dirs[name])
    assert first.updated and second.updated and second.version == 2
    assert abs(first_mb.ppo_kl) < 1e-9 and first_mb.clip_frac == 0.0  # step 0: nothing has moved yet
    assert first.ref_kl == 0.0  # the reference is the initial policy, bit for bit
    for stats in (first, second):  # the engine sampled with the weights the trainer scores: parity each step
        assert stats.logprob_diff_max < 1e-5 and abs(stats.rollout_train_kl) < 1e-6, (name, stats)
    assert second.ref_kl > 0.0  # step 1 moved the policy away from the reference
    want = json.loads(METRICS.read_text())[name]
    assert abs(first.grad_norm - want["grad_norm"]) <= BAND * want["grad_norm"], (name, first.grad_norm, want)
    # On-policy GRPO's loss is ~0 (advantages cancel), so its band is absolute there.
    assert abs(first.loss - want["loss"]) <= BAND * max(abs(want["loss"]), 1.0), (name, first.loss, want)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.tool_format])
def test_a_tool_call_episode_parses_and_re_renders_to_its_ids(family_dirs, name: str) -> None:
    """A call and a final answer in the family's template: the call parses back, and the whole conversation
    rendered from text tokenizes to exactly the incrementally built ids (tito_mismatch_tokens == 0)."""
    tok = load_tokenizer(family_dirs[name])
    fmt = tool_format(tok)  # auto: read from the family's own template
    assert fmt.name == FAMILIES[name].tool_format
    call = Message("assistant", "<think>\nLook first.\n</think>\n\n" if name.startswith("qwen3") else "Look first.",
                   (ToolCall("bash", {"command": "ls -la /app"}),))
    answer = Message("assistant", "<think>\nSeen.\n</think>\n\nTwo files." if name.startswith("qwen3") else "Two files.")
    history = [Message("system", "You are terse."), Message("user", "List the files.")]
    ids = render_prompt_ids(tok, history, tools=[BASH])
    sampled = assistant_ids(tok, call, fmt.turn_ends)
    assert fmt.parse(tok.decode(sampled, skip_special_tokens=False), [BASH]) == [call.tool_calls[0]]
    turns = [(len(ids), len(ids) + len(sampled))]
    ids += sampled + continuation_ids(tok, [Message("tool", "a.txt b.txt")], end_of_turn=fmt.turn_ends, answered=call)
    history += [call, Message("tool", "a.txt b.txt")]
    assert tito_mismatch(tok, render_text(tok, history, [BASH], add_generation_prompt=True), ids, turns) == 0
    final = assistant_ids(tok, answer, fmt.turn_ends)
    assert fmt.parse(tok.decode(final, skip_special_tokens=False), [BASH]) == []
    turns.append((len(ids), len(ids) + len(final)))
    ids += final
    # GLM-4.5's template writes no end marker after a turn: the <|user|> the model ended its answer with is
    # the role of the next message, there once one follows
    after = [Message("user", "Thanks.")] if name == "glm4_moe" else []
    if name != "gpt_oss":  # harmony's template drops a call's analysis once an answer follows (docs/models.md)
        assert tito_mismatch(tok, render_text(tok, [*history, answer, *after], [BASH]), ids, turns) == 0


EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3 writes for a turn without reasoning


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_qwen3_turns_without_reasoning_continue_as_the_template_writes_them(family_dirs, name: str) -> None:
    """Qwen3's template gives a conversation's last assistant turn an empty think block and drops it once
    the conversation goes on: continuing after a call and after an answer (a tool result, a user turn) keeps
    the sampled ids and appends what the template writes for the next turn (it raised ChatTemplateError).
    Its last-turn form also strips an answer's leading newlines, which its history form keeps."""
    tok = load_tokenizer(family_dirs[name])
    ends = tool_format(tok).turn_ends
    history = [Message("system", "You are terse."), Message("user", "List the files.")]
    ids = render_prompt_ids(tok, history, tools=[BASH])
    call = Message("assistant", "", (ToolCall("bash", {"command": "ls"}),))
    steps = [(call, Message("tool", "a.txt")), (Message("assistant", "One file."), Message("user", "More?")),
             (Message("assistant", "\n\nSpaced."), Message("user", "Go on."))]
    sampled = [assistant_ids(tok, Message("assistant", EMPTY_THINK, call.tool_calls), ends),
               assistant_ids(tok, Message("assistant", EMPTY_THINK + "One file."), ends),
               encode(tok, "\n\nSpaced.<|im_end|>")]  # sampled without a think block, as the tiny model does
    for out, (said, answer) in zip(sampled, steps, strict=True):
        ids += out + continuation_ids(tok, [answer], end_of_turn=ends, answered=said)
        history += [said, answer]
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.count(EMPTY_THINK) == 2  # the sampled blocks stay; the template writes neither in history
    assert text.replace(EMPTY_THINK, "") == render_text(tok, history, [BASH], add_generation_prompt=True)
    # what the model wrote is still never re-rendered away: reasoning goes at a new user query, an earlier
    # turn's or the answered turn's own
    thought = Message("assistant", "<think>\nPlan.\n</think>\n\n", call.tool_calls)
    for before, said in [([*history[:2], thought, history[3]], history[4]), (history[:2], thought)]:
        with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
            continuation_ids(tok, [Message("user", "More?")], end_of_turn=ends, answered=said, history=before)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_a_qwen3_tool_episode_in_furlongs_agent(family_dirs, name: str, backend, base_image, tmp_path) -> None:
    """furlong's own agent on the family's template, a real sandbox: a call with an empty think block, one
    without any (a sample that skipped it), then an answer. It was an infra_error after the first turn."""
    tok = load_tokenizer(family_dirs[name])
    ends = tool_format(tok).turn_ends
    said = [Message("assistant", EMPTY_THINK, (ToolCall("bash", {"command": "mkdir -p /app"}),)),
            Message("assistant", "", (ToolCall("bash", {"command": "echo hi > /app/out.txt"}),)),
            Message("assistant", EMPTY_THINK + "Done.")]
    policy = ScriptedTurns([assistant_ids(tok, m, ends) for m in said])
    task = make_task(tmp_path, "qwen3-think", "Write hi to /app/out.txt",
                     test="grep -q hi /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")
    params = agent_params(max_turns=4, max_context_tokens=4096, tool_format="auto")
    ep = run(run_episode(task, policy, tok, FreshSandboxes(backend, fixed_image(base_image)), params, SamplingParams()))
    assert (ep.status, ep.reward, ep.turns, ep.error) == ("ok", 1.0, 3, None)
    assert [t for t, m in zip(ep.tokens, ep.loss_mask) if m] == [t for turn in policy.turns for t in turn]
    assert list(ep.tokens) == policy.prompts[-1] + policy.turns[-1]
    conversation = [Message("system", params.system_prompt), Message("user", task.instruction), said[0],
                    Message("tool", "exit code 0"), said[1], Message("tool", "exit code 0")]
    assert tok.decode(policy.prompts[-1], skip_special_tokens=False).replace(EMPTY_THINK, "") == render_text(
        tok, conversation, add_generation_prompt=True)


def tito_mismatch(tok, text: str, ids: list[int], turns: list[tuple[int, int]]) -> int:
    """The gateway's tito_mismatch_tokens rule (furlong.gateway.trajectory): find each sampled span's text in
    the render of the conversation, tokenize the text between them; count ids that differ from the episode's."""
    expected, pos = [], 0
    for start, stop in turns:
        span = tok.decode(ids[start:stop], skip_special_tokens=False)
        at = text.find(span, pos)
        assert at >= 0, (span, text)
        expected += encode(tok, text[pos:at]) + ids[start:stop]
        pos = at + len(span)
    expected += encode(tok, text[pos:])[: max(len(ids) - len(expected), 0)]  # the continuation after the last turn
    return sum(a != b for a, b in zip(expected, ids, strict=False)) + abs(len(expected) - len(ids))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lora_on_the_familys_own_modules(family_dirs, name: str) -> None:
    """LoRA on the family's projections trains only adapters; an engine holding the same spec takes them."""
    fam, directory = family(name), family_dirs[name]
    spec = LoraSpec(targets=fam.lora_targets)
    peft = wrap_lora(load_model(directory), spec)
    layers = load_model(directory).config.num_hidden_layers
    assert len(adapter_state_dict(peft)) == 2 * layers * len(fam.lora_targets)  # A and B on every target
    base0 = {k: v.clone() for k, v in base_state_dict(peft).items()}
    tokenizer = load_tokenizer(directory)
    trainer = LocalTrainer(trainable_model(peft), grpo(lr=1e-2, temperature=TEMPERATURE))

    async def main() -> None:
        async with HFEngine(wrap_lora(load_model(directory), spec, seed=123), deterministic=True) as engine:
            stats = trainer.train_step(await sample(engine, tokenizer, 0))
            assert stats.updated and stats.grad_norm > 0
            await engine.update_weights(adapter_state_dict(peft), stats.version)  # what AdapterPublisher ships
            live = adapter_state_dict(engine.model)  # type: ignore[arg-type]  # the engine holds a PeftModel
            assert checksums(live) == checksums(adapter_state_dict(peft))

    asyncio.run(main())
    assert all(torch.equal(v, base0[k]) for k, v in base_state_dict(peft).items())  # the base never moves


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_hf_export_loads_back_in_transformers(family_dirs, name: str, tmp_path: Path) -> None:
    directory = family_dirs[name]
    trainer = LocalTrainer(load_model(directory), grpo())
    out = trainer.export_hf(tmp_path / "export", load_tokenizer(directory), base_model=directory)
    back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(back) is type(trainer.model)
    assert checksums(back.state_dict()) == checksums(trainer.model.state_dict())
    assert load_tokenizer(out).chat_template == load_tokenizer(directory).chat_template


def test_furlong_train_runs_two_rl_steps_on_a_moe_family(family_dirs, tmp_path: Path) -> None:
    """`furlong train` as a user runs it, on the Qwen3-MoE variant (the bundled prompts example: no sandbox):
    both steps train on every episode and log trainer/rollout parity; the engine records routes, the trainer
    replays them (train.moe.routing_replay=on) and logs expert load, and episodes.jsonl summarises them."""
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--config", "recipes/prompts-arith.yaml",
                          f"train.model.path={family_dirs['qwen3_moe']}", f"train.run_dir={run}", "train.sft.epochs=0",
                          "train.rl.steps=2", "train.rl.tasks_per_step=2", "train.rl.group_size=2",
                          "train.rl.filter_zero_variance=false", "train.eval.heldout_per_family=1",
                          "train.moe.routing_replay=on"],
                         check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["updated"] and r["loss_tokens"] > 0 for r in rows)
    assert all(r["logprob_diff_max"] < 1e-5 and abs(r["rollout_train_kl"]) < 1e-6 for r in rows), rows
    assert rows[0]["ppo_kl"] == 0.0 and rows[0]["clip_frac"] == 0.0
    assert all(r["moe_load_max_ratio"] >= 1.0 and 0 < r["moe_load_entropy"] <= 1.0 for r in rows), rows
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    routed = [r["routes"] for r in records if r["phase"] == "rl"]
    assert routed and all(r["layers"] == 2 and r["top_k"] == 2 and r["tokens"] > 0 for r in routed), routed


def test_an_unknown_family_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model family 'qwen9'.*qwen3, qwen3_moe, llama3"):
        init_family("qwen9")


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.tool_format in ("pythonic", "glm45", "deepseek_v3")])
def test_a_tool_episode_in_furlongs_agent(family_dirs, name: str, backend, base_image, tmp_path) -> None:
    """furlong's own agent on the family's template and format, a real sandbox: two calls (one with text and
    several arguments' worth of quoting), then an answer; the sampled ids stay verbatim, and the last prompt
    is the template's render of the conversation (no end marker of its own after a GLM-4.5 turn: the
    <|observation|> the model wrote ends it)."""
    tok = load_tokenizer(family_dirs[name])
    fmt = tool_format(tok)
    assert fmt.name == FAMILIES[name].tool_format
    said = [Message("assistant", "Make the dir.", (ToolCall("bash", {"command": "mkdir -p /app"}),)),
            Message("assistant", "", (ToolCall("bash", {"command": "printf '%s\\n' \"hi ü\" > /app/out.txt"}),)),
            Message("assistant", "Done.")]
    policy = ScriptedTurns([assistant_ids(tok, m, fmt.turn_ends) for m in said])
    task = make_task(tmp_path, f"{name}-tools", "Write hi to /app/out.txt",
                     test="grep -q 'hi ü' /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt")
    params = agent_params(max_turns=4, max_context_tokens=4096, tool_format="auto")
    ep = run(run_episode(task, policy, tok, FreshSandboxes(backend, fixed_image(base_image)), params, SamplingParams()))
    assert (ep.status, ep.reward, ep.turns, ep.error, ep.tool_errors) == ("ok", 1.0, 3, None, 0)
    assert [t for t, m in zip(ep.tokens, ep.loss_mask) if m] == [t for turn in policy.turns for t in turn]
    assert list(ep.tokens) == policy.prompts[-1] + policy.turns[-1]
    conversation = [Message("system", params.system_prompt), Message("user", task.instruction), said[0],
                    Message("tool", "exit code 0"), said[1], Message("tool", "exit code 0")]
    assert tok.decode(policy.prompts[-1], skip_special_tokens=False) == render_text(
        tok, conversation, add_generation_prompt=True)


@pytest.mark.parametrize("name", ["llama3", "gpt_oss"])
def test_a_template_that_prints_the_date_renders_one_fixed_date(family_dirs, name: str, monkeypatch) -> None:
    """Llama 3.1 and gpt-oss print today's date: a prompt rendered after midnight would differ from the same
    prompt before it (a run would not reproduce, a re-rendered conversation would not match its ids)."""
    tok = load_tokenizer(family_dirs[name])
    msgs = [Message("system", "You are terse."), Message("user", "List the files.")]
    text = render_text(tok, msgs, add_generation_prompt=True)
    assert ("07 Dec 2026" if name == "llama3" else "2026-12-07") in text
    # the wall clock's date is not what it printed (that is what failed the metric gate after midnight)
    today = datetime.date.today()
    assert today == datetime.date(2026, 12, 7) or today.strftime("%Y-%m-%d") not in text
    monkeypatch.setenv("FURLONG_TEMPLATE_DATE", "2025-01-31")
    assert ("31 Jan 2025" if name == "llama3" else "2025-01-31") in render_text(tok, msgs, add_generation_prompt=True)
    monkeypatch.setenv("FURLONG_TEMPLATE_DATE", "31/01/2025")
    with pytest.raises(ChatTemplateError, match="FURLONG_TEMPLATE_DATE='31/01/2025': expected a date as YYYY-MM-DD"):
        render_text(tok, msgs)
