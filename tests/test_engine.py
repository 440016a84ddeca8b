"""The in-process HF engine: RL-exact logprobs under batching, sampling controls, weight updates, pausing."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

from furlong.engine import Engine, EngineError, Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.engine.sampling import sample_next
from furlong.model import (
    Message,
    continuation_ids,
    end_of_turn_id,
    load_model,
    load_tokenizer,
    render_prompt_ids,
)

TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return load_model(tiny_dir)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of clearly different lengths, so batching needs left padding."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(3 + 9 * i)] for i in range(n)]


def reference_logprobs(model, prompt: list[int], output: tuple[int, ...], temperature: float) -> torch.Tensor:
    """What a trainer computes: one plain forward over prompt + output (no cache, no padding)."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + list(output)])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1: -1] / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def assert_matches_reference(model, prompt: list[int], gen: Generation, temperature: float) -> None:
    ref = reference_logprobs(model, prompt, gen.output_ids, temperature)
    assert len(gen.logprobs) == len(gen.output_ids) == len(gen.token_weight_versions)
    assert (ref - torch.tensor(gen.logprobs)).abs().max().item() <= TOL


def run(coro):
    return asyncio.run(coro)


async def tokens_generated(engine: HFEngine, n: int) -> None:
    """Wait until the engine has sampled `n` tokens in total (so requests are mid-flight)."""
    while engine.stats.generated_tokens < n:
        await asyncio.sleep(0.002)


def test_batched_logprobs_match_full_forward(model) -> None:
    """Requests of different lengths, some joining mid-flight with longer prompts (re-padding the batch)."""
    ps = prompts(8)
    settings = [SamplingParams(temperature=t, top_p=p, top_k=k, max_new_tokens=24 + 3 * i, seed=i)
                for i, (t, p, k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 40), (0.0, 1.0, 0)] * 2)]

    async def main() -> tuple[list[Generation], HFEngine]:
        async with HFEngine(model, eos_token_ids=()) as engine:
            early = [asyncio.create_task(engine.generate(p, s)) for p, s in zip(ps[:4], settings[:4], strict=True)]
            await tokens_generated(engine, 12)  # let the first batch decode a few steps
            late = [engine.generate(p, s) for p, s in zip(ps[4:], settings[4:], strict=True)]
            return list(await asyncio.gather(*early, *late)), engine

    gens, engine = run(main())
    for p, s, g in zip(ps, settings, gens, strict=True):
        assert g.finish_reason == "length" and len(g.output_ids) == s.max_new_tokens
        assert_matches_reference(model, p, g, s.temperature)
    # Prompts admitted together share one prefill forward: the 4 early ones, then the 4 late ones.
    assert engine.stats.max_decode_batch == 8 and engine.stats.prefill_calls == 2


def test_concurrent_requests_are_batched_and_independent(model) -> None:
    ps = prompts(8, seed=1)
    greedy = SamplingParams(temperature=0, max_new_tokens=16)

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            together = await asyncio.gather(*[engine.generate(p, greedy) for p in ps])
            steps = engine.stats.decode_steps
            alone = [await engine.generate(p, greedy) for p in ps]
            return together, alone, steps, engine.stats

    together, alone, steps, stats = run(main())
    assert [g.output_ids for g in together] == [g.output_ids for g in alone]
    assert stats.max_decode_batch == 8 and steps == 15  # 8 x 16 tokens: 1 prefill + 15 shared decode steps
    for p, g in zip(ps, together, strict=True):
        assert_matches_reference(model, p, g, 0.0)


def test_multi_turn_episode_logprobs_match_one_forward(model, tiny_dir: Path) -> None:
    """A TITO episode: the trainer's single forward over the whole token list reproduces every turn's
    logprobs, because the ids were appended, never re-tokenized."""
    tok = load_tokenizer(tiny_dir)
    im_end = end_of_turn_id(tok)
    sampling = SamplingParams(temperature=0.9, max_new_tokens=12, stop_token_ids=[im_end], seed=3)

    async def main():
        async with HFEngine(model) as engine:
            ids = render_prompt_ids(tok, [Message("system", "Be terse."), Message("user", "List /app.")])
            turns = []
            for reply in ("file_a\nfile_b", "done"):
                gen = await engine.generate(ids, sampling)
                turns.append((len(ids), gen))
                ids = ids + list(gen.output_ids)
                ids += continuation_ids(tok, [Message("tool", reply)], close_turn=gen.finish_reason != "stop")
            return ids, turns

    ids, turns = run(main())
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / 0.9, dim=-1)
    for start, gen in turns:
        positions = torch.arange(start - 1, start - 1 + len(gen.output_ids))
        ref = logp[positions, torch.tensor(gen.output_ids)]
        assert (ref - torch.tensor(gen.logprobs)).abs().max().item() <= TOL


