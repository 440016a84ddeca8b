"""What a self-distillation teacher under a brevity prompt has to teach, before any update (docs/distill.md).
From a kept distill_bench run (its SFT checkpoint, its demonstrations' prompts, its step-0 RL episodes):

  1. the teacher's own replies: first turns sampled at temperature 1 under the default system prompt and under
     distill_bench's BRIEF, generated tokens per reply (a teacher that is not briefer has no brevity to give);
  2. the distillation term at step 0: the SFT policy's own first turns (default prompt) scored under BRIEF by
     the same weights, A_t = logp_teacher - logp_student per sampled token: its quantiles, how concentrated
     it is, its sign, its value on the end-of-turn token, against GRPO's per-token advantage on the run's
     step-0 batch (the recipe's normalize_std and negative_weight).

    python bench/distill_teacher_probe.py --run DIR/seed0-distill   # DIR: distill_bench.py --keep DIR
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
import yaml
from distill_bench import BRIEF
from provenance import finish, provenance
from runs import ROOT, ci
from transformers import AutoModelForCausalLM, AutoTokenizer

from furlong.config import DEFAULT_SYSTEM_PROMPT
from furlong.metrics.episodes import read_jsonl
from furlong.metrics.stats import bootstrap_diff, bootstrap_mean
from furlong.train.grpo import group_advantages, weigh_negatives

RESULTS = ROOT / "bench" / "results" / "distill_teacher_probe.json"
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def prompts(run: Path, tok, n: int) -> list[list[int]]:
    """The first-turn prompts of `n` of the run's SFT demonstrations, one per task, evenly spread."""
    system = tok.encode(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False)
    out = []
    for d in read_jsonl(run / "demos.jsonl"):
        ids = d["tokens"][: d["loss_mask"].index(1)]
        if ids[3 : 3 + len(system)] != system:  # <bos> role \n, then the system message's text
            raise SystemExit(f"{run}/demos.jsonl: {d['task_id']}'s prompt does not open with the default system prompt")
        out.append(ids)
    return out[:: max(len(out) // n, 1)][:n]


def with_system(ids: list[int], tok, text: str) -> list[int]:
    """The prompt with its default system message's text replaced by `text`."""
    n = len(tok.encode(DEFAULT_SYSTEM_PROMPT, add_special_tokens=False))
    return ids[:3] + tok.encode(text, add_special_tokens=False) + ids[3 + n :]


def sample(model, prompt: list[int], k: int, eot: int) -> list[list[int]]:
    """k first turns at temperature 1 (no top-k/top-p: the rollout's sampling), each up to its end of turn."""
    ids = torch.tensor([prompt]).repeat(k, 1)  # one prompt k times: no padding, the mask is all ones
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=150,
        eos_token_id=eot,
        pad_token_id=eot,
    )
    gens = [row[len(prompt) :].tolist() for row in out]
    return [g[: g.index(eot) + 1] if eot in g else g for g in gens]


@torch.no_grad()
def logprobs(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + gen])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1 :]


def grpo_scale(run: Path) -> dict:
    """GRPO's advantage on the run's step-0 batch, per sampled token (each episode's on each of its tokens)."""
    rl = yaml.safe_load((run / "config.yaml").read_text())["train"]["rl"]
    eps = [r for r in read_jsonl(run / "episodes.jsonl") if r["phase"] == "rl" and r["step"] == 0]
    adv = group_advantages([r["reward"] for r in eps], [(r["task"], r["group"]) for r in eps], rl["normalize_std"])
    adv = weigh_negatives(adv, rl["negative_weight"])
    per_token = torch.cat([torch.full((r["tokens_response"],), float(a)) for r, a in zip(eps, adv.tolist())])
    return {
        "episodes": len(eps),
        "mean_abs": round(per_token.abs().mean().item(), 4),
        "rms": round(per_token.pow(2).mean().sqrt().item(), 4),
        "max_abs": round(per_token.abs().max().item(), 4),
    }


def term(terms: list[torch.Tensor], gens: list[list[int]], eot: int, tok) -> dict:
    """The step-0 distillation term over every sampled token, and the tokens that carry most of it."""
    flat = torch.cat(terms)
    mag = flat.abs().sort(descending=True).values
    by_token: dict[int, list[float]] = defaultdict(list)
    for a, g in zip(terms, gens):
        for v, i in zip(a.tolist(), g):
            by_token[i].append(v)
    heaviest = sorted(by_token.items(), key=lambda kv: sum(kv[1]))[:5]
    return {
        "tokens": flat.numel(),
        "quantiles": {
            str(q): round(v, 4) for q, v in zip(QUANTILES, torch.quantile(flat, torch.tensor(QUANTILES)).tolist())
        },
        "mean": round(flat.mean().item(), 5),
        "mean_abs": round(flat.abs().mean().item(), 4),
        "rms": round(flat.pow(2).mean().sqrt().item(), 4),
        "min": round(flat.min().item(), 4),
        "max": round(flat.max().item(), 4),
        "top1pct_share_of_abs": round((mag[: max(len(mag) // 100, 1)].sum() / mag.sum()).item(), 4),
        "negative_share_of_abs": round((flat.clamp(max=0).abs().sum() / flat.abs().sum()).item(), 4),
        "end_of_turn_mean": round(sum(by_token[eot]) / max(len(by_token[eot]), 1), 5),
        "most_negative_tokens": [
            {"token": tok.decode([i]), "n": len(v), "sum": round(sum(v), 3), "mean": round(sum(v) / len(v), 3)}
            for i, v in heaviest
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a distill_bench run kept with --keep (seedN-distill)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8, help="first turns sampled per prompt and system prompt")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    prov = provenance()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a 4.2M-parameter model: threads only contend with the box's other jobs
    ckpt = args.run / "checkpoints" / "sft"
    tok, model = AutoTokenizer.from_pretrained(ckpt), AutoModelForCausalLM.from_pretrained(ckpt).eval()
    eot = tok.convert_tokens_to_ids(tok.eos_token)
    lengths: dict[str, list[int]] = {"default": [], "brief": []}
    terms, gens = [], []
    for p in prompts(args.run, tok, args.prompts):
        for name, text in (("default", DEFAULT_SYSTEM_PROMPT), ("brief", BRIEF)):
            replies = sample(model, with_system(p, tok, text), args.samples, eot)
            lengths[name] += [len(g) for g in replies]
            if name == "default":  # the student's own samples, scored by the teacher (the same weights, BRIEF)
                brief = with_system(p, tok, BRIEF)
                terms += [logprobs(model, brief, g) - logprobs(model, p, g) for g in replies]
                gens += replies
    out = {
        "question": "is the SFT checkpoint under the brevity prompt a briefer policy, and what is the step-0 term?",
        "run": str(args.run),
        "teacher_system_prompt": BRIEF,
        "values": "[value, 90% bootstrap low, high]; first turns sampled at temperature 1, tokens to end of turn",
        "first_turn_tokens": {k: ci(bootstrap_mean(v)) for k, v in lengths.items()},
        "first_turn_brief_minus_default": ci(bootstrap_diff(lengths["brief"], lengths["default"])),
        "replies": len(lengths["default"]),
        "term_step0": term(terms, gens, eot, tok),
        "grpo_advantage_step0": grpo_scale(args.run),
        "provenance": finish(prov),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("first_turn_tokens", "term_step0", "grpo_advantage_step0")}, indent=1))


if __name__ == "__main__":
    main()
