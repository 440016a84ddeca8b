"""MoE routing replay (furlong.model.moe, furlong.train.routing): the hf engine records the experts it chose
per token, episodes carry them, the trainer's forward replays them (the gate weights still from the trainer's
router) and counts where its own choice differed; the router load-balancing loss; dense models refused.
Tiny MoE family variants (furlong.model.families), a few short sequences each."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tests_support import grpo, routed_episodes

from furlong.agent.episode import Episode
from furlong.config import TrainConfig
from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model.families import init_family
from furlong.model.loading import load_model
from furlong.model.moe import (
    ROUTED_FAMILIES,
    UNKNOWN,
    RouteHooks,
    merge_routes,
    moe_routers,
    replay_weights,
    route_shape,
)
from furlong.train import LocalTrainer
from furlong.train.batch import collate
from furlong.train.logprobs import token_logprobs
from furlong.train.routing import Routing

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = ([5, 17, 300, 41, 9, 77, 12], [8, 1000, 3, 3, 64])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: init_family(name, root / name) for name in (*ROUTED_FAMILIES, "qwen3")}


def sample(model: torch.nn.Module, n: int = 2, tokens: int = 12) -> list[Episode]:
    return routed_episodes(model, list(PROMPTS), n, tokens)


def trainer_logprobs(model, episodes: list[Episode], routing: Routing | None) -> torch.Tensor:
    """The trainer's per-token logprobs of the episodes (one padded forward), replayed through `routing`."""
    mb = collate(episodes, torch.zeros(len(episodes)), torch.device("cpu"))
    with torch.no_grad():
        if routing is None:
            return token_logprobs(model, mb.tokens, mb.attention_mask, 1.0)
        with routing.forward(mb.routes):
            return token_logprobs(model, mb.tokens, mb.attention_mask, 1.0)


@pytest.mark.parametrize("name", ROUTED_FAMILIES)
def test_the_replay_weights_are_the_routers_own(dirs, name: str) -> None:
    """Each family's weighting, given the router's own choice, gives the router's weights bit for bit, and
    replaying a forward's own routes reproduces its logprobs exactly; other routes change them."""
    model = load_model(dirs[name])
    seen: list = []
    handles = [r.register_forward_hook(lambda m, a, o: seen.append((m, o))) for r in moe_routers(model)]
    ids = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    for router, (logits, weights, chosen) in seen:
        assert torch.equal(replay_weights(router, logits, chosen), weights)
    mask = torch.ones_like(ids)
    with RouteHooks(model, record=True) as hooks, torch.no_grad():
        own = token_logprobs(model, ids, mask, 1.0)
        routes = hooks.take()
        assert routes.shape == (ids.numel(), route_shape(model).layers, route_shape(model).top_k)
        with hooks.forcing(routes):
            replayed = token_logprobs(model, ids, mask, 1.0)
        other = (routes + 1) % route_shape(model).experts  # every token to other experts, still distinct
        with hooks.forcing(other):
            forced = token_logprobs(model, ids, mask, 1.0)
    assert torch.equal(own, replayed)
    assert (forced - own).abs().max() > 1e-3  # the replay is real: the forward used the forced experts


def test_the_engine_records_every_forwarded_token(dirs) -> None:
    """A Generation's routes cover prompt + output: every prefilled and fed-back token is known, the last
    sampled one (never fed to the model) is not; indices are valid experts; group members share theirs."""
    model = load_model(dirs["qwen3_moe"])
    shape = route_shape(model)
    episodes = sample(model)
    for e in episodes:
        assert e.routes is not None and e.routes.shape == (len(e.tokens), shape.layers, shape.top_k)
        known = (e.routes >= 0).all(-1).all(-1)
        assert known[:-1].all() and not known[-1]
        assert int(e.routes.max()) < shape.experts
    assert torch.equal(episodes[0].routes[: episodes[0].prompt_len], episodes[1].routes[: episodes[1].prompt_len])
    # fp32 engine and fp32 trainer: replaying the engine's routes changes nothing the trainer chose itself
    routing = Routing(model, "on", 0.0)
    trainer_logprobs(model, episodes, routing)
    pairs, tokens, compared = routing.hooks.mismatch()
    assert compared == sum(len(e.tokens) - 1 for e in episodes) and tokens <= pairs