def test_greedy_picks_the_argmax_deterministically(model) -> None:
    p = prompts(3)[2]

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            return await asyncio.gather(*[engine.generate(p, SamplingParams(temperature=0, max_new_tokens=12))
                                          for _ in range(2)])

    a, b = run(main())
    assert a.output_ids == b.output_ids
    with torch.inference_mode():
        logits = model(torch.tensor([p + list(a.output_ids)])).logits[0, len(p) - 1: -1]
    assert torch.equal(logits.argmax(-1), torch.tensor(a.output_ids))


def test_seeded_sampling_is_reproducible_and_groups_share_prefill(model) -> None:
    p = prompts(2)[1]

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            group = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=10, seed=s))
                                           for s in (1, 2, 3, 1)])
            prefills = engine.stats.prefill_calls
            again = await engine.generate(p, SamplingParams(max_new_tokens=10, seed=2))
            return group, prefills, again

    group, prefills, again = run(main())
    assert prefills == 1  # identical prompts (a GRPO group) share one prefill
    assert group[0].output_ids == group[3].output_ids and again.output_ids == group[1].output_ids
    assert len({g.output_ids for g in group}) == 3
    for g in group:
        assert_matches_reference(model, p, g, 1.0)


def test_deterministic_engine_gives_the_same_bits_whatever_the_arrival(model) -> None:
    """deterministic=True: a seeded request's tokens and logprobs, to the bit, do not depend on what else
    runs. The default engine's shared forwards move logprobs by ~1e-6 with the batch (measured: CPU matmul
    bits depend on the rows sharing the call), which a sync run's trainer sees. Here the same requests arrive
    one at a time, all at once, and in reverse order joining generations in flight; the last one is a
    second turn (a prompt extending an earlier request's), which the default engine serves from its
    prefix cache with KV another request's forwards computed."""
    ps = prompts(5, seed=4)
    sampling = [SamplingParams(max_new_tokens=24, seed=10 + i) for i in range(len(ps))]

    async def serve(order: list[int], join_after: int) -> dict[int, Generation]:
        async with HFEngine(model, eos_token_ids=(), deterministic=True) as engine:
            first = await engine.generate(ps[0], sampling[0])  # the earlier turn the last request extends
            requests = {**dict(enumerate(ps)), len(ps): ps[0] + list(first.output_ids) + ps[1][:7]}

            async def one(k: int, i: int) -> tuple[int, Generation]:
                await tokens_generated(engine, 24 + k * join_after)
                return i, await engine.generate(requests[i], sampling[i % len(ps)])

            if join_after < 0:  # one at a time
                return {i: (await one(0, i))[1] for i in order}
            return dict(await asyncio.gather(*(one(k, i) for k, i in enumerate(order))))

    alone = run(serve(list(range(len(ps) + 1)), -1))
    for order, join_after in ((list(range(len(ps) + 1)), 0), (list(range(len(ps), -1, -1)), 5)):
        other = run(serve(order, join_after))
        assert [other[i].output_ids for i in alone] == [g.output_ids for g in alone.values()]
        assert [other[i].logprobs for i in alone] == [g.logprobs for g in alone.values()]  # exactly equal
    for i, p in enumerate(ps):
        assert_matches_reference(model, p, alone[i], 1.0)  # still the model's logprobs


def test_stop_tokens_and_max_new_tokens(model, tiny_dir: Path) -> None:
    p = prompts(2)[1]

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            free = await engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8))
            stop = free.output_ids[3]
            stopped = await engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8,
                                                              stop_token_ids=[stop]))
            one = await engine.generate(p, SamplingParams(max_new_tokens=1))
            return free, stop, stopped, one

    free, stop, stopped, one = run(main())
    assert free.finish_reason == "length" and len(free.output_ids) == 8
    first = free.output_ids.index(stop)
    assert stopped.finish_reason == "stop" and stopped.output_ids == free.output_ids[: first + 1]
    assert one.finish_reason == "length" and len(one.output_ids) == 1
    # By default the model's eos ids (generation_config) stop every request.
    assert HFEngine(load_model(tiny_dir)).eos_token_ids == frozenset(model.generation_config.eos_token_id)


