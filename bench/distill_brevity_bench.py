"""Self-distillation that shortens, with a teacher that is briefer (docs/distill.md; issue 47's second
measurement). The tiny model never learned to follow an instruction: under a brevity prompt its replies are as
long as without one (bench/distill_teacher_probe.py), so a brevity-prompted self-teacher has no brevity to
give. Here SFT first teaches it to follow one:

  1. src: the default recipe's SFT and pre-RL eval (`furlong train train.rl.steps=0`): its demonstrations;
  2. conditional SFT, from the same base model with the same SFT settings, on each demonstration twice: under
     the default system prompt with a long closing answer (VERBOSE in place of "Done."), and under BRIEF (the
     default prompt plus a brevity instruction) with the demonstration as it is. The closing answer is not
     graded, so the long one costs tokens and nothing else;
  3. three runs forked from that checkpoint: `teacher` (train.agent.system_prompt=BRIEF, no RL: what the
     teacher itself does on the held-out tasks), `grpo` (GRPO alone) and `sdist` (grpo+opd, the teacher the
     frozen SFT policy under BRIEF; train.distill.teacher.frozen).

Reported: held-out generated tokens per episode (all turns) and pass@1 before RL (default prompt), under the
teacher's prompt, and after each arm, with 90% bootstrap intervals paired on the same instances and sampling
seeds; the RL episodes' tokens in the first and last quarter of the steps; the teacher's cost. The issue's
target: tokens down by a third or more, pass@1 not below its interval.

    python bench/distill_brevity_bench.py --keep DIR --seed 0 train.rl.steps=10 train.eval.heldout_per_family=32
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch
import yaml
from distill_bench import BRIEF, arm, compare, lengths
from provenance import finish, provenance
from runs import ROOT, ci, fork_with_own_eval, heldout, train

from furlong.config import DEFAULT_SYSTEM_PROMPT
from furlong.metrics.stats import bootstrap_mean
from furlong.model.chat import Message, assistant_ids
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.model.toolcall import tool_format
from furlong.train.export import write_hf
from furlong.train.sft import FINAL_ANSWER, Demo, load_demos, save_demos, sft_train

RESULTS = ROOT / "bench" / "results" / "distill_brevity.json"
VERBOSE = (
    "I ran the command above and read what it printed: the files the task asks for are in place and their "
    f"contents follow the instructions, so the task is complete. {FINAL_ANSWER}"
)
SDIST = {"mode": "grpo+opd", "weight": 1.0, "teacher": {"path": None, "system_prompt": BRIEF, "frozen": True}}


def conditional_demos(demos: list[Demo], tok, fmt: str) -> list[Demo]:
    """Each demonstration under the default prompt with VERBOSE as its closing answer, and under BRIEF as it is."""
    ends = tool_format(tok, fmt).turn_ends
    short = list(assistant_ids(tok, Message("assistant", FINAL_ANSWER), ends))
    long = list(assistant_ids(tok, Message("assistant", VERBOSE), ends))
    system, brief = (tok.encode(t, add_special_tokens=False) for t in (DEFAULT_SYSTEM_PROMPT, BRIEF))
    out = []
    for d in demos:
        ids, mask = list(d.tokens), list(d.loss_mask)
        if ids[-len(short) :] != short or ids[3 : 3 + len(system)] != system:  # <bos> role \n, then the system text
            raise SystemExit(f"{d.task_id}: not a Harbor demonstration closing with {FINAL_ANSWER!r} under the default prompt")
        cut = len(ids) - len(short)
        out.append(Demo(d.task_id, tuple(ids[:cut] + long), tuple(mask[:cut] + [1] * len(long))))
        n = 3 + len(system)
        out.append(Demo(d.task_id, tuple(ids[:3] + brief + ids[n:]), tuple(mask[:3] + [0] * len(brief) + mask[n:])))
    return out


def conditional_sft(src: Path, work: Path) -> Path:
    """The base model fine-tuned on conditional_demos of src's demonstrations, with src's SFT settings."""
    out = work / "csft"
    if (out / "config.json").exists():
        return out
    t = yaml.safe_load((src / "config.yaml").read_text())["train"]
    base = t["model"]["path"] or init_tiny(seed=t["model"]["seed"])
    tok = load_tokenizer(base)
    demos = conditional_demos(load_demos(src / "demos.jsonl"), tok, t["agent"]["tool_format"])
    save_demos(work / "csft-demos.jsonl", demos)
    model = load_model(base)
    s = t["sft"]
    torch.manual_seed(t["seed"])
    losses = sft_train(model, demos, s["epochs"], s["lr"], s["batch_size"], t["seed"], tok.pad_token_id)
    write_hf(model, tok, out)
    (work / "csft.json").write_text(json.dumps({"demos": len(demos), "final_loss": losses[-1]}))
    return out


def fork(src: Path, csft: Path, dst: Path, steps: int, agent: dict, distill: dict | None) -> None:
    """A run of src's config from the conditional SFT checkpoint: its own pre-RL eval, `steps` RL steps."""
    fork_with_own_eval(src, dst, csft, {"steps": steps})
    config = yaml.safe_load((dst / "config.yaml").read_text())
    config["train"]["agent"].update(agent)
    if distill is not None:
        config["train"]["distill"] = distill
        config["train"]["rl"].pop("filter_zero_variance", None)  # unset: off under distillation (the config refuses true)
    (dst / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    shutil.copy2(csft.parent / "csft-demos.jsonl", dst / "demos.jsonl")  # the anchor trains on what SFT saw


def same_episodes(a: dict[str, dict], b: dict[str, dict]) -> bool:
    """The same sampled replies and rewards on the same instances (timings aside): one checkpoint's pre-RL eval
    run twice with the same sampling seeds."""
    keep = ("response_sha", "reward", "tokens_response")
    return a.keys() == b.keys() and all([a[t][k] for k in keep] == [b[t][k] for k in keep] for t in a)


def view(eps: dict[str, dict]) -> dict:
    return {
        "pass_at_1": ci(bootstrap_mean([float(e["reward"] >= 1) for e in eps.values()])),
        "tokens_per_episode": lengths(eps),
        "instances": len(eps),
    }


def runs(work: Path, seed: int, steps: int, overrides: list[str]) -> dict[str, Path]:
    src = work / "src"
    if not (src / "summary.json").exists():
        print("src: furlong train (SFT and evals only) ...", flush=True)
        shutil.rmtree(src, ignore_errors=True)
        train([f"train.seed={seed}", f"train.run_dir={src}", *overrides, "train.rl.steps=0"], "(src)")
    print("conditional SFT ...", flush=True)
    csft = conditional_sft(src, work)
    arms = {"teacher": (0, {"system_prompt": BRIEF}, None), "grpo": (steps, {}, None), "sdist": (steps, {}, SDIST)}
    out = {"src": src}
    for name, (n, agent, distill) in arms.items():
        run = out[name] = work / name
        if (run / "summary.json").exists():
            continue
        print(f"{name}: furlong train --resume ...", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        fork(src, csft, run, n, agent, distill)
        train(["--resume", str(run)], f"({name})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep", type=Path, help="keep the runs here (default: deleted); finished runs there are reused")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run (train.rl.steps: the arms' steps)")
    args = ap.parse_args()
    steps = next((int(o.split("=", 1)[1]) for o in args.overrides if o.startswith("train.rl.steps=")), 20)
    overrides = [o for o in args.overrides if not o.startswith("train.rl.steps=")]
    prov = provenance()
    work = args.keep or Path(tempfile.mkdtemp(prefix="furlong-brevity-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        r = runs(work, args.seed, steps, overrides)
        before = heldout(r["grpo"], "eval_before")
        sdist_before = heldout(r["sdist"], "eval_before")
        result = {
            "seed": args.seed,
            "steps": steps,
            "default_sft": view(heldout(r["src"], "eval_before")),
            "conditional_sft": json.loads((work / "csft.json").read_text()),
            "before": view(before),
            "same_before_in_both_arms": same_episodes(sdist_before, before),
            "teacher_view": compare(heldout(r["teacher"], "eval_before"), before),
            "grpo": arm(r["grpo"], before, steps),
            "sdist": arm(r["sdist"], before, steps),
            "sdist_minus_grpo": compare(heldout(r["sdist"], "eval_after"), heldout(r["grpo"], "eval_after")),
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out = {
        "question": "with a teacher that is briefer, does self-distillation shorten replies while pass@1 holds?",
        "teacher_system_prompt": BRIEF,
        "verbose_answer": VERBOSE,
        "sdist": SDIST,
        "overrides": args.overrides,
        "values": "[value, 90% bootstrap low, high]; pass gains in points, paired on the same held-out instances "
        "and sampling seeds; tokens: generated (sampled) tokens per episode, all turns",
        **result,
        "provenance": finish(prov),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