def test_a_bf16_engine_replayed_in_an_fp32_trainer(dirs) -> None:
    """bf16 engine, fp32 trainer: with replay the trainer's forward uses exactly the engine's experts (an
    outer recorder sees what the replaying hook returned), without it, its own."""
    directory = dirs["qwen3_moe"]
    trainer_model = load_model(directory)
    episodes = sample(load_model(directory, dtype=torch.bfloat16), n=3, tokens=16)
    recorded = collate(episodes, torch.zeros(len(episodes)), torch.device("cpu")).routes
    assert recorded is not None
    recorded = recorded.reshape(-1, *recorded.shape[2:])
    known = (recorded >= 0).all(-1).all(-1)
    used = {}
    for mode in ("on", "off"):
        routing = Routing(trainer_model, mode, 0.0)
        with RouteHooks(trainer_model, record=True) as outer:  # registered after the replay hook: sees its output
            trainer_logprobs(trainer_model, episodes, routing)
            used[mode] = outer.take()
        routing.hooks.close()
    assert torch.equal(used["on"][known].sort(-1).values, recorded[known].sort(-1).values.to(torch.int16))
    # Tokens without a route keep the trainer's own choice (how often bf16 and fp32 choose differently
    # elsewhere depends on the machine's kernels: bench/routing_replay.py measures it).
    assert torch.equal(used["off"][~known], used["on"][~known])


def test_the_trainer_replays_and_logs_routing(dirs) -> None:
    """LocalTrainer with replay: a step trains and logs expert load from the recorded routes and the mismatch;
    episodes without routes train too (their tokens keep the trainer's own choice)."""
    directory = dirs["qwen3_moe"]
    episodes = sample(load_model(directory))
    trainer = LocalTrainer(load_model(directory), replace(grpo(lr=1e-3), routing_replay="on"))
    stats = trainer.train_step(episodes)
    assert stats.updated and 1.0 <= stats.moe_load_max_ratio <= 8 and 0 < stats.moe_load_entropy <= 1
    assert 0 <= stats.moe_route_mismatch <= stats.moe_token_mismatch <= 1 and stats.moe_aux_loss == 0.0
    bare = [replace(e, routes=None) for e in episodes]
    stats = trainer.train_step(bare[:2] + episodes[2:])
    assert stats.updated


def test_the_load_balancing_loss_joins_the_loss_only_with_a_weight(dirs) -> None:
    directory = dirs["qwen3_moe"]
    episodes = sample(load_model(directory))
    results = {}
    for coef in (0.0, 0.5):
        trainer = LocalTrainer(load_model(directory), replace(grpo(lr=1e-3, micro_batch_size=2), moe_aux_coef=coef))
        results[coef] = trainer.train_step(episodes)
    assert results[0.0].moe_aux_loss == 0.0 and results[0.5].moe_aux_loss > 0.0
    # micro-batches weigh their aux terms by their share of the loss tokens: the step's loss gains coef * aux
    gained = results[0.5].loss - results[0.0].loss
    assert gained == pytest.approx(0.5 * results[0.5].moe_aux_loss, rel=0.2), (gained, results)
    assert results[0.5].grad_norm != results[0.0].grad_norm


def test_a_dense_model_is_refused_with_on_and_ignored_with_auto(dirs) -> None:
    dense = load_model(dirs["qwen3"])
    with pytest.raises(ValueError, match=r"routing_replay=on, but Qwen3ForCausalLM has no MoE router"):
        Routing(dense, "on", 0.0)
    with pytest.raises(ValueError, match=r"aux_loss_coef=0.1, but Qwen3ForCausalLM has no MoE router"):
        Routing(dense, "auto", 0.1)
    assert not Routing(dense, "auto", 0.0).active
    with pytest.raises(ValueError, match=r"routing_replay=on: only the in-process hf engine records"):
        TrainConfig(engine="vllm", moe={"routing_replay": "on"})
    assert not TrainConfig(engine="vllm").records_routes and TrainConfig().records_routes


