"""The hf engine's prefix cache and batched prefill: later turns and group members reuse KV, outputs and
logprobs stay exactly those of a cache-less engine and of the trainer's forward, weight updates invalidate."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_engine import assert_matches_reference, perturbed_weights, prompts, run, tokens_generated

from furlong.config import ConfigError, load_config
from furlong.engine import Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import Message, continuation_ids, end_of_turn_id, load_model, load_tokenizer, render_prompt_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_dir: Path):
    return load_model(tiny_dir)


async def episode(engine: HFEngine, tok, seed: int) -> tuple[list[int], list[tuple[int, Generation]]]:
    """A three-turn TITO conversation: each prompt is the previous one + the reply + a tool result."""
    sampling = SamplingParams(temperature=0.9, max_new_tokens=20, stop_token_ids=[end_of_turn_id(tok)], seed=seed)
    ids = render_prompt_ids(tok, [Message("system", "Be terse."), Message("user", f"Count the files {seed}.")])
    turns = []
    for reply in ("a.txt\nb.txt\nc.txt", "3", "ok"):
        gen = await engine.generate(ids, sampling)
        turns.append((len(ids), gen))
        ids = ids + list(gen.output_ids)
        ids += continuation_ids(tok, [Message("tool", reply)], close_turn=gen.finish_reason != "stop")
    return ids, turns


def test_later_turns_reuse_the_episode_kv_and_match_the_trainer(model, tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)

    async def main(cache_mb: float):
        async with HFEngine(model, prefix_cache_mb=cache_mb) as engine:
            return await asyncio.gather(*[episode(engine, tok, seed) for seed in range(4)]), engine.stats

    cached, with_cache = run(main(256))
    plain, without = run(main(0))
    for (ids, turns), (ids0, _) in zip(cached, plain, strict=True):
        assert ids == ids0  # same seeds, same tokens, cache or not
        with torch.inference_mode():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / 0.9, dim=-1)
        for start, gen in turns:
            ref = logp[torch.arange(start - 1, start - 1 + gen.num_tokens), torch.tensor(gen.output_ids)]
            assert (ref - torch.tensor(gen.logprobs)).abs().max().item() <= 1e-4
    # Turns 2 and 3 reuse everything but the tool result (and the last sampled token): at least the previous
    # turn's prompt + reply - 1 tokens each. Turn 1 reuses the shared system prompt from other episodes.
    later = sum(turns[k][0] + turns[k][1].num_tokens - 1 for _, turns in cached for k in (0, 1))
    assert with_cache.cached_tokens >= later
    assert with_cache.prompt_tokens == without.prompt_tokens
    assert without.cached_tokens == 0 and with_cache.prefill_tokens < without.prefill_tokens / 2
    assert with_cache.prefix_hit_rate > 0.5


def test_group_members_arriving_later_reuse_the_shared_prompt(model) -> None:
    p = prompts(3)[2]

    async def main(cache_mb: float):
        async with HFEngine(model, eos_token_ids=(), prefix_cache_mb=cache_mb) as engine:
            first = await engine.generate(p, SamplingParams(max_new_tokens=8, seed=1))
            rest = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=8, seed=s))
                                          for s in (2, 3)])
            return [first, *rest], engine.stats

    group, stats = run(main(256))
    plain, _ = run(main(0))
    assert [g.output_ids for g in group] == [g.output_ids for g in plain]
    # The late pair shares one prefill of the single token the cache cannot give (the last prompt token).
    assert stats.cached_tokens == len(p) - 1 and stats.prefill_tokens == len(p) + 1
    assert stats.prompt_tokens == 3 * len(p) and stats.prefill_calls == 2
    for g in group:
        assert_matches_reference(model, p, g, 1.0)


def test_one_prefill_forward_mixes_cached_and_fresh_prompts(model) -> None:
    a, b, c = prompts(3, seed=5)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            first = await asyncio.gather(engine.generate(a, greedy), engine.generate(b, greedy))
            calls, cached = engine.stats.prefill_calls, engine.stats.cached_tokens
            longer = [a + list(first[0].output_ids) + [11, 12, 13], b + list(first[1].output_ids) + [14] * 9, c]
            gens = await asyncio.gather(*[engine.generate(q, SamplingParams(max_new_tokens=6, seed=i))
                                          for i, q in enumerate(longer)])
            return longer, gens, engine.stats.prefill_calls - calls, engine.stats.cached_tokens - cached

    longer, gens, calls, cached = run(main())
    assert calls == 1  # different prompts, different cached lengths (one none): one right-padded forward
    # Cached: the prompt and all but the last reply token, so the last reply token and the new ones are run.
    assert cached == (len(longer[0]) - 4) + (len(longer[1]) - 10)
    for q, g in zip(longer, gens, strict=True):
        assert_matches_reference(model, q, g, 1.0)


def test_weight_update_invalidates_cached_kv(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)  # private copy: this test rewrites weights
    p, new_weights = prompts(3)[2], perturbed_weights(model)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)

    async def main():
        async with HFEngine(model, eos_token_ids=()) as engine:
            before = await engine.generate(p, greedy)
            assert len(engine.prefix_cache) == 1
            await engine.update_weights(new_weights, version=1)
            assert len(engine.prefix_cache) == 0 and engine.prefix_cache.nbytes == 0
            follow = p + list(before.output_ids) + [7, 8]
            after = await engine.generate(follow, greedy)
            hits_after_update = engine.stats.cached_tokens
            assert_matches_reference(model, follow, after, 0.0)  # computed under the new weights only
            # A request that spans an update continues on KV recomputed under the new weights, so its KV is
            # the new weights' alone: it is cached, and a request reusing it matches the new weights.
            q = prompts(4)[3]
            spanning = asyncio.create_task(engine.generate(q, SamplingParams(max_new_tokens=30)))
            await tokens_generated(engine, engine.stats.generated_tokens + 3)
            await engine.update_weights(perturbed_weights(model), version=2)
            spanned = await spanning
            entries, hits = len(engine.prefix_cache), engine.stats.cached_tokens
            reuse = q + list(spanned.output_ids) + [5]
            again = await engine.generate(reuse, greedy)
            return after, hits_after_update, spanned, entries, reuse, again, engine.stats.cached_tokens - hits

    after, hits_after_update, spanned, entries, reuse, again, reused = run(main())
    assert hits_after_update == 0 and set(after.token_weight_versions) == {1}
    assert set(spanned.token_weight_versions) == {1, 2}
    assert entries == 1 and reused == len(reuse) - 2  # the prompt and every token it fed back
    assert_matches_reference(model, reuse, again, 0.0)


def test_cache_stays_within_its_budget_least_recently_used_first(model) -> None:
    ps = prompts(7, seed=9)[3:]  # 4 prompts of 30-57 tokens; 4 KiB of KV per token in the tiny model
    one = SamplingParams(temperature=0, max_new_tokens=1)

    async def main():
        async with HFEngine(model, eos_token_ids=(), prefix_cache_mb=0.5) as engine:
            for q in ps:
                await engine.generate(q, one)
                assert engine.prefix_cache.nbytes <= engine.prefix_cache.max_bytes
            hits = []
            for q in (ps[-1], ps[0]):  # the newest is kept, the oldest was evicted
                before = engine.stats.cached_tokens
                await engine.generate(q + [5], one)
                hits.append(engine.stats.cached_tokens - before)
            return hits, engine.stats.prefix_evictions

    hits, evictions = run(main())
    assert hits == [len(ps[-1]), 0] and evictions >= 1
    with pytest.raises(ConfigError, match="prefix_cache_mb"):
        load_config(None, ["train.hf.prefix_cache_mb=-1"])