def test_context_limit_truncates(model) -> None:
    async def main():
        async with HFEngine(model, eos_token_ids=(), max_context=20) as engine:
            gen = await engine.generate(list(range(10, 25)), SamplingParams(max_new_tokens=50))
            with pytest.raises(EngineError, match="no room"):
                await engine.generate(list(range(10, 30)), SamplingParams())
            return gen

    gen = run(main())
    assert gen.finish_reason == "length" and len(gen.output_ids) == 5


def perturbed_weights(model) -> dict[str, torch.Tensor]:
    """Every matrix moved by noise: clearly different outputs and logprobs."""
    return {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items() if v.dim() == 2}


def test_update_weights_changes_outputs_and_versions(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)  # private copy: this test rewrites weights
    p = prompts(2)[1]
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    new_weights = perturbed_weights(model)

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            before = await engine.generate(p, greedy)
            await engine.update_weights(new_weights, version=1)
            after = await engine.generate(p, greedy)
            return before, after, engine.weight_version

    before, after, version = run(main())
    assert version == 1 and before.weight_version == 0 and after.weight_version == 1
    assert set(after.token_weight_versions) == {1}
    assert before.output_ids != after.output_ids
    assert_matches_reference(model, p, after, 0.0)  # the model now holds the new weights


def test_update_lands_between_steps_mid_generation(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    update = {"model.norm.weight": model.model.norm.weight.detach() * 1.5}

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            task = asyncio.create_task(engine.generate(prompts(1)[0], SamplingParams(max_new_tokens=60)))
            await tokens_generated(engine, 5)
            await engine.update_weights(update, version=7)
            return await task

    gen = run(main())
    versions = gen.token_weight_versions
    assert versions[0] == 0 and versions[-1] == 7 and list(versions) == sorted(versions)
    assert gen.weight_version == 0  # the oldest contributing policy bounds staleness


def test_tokens_after_a_mid_generation_update_come_from_the_new_weights_alone(tiny_dir: Path) -> None:
    """A partial rollout: each token's logprob is what a trainer holding the weights of its version computes,
    on both sides of the update (the running request's KV is recomputed, not kept from the old weights)."""
    model = load_model(tiny_dir)
    old = load_model(tiny_dir)
    new_weights = perturbed_weights(model)
    p = prompts(3)[2]

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            task = asyncio.create_task(engine.generate(p, SamplingParams(max_new_tokens=40, seed=3)))
            await tokens_generated(engine, 10)
            await engine.update_weights(new_weights, version=1)
            return await task, engine.stats.recomputed_tokens

    gen, recomputed = run(main())
    versions = torch.tensor(gen.token_weight_versions)
    assert 0 < int((versions == 1).sum()) < len(versions) - 5  # the update landed mid-generation
    first_new = int((versions == 1).nonzero()[0])
    assert recomputed == len(p) + first_new - 1  # the prompt and every token fed back before the update
    got = torch.tensor(gen.logprobs)
    ref_old, ref_new = (reference_logprobs(m, p, gen.output_ids, 1.0) for m in (old, model))
    assert (got - ref_old)[versions == 0].abs().max() <= TOL
    assert (got - ref_new)[versions == 1].abs().max() <= TOL
    assert (ref_old - ref_new)[versions == 1].abs().max() > 100 * TOL  # the two policies really differ


def test_bad_weight_updates_are_rejected_whole(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)
    norm = model.model.norm.weight.detach().clone()

    async def main():
        async with HFEngine(model) as engine:
            with pytest.raises(EngineError, match="unknown"):
                await engine.update_weights({"nope": torch.zeros(1)}, 1)
            with pytest.raises(EngineError, match="shape"):
                await engine.update_weights({"model.norm.weight": torch.zeros(3),
                                             "model.embed_tokens.weight": torch.zeros(1)}, 1)
            return engine.weight_version

    assert run(main()) == 0 and torch.equal(model.model.norm.weight, norm)


def test_pause_holds_steps_until_resume(model) -> None:
    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            running = asyncio.create_task(engine.generate(prompts(1)[0], SamplingParams(max_new_tokens=40)))
            await tokens_generated(engine, 3)
            await engine.pause()
            frozen = engine.stats.generated_tokens
            queued = asyncio.create_task(engine.generate(prompts(2)[1], SamplingParams(max_new_tokens=5)))
            await asyncio.sleep(0.1)
            assert engine.paused and engine.stats.generated_tokens == frozen
            assert not running.done() and not queued.done()
            await engine.resume()
            return await running, await queued

    running, queued = run(main())
    assert len(running.output_ids) == 40 and len(queued.output_ids) == 5


def test_cancel_abort_and_close(model) -> None:
    long = SamplingParams(max_new_tokens=500)

    async def main():
        engine = HFEngine(model, eos_token_ids=())
        doomed = asyncio.create_task(engine.generate(prompts(1)[0], long))
        kept = asyncio.create_task(engine.generate(prompts(2)[1], long))
        await tokens_generated(engine, 6)
        doomed.cancel()
        short = await engine.generate(prompts(3)[2], SamplingParams(max_new_tokens=4))  # still serving
        assert await engine.abort_all() == 1  # `kept`; the cancelled request is already gone
        aborted = await kept
        late = asyncio.create_task(engine.generate(prompts(2)[1], long))
        await tokens_generated(engine, engine.stats.generated_tokens + 5)
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await engine.generate([1, 2], SamplingParams())
        return doomed, short, aborted, await late

    doomed, short, aborted, closed = run(main())
    assert doomed.cancelled() and len(short.output_ids) == 4
    for gen in (aborted, closed):
        assert gen.finish_reason == "abort" and 0 < len(gen.output_ids) < 500
        assert len(gen.logprobs) == len(gen.output_ids)


def test_invalid_requests(model) -> None:
    async def main():
        async with HFEngine(model) as engine:
            assert isinstance(engine, Engine)
            with pytest.raises(EngineError, match="empty"):
                await engine.generate([], SamplingParams())
            with pytest.raises(EngineError, match="vocabulary"):
                await engine.generate([1, 10**6], SamplingParams())

    run(main())
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_sampler_filters_and_reports_untruncated_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(4, 1)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5), SamplingParams(temperature=0),
              SamplingParams(temperature=0.5)]
    rngs = [random.Random(i) for i in range(4)]
    seen: list[set[int]] = [set() for _ in params]
    for _ in range(300):
        tokens, logprobs = sample_next(logits, params, rngs)
        for i, t in enumerate(tokens):
            seen[i].add(t)
        expected = torch.log_softmax(logits / torch.tensor([1.0, 1.0, 1.0, 0.5])[:, None], -1)
        assert torch.allclose(torch.tensor(logprobs), expected[torch.arange(4), torch.tensor(tokens)])
    assert seen[0] == {0, 1} and seen[1] == {0} and seen[2] == {0} and len(seen[3]) >= 2