def test_a_route_from_a_later_turn_overwrites_only_what_it_recorded() -> None:
    first = torch.tensor([[[1, 2]], [[3, 4]], [[UNKNOWN, UNKNOWN]]], dtype=torch.int16)
    later = torch.tensor([[[UNKNOWN, UNKNOWN]], [[5, 6]], [[7, 0]], [[1, 3]]], dtype=torch.int16)
    merged = merge_routes(first, later, 6)
    assert merged is not None and merged[:, 0].tolist() == [[1, 2], [5, 6], [7, 0], [1, 3], [-1, -1], [-1, -1]]
    assert merge_routes(None, None, 3) is None


def own_routes(model, tokens: list[int]) -> torch.Tensor:
    """The experts `model`'s routers choose for `tokens` in one trainer forward, [tokens, layers, top_k]."""
    with RouteHooks(model, record=True) as hooks, torch.no_grad():
        token_logprobs(model, torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long), 1.0)
        return hooks.take()


@pytest.mark.parametrize("deterministic", [False, True])
def test_routes_after_a_mid_generation_update_are_the_new_weights(dirs, deterministic: bool) -> None:
    """A weight update re-prefills a running request's context: its routes there become the new router's (the
    same as a trainer forward under the new weights), and decode goes on recording (batched or SoloBatch)."""
    directory = dirs["qwen3_moe"]
    model, new = load_model(directory), load_model(directory)
    torch.manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(new):
            router.weight.add_(torch.randn_like(router.weight))  # type: ignore[operator]
    prompt = list(PROMPTS[0]) * 3

    async def main():
        async with HFEngine(model, record_routes=True, deterministic=deterministic) as engine:
            task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=30, seed=1)))
            while engine.stats.generated_tokens < 6:
                await asyncio.sleep(0.002)
            await engine.update_weights(new.state_dict(), version=1)
            return await task

    gen = asyncio.run(main())
    versions = gen.token_weight_versions
    assert 0 < versions.count(1) < len(versions)  # the update landed mid-generation
    fed = len(prompt) + versions.index(1) - 1  # context recomputed under the new weights (then decoded with them)
    assert gen.routes is not None and (gen.routes[:-1] >= 0).all()
    tokens = [*prompt, *gen.output_ids]
    assert torch.equal(gen.routes[:-1], own_routes(new, tokens)[:-1])  # recomputed context, then decode
    assert not torch.equal(gen.routes[:fed], own_routes(load_model(directory), tokens)[:fed])


def test_a_second_turn_after_a_prefix_cache_hit_completes_the_episodes_routes(dirs) -> None:
    """Turn 2's prompt extends turn 1's episode; the prefix cache holds turn 1's KV, so turn 2 prefills only the
    new tokens and records routes there alone: merged as the agent merges them, every forwarded position of the
    episode has a route, the same one a trainer forward over the whole episode chooses (fp32 both)."""
    model = load_model(dirs["qwen3_moe"])
    first = list(PROMPTS[0])

    async def main():
        async with HFEngine(model, record_routes=True) as engine:
            one = await engine.generate(first, SamplingParams(max_new_tokens=10, seed=2))
            second_prompt = [*first, *one.output_ids, *PROMPTS[1]]
            two = await engine.generate(second_prompt, SamplingParams(max_new_tokens=10, seed=3))
            return one, second_prompt, two, engine.stats.cached_tokens

    one, second_prompt, two, cached = asyncio.run(main())
    assert cached > 0 and two.routes is not None
    assert (two.routes[:cached] < 0).all()  # not forwarded in turn 2: its routes come from turn 1
    tokens = [*second_prompt, *two.output_ids]
    routes = merge_routes(merge_routes(None, one.routes, len(first) + len(one.output_ids)), two.routes, len(tokens))
    assert routes is not None and (routes[:-1] >= 0).all()
    assert torch.equal(routes[:-1], own_routes(model, tokens)[:-1])
