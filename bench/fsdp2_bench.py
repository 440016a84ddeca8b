"""FSDP2 at world size 2 vs the local trainer on this machine: step time and peak memory per process.

Both train the same model (a 26M-parameter Qwen3 built with furlong's tiny-model builder, fp32, AdamW) on
the same fixed batch of synthetic episodes for --steps steps (the first is warm-up, not timed). The local
trainer runs in a spawned process of its own, so every process measured holds exactly one trainer. Memory
is each process's peak resident set (VmHWM) and its resident set before the first step; both include the
~0.4 GB every torch process holds, so the per-rank share of parameters, gradients and Adam state shows
in the difference. On a shared 2-core box the two ranks compete for the cores: the time ratio there is a
cost of sharding, not a speed-up.

Each pair runs twice: with glibc's default allocator settings, and with a fixed mmap threshold
(MALLOC_MMAP_THRESHOLD_=131072 in the spawned processes). glibc raises its threshold to the size of each
large block freed, so FSDP2's per-layer gather and reduce-scatter buffers, allocated and freed every pass,
end up in heap arenas that keep the memory after it is freed; with the threshold fixed every such block is
mapped and returned on free, so the second arm's peak is close to what the tensors themselves need.

    python bench/fsdp2_bench.py                     # ~1 min; writes bench/results/fsdp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from provenance import finish, provenance

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests_support imports its siblings as top-level modules

from furlong.model.tiny import TinySpec, init_tiny  # noqa: E402
from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer  # noqa: E402
from furlong.train.ranks import LocalRanks  # noqa: E402
from tests.fsdp2_support import fixed_episodes  # noqa: E402
from tests.tests_support import grpo  # noqa: E402

MODEL = TinySpec(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                 intermediate_size=1536, corpus_samples=1000, stdlib_bytes=100_000)


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(ranks: LocalRanks, trainer, steps: int, episodes) -> dict:
    """Step seconds (after one warm-up step) and each process's memory."""
    before = [_kib(pid, "VmRSS") for pid in ranks.pids]
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer(episodes)
        seconds.append(time.perf_counter() - start)
    return {"step_seconds": seconds[1:], "step_seconds_median": statistics.median(seconds[1:]),
            "rss_before_bytes": before, "peak_rss_bytes": [_kib(pid, "VmHWM") for pid in ranks.pids]}


ALLOCATORS = {"default_malloc": None, "fixed_mmap_threshold": "131072"}


def pair(model: Path, config, steps: int, episodes) -> dict:
    """The local trainer, then FSDP2 at world size 2, each in processes spawned now, and their ratios."""
    results = {}
    # the reference is LocalTrainer itself, alone in a process of its own (a one-rank group, no sharding)
    with LocalRanks(LocalSpec(model, config), 1) as local:
        results["local"] = measure(local, lambda e: local.call("train_step", e), steps, episodes)
    spec = FSDP2Spec(model, config)
    ranks = LocalRanks(spec, 2)
    trainer = FSDP2Trainer(ranks, spec)
    try:
        results["fsdp2_ws2"] = measure(ranks, trainer.train_step, steps, episodes)
    finally:
        trainer.close()
    local, fsdp = results["local"], results["fsdp2_ws2"]
    results["ratios"] = {
        "step_time_fsdp2_over_local": fsdp["step_seconds_median"] / local["step_seconds_median"],
        "peak_rss_per_rank_over_local": max(fsdp["peak_rss_bytes"]) / local["peak_rss_bytes"][0],
        "step_memory_per_rank_over_local": max(p - b for p, b in zip(fsdp["peak_rss_bytes"], fsdp["rss_before_bytes"]))
        / (local["peak_rss_bytes"][0] - local["rss_before_bytes"][0])}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per trainer, the first untimed")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fsdp2.json")
    parser.add_argument("--work", type=Path, default=ROOT / ".bench-fsdp2")
    args = parser.parse_args()
    prov = provenance()
    model = init_tiny(args.work / "model", spec=MODEL)
    config = grpo(lr=1e-5, micro_batch_size=4, minibatches=2, sft_coef=0.0, kl_coef=0.0)
    episodes = fixed_episodes(groups=4, group_size=4, vocab=4000)
    results = {}
    for name, threshold in ALLOCATORS.items():  # the spawned processes read it when they start
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if threshold is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = threshold
        results[name] = pair(model, config, args.steps, episodes)
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    default, fixed = results["default_malloc"], results["fixed_mmap_threshold"]
    ratios = {**default["ratios"],
              "fixed_threshold_peak_rss_per_rank_over_local": fixed["ratios"]["peak_rss_per_rank_over_local"],
              "fixed_threshold_over_default_fsdp2_peak_rss": max(fixed["fsdp2_ws2"]["peak_rss_bytes"])
              / max(default["fsdp2_ws2"]["peak_rss_bytes"]),
              "fixed_threshold_over_default_fsdp2_step_time": fixed["fsdp2_ws2"]["step_seconds_median"]
              / default["fsdp2_ws2"]["step_seconds_median"]}
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    out = {"model": {"dir": str(model), "hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                     "vocab_size": cfg.vocab_size},
           "batch": {"episodes": len(episodes), "tokens": sum(len(e.tokens) for e in episodes)},
           "steps": args.steps, "results": results, "ratios": ratios, "provenance": finish(prov)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"ratios": ratios}, indent=1))


class LocalSpec:
    """A rank hosting a plain LocalTrainer (no sharding, no collectives): the baseline in its own process."""

    backend = "gloo"

    def __init__(self, model: Path, config) -> None:
        self.model, self.config = model, config

    def make(self, rank: int, world_size: int):
        import torch

        from furlong.model.loading import load_model
        from furlong.train.trainer import LocalTrainer

        torch.set_num_threads(1)
        return LocalTrainer(load_model(self.model), self.config)


if __name__ == "__main__":
    main()
