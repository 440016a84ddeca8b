"""`furlong train`: the model (the tiny one by default) -> SFT on oracle demonstrations -> held-out eval ->
GRPO with episodes in sandboxes -> held-out eval. Every role is built by furlong.build; this module is the
algorithm. Each phase records its result in the run directory when it finishes, so `--resume` skips what is
done and continues RL after the last checkpoint with exactly the samples the killed run would have drawn.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console

from furlong.build import links
from furlong.build import training as build
from furlong.build.training import Pieces
from furlong.config import Config, RLConfig
from furlong.engine.prefix import prefix_metrics
from furlong.metrics.diagnostics import BusyMeter, StepWindow
from furlong.metrics.episodes import EpisodeLog, drop_episodes_after
from furlong.metrics.run import RunDir, atomic_write, metrics_row
from furlong.metrics.ui import progress_bar
from furlong.rollout.groups import Rollouts
from furlong.rollout.records import batch_metrics, rollout_metrics, settled_records
from furlong.rollout.scheduler import Batch, Scheduler
from furlong.run.phases import anchor_demos, eval_phase, sft_phase
from furlong.run.summary import rl_totals, run_summary
from furlong.train.distill_engine import EngineTeacher
from furlong.train.export import HF_DIR
from furlong.train.protocol import Trainer
from furlong.train.stats import TrainStats
from furlong.train.weights import WeightLink

CURSOR_FILE = "rollout_cursor.json"  # beside each RL checkpoint: where the group stream resumes
HOSTS_FILE = "sandbox_hosts.json"  # train.ray.sandbox_hosts: each host's /v1/metrics at the end of the run


async def train(cfg: Config, run: RunDir, console: Console) -> dict:
    began = time.perf_counter()
    torch.set_num_threads(cfg.train.torch_threads)
    p = await asyncio.to_thread(build.pieces, cfg)
    shared = None
    try:
        sft_dir = await sft_phase(cfg, p, run, console)
        shared = links.shared_engine(cfg, sft_dir, run.path)  # vllm: one engine for the whole run, else None
        before = await eval_phase("eval_before", sft_dir, cfg, p, run, console, shared)
        trainer = await rl_phase(cfg, p, run, console, sft_dir, shared)
        try:
            final = final_model(trainer, p, run)
            if shared is not None:  # RL pushed its last weights there, but a resumed run may have skipped RL
                await shared.update_weights(trainer.engine_weights(), trainer.version)
        finally:
            trainer.close()
        after = await eval_phase("eval_after", final, cfg, p, run, console, shared)
    finally:
        if shared is not None:
            await shared.close()
        if p.hosts is not None:  # train.ray.sandbox_hosts: what each served, before they go
            atomic_write(run.path / HOSTS_FILE, json.dumps(p.hosts.metrics(), indent=1))
        p.close()  # train.cluster=ray: the run's actors and a cluster it started
    summary = run_summary(cfg, run, before, after, time.perf_counter() - began, final)
    atomic_write(run.path / "summary.json", json.dumps(summary, indent=1))
    return summary


async def rl_phase(cfg: Config, p: Pieces, run: RunDir, console: Console, sft_dir: Path, shared=None) -> Trainer:
    # a finished RL phase trains no more, so it needs no anchor: a run from before demos.jsonl still resumes
    done = bool(run.phase("rl"))
    hints = build.teacher_hints(cfg.train, p.train_tasks)  # the teacher's, held by the trainer or an engine
    trainer = build.trainer(
        cfg.train, sft_dir, [] if done else anchor_demos(cfg, run), anchor=not done, cluster=p.cluster, hints=hints
    )
    try:
        return await _rl_run(cfg, p, run, console, sft_dir, shared, trainer, done, hints)
    except BaseException:
        trainer.close()
        raise


async def _rl_run(
    cfg: Config,
    p: Pieces,
    run: RunDir,
    console: Console,
    sft_dir: Path,
    shared,
    trainer: Trainer,
    done: bool,
    hints: dict[str, str],
) -> Trainer:
    start = resume(trainer, run)
    if done:
        return trainer
    drop_episodes_after(run.path, "rl", start - 1)  # the records of steps redone after a kill
    link = await links.weight_link(cfg, run.path, sft_dir, shared, p.cluster)
    served = None
    try:
        served = await build.engine_teacher(cfg.train, sft_dir, hints, p.cluster)  # ray: in the teacher's bundle
        if served is not None:
            console.print(f"distill: the teacher's {cfg.train.distill.teacher.engine} engine is {served.where}")
        async with p.env.open() as env:
            rollouts = Rollouts(
                BusyMeter(link.engine),
                p.tokenizer,
                env,
                p.params,
                cfg.train.rl.concurrency,
                harness=cfg.train.agent.harness.command,
            )
            try:
                await link.push(trainer.engine_weights(), trainer.version)
                await rl_steps(cfg, trainer, rollouts, link, p, run, console, start, served)
            finally:
                await rollouts.close()
    finally:
        if served is not None:
            await served.engine.close()  # type: ignore[attr-defined]  # hf and vllm engines close
        await link.close()
    run.finish_phase("rl", rl_totals(run))
    return trainer


async def rl_steps(
    cfg: Config,
    trainer: Trainer,
    rollouts: Rollouts,
    link: WeightLink,
    p: Pieces,
    run: RunDir,
    console: Console,
    start: int,
    served: EngineTeacher | None = None,
) -> None:
    """Batch -> train -> publish -> log, until rl.steps or rl.time_budget_s (RL step time, resumed runs included)."""
    r, records, rows = cfg.train.rl, EpisodeLog(run.path, "rl"), run.metrics("rl")
    cursor = _cursor(run)
    scheduler = build.scheduler(
        cfg.train,
        rollouts,
        p.train_tasks,
        start,
        cursor,
        counted=rows[-1].get("episodes_in_flight", 0) if cursor and rows else 0,
    )
    spent = sum(row["step_seconds"] for row in rows)
    try:
        with progress_bar(console, f"rl: GRPO steps ({r.mode})", r.steps, completed=start) as advance:
            for step in range(start, r.steps):
                if r.time_budget_s is not None and spent >= r.time_budget_s:
                    break  # a resumed run whose budget was already spent
                step_start, window = time.perf_counter(), StepWindow(rollouts.engine)
                batch = await scheduler.next_batch(trainer.version)
                if step + 1 < r.steps:
                    scheduler.prestart()  # the next groups' sandboxes start while this step trains
                batch, taught = await taught_batch(cfg, trainer, batch, served)
                stats = await asyncio.to_thread(trainer.train_step, batch.episodes)
                synced = await link.push(trainer.engine_weights(), trainer.version)
                scheduler.step_done()
                spent += (seconds := time.perf_counter() - step_start)
                run.log("rl", step, _step_row(r, batch, stats, window, synced, link, taught, seconds))
                records.write(settled_records(batch, step, r.filter_zero_variance))
                last = step == r.steps - 1 or (r.time_budget_s is not None and spent >= r.time_budget_s)
                if (step + 1) % r.checkpoint_every == 0 or last:
                    checkpoint(trainer, scheduler, p, run, step)
                advance(f"reward {stats.reward_mean:.2f}")
                if last:
                    break
    finally:
        await scheduler.close()


def _step_row(
    r: RLConfig,
    batch: Batch,
    stats: TrainStats,
    window: StepWindow,
    synced: dict,
    link: WeightLink,
    taught: dict,
    seconds: float,
) -> dict:
    """One RL step's metrics row: the trainer's stats, the rollouts', the engine's over the step, the batch's,
    the weight sync's, the prefix cache's, the teacher's (train.distill) and the step's time."""
    return metrics_row(
        asdict(stats),
        rollout_metrics(batch.episodes),
        window.diagnostics(batch.episodes, batch.version, stats.seconds + taught.get("teacher_seconds", 0.0)),
        batch_metrics(batch, r.filter_zero_variance),
        synced,
        prefix_metrics(link.engine),
        taught,
        {"step_seconds": seconds},
    )


async def taught_batch(
    cfg: Config, trainer: Trainer, batch: Batch, served: EngineTeacher | None = None
) -> tuple[Batch, dict]:
    """train.distill: the batch with the teacher's logprobs, scored by the trainer with the weights about to
    train on it (or by `served`, the teacher's own engine), and the step row's teacher keys (docs/distill.md);
    else the batch as it is."""
    if not cfg.train.distill.on:
        return batch, {}
    if served is not None:
        scored = await served.score(batch.episodes)
    else:
        scored = await asyncio.to_thread(trainer.score_teacher, batch.episodes)
    return batch.with_episodes(scored.episodes), scored.metrics()


def checkpoint(trainer: Trainer, scheduler: Scheduler, p: Pieces, run: RunDir, step: int) -> None:
    """checkpoints/rl-N: trainer state, the policy as a Hugging Face directory (hf/), the rollout cursor;
    recorded as the last checkpoint only once all three are written."""
    path = run.checkpoint_dir(f"rl-{step}")
    trainer.save(path)
    trainer.export_hf(path / HF_DIR, p.tokenizer, base_model=run.checkpoint_dir("sft"))
    atomic_write(path / CURSOR_FILE, json.dumps(scheduler.cursor()))
    run.record_checkpoint(f"rl-{step}", step)


def resume(trainer: Trainer, run: RunDir) -> int:
    """Loads the last complete checkpoint, if any, and returns the step RL continues from (its later
    metrics rows are redone)."""
    last = run.state()["last_checkpoint"]
    if not last:
        return 0
    trainer.load(run.checkpoint_dir(last["name"]))
    run.drop_metrics_after("rl", last["step"])
    return last["step"] + 1


def _cursor(run: RunDir) -> dict | None:
    last = run.state()["last_checkpoint"]
    path = run.checkpoint_dir(last["name"]) / CURSOR_FILE if last else None
    return json.loads(path.read_text()) if path and path.exists() else None


def final_model(trainer: Trainer, p: Pieces, run: RunDir) -> Path:
    """The end of the run as a Hugging Face directory: the last RL checkpoint's hf/ (the last step always
    checkpoints), exported now if that checkpoint predates exports (or RL had no steps)."""
    last = run.state()["last_checkpoint"]
    hf = (run.checkpoint_dir(last["name"]) if last else run.checkpoint_dir("final")) / HF_DIR
    return hf if (hf / "config.json").is_file() else trainer.export_hf(hf, p.tokenizer, run.checkpoint_dir("sft"))
