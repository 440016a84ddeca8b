"""MoE routing replay where engine and trainer numerics differ (docs/models.md#moe-routing-replay): each MoE
family's tiny variant samples episodes in the hf engine (bf16 weights, and fp32 as the control) recording the
experts it chose per token; the fp32 trainer then scores the same episodes twice in one run, without and with
replaying those routes, and this records furlong's trainer/rollout figures for each: mean and max |trainer
logprob - rollout logprob| over the sampled tokens (`logprob_diff_mean` / `_max`, the issue's
train_rollout_logprob_abs_diff) and mean(rollout - trainer) (`rollout_train_kl`, its train_rollout_kl); and,
without replay, the fraction of tokens (and of token-layer pairs) whose trainer top-k set differed from the
engine's. With replay the trainer's forward uses the engine's experts exactly (`replayed_topk_mismatch`, 0).

    python bench/routing_replay.py [--families qwen3_moe,gpt_oss] [--prompts 8] [--samples 4] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))  # tests_support imports its siblings as top-level modules

from provenance import finish, provenance  # noqa: E402
from tests_support import routed_episodes  # noqa: E402

from furlong.model.families import init_family  # noqa: E402
from furlong.model.loading import load_model  # noqa: E402
from furlong.model.moe import ROUTED_FAMILIES, RouteHooks  # noqa: E402
from furlong.train.batch import collate  # noqa: E402
from furlong.train.grpo import policy_loss  # noqa: E402
from furlong.train.logprobs import token_logprobs  # noqa: E402
from furlong.train.routing import Routing  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "routing_replay.json"


def _score(model, episodes: list, mode: str) -> dict:
    """The trainer's figures on `episodes` with replay `mode` (on | off), one micro-batch of 4 at a time."""
    routing = Routing(model, mode, 0.0)
    metrics, used_differ, known_total = [], 0, 0
    for i in range(0, len(episodes), 4):
        mb = collate(episodes[i : i + 4], torch.zeros(len(episodes[i : i + 4])), torch.device("cpu"))
        with torch.no_grad(), RouteHooks(model, record=True) as outer:  # sees the experts the forward used
            with routing.forward(mb.routes):
                logp = token_logprobs(model, mb.tokens, mb.attention_mask, 1.0)
            used = outer.take()
        assert mb.routes is not None
        recorded = mb.routes.reshape(-1, *mb.routes.shape[2:])
        known = (recorded >= 0).all(-1).all(-1)
        differ = used[known].sort(-1).values != recorded[known].sort(-1).values
        used_differ, known_total = used_differ + int(differ.any(-1).any(-1).sum()), known_total + int(known.sum())
        _, m = policy_loss(logp, logp, mb.rollout_logprobs, torch.zeros(len(logp)), mb.loss_mask)
        metrics.append(m)
    pairs, tokens, compared = routing.hooks.mismatch()
    layers = len(routing.hooks.routers)
    n = sum(m.tokens for m in metrics)
    routing.hooks.close()
    return {
        "logprob_diff_mean": sum(m.logprob_diff_mean * m.tokens for m in metrics) / n,
        "logprob_diff_max": max(m.logprob_diff_max for m in metrics),
        "rollout_train_kl": sum(m.rollout_train_kl * m.tokens for m in metrics) / n,
        "sampled_tokens": n,
        "routed_tokens": compared,
        "own_topk_token_mismatch": tokens / compared,  # the trainer's own top-k vs the engine's, any MoE layer
        "own_topk_pair_mismatch": pairs / (compared * layers),  # per (token, MoE layer)
        "used_topk_token_mismatch": used_differ / known_total,  # what the forward actually used
    }


def one(name: str, work: Path, args: argparse.Namespace) -> dict:
    directory = init_family(name, work / name)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(rng.randrange(12, 40))] for _ in range(args.prompts)]
    trainer = load_model(directory)
    out = {}
    for dtype in ("bfloat16", "float32"):
        episodes = routed_episodes(
            load_model(directory, dtype=getattr(torch, dtype)), prompts, args.samples, args.tokens
        )
        out[f"engine_{dtype}"] = {mode: _score(trainer, episodes, mode) for mode in ("off", "on")}
        print(name, dtype, json.dumps(out[f"engine_{dtype}"]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(ROUTED_FAMILIES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    prov = provenance()
    with tempfile.TemporaryDirectory() as work:
        results = {name: one(name, Path(work), args) for name in args.families.split(",")}
    setup = {k: getattr(args, k) for k in ("prompts", "samples", "tokens", "seed")}
    args.out.write_text(json.dumps({"provenance": finish(prov), "setup": setup, "families": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
