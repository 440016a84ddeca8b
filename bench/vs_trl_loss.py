"""Same samples, same gradient? TRL's GRPOTrainer and furlong's Trainer on one identical batch.

    python bench/vs_trl_loss.py [--seeds 0 1 2] [--out bench/results/vs_trl_loss.json]

bench/vs_trl.py runs the two frameworks on the same prompts, but each samples its own completions, so their
training runs diverge from the first step and their final rewards differ by chance as well as by any
difference in the algorithm. This check removes the sampling: furlong's engine samples one step's batch
(the bench's first step, per seed), furlong's Trainer takes its step on it, and TRL's GRPOTrainer takes its
first step on the very same completion ids (its generation is replaced by a lookup; scoring, advantages,
loss, backward and clipping are TRL's own, with bench/vs_trl.py's config). Compared: the gradient each
optimizer step received (after clipping at 1.0, both), the pre-clip gradient norm, the rewards and the
updated weights. Needs `trl` (see bench/README.md). 3 min at load ~7.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import finish, provenance  # noqa: E402
from vs_trl import FurlongRun, Task, make_task, parse_args, trl_config  # noqa: E402

from furlong.agent.episode import Episode  # noqa: E402
from furlong.model import init_tiny, load_model, load_tokenizer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "vs_trl_loss.json"
Grads = dict[str, torch.Tensor]


def furlong_step(model_dir: Path, task: Task, a: argparse.Namespace) -> tuple[list[Episode], Grads, Any, Grads]:
    """The bench's first furlong step: its batch, the gradient its optimizer step saw, its TrainStats, weights."""
    run = FurlongRun(model_dir, task, a)
    batches: list[list[Episode]] = []
    stats: list[Any] = []
    grads: Grads = {}
    train_step, opt_step = run.trainer.train_step, run.trainer.optimizer.step

    def recording_train_step(episodes: list[Episode]) -> Any:
        batches.append(list(episodes))
        stats.append(train_step(episodes))
        return stats[-1]

    def recording_opt_step(*args: Any, **kwargs: Any) -> Any:
        grads.update({n: p.grad.detach().clone() for n, p in run.policy.named_parameters() if p.grad is not None})
        return opt_step(*args, **kwargs)

    run.trainer.train_step = recording_train_step  # type: ignore[method-assign]
    run.trainer.optimizer.step = recording_opt_step  # type: ignore[method-assign]
    run.step()
    weights = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    run.close()
    return batches[0], grads, stats[0], weights


def trl_step(model_dir: Path, task: Task, a: argparse.Namespace,
             episodes: list[Episode]) -> tuple[Grads, dict[str, Any], list[float], Grads]:
    """TRL's first step on `episodes`' completions (in TRL's order: each prompt's group in a row)."""
    import transformers
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(a.seed)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    completions = [list(e.tokens[e.prompt_len:]) for e in sorted(episodes, key=lambda e: (e.group_id, e.sample_id))]
    prompts = [list(e.tokens[:e.prompt_len]) for e in sorted(episodes, key=lambda e: (e.group_id, e.sample_id))]
    rewards: list[float] = []
    grads: Grads = {}

    def allowed_token_fraction(prompts: list, completions: list, completion_ids: list[list[int]],
                               **_: Any) -> list[float]:
        rewards.extend(task.reward(ids) for ids in completion_ids)
        return [task.reward(ids) for ids in completion_ids]

    class GradTap(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):  # after clipping, as furlong's tap
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    out_dir = tempfile.mkdtemp(prefix="furlong-vs-trl-loss-")
    dataset = Dataset.from_list([{"prompt": m} for m in task.messages[:a.prompts_per_step]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=allowed_token_fraction, args=trl_config(a, out_dir, max_steps=1),
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[GradTap()])
    trainer.remove_callback(PrinterCallback)

    def replay(prompt_ids: list, *_: Any, **__: Any) -> tuple[list[list[int]], None]:
        if [list(map(int, p)) for p in prompt_ids] != prompts:
            raise RuntimeError("TRL's prompts are not furlong's batch: the replay would pair the wrong completions")
        return completions, None

    trainer._generate_single_turn = replay  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)
    log = next(h for h in trainer.state.log_history if "reward" in h)
    return grads, log, rewards, {n: p.detach().clone() for n, p in model.named_parameters()}


def relative_gap(a: Grads, b: Grads) -> dict[str, float]:
    """||a - b|| / ||b|| over all parameters, and the largest per-parameter-tensor value of the same."""
    if a.keys() != b.keys():
        raise RuntimeError(f"parameter sets differ: {sorted(a.keys() ^ b.keys())}")
    diff = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    norm = torch.sqrt(sum((b[k].double() ** 2).sum() for k in b))
    worst = max(float((a[k] - b[k]).double().norm() / b[k].double().norm().clamp(min=1e-30)) for k in a)
    return {"all": float(diff / norm), "worst_tensor": worst, "norm_b": float(norm)}


def check(model_dir: Path, tokenizer: Any, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    a = argparse.Namespace(**{**vars(a), "seed": seed})
    task = make_task(tokenizer, a.steps * a.prompts_per_step, a.eval_prompts, seed)
    episodes, f_grads, f_stats, f_weights = furlong_step(model_dir, task, a)
    t_grads, t_log, t_rewards, t_weights = trl_step(model_dir, task, a, episodes)
    f_rewards = [e.reward for e in sorted(episodes, key=lambda e: (e.group_id, e.sample_id))]
    start = {n: p.detach() for n, p in load_model(model_dir).named_parameters()}
    f_delta = {n: f_weights[n] - start[n] for n in start}
    t_delta = {n: t_weights[n] - start[n] for n in start}
    return {"seed": seed, "episodes": len(episodes), "rewards_equal": f_rewards == t_rewards,
            "reward_mean": f_stats.reward_mean, "trl_logged_reward": t_log["reward"],
            "grad_norm_furlong": f_stats.grad_norm, "grad_norm_trl": t_log.get("grad_norm"),
            "furlong_tis_weight_mean": f_stats.tis_weight_mean, "furlong_logprob_diff_max": f_stats.logprob_diff_max,
            "furlong_groups_filtered": f_stats.groups_filtered,
            "clipped_grad_gap": relative_gap(f_grads, t_grads), "weight_update_gap": relative_gap(f_delta, t_delta)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args, bench_argv = ap.parse_known_args(argv)
    prov = provenance()
    torch.set_num_threads(1)
    a = parse_args(bench_argv)
    model_dir = init_tiny()
    tokenizer = load_tokenizer(model_dir)
    rows = [check(model_dir, tokenizer, seed, a) for seed in args.seeds]
    for r in rows:
        print(json.dumps(r))
    result = {"provenance": finish(prov), "bench_config": {k: str(v) for k, v in vars(a).items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
