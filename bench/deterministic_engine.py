"""What `train.hf.deterministic` costs and buys: the hf engine on an RL-shaped load, default vs deterministic.

    python bench/deterministic_engine.py [--out bench/results/deterministic_engine.json]

The load: `groups` GRPO groups of `group` seeded samples each (a group shares its prompt), two turns per
episode (turn 2's prompt extends turn 1's with a tool-result-sized tail, as an episode's does), all
episodes at once; the tiny model (`furlong model init tiny`), one torch thread, as `furlong train` runs it.
Each mode serves the load `repeats` times, interleaved, once with every episode arriving at once and
once staggered; reported: the median wall time and generated tokens/s, and whether a request's
tokens and logprobs came out the same to the bit under both arrivals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import finish, provenance

from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import load_model
from furlong.model.tiny import init_tiny


async def _episode(engine: HFEngine, prompt: list[int], seed: int, delay: float, tail: list[int]) -> list:
    await asyncio.sleep(delay)
    out = []
    for turn in range(2):
        gen = await engine.generate(prompt, SamplingParams(max_new_tokens=48, seed=seed * 2 + turn))
        out.append((gen.output_ids, gen.logprobs))
        prompt = prompt + list(gen.output_ids) + tail
    return out


async def serve(model, deterministic: bool, prompts: list[list[int]], group: int, stagger: float) -> tuple[float, int, list]:
    """Wall seconds, generated tokens and every episode's (ids, logprobs) for one pass over the load."""
    tail = list(range(100, 130))
    async with HFEngine(model, eos_token_ids=(), deterministic=deterministic) as engine:
        start = time.perf_counter()
        jobs = [_episode(engine, p, g * group + s, stagger * ((g * group + s) % 5), tail)
                for g, p in enumerate(prompts) for s in range(group)]
        results = await asyncio.gather(*jobs)
        return time.perf_counter() - start, engine.stats.generated_tokens, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "deterministic_engine.json")
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    model = load_model(init_tiny())
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(120 + 17 * g)] for g in range(args.groups)]
    rows = {}
    for mode, det in (("default", False), ("deterministic", True)):
        rows[mode] = {"seconds": [], "tokens": 0, "bit_equal_across_arrivals": True}
    for _ in range(args.repeats):
        for mode, det in (("default", False), ("deterministic", True)):
            secs, tokens, together = asyncio.run(serve(model, det, prompts, args.group, 0.0))
            _, _, staggered = asyncio.run(serve(model, det, prompts, args.group, 0.02))
            rows[mode]["seconds"].append(round(secs, 3))
            rows[mode]["tokens"] = tokens
            rows[mode]["bit_equal_across_arrivals"] &= together == staggered
    for row in rows.values():
        row["median_seconds"] = statistics.median(row["seconds"])
        row["tokens_per_s"] = round(row["tokens"] / row["median_seconds"], 1)
    rows["deterministic_over_default_time"] = round(
        rows["deterministic"]["median_seconds"] / rows["default"]["median_seconds"], 2)
    result = {"load": {"groups": args.groups, "group": args.group, "turns": 2, "max_new_tokens": 48,
                       "torch_threads": 1, "repeats": args.repeats}, **rows, "provenance": finish(prov)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))


if __name__ == "__main__":
    main()
