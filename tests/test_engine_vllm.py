"""The vllm engine, for real (vLLM's CPU build): token in/out, logprobs against the trainer, weight updates
direct and through the relay, pause/resume. One engine serves the module: vLLM takes 15-70 s to start."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import skips
import torch
from test_train import random_prompts, toy_grpo_steps
from tests_support import Background, grpo

from furlong.engine.base import EngineError, SamplingParams
from furlong.engine.vllm import vllm_available
from furlong.model.loading import load_model
from furlong.model.tiny import init_tiny
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay
from furlong.sync.transport import InProcessTransport
from furlong.train import LocalTrainer
from furlong.train.logprobs import token_logprobs

pytestmark = [skips.skipif("extra:vllm", not vllm_available(), "vLLM is not installed (bash install.sh --vllm)"),
              pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [5, 6, 7, 8, 9, 10, 11]
# longer than several KV blocks: vLLM's prefix cache keeps its blocks between requests
LONG_PROMPT = [5 + (i * 37) % 400 for i in range(300)]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(init_tiny(seed=0))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """test_train_smoke_with_the_vllm_engine's `furlong train`, started with the module's engine (which asks for
    it) so that its own vLLM start and steps run beside the module's other tests; that test checks it."""
    tmp = tmp_path_factory.mktemp("vllm-smoke")
    # 2 RL steps, every group trained: step 1 samples from the weights step 0 pushed into vLLM, so its
    # logprob check is one after an update
    run = Background(tmp / "train.log", "train", "--config", "recipes/smoke.yaml", "train.engine=vllm",
                     "train.rl.steps=2", "train.rl.filter_zero_variance=false", f"train.run_dir={tmp / 'run'}")
    yield tmp / "run", run
    run.stop()


@pytest.fixture(scope="module")
def engine(model_dir, loop, smoke):
    from furlong.engine.vllm import VLLMEngine

    eng = VLLMEngine.start(model_dir, eos_token_ids=(), seed=0)
    yield eng
    loop.run_until_complete(eng.close())


async def _all(*coros):
    return await asyncio.gather(*coros)


def _max_diff(model, prompt: list[int], gen, temperature: float) -> float:
    tokens = torch.tensor([prompt + list(gen.output_ids)])
    with torch.no_grad():
        lp = token_logprobs(model, tokens, torch.ones_like(tokens), temperature)[0, len(prompt):]
    return float((lp - torch.tensor(gen.logprobs)).abs().max())


def _scaled(model, factor: float, names: list[str]) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {n: sd[n] * factor for n in names}


def test_generate_token_ids_with_logprobs_matching_the_trainer(engine, model_dir, loop):
    model = load_model(model_dir)
    for temperature in (1.0, 0.7):
        gens = loop.run_until_complete(_all(*[
            engine.generate(PROMPT, SamplingParams(temperature=temperature, max_new_tokens=40, seed=s))
            for s in range(6)]))
        assert len({g.output_ids for g in gens}) > 1, "different seeds should sample different completions"
        for g in gens:
            assert g.num_tokens == 40 and g.finish_reason == "length" and g.prompt_len == len(PROMPT)
            assert g.token_weight_versions == (0,) * 40 and g.weight_version == 0
            assert _max_diff(model, PROMPT, g, temperature) < 1e-4
    greedy = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=12)))
    assert _max_diff(model, PROMPT, greedy, 1.0) < 1e-4  # greedy reports temperature-1 logprobs
    again = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(temperature=0.7, max_new_tokens=40,
                                                                           seed=3)))
    assert again.output_ids == gens[3].output_ids  # a seed fixes the sample


