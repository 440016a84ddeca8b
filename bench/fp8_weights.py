"""FP8 rollout weights on real GRPO steps of the default tiny model (docs/weight-sync.md#fp8-rollout-weights).

One run: the hf engine holds fp8 weights (e4m3, per-output-channel scales; furlong.model.fp8) and samples every
step's episodes; the fp32 trainer takes --steps real `LocalTrainer.train_step`s on them (the recipe's GRPO
settings, no KL reference, no demonstrations) and after each the same weights go out through two Publishers,
bf16 (every tensor) and fp8 (the decoder Linears as e4m3 + float32 scales, the rest bf16), each a snapshot then
deltas. Per update: payload bytes of each, and the fraction of the quantized Linears' elements whose bytes
changed (fp8 vs the same weights in bf16: delta density) and of all elements. Every step the engine is loaded
through a DirectLink (train.sync.transport=direct), whose checksum proves it holds the trainer's fp8 tensors; the
trainer then scores the step's episodes twice, with its plain fp32 forward and with the quantized forward
(train.sync.quantized_forward), giving mean/max |trainer logprob - rollout logprob| over the sampled tokens.

    python bench/fp8_weights.py [--steps 6] [--prompts 8] [--group-size 4] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from provenance import finish, provenance  # noqa: E402
from weight_sync import rollouts, task  # noqa: E402

from furlong.build.training import grpo_config  # noqa: E402
from furlong.config import RECIPES, load_config  # noqa: E402
from furlong.engine import SamplingParams  # noqa: E402
from furlong.engine.hf import HFEngine  # noqa: E402
from furlong.model import init_tiny, load_model  # noqa: E402
from furlong.model.fp8 import FakeQuantLinear, Fp8Spec, fp8_targets, to_fp8_engine  # noqa: E402
from furlong.sync import InProcessTransport, Publisher  # noqa: E402
from furlong.train import LocalTrainer  # noqa: E402
from furlong.train.batch import collate  # noqa: E402
from furlong.train.logprobs import token_logprobs  # noqa: E402
from furlong.train.weights import DirectLink  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "fp8_weights.json"


def _changed(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], names) -> tuple[int, int]:
    """(elements whose bytes differ, elements) over `names`."""
    diff = total = 0
    for n in names:
        a, b = prev[n].view(-1), new[n].view(-1)
        w = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        diff += int((a.view(w) != b.view(w)).sum())
        total += a.numel()
    return diff, total


def _logprob_diff(model, spec: Fp8Spec, episodes, quantized: bool) -> dict[str, float]:
    """mean/max |trainer - rollout| logprob over the sampled tokens, with or without the quantized forward."""
    for name in spec.weights:  # switched in place: the same parameters either way
        model.get_submodule(name.removesuffix(".weight")).__class__ = FakeQuantLinear if quantized else torch.nn.Linear
    gaps = []
    with torch.no_grad():
        for i in range(0, len(episodes), 8):
            mb = collate(episodes[i : i + 8], torch.zeros(len(episodes[i : i + 8])), torch.device("cpu"))
            logp = token_logprobs(model, mb.tokens, mb.attention_mask, 1.0)
            mask = mb.loss_mask.bool()
            gaps.append((logp - mb.rollout_logprobs).abs()[mask])
    for name in spec.weights:
        model.get_submodule(name.removesuffix(".weight")).__class__ = torch.nn.Linear
    gap = torch.cat(gaps)
    return {"mean": float(gap.mean()), "max": float(gap.max()), "tokens": int(gap.numel())}


async def run(model_dir: Path, grpo, args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(args.seed)
    policy = load_model(model_dir)
    spec = fp8_targets(policy)
    prompts, targets = task(policy.config.vocab_size, args)
    sampling = SamplingParams(temperature=grpo.temperature, max_new_tokens=args.max_new_tokens)
    trainer = LocalTrainer(policy, grpo)
    bf16 = Publisher(InProcessTransport(), engine_dtype=torch.bfloat16, full_every=10_000)
    fp8 = Publisher(InProcessTransport(), engine_dtype=torch.bfloat16, full_every=10_000, fp8=spec)
    link = DirectLink(HFEngine(to_fp8_engine(load_model(model_dir), spec), eos_token_ids=()), spec)
    rows, prev = [], None
    try:
        for step in range(args.steps + 1):
            sync = await link.push(dict(policy.state_dict()), step)  # raises unless the checksums agree
            pubs = {k: p.publish(policy.state_dict(), step) for k, p in (("bf16", bf16), ("fp8", fp8))}
            now = {"bf16": dict(bf16.published or {}), "fp8": dict(fp8.published or {})}
            row: dict = {"step": step, "fp8_checksum_ok": sync["sync_fp8_checksum_ok"]}
            for k, pub in pubs.items():
                row[f"{k}_kind"], row[f"{k}_payload_bytes"] = pub.kind, pub.payload_bytes
                row[f"{k}_full_bytes"] = pub.full_bytes
            if prev is not None:
                for k in ("bf16", "fp8"):
                    d, n = _changed(prev[k], now[k], spec.weights)
                    row[f"{k}_linear_density"] = d / n
                    d, n = _changed(prev[k], now[k], now[k].keys())
                    row[f"{k}_all_density"] = d / n
            prev = now
            eps = await rollouts(link.engine, prompts, targets, args.group_size, sampling, seed=100_000 * step + args.seed)
            row["logprob_diff_plain"] = _logprob_diff(policy, spec, eps, quantized=False)
            row["logprob_diff_quantized"] = _logprob_diff(policy, spec, eps, quantized=True)
            if step < args.steps:
                row["updated"] = trainer.train_step(eps).updated
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        await link.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    deltas = [r for r in rows if r["fp8_kind"] == "delta"]

    def mean(key: str, among=deltas) -> float:
        return sum(r[key] for r in among) / len(among)

    def diff(kind: str, stat: str) -> float:
        values = [r[f"logprob_diff_{kind}"][stat] for r in rows]
        return sum(values) / len(values) if stat == "mean" else max(values)

    return {
        "deltas": len(deltas),
        "bf16_linear_density": mean("bf16_linear_density"),
        "fp8_linear_density": mean("fp8_linear_density"),
        "bf16_all_density": mean("bf16_all_density"),
        "fp8_all_density": mean("fp8_all_density"),
        "bf16_delta_payload_bytes": mean("bf16_payload_bytes"),
        "fp8_delta_payload_bytes": mean("fp8_payload_bytes"),
        "fp8_over_bf16_delta_payload": mean("fp8_payload_bytes") / mean("bf16_payload_bytes"),
        "bf16_full_bytes": rows[0]["bf16_payload_bytes"],
        "fp8_full_bytes": rows[0]["fp8_payload_bytes"],
        "logprob_diff_plain_mean": diff("plain", "mean"),
        "logprob_diff_plain_max": diff("plain", "max"),
        "logprob_diff_quantized_mean": diff("quantized", "mean"),
        "logprob_diff_quantized_max": diff("quantized", "max"),
        "step0_logprob_diff_plain_mean": rows[0]["logprob_diff_plain"]["mean"],
        "step0_logprob_diff_quantized_mean": rows[0]["logprob_diff_quantized"]["mean"],
        "checksums_ok": all(r["fp8_checksum_ok"] == 1.0 for r in rows),
        "updates": sum(bool(r.get("updated")) for r in rows),
    }


def main() -> None:
    cfg = load_config(RECIPES / "default.yaml")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps")
    ap.add_argument("--prompts", type=int, default=cfg.train.rl.tasks_per_step, help="groups per step")
    ap.add_argument("--group-size", type=int, default=cfg.train.rl.group_size)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    torch.set_num_threads(1)
    grpo = replace(grpo_config(cfg.train), kl_coef=0.0, sft_coef=0.0)  # no KL reference, no demonstrations
    start = time.perf_counter()
    rows = asyncio.run(run(init_tiny(), grpo, args))
    setup = {k: getattr(args, k) for k in ("steps", "prompts", "group_size", "max_new_tokens", "seed")}
    setup |= {"lr": grpo.lr, "model": "default tiny (init_tiny)", "scales": "per output channel",
              "seconds": time.perf_counter() - start}  # fmt: skip
    out = {"provenance": finish(prov), "setup": setup, "summary": summarize(rows), "steps": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
