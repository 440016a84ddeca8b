"""furlong vs TRL's GRPOTrainer: the same tiny model, task, group size and batch, both in this one run.

    python bench/vs_trl.py [--steps 15] [--group-size 8] [--prompts-per-step 4] [--rounds 3]
                           [--out bench/results/vs_trl.json]

Needs `trl` (see bench/README.md for the pip command). Each framework trains a fresh copy of the same
checkpoint for `--steps` GRPO steps on the same prompts in the same order: generate `group-size` completions
per prompt, score them with the same reward function, one optimizer step per batch (one pass, no KL), then
(furlong) push the weights to its engine. The two run step-interleaved in one process (TRL step i, then
furlong step i, each timed on its own), so background load hits both alike; `--rounds` repeats that with
seeds seed, seed+1, ... Reported per framework: wall time per step (the first `--warmup` steps of each round
are reported but left out of the mean), the training reward over the first and last steps, and the reward of
the final weights on held-out prompts, sampled by one shared sampler (furlong's engine) with the same seeds.

The task: reply with tokens from a hidden "allowed" set (1/16 of the vocabulary, drawn with the seed); reward
= fraction of the completion's tokens (end-of-turn excluded) that are allowed. ~0.06 by chance.

Everything runs on the CPU, fp32, torch.set_num_threads(--threads, default 1) for both. This machine is
noisy: only same-run ratios mean much.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from provenance import finish, provenance  # noqa: E402
from vs_trl_report import TARGET_SPEEDUP, print_report, ratios, summarize, summarize_round  # noqa: E402

from furlong.agent.episode import Episode, EpisodeTiming
from furlong.config import RLConfig
from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import init_tiny, load_model, load_tokenizer
from furlong.train import GRPOConfig as FurlongConfig
from furlong.train import LocalTrainer

WORDS = ("apple", "river", "stone", "light", "cloud", "seven", "blue", "quiet", "paper", "garden", "number",
         "window", "orange", "silver", "table", "winter", "forest", "candle", "bridge", "yellow", "planet", "music",
         "circle", "button", "little", "mountain", "ocean", "pencil", "rabbit", "summer", "engine", "kernel")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=15, help="GRPO steps per framework (K)")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts (groups) per step")
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the time-per-step mean")
    p.add_argument("--tail", type=int, default=5, help="last steps whose training reward is averaged")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for the final-weights reward")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, the same for both")
    p.add_argument("--seed", type=int, default=0, help="round r uses seed + r (task, sampling, init order)")
    p.add_argument("--rounds", type=int, default=3,
                   help="runs per framework (seed + r); times pooled, rewards averaged over rounds")
    p.add_argument("--only", choices=("furlong", "trl"), help="run one side only (no ratios)")
    p.add_argument("--sequential", action="store_true",
                   help="run each framework's K steps in one block, alternating which goes first (default: "
                        "interleave them step by step)")
    p.add_argument("--trl-continuous-batching", action="store_true",
                   help="TRL generates with transformers' continuous batching instead of model.generate")
    p.add_argument("--model-dir", type=Path, help="checkpoint to use (default: furlong's tiny model)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "vs_trl.json")
    args = p.parse_args(argv)
    if args.group_size < 2 or args.prompts_per_step < 1 or args.steps <= args.warmup or args.rounds < 1:
        p.error("need --group-size >= 2, --prompts-per-step >= 1, --steps > --warmup and --rounds >= 1")
    return args


# --- the task: the same prompts and the same reward for both frameworks --------------------------------------


@dataclass(frozen=True)
class Task:
    messages: list[list[dict[str, str]]]  # training prompts, step s uses [s * P, (s + 1) * P)
    prompt_ids: list[list[int]]  # the same, chat-templated (what TRL's tokenisation produces; checked)
    eval_ids: list[list[int]]  # held-out prompts
    allowed: frozenset[int]
    special: frozenset[int]  # end-of-turn / pad ids: not part of the answer

    def reward(self, ids: list[int] | tuple[int, ...]) -> float:
        answer = [t for t in ids if t not in self.special]
        return sum(t in self.allowed for t in answer) / len(answer) if answer else 0.0


def make_task(tokenizer: Any, n_train: int, n_eval: int, seed: int) -> Task:
    rng = random.Random(seed)
    special = frozenset(int(t) for t in tokenizer.all_special_ids)
    candidates = [t for t in range(len(tokenizer)) if t not in special]
    allowed = frozenset(rng.sample(candidates, len(candidates) // 16))

    def prompt(i: int) -> list[dict[str, str]]:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14)))
        return [{"role": "user", "content": f"Request {i}: reply using only allowed tokens. Context: {words}"}]

    def ids(messages: list[dict[str, str]]) -> list[int]:  # exactly TRL's call for conversational prompts
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(out["input_ids"])

    messages = [prompt(i) for i in range(n_train)]
    held_out = [prompt(n_train + i) for i in range(n_eval)]
    return Task(messages, [ids(m) for m in messages], [ids(m) for m in held_out], allowed, special)


# --- furlong ------------------------------------------------------------------------------------------------


class FurlongRun:
    """furlong's sync GRPO loop for this task, one `step()` at a time (so it can be interleaved with TRL's)."""

    def __init__(self, model_dir: Path, task: Task, a: argparse.Namespace) -> None:
        t = time.perf_counter()
        self.task, self.a = task, a
        torch.manual_seed(a.seed)
        self.policy, engine_model = load_model(model_dir), load_model(model_dir)
        self.batch = a.prompts_per_step * a.group_size
        # plain GRPO, as TRL's defaults run it: no KL reference, no anchor, constant lr, std-normalized advantages;
        # adv_eps: TRL divides by (group std + 1e-4), furlong's default eps is 1e-6; held equal here
        rl = RLConfig(lr=a.lr, temperature=1.0, micro_batch_size=self.batch, kl_coef=0.0, sft_coef=0.0,
                      warmup_steps=0, lr_decay="constant", normalize_std=True, negative_weight=1.0, adv_eps=1e-4)
        self.trainer = LocalTrainer(self.policy, FurlongConfig.of(rl, seed=a.seed))
        self.sampling = SamplingParams(temperature=1.0, max_new_tokens=a.max_completion_length)
        # eos_token_ids=None: the model's generation_config eos ids (<|im_end|>, <|endoftext|>), as TRL uses.
        self.engine = HFEngine(engine_model)
        self.loop = asyncio.new_event_loop()  # lives across steps, as the engine's background task does
        self.steps: list[dict[str, Any]] = []
        self.setup_s = time.perf_counter() - t

    def step(self) -> dict[str, Any]:
        record = self.loop.run_until_complete(self._step(len(self.steps)))
        self.steps.append(record)
        return record

    async def _step(self, step: int) -> dict[str, Any]:
        a, task, engine, trainer = self.a, self.task, self.engine, self.trainer
        t0 = time.perf_counter()
        prompts = task.prompt_ids[step * a.prompts_per_step:(step + 1) * a.prompts_per_step]
        seed = a.seed * 1_000_003 + step * self.batch
        calls = [engine.generate(p, replace(self.sampling, seed=seed + g * a.group_size + i))
                 for g, p in enumerate(prompts) for i in range(a.group_size)]
        gens = await asyncio.gather(*calls)
        t1 = time.perf_counter()
        eps, rewards = [], []
        for k, gen in enumerate(gens):
            g, i = divmod(k, a.group_size)
            prompt, n = prompts[g], len(gen.output_ids)
            rewards.append(task.reward(gen.output_ids))
            eps.append(Episode(
                task_id="allowed-tokens", group_id=step * a.prompts_per_step + g, sample_id=i,
                prompt_len=len(prompt), tokens=tuple(prompt) + gen.output_ids,
                loss_mask=(0,) * len(prompt) + (1,) * n, rollout_logprobs=(0.0,) * len(prompt) + gen.logprobs,
                token_weight_versions=(-1,) * len(prompt) + gen.token_weight_versions,
                reward=rewards[-1], status="ok", timing=EpisodeTiming(), turns=1))
        t2 = time.perf_counter()
        stats = trainer.train_step(eps)
        t3 = time.perf_counter()
        await engine.update_weights(trainer.engine_weights(), trainer.version)
        t4 = time.perf_counter()
        return {"step": step + 1, "seconds": t4 - t0, "generate_s": t1 - t0, "other_s": t4 - t1,
                "score_s": t2 - t1, "train_s": t3 - t2, "sync_s": t4 - t3, "reward": statistics.fmean(rewards),
                "completion_len": statistics.fmean(len(g.output_ids) for g in gens),
                "updated": stats.updated, "logprob_diff_max": stats.logprob_diff_max}

    def close(self) -> dict[str, Any]:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()
        return {"setup_s": self.setup_s, "steps": self.steps, "model": self.policy,
                "threads_seen": torch.get_num_threads()}


def run_furlong(model_dir: Path, task: Task, a: argparse.Namespace) -> dict[str, Any]:
    run = FurlongRun(model_dir, task, a)
    for _ in range(a.steps):
        run.step()
    return run.close()


# --- TRL ----------------------------------------------------------------------------------------------------


def trl_config(a: argparse.Namespace, out_dir: str, **overrides: Any) -> Any:
    """TRL's GRPOConfig for the bench's job: every setting furlong's side is held equal to is spelled out."""
    from trl import GRPOConfig

    settings: dict[str, Any] = dict(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=a.seed,
        max_steps=a.steps, per_device_train_batch_size=a.prompts_per_step * a.group_size,
        gradient_accumulation_steps=1, num_generations=a.group_size, max_completion_length=a.max_completion_length,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, dataloader_num_workers=0, log_completions=False,
        use_transformers_continuous_batching=a.trl_continuous_batching,
    )
    return GRPOConfig(**settings | overrides)