def test_score_is_the_trainers_logprobs_of_the_given_tokens(engine, model_dir, loop):
    """Engine.score from vLLM's prompt logprobs (a teacher served by vLLM, docs/distill.md): the trainer's fp32
    logprobs of LONG_PROMPT[start:] within 1e-4 (vLLM's own fp32 kernels), at temperature 1 only."""
    tokens = torch.tensor([LONG_PROMPT])
    with torch.no_grad():
        want = token_logprobs(load_model(model_dir), tokens, torch.ones_like(tokens), 1.0)[0, 100:]
    got = loop.run_until_complete(engine.score(LONG_PROMPT, 100))
    assert len(got) == len(LONG_PROMPT) - 100
    assert float((want - torch.tensor(got)).abs().max()) < 1e-4
    for args, message in (((LONG_PROMPT, 100, 0.7), "temperature 1 only"), ((LONG_PROMPT, 0), "start"),
                          (([5, engine.vocab_size], 1), "outside the vocabulary")):
        with pytest.raises(EngineError, match=message):
            loop.run_until_complete(engine.score(*args))


def test_stop_token_is_kept_and_bad_requests_are_refused(engine, loop):
    free = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(max_new_tokens=30, seed=1)))
    stop = free.output_ids[4]
    first = free.output_ids.index(stop)
    g = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(max_new_tokens=30, seed=1,
                                                                       stop_token_ids=[stop])))
    assert g.finish_reason == "stop" and g.output_ids == free.output_ids[: first + 1]
    for bad, message in (([], "empty"), ([engine.vocab_size], "outside the vocabulary")):
        with pytest.raises(EngineError, match=message):
            loop.run_until_complete(engine.generate(bad, SamplingParams()))
    with pytest.raises(EngineError, match="top-k/top-p"):
        loop.run_until_complete(engine.generate(PROMPT, SamplingParams(top_p=0.9)))
    with pytest.raises(EngineError, match="unknown tensor"):
        loop.run_until_complete(engine.update_weights({"nope.weight": torch.zeros(1)}, 99))
    with pytest.raises(EngineError, match="shape"):
        loop.run_until_complete(engine.update_weights({"model.norm.weight": torch.zeros(3)}, 99))
    assert engine.weight_version == 0  # a refused update changes nothing


def test_direct_update_in_place_then_logprobs_match_the_new_weights(engine, model_dir, loop):
    model = load_model(model_dir)
    # a subset, including the tied embedding (vLLM's lm_head shares it) and one of the stacked q/k/v
    new = _scaled(model, 1.3, ["model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
                               "model.layers.0.mlp.down_proj.weight"])
    before = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(max_new_tokens=30, seed=5)))
    # cached: without a prefix-cache reset, the KV of this prompt's blocks would outlive the old weights
    loop.run_until_complete(engine.generate(LONG_PROMPT, SamplingParams(max_new_tokens=4, seed=5)))
    loop.run_until_complete(engine.update_weights(new, 1))
    assert engine.weight_version == 1 and engine.last_update["sync_pause_s"] > 0
    model.load_state_dict(new, strict=False)
    model.tie_weights()
    after = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(max_new_tokens=30, seed=5)))
    assert after.token_weight_versions == (1,) * 30
    assert _max_diff(model, PROMPT, after, 1.0) < 1e-4
    assert after.logprobs != before.logprobs
    long = loop.run_until_complete(engine.generate(LONG_PROMPT, SamplingParams(max_new_tokens=8, seed=5)))
    assert _max_diff(model, LONG_PROMPT, long, 1.0) < 1e-4


def test_update_waits_for_generations_in_flight_and_holds_new_ones(engine, model_dir, loop):
    model = load_model(model_dir)
    old = engine.weight_version

    async def run():
        running = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=300, seed=2)))
        await asyncio.sleep(0.5)
        update = asyncio.ensure_future(engine.update_weights(_scaled(model, 1.05, ["model.norm.weight"]), old + 1))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=5, seed=3)))
        first = await running
        assert not update.done() or engine.weight_version == old + 1
        await update
        return first, await queued

    first, queued = loop.run_until_complete(run())
    assert first.num_tokens == 300 and first.token_weight_versions == (old,) * 300
    assert queued.token_weight_versions == (old + 1,) * 5  # asked during the update: served after it
    assert engine.last_update["sync_drain_s"] >= 0 and engine.weight_version == old + 1


