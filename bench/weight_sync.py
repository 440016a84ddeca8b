"""Weight-sync benchmark on real GRPO steps: furlong deltas vs the XOR+zstd reference.

The synthetic benchmark (weight_sync_synthetic.py) calibrates a made-up step to a target density; this one
measures the deltas training actually produces. It loads the default tiny model (`init_tiny()`) in fp32 (the
trainer's master weights) and, for each learning rate (default: the default recipe's `train.rl.lr` and 4x
below and above it), runs --steps real GRPO steps with the recipe's trainer settings (`GRPOConfig` as the
training driver builds it, warm-up included, only the lr replaced): real sampling with `HFEngine` on a
sandbox-free single-turn task (reward 1 when the answer contains one of vocab/16 target ids, as in the
learning test of tests/test_train.py) and a real `LocalTrainer.train_step`.

After each step the master is cast to bf16 (the published engine weights; tied tensors once) and diffed
against the previous version (version 0 = bf16 of the starting weights). Each delta is encoded with furlong
(`encode_delta` as the next link of one chain per lr, with momentum prediction, as a Publisher sends it;
"plain" is the same delta without momentum) and with byte-wise XOR + zstd level 1, both are applied onto a
copy of the previous version and checked bit for bit, and the empirical entropy bound of positions + values
is computed (`delta_entropy_bound`: order-0, memoryless; momentum is a context model and can go below it). The engine samples with exactly the published bf16 values (upcast to fp32 for
compute), as an engine fed these updates would; TIS absorbs the rounding, as in training.

LoRA: the same task trained with the default adapters (rank 8 on q/k/v/o, --lora-lr), each step's adapter
published in bf16 through an `AdapterPublisher` (a snapshot, then deltas) and loaded by the engine; reported:
payload and raw adapter bytes per update against the whole model's bf16 bytes.

Throughput: GB of full bf16 tensor bytes per second of this thread's CPU time (best of --repeats), one
thread. The model is small (~8 MB of bf16), so GB/s here include per-tensor overheads a 1B model amortizes.

    python bench/weight_sync.py                       # 3 lrs x 6 steps, then LoRA, ~1 min on 2 shared cores
    python bench/weight_sync.py --steps 3 --lrs 2e-4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

# The synthetic benchmark's helpers (measure, environment), importable when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import finish, provenance
from weight_sync_synthetic import Chain, environment, measure, print_table

from furlong.agent.episode import Episode, EpisodeTiming
from furlong.config import RECIPES, load_config
from furlong.engine import Generation, SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import init_tiny, load_model
from furlong.model.lora import adapter_state_dict, trainable_model, wrap_lora
from furlong.sync import InProcessTransport
from furlong.sync.adapter import AdapterPublisher
from furlong.train import LocalTrainer
from furlong.build.training import grpo_config

Model = dict[str, torch.Tensor]
RESULTS = Path(__file__).parent / "results" / "weight_sync.json"


def publish(model: torch.nn.Module) -> Model:
    """bf16 copies of the model's tensors, each storage once (tied lm_head / embeddings ship once)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[name] = t.detach().to(torch.bfloat16, copy=True).contiguous()
    return out


def one_turn_episode(
    prompt: list[int], gen: Generation, reward: float, group_id: int, sample_id: int
) -> Episode:
    n, p = len(gen.output_ids), len(prompt)
    return Episode(
        task_id="toy",
        group_id=group_id,
        sample_id=sample_id,
        prompt_len=p,
        tokens=tuple(prompt) + gen.output_ids,
        loss_mask=(0,) * p + (1,) * n,
        rollout_logprobs=(0.0,) * p + gen.logprobs,
        token_weight_versions=(-1,) * p + gen.token_weight_versions,
        reward=reward,
        status="ok",
        timing=EpisodeTiming(),
        turns=1,
    )


