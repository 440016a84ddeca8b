"""The phases around RL: SFT on oracle demonstrations, and the held-out evals before and after RL. Each
records its result in the run directory when it finishes, so `--resume` skips what is done."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch
from rich.console import Console

from furlong.build.links import phase_engine
from furlong.build.training import Pieces
from furlong.config import Config, ConfigError
from furlong.metrics.episodes import EpisodeLog, drop_episodes_after
from furlong.metrics.outcomes import Scored, outcome_summary
from furlong.metrics.run import RunDir
from furlong.metrics.ui import progress_bar
from furlong.model.loading import load_model
from furlong.rollout.groups import Rollouts
from furlong.train.export import write_hf
from furlong.train.sft import demonstrable, load_demos, oracle_demos, save_demos, sft_train

DEMOS_FILE = "demos.jsonl"  # in the run dir: SFT's demonstrations, which RL's anchor (rl.sft_coef) reuses


async def sft_phase(cfg: Config, p: Pieces, run: RunDir, console: Console) -> Path:
    if done := run.phase("sft"):
        return Path(done["model"])
    s, start = cfg.train.sft, time.perf_counter()
    run.drop_metrics_after("sft", -1)  # a killed SFT restarts from scratch: its partial rows go too
    by_family: dict[str, list] = {}
    for task in p.train_tasks:  # reward-only families' demonstrations are never shown
        if task.family in cfg.train.demonstrated() and demonstrable(task):
            by_family.setdefault(task.family, []).append(task)
    # epochs 0 (a model already fine-tuned): demonstrations are needed only for RL's anchor
    wanted = s.epochs > 0 or cfg.train.rl.sft_coef > 0
    tasks = [t for fam in by_family.values() for t in fam[: s.instances_per_family]] if wanted else []
    async with p.env.open() as env:  # the environment RL's episodes get, through the same runner
        with progress_bar(console, "sft: oracle demos", len(tasks)) as advance:
            demos = await oracle_demos(tasks, p.tokenizer, env, p.params, s.concurrency, advance)
    save_demos(run.path / DEMOS_FILE, demos)
    demo_seconds = time.perf_counter() - start
    model = load_model(p.base_model).to(sft_device(cfg))  # type: ignore[arg-type]  # transformers' wrapped .to() misleads mypy
    steps = s.epochs * -(-len(demos) // s.batch_size)
    with progress_bar(console, "sft: training", steps) as advance:

        def on_step(step: int, loss: float) -> None:
            run.log("sft", step, {"loss": loss})
            advance()

        losses = await asyncio.to_thread(
            sft_train, model, demos, s.epochs, s.lr, s.batch_size, cfg.train.seed, p.tokenizer.pad_token_id, on_step
        )
    out = write_hf(model.cpu(), p.tokenizer, run.checkpoint_dir("sft"))
    result = {
        "model": str(out),
        "demos": len(demos),
        "demo_failures": len(tasks) - len(demos),
        "steps": len(losses),
        "final_loss": losses[-1] if losses else None,
        "epochs": s.epochs,
        "demo_seconds": demo_seconds,
        "seconds": time.perf_counter() - start,
    }
    run.finish_phase("sft", result)
    return out


def sft_device(cfg: Config) -> str:
    """train.device, where this process has it: in local mode always (the config refuses cuda without a
    GPU); on Ray the GPU is the trainer actor's, so SFT (run here, before RL) uses one only if the
    driver's node has one too, else the CPU."""
    if cfg.train.device == "cuda" and cfg.train.cluster == "ray" and not torch.cuda.is_available():
        return "cpu"
    return cfg.train.device


async def eval_phase(
    name: str, model_dir: Path, cfg: Config, p: Pieces, run: RunDir, console: Console, shared=None
) -> dict:
    """Held-out pass@1 of the policy saved in `model_dir`, on a fresh hf engine over it, or on the run's
    `shared` engine (vllm), which holds the same weights."""
    if done := run.phase(name):
        return done
    start = time.perf_counter()
    drop_episodes_after(run.path, name, -1)  # a killed eval restarts from scratch: its records go too
    hf = cfg.train.hf
    engine = phase_engine(model_dir, shared, hf.prefix_cache_mb, hf.device, hf.deterministic)
    async with p.env.open() as env:
        rollouts = Rollouts(
            engine,
            p.tokenizer,
            env,
            p.params,
            cfg.train.eval.concurrency,
            EpisodeLog(run.path, name),
            harness=cfg.train.agent.harness.command,
        )
        try:
            with progress_bar(console, f"{name}: held-out episodes", len(p.eval_tasks)) as advance:
                e = cfg.train.eval
                episodes = await rollouts.evaluate(p.eval_tasks, e.temperature, e.seed, advance)
        finally:
            await rollouts.close()
    await engine.close()
    s = outcome_summary([Scored(e.family, e.reward, e.status) for e in episodes])
    result = {
        "pass_at_1": s["pass_at_1"],
        "episodes": s["episodes"],
        "scored": s["scored"],
        "infra_errors": s["infra_errors"],
        "status": s["status"],
        "per_family": s["per_family"],
        "seconds": time.perf_counter() - start,
    }
    run.finish_phase(name, result)
    return result


def anchor_demos(cfg: Config, run: RunDir) -> list:
    """SFT's demonstrations, for rl.sft_coef; none when the anchor is off."""
    if cfg.train.rl.sft_coef == 0:
        return []
    path = run.path / DEMOS_FILE
    if not path.is_file():
        raise ConfigError(
            f"train.rl.sft_coef: {cfg.train.rl.sft_coef} needs SFT's demonstrations, but {path} "
            "is missing (a run whose SFT phase predates it): set train.rl.sft_coef=0 or start a new run"
        )
    demos = load_demos(path)
    if not demos:
        raise ConfigError(
            f"train.rl.sft_coef: {cfg.train.rl.sft_coef} needs demonstrations, but SFT collected "
            f"none ({path}): check train.sft.families and train.sft.instances_per_family"
        )
    return demos