def test_pause_holds_requests_until_resume(engine, loop):
    async def run():
        await engine.pause()
        pending = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(max_new_tokens=8, seed=0)))
        await asyncio.sleep(1.0)
        held = not pending.done()
        await engine.resume()
        return held, await pending

    held, g = loop.run_until_complete(run())
    assert held and g.num_tokens == 8 and not engine.paused


def test_published_full_and_delta_updates_through_the_relay(engine, model_dir, loop):
    model = load_model(model_dir)
    transport = InProcessTransport()
    publisher = Publisher(transport, full_every=10, engine_dtype=torch.float32, momentum=False)
    relay = Relay(transport, engine)
    kinds = []
    for version, factor in ((10, 1.0), (11, 1.02)):
        weights = {n: t * factor for n, t in model.state_dict().items()}
        kinds.append(publisher.publish(weights, version).kind)
        report = loop.run_until_complete(relay.sync_once())
        assert report.engine_version == version == engine.weight_version and report.pause_s > 0
        model.load_state_dict(weights)
    assert kinds == ["full", "delta"]
    g = loop.run_until_complete(engine.generate(PROMPT, SamplingParams(max_new_tokens=30, seed=9)))
    assert _max_diff(model, PROMPT, g, 1.0) < 1e-4 and g.token_weight_versions == (11,) * 30


def test_seeded_requests_with_prompts_longer_than_a_prefill_chunk(engine, loop):
    """vLLM's default 2048-token step budget chunked such prompts and then crashed rewinding the seeded
    generator on the CPU build; whole-prompt prefill serves them."""
    prompts = [[(7 * i + j) % 4000 + 10 for i in range(2500 + 300 * j)] for j in range(3)]
    gens = loop.run_until_complete(_all(*[engine.generate(p, SamplingParams(max_new_tokens=8, seed=j))
                                          for j, p in enumerate(prompts)]))
    assert [g.num_tokens for g in gens] == [8, 8, 8]


def test_a_model_directory_vllm_cannot_load_is_one_clear_error(tmp_path, loop):
    from furlong.engine.vllm import VLLMEngine

    with pytest.raises(EngineError, match="not a Hugging Face model directory"):
        VLLMEngine.start(tmp_path)


def test_grpo_learns_toy_task_on_vllm(engine, model_dir, loop):
    """test_train's toy task (reward 1 when the 4-token answer holds one of 256 target ids, ~23% by chance)
    with vLLM as the rollout engine: the trainer's weights pushed after every step, and the engine's
    logprobs equal to the trainer's recomputation at every step."""
    torch.manual_seed(0)
    policy = load_model(model_dir)
    vocab = policy.config.vocab_size
    targets = set(random.Random(0).sample(range(vocab), vocab // 16))
    trainer = LocalTrainer(policy, grpo(lr=3e-3, micro_batch_size=32))
    prompts = random_prompts(4, vocab, seed=3)

    async def main() -> list[float]:
        await engine.update_weights(trainer.engine_weights(), trainer.version)
        return await toy_grpo_steps(engine, trainer, prompts, targets, 30)

    rewards = loop.run_until_complete(main())
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, rewards


@pytest.mark.slow
def test_train_smoke_with_the_vllm_engine(smoke):
    run, background = smoke
    res = background.result(timeout_s=1500)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]  # vLLM shut down once, cleanly
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_episodes"] == 4 and summary["eval_infra_errors"] == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 2 and all(r["sync_pause_s"] > 0 for r in rl)
    # the engine's logprobs are the trainer's (fp32 both): a mismatch would show here first
    assert max(r["logprob_diff_max"] for r in rl) < 1e-3