async def rollouts(
    engine: HFEngine,
    prompts: list[list[int]],
    targets: set[int],
    group_size: int,
    sampling: SamplingParams,
    seed: int,
) -> list[Episode]:
    calls = [
        engine.generate(p, replace(sampling, seed=seed + 1000 * g + i))
        for g, p in enumerate(prompts)
        for i in range(group_size)
    ]
    gens = await asyncio.gather(*calls)
    return [
        one_turn_episode(
            prompts[k // group_size],
            gen,
            float(bool(targets & set(gen.output_ids))),
            k // group_size,
            k % group_size,
        )
        for k, gen in enumerate(gens)
    ]


def task(vocab: int, args: argparse.Namespace) -> tuple[list[list[int]], set[int]]:
    """The prompts and the rewarded target ids of the single-turn task."""
    rng = random.Random(args.seed)
    targets = set(rng.sample(range(10, vocab), vocab // 16))
    prompts = [[rng.randrange(10, vocab) for _ in range(3 + 5 * (i % 4))] for i in range(args.prompts)]
    return prompts, targets


async def run_lora(model_dir: Path, grpo, args: argparse.Namespace) -> list[dict[str, Any]]:
    """LoRA (the default spec: rank 8 on q/k/v/o) trained on the same task; each step's adapter goes out through
    an AdapterPublisher in bf16 (a snapshot, then deltas) and into the engine: adapter bytes per update against
    the whole model's bf16 bytes. Row 0 is the initial snapshot."""
    torch.manual_seed(args.seed)
    peft, engine_peft = wrap_lora(load_model(model_dir)), wrap_lora(load_model(model_dir))
    prompts, targets = task(trainable_model(peft).config.vocab_size, args)
    trainer = LocalTrainer(trainable_model(peft), grpo)
    publisher = AdapterPublisher(InProcessTransport(), engine_dtype=torch.bfloat16)
    publisher.publish(peft, 0)
    sampling = SamplingParams(temperature=grpo.temperature, max_new_tokens=args.max_new_tokens)
    updated = [True]
    async with HFEngine(engine_peft, eos_token_ids=()) as engine:
        await engine.update_weights(adapter_state_dict(peft), 0)
        for step in range(1, args.steps + 1):
            eps = await rollouts(engine, prompts, targets, args.group_size, sampling, seed=100_000 * step + args.seed)
            updated.append(trainer.train_step(eps).updated)
            publisher.publish(peft, step)
            await engine.update_weights(adapter_state_dict(peft), trainer.version)
    return [{"lr": grpo.lr, "step": s.version, "updated": u, "kind": s.kind, "payload_bytes": s.payload_bytes,
             "adapter_bytes": s.adapter_bytes, "full_model_bytes": s.full_model_bytes,
             "payload_over_full": s.ratio, "adapter_over_full": s.raw_ratio}
            for s, u in zip(publisher.sizes, updated)]


async def run_lr(
    model_dir: Path, grpo, args: argparse.Namespace
) -> list[dict[str, Any]]:
    torch.manual_seed(args.seed)
    policy, engine_model = load_model(model_dir), load_model(model_dir)
    prompts, targets = task(policy.config.vocab_size, args)
    sampling = SamplingParams(
        temperature=grpo.temperature, max_new_tokens=args.max_new_tokens
    )
    trainer = LocalTrainer(policy, grpo)
    prev = publish(policy)
    receiver = {k: v.clone() for k, v in prev.items()}
    chain = Chain.with_momentum()  # the steps are one delta chain, as a Publisher sends them
    rows = []
    async with HFEngine(engine_model, eos_token_ids=()) as engine:
        await engine.update_weights(prev, 0)
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            # A batch whose groups all tie in reward trains nothing (no update): resample it.
            for attempt in range(5):
                eps = await rollouts(
                    engine,
                    prompts,
                    targets,
                    args.group_size,
                    sampling,
                    seed=100_000 * step + 10_000 * attempt + args.seed,
                )
                stats = trainer.train_step(eps)
                if stats.updated:
                    break
            else:
                raise RuntimeError(
                    f"lr {grpo.lr}: step {step} found no group with varied rewards in 5 tries"
                )
            train_s = time.perf_counter() - t0
            new = publish(policy)
            # Both codecs, applied onto `receiver` (reset to prev), checked bit for bit; leaves it == new.
            m = measure(prev, new, receiver, args.repeats, chain)
            row = {
                "lr": grpo.lr,
                "step": step,
                "step_lr": trainer.optimizer.param_groups[0]["lr"],
                "reward_mean": stats.reward_mean,
                "groups_used": stats.groups_used,
                "grad_norm": stats.grad_norm,
                "logprob_diff_max": stats.logprob_diff_max,
                "train_s": train_s,
                "bound_over_full": m["bound_bytes"] / m["full_bytes"],
                **m,
            }
            rows.append(row)
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()
                              if k not in ("timings", "encodings")}), flush=True)
            await engine.update_weights(new, trainer.version)
            prev = new
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over one lr's steps: byte sums, so each ratio is of totals, not a mean of ratios."""
    tot = lambda k: sum(r[k] for r in rows)
    cpu = lambda k: sum(r["timings"][k]["cpu_s"] for r in rows)
    full, fb, xb, bb, pb = (
        tot("full_bytes"),
        tot("furlong_bytes"),
        tot("xor_zstd_bytes"),
        tot("bound_bytes"),
        tot("furlong_plain_bytes"),
    )
    return {
        "lr": rows[0]["lr"],
        "step": "all",
        "step_lr": rows[-1]["step_lr"],
        "reward_mean": tot("reward_mean") / len(rows),
        "full_bytes": full,
        "changed": tot("changed"),
        "density": tot("changed") / (full / 2),
        "furlong_bytes": fb,
        "furlong_plain_bytes": pb,
        "xor_zstd_bytes": xb,
        "bound_bytes": bb,
        "bound_over_full": bb / full,
        "furlong_over_full": fb / full,
        "xor_over_full": xb / full,
        "furlong_over_xor": fb / xb,
        "plain_over_xor": pb / xb,
        "furlong_over_bound": fb / bb,
        "xor_over_bound": xb / bb,
        "encode_gbps": full / cpu("encode") / 1e9,
        "apply_gbps": full / cpu("apply") / 1e9,
        "xor_encode_gbps": full / cpu("xor_encode") / 1e9,
        "xor_apply_gbps": full / cpu("xor_apply") / 1e9,
        "bit_mismatches": tot("bit_mismatches"),
        "xor_bit_mismatches": tot("xor_bit_mismatches"),
    }