def test_the_reproducibility_figures_are_the_committed_results() -> None:
    """docs/training.md#reproducibility cites bench/results/repro_*.json (bench/compare_runs.py) and
    bench/results/deterministic_engine.json (bench/deterministic_engine.py); its figures are theirs."""
    root = Path(__file__).resolve().parent.parent
    doc = " ".join((root / "docs/training.md").read_text().split())
    default, det, cost = (json.loads((root / "bench/results" / f"{name}.json").read_text())
                          for name in ("repro_default", "repro_deterministic", "deterministic_engine"))
    assert default["episodes_differing"] == 0 and default["weights_equal"] and default["summary_equal"]
    hits = default["metric_rows_differing"][0]["values"]["engine_prefix_hit_rate"]
    assert f"({hits[0]:.2f} vs {hits[1]:.2f} at step 0)" in doc
    assert det["episodes_differing"] == 0 and det["summary_equal"] and det["weights_equal"]
    assert {k for row in det["metric_rows_differing"] for k in row["values"]} <= {"engine_prefix_hit_rate",
                                                                                  "engine_prefill_tokens"}
    assert cost["deterministic"]["bit_equal_across_arrivals"] and not cost["default"]["bit_equal_across_arrivals"]
    d, x = cost["default"], cost["deterministic"]
    assert (f"{x['median_seconds']:.1f} s against {d['median_seconds']:.1f} s, "
            f"{cost['deterministic_over_default_time']} x the time") in doc