def run_trl(model_dir: Path, task: Task, a: argparse.Namespace,
            other_step: Callable[[], object] | None = None, other_first: bool = False) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same task. `other_step` (interleaving: one furlong step) runs at each
    on_step_end, or with `other_first` at each on_step_begin; its time is subtracted from TRL's step times."""
    import transformers
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    transformers.logging.set_verbosity_error()
    t_setup = time.perf_counter()
    torch.manual_seed(a.seed)
    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    n_train = a.steps * a.prompts_per_step
    dataset = Dataset.from_list([{"prompt": m} for m in task.messages[:n_train]])
    scored: list[tuple[list[float], list[int]]] = []

    def allowed_token_fraction(prompts: list, completions: list, completion_ids: list[list[int]],
                               **_: Any) -> list[float | None]:
        rewards: list[float | None] = [task.reward(ids) for ids in completion_ids]
        scored.append(([float(r or 0.0) for r in rewards], [len(ids) for ids in completion_ids]))
        return rewards

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[tuple[str, float]] = []
            self.threads: set[int] = set()

        def on_train_begin(self, args, state, control, **kw):
            self.marks.append(("train_begin", time.perf_counter()))

        def other(self) -> None:
            if other_step is not None:
                t = time.perf_counter()
                other_step()
                self.marks.append(("excluded", time.perf_counter() - t))

        def on_step_begin(self, args, state, control, **kw):
            if other_first:
                self.other()
            self.marks.append(("begin", time.perf_counter()))

        def on_step_end(self, args, state, control, **kw):
            self.marks.append(("end", time.perf_counter()))
            self.threads.add(torch.get_num_threads())
            if not other_first:
                self.other()

    out_dir = tempfile.mkdtemp(prefix="furlong-vs-trl-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = trl_config(a, out_dir)
        timer = StepTimer()
        trainer = GRPOTrainer(model=model, reward_funcs=allowed_token_fraction, args=config,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts on stdout; log_history still fills
    # Observe (not change) two internals: the prompt ids TRL feeds the model, to check they are exactly
    # furlong's, and the time spent generating, for the per-phase split.
    seen_prompts: list[list[int]] = []
    generate_s: list[float] = []
    if hasattr(trainer, "_tokenize_prompts"):
        tokenize = trainer._tokenize_prompts

        def recording(prompts: list) -> Any:
            out = tokenize(prompts)
            seen_prompts.extend(list(map(int, ids)) for ids in out[0])
            return out

        trainer._tokenize_prompts = recording  # type: ignore[method-assign]
    if hasattr(trainer, "_generate_single_turn"):
        generate = trainer._generate_single_turn

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = generate(*args, **kwargs)
            generate_s.append(time.perf_counter() - t)
            return out

        trainer._generate_single_turn = timed  # type: ignore[method-assign]
    setup = time.perf_counter() - t_setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    shutil.rmtree(out_dir, ignore_errors=True)

    logs = [h for h in trainer.state.log_history if "reward" in h]
    # A step's wall time: from the previous step's end (or the start of training) to its own end, so it
    # includes TRL's logging and data loading between steps, less any interleaved furlong step.
    steps: list[dict[str, Any]] = []
    begin: float | None = None
    last_end: float | None = None
    excluded = 0.0
    for kind, t in timer.marks:
        if kind == "train_begin":
            last_end = t
        elif kind == "begin":
            begin = t
        elif kind == "excluded":
            excluded += t
        elif kind == "end" and begin is not None and last_end is not None:
            steps.append({"step": len(steps) + 1, "seconds": t - last_end - excluded, "step_core_s": t - begin})
            last_end, excluded = t, 0.0
    for s, (rewards, lengths) in zip(steps, scored, strict=False):
        s["reward"] = statistics.fmean(rewards)
        s["completion_len"] = statistics.fmean(lengths)
    if len(generate_s) == len(steps):
        for s, g in zip(steps, generate_s, strict=True):
            s["generate_s"] = g
            s["other_s"] = s["seconds"] - g  # scoring, logprobs, backward, optimizer, logging
    for s, log in zip(steps, logs, strict=False):
        s["trl_logged_reward"] = log["reward"]
        s["trl_step_time"] = log.get("step_time")
    expected = [ids for ids in task.prompt_ids[:n_train] for _ in range(a.group_size)]
    prompts_match = None if not seen_prompts else seen_prompts == expected
    return {"setup_s": setup, "steps": steps, "model": trainer.model, "prompts_match": prompts_match,
            "threads_seen": sorted(timer.threads)}


# --- held-out reward of the final weights, one sampler for both ----------------------------------------------


def eval_reward(model: Any, task: Task, a: argparse.Namespace) -> float:
    model = model.float().eval()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=a.max_completion_length)

    async def main() -> list[float]:
        async with HFEngine(model) as engine:
            calls = [engine.generate(p, replace(sampling, seed=10_000_019 + 1000 * g + i))
                     for g, p in enumerate(task.eval_ids) for i in range(a.eval_samples)]
            return [task.reward(gen.output_ids) for gen in await asyncio.gather(*calls)]

    return statistics.fmean(asyncio.run(main()))


# --- report ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    prov = provenance()
    torch.set_num_threads(a.threads)
    console = Console(width=None if sys.stdout.isatty() else 120)
    import transformers
    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        if a.only != "furlong":
            console.print("[red]trl is not installed[/red]: see bench/README.md (or pass --only furlong)")
            return 2
        trl_version = None
    model_dir = a.model_dir or init_tiny()
    tokenizer = load_tokenizer(model_dir)
    loadavg_start = os.getloadavg()
    t_all = time.perf_counter()

    sides = [k for k in ("furlong", "trl") if not a.only or a.only == k]
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        seed = a.seed + r
        args = argparse.Namespace(**{**vars(a), "seed": seed})
        task = make_task(tokenizer, a.steps * a.prompts_per_step, a.eval_prompts, seed)
        record: dict[str, Any] = {"round": r, "seed": seed}
        if len(sides) == 2 and not a.sequential:
            # Step-interleaved: furlong step i runs right after TRL step i (inside TRL's on_step_end, timed
            # apart; in odd rounds right before it, in on_step_begin), so both see the same load, step by step.
            furlong_first = r % 2 == 1
            console.print(f"round {r + 1}/{a.rounds}: TRL and furlong, {a.steps} steps each, interleaved "
                          f"({'furlong' if furlong_first else 'TRL'} first) ...")
            record["order"] = "interleaved, " + ("furlong first" if furlong_first else "TRL first")
            t = time.perf_counter()
            frun = FurlongRun(model_dir, task, args)
            trl_run = run_trl(model_dir, task, args, other_step=frun.step, other_first=furlong_first)
            runs = {"trl": trl_run, "furlong": frun.close()}
            for run in runs.values():
                run["wall_s"] = time.perf_counter() - t
        else:
            order = sides if r % 2 == 0 else sides[::-1]  # alternate who goes first: load drift hits both
            record["order"] = order
            runs = {}
            for side in order:
                console.print(f"round {r + 1}/{a.rounds}: {side} ({a.steps} steps) ...")
                t = time.perf_counter()
                runs[side] = (run_furlong if side == "furlong" else run_trl)(model_dir, task, args)
                runs[side]["wall_s"] = time.perf_counter() - t
        for side, run in runs.items():
            eval_r = eval_reward(run.pop("model"), task, args)
            record[side] = {"summary": summarize_round(run, a, eval_r), "steps": run["steps"],
                            "threads_seen": run["threads_seen"], "loadavg_after": os.getloadavg()}
            if side == "trl":
                record[side]["prompts_match"] = run["prompts_match"]
        rounds.append(record)

    summary = {k: summarize(rounds, k, a) for k in sides}
    params = sum(p.numel() for p in load_model(model_dir).parameters())
    result: dict[str, Any] = {
        "provenance": finish(prov),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "trl": trl_version,
                        "cpu_count": os.cpu_count(), "threads": a.threads, "model_dir": str(model_dir),
                        "model_params": params, "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
                        "threads_seen": {k: sorted({t for r in rounds for t in _as_list(r[k]["threads_seen"])})
                                         for k in sides},
                        "total_wall_s": time.perf_counter() - t_all},
        "summary": summary,
        "target_speedup": TARGET_SPEEDUP,
        "rounds": rounds,
    }
    if "trl" in sides:
        matches = [r["trl"]["prompts_match"] for r in rounds]
        result["trl_prompts_match"] = None if None in matches else all(matches)
    if len(sides) == 2:
        result["ratios"] = ratios(summary["furlong"], summary["trl"], rounds)
    print_report(console, result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {a.out} (whole benchmark {result['environment']['total_wall_s']:.0f}s)")
    return 0


def _as_list(x: Any) -> list[int]:
    return list(x) if isinstance(x, list | tuple | set) else [x]


if __name__ == "__main__":
    sys.exit(main())