COLUMNS = [  # (header, key, format)
    ("lr", "lr", "{:.0e}"),
    ("step", "step", "{}"),
    ("step lr", "step_lr", "{:.1e}"),
    ("reward", "reward_mean", "{:.2f}"),
    ("density", "density", "{:.2%}"),
    ("bound/full", "bound_over_full", "{:.4f}"),
    ("furlong/full", "furlong_over_full", "{:.4f}"),
    ("xor/full", "xor_over_full", "{:.4f}"),
    ("furlong/xor", "furlong_over_xor", "{:.3f}"),
    ("plain/xor", "plain_over_xor", "{:.3f}"),
    ("furlong/bound", "furlong_over_bound", "{:.3f}"),
    ("xor/bound", "xor_over_bound", "{:.2f}"),
    ("enc GB/s", "encode_gbps", "{:.2f}"),
    ("apply GB/s", "apply_gbps", "{:.2f}"),
    ("xor enc GB/s", "xor_encode_gbps", "{:.2f}"),
    ("xor apply GB/s", "xor_apply_gbps", "{:.2f}"),
    ("mismatch", "bit_mismatches", "{}"),
    ("xor mism.", "xor_bit_mismatches", "{}"),
]


LORA_COLUMNS = [
    ("step", "step", "{}"),
    ("kind", "kind", "{}"),
    ("trained", "updated", "{}"),
    ("payload B", "payload_bytes", "{:,}"),
    ("raw adapter B", "adapter_bytes", "{:,}"),
    ("full model B", "full_model_bytes", "{:,}"),
    ("payload/full", "payload_over_full", "{:.4f}"),
    ("adapter/full", "adapter_over_full", "{:.4f}"),
]


def task_description(args: argparse.Namespace) -> dict[str, Any]:
    return {"prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
            "reward": "1 if the answer holds one of vocab/16 target ids", "seed": args.seed}


def main() -> None:
    cfg = load_config(RECIPES / "default.yaml")
    recipe_lr = cfg.train.rl.lr
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per learning rate")
    ap.add_argument(
        "--lrs",
        default=f"{recipe_lr / 4:g},{recipe_lr:g},{recipe_lr * 4:g}",
        help="learning rates, comma-separated (default: the recipe's, /4 and x4)",
    )
    ap.add_argument(
        "--warmup-steps", type=int, default=None, help="default: the recipe's"
    )
    ap.add_argument(
        "--prompts",
        type=int,
        default=cfg.train.rl.tasks_per_step,
        help="groups per step",
    )
    ap.add_argument("--group-size", type=int, default=cfg.train.rl.group_size)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lora-lr", type=float, default=2e-3,
                    help="lr of the LoRA run (adapters start at zero and need ~10x the full-model lr)")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (best of)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    env = environment(args)
    model_dir = init_tiny()
    grpo = replace(grpo_config(cfg.train), kl_coef=0.0, sft_coef=0.0)  # as measured: no KL reference, no demonstrations
    if args.warmup_steps is not None:
        grpo = replace(grpo, warmup_steps=args.warmup_steps)
    start = time.perf_counter()
    rows, table = [], []
    for lr in (float(x) for x in args.lrs.split(",")):
        lr_rows = asyncio.run(run_lr(model_dir, replace(grpo, lr=lr), args))
        rows += lr_rows
        table += [*lr_rows, summarize(lr_rows)]
    lora_rows = asyncio.run(run_lora(model_dir, replace(grpo, lr=args.lora_lr), args))
    env["loadavg_end"] = os.getloadavg()
    env["seconds"] = time.perf_counter() - start
    n_params = sum(v.numel() for v in publish(load_model(model_dir)).values())
    title = (
        f"weight sync on real GRPO steps: default tiny model, {n_params / 1e6:.2f} M bf16 params "
        f"(tied once), fp32 master, recipe lr {recipe_lr:g}, warm-up {grpo.warmup_steps} steps; "
        "1 thread, GB/s of full bf16 bytes per CPU-second"
    )
    print_table(table, title, COLUMNS, is_total=lambda row: row["step"] == "all")
    print_table(lora_rows, f"LoRA (rank 8, q/k/v/o) adapter-only updates in bf16, lr {args.lora_lr:g}", LORA_COLUMNS)
    results = {"provenance": finish(prov), "model": str(model_dir), "params_bf16": n_params, "recipe_lr": recipe_lr, "steps": args.steps,
               "grpo": asdict(grpo) | {"lr": "per row"}, "task": task_description(args), "environment": env,
               "summary": [r for r in table if r["step"] == "all"], "rows": rows, "lora": lora_rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} ({env['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
