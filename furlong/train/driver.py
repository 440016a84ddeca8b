"""`furlong train`: tiny model -> SFT on oracle demos -> held-out eval -> GRPO in sandboxes -> eval.

Each phase records its result in the run directory when it finishes, so `--resume` skips what is
done and continues RL from the last checkpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console

from furlong.agent.episode import AgentParams, Episode
from furlong.config import Config, ConfigError
from furlong.engine.prefix import prefix_metrics
from furlong.agent.runner import STATUSES
from furlong.metrics.diagnostics import BusyMeter, StepWindow
from furlong.metrics.episodes import EpisodeLog, drop_episodes_after, episode_record
from furlong.metrics.gains import heldout_gains
from furlong.metrics.outcomes import Scored, outcome_summary, status_counts
from furlong.metrics.run import RunDir, atomic_write
from furlong.metrics.ui import progress_bar
from furlong.model.loading import load_model, load_tokenizer
from furlong.model.tiny import init_tiny
from furlong.rollout.groups import Rollouts, step_of
from furlong.rollout.scheduler import (ATTEMPT_STRIDE, OUTCOMES, Batch, GroupStream, Scheduler, outcome_counts,
                                       settled_episodes, staleness_stats)
from furlong.sandbox.bwrap import BwrapBackend
from furlong.sandbox.images import ImageStore
from furlong.sandbox.pool import StoreImages, WarmPools
from furlong.tasks.family import load_family
from furlong.train.export import HF_DIR, write_hf
from furlong.train.sft import load_demos, oracle_demos, save_demos, sft_train
from furlong.train.trainer import GRPOConfig, Trainer
from furlong.train.weights import open_link, rollout_engine, shared_vllm

CURSOR_FILE = "rollout_cursor.json"  # beside each RL checkpoint: where the group stream resumes
DEMOS_FILE = "demos.jsonl"  # in the run dir: SFT's demonstrations, which RL's anchor (rl.sft_coef) reuses


@dataclass(frozen=True)
class Pieces:
    tokenizer: object
    backend: BwrapBackend
    store: ImageStore
    images: StoreImages  # shared, so a Dockerfile that fails to build is tried once per run
    train_tasks: list
    eval_tasks: list
    params: AgentParams
    base_model: Path


def build(cfg: Config) -> Pieces:
    t = cfg.train
    families = [load_family(t.tasks / name) for name in t.families]
    for f in families:
        if len(f.seeds["heldout"]) < t.eval.heldout_per_family:
            raise ConfigError(f"train.eval.heldout_per_family: {t.eval.heldout_per_family} requested, but family "
                              f"{f.name!r} has {len(f.seeds['heldout'])} held-out instances")
    base = t.model.path or init_tiny(seed=t.model.seed)
    backend = BwrapBackend(host_uid=cfg.sandbox.host_uid, output_cap=cfg.sandbox.output_cap_bytes)
    store = ImageStore(host_uid=backend.host_uid, mirror=cfg.sandbox.debian_mirror)
    return Pieces(
        tokenizer=load_tokenizer(base), backend=backend, store=store, images=StoreImages(store, backend),
        train_tasks=[task for f in families for task in f.instances("train")],
        eval_tasks=[task for f in families for task in f.instances("heldout", t.eval.heldout_per_family)],
        params=AgentParams.of(t.agent),
        base_model=Path(base))


def _pools(p: Pieces) -> WarmPools:
    """Sandboxes for one phase, each started ahead of the episode that uses it (Rollouts reserves a
    window as wide as the rollout concurrency), so an episode does not wait on a sandbox start; time
    spent waiting on one still counts as sandbox_start. Closed when the phase ends."""
    return WarmPools(p.backend, p.images)


def _lora_spec(cfg: Config) -> dict | None:
    lo = cfg.train.lora
    return {"rank": lo.rank, "alpha": lo.alpha, "targets": list(lo.targets)} if lo.enabled else None


async def sft_phase(cfg: Config, p: Pieces, run: RunDir, console: Console) -> Path:
    if done := run.phase("sft"):
        return Path(done["model"])
    s, start = cfg.train.sft, time.perf_counter()
    run.drop_metrics_after("sft", -1)  # a killed SFT restarts from scratch: its partial rows go too
    by_family: dict[str, list] = {}
    for task in p.train_tasks:  # reward-only families' demonstrations are never shown
        if task.family in cfg.train.demonstrated():
            by_family.setdefault(task.family, []).append(task)
    # epochs 0 (a model already fine-tuned, as bench/rl_vs_sft.py's arm C): demonstrations are needed only
    # for RL's anchor
    wanted = s.epochs > 0 or cfg.train.rl.sft_coef > 0
    tasks = [t for fam in by_family.values() for t in fam[: s.instances_per_family]] if wanted else []
    with progress_bar(console, "sft: oracle demos", len(tasks)) as advance:
        demos = await oracle_demos(tasks, p.tokenizer, p.backend, p.store, p.params, cfg.train.rl.concurrency, advance)
    save_demos(run.path / DEMOS_FILE, demos)
    demo_seconds = time.perf_counter() - start
    model = load_model(p.base_model)
    steps = s.epochs * -(-len(demos) // s.batch_size)
    with progress_bar(console, "sft: training", steps) as advance:
        def on_step(step: int, loss: float) -> None:
            run.log("sft", step, {"loss": loss})
            advance()
        losses = await asyncio.to_thread(sft_train, model, demos, s.epochs, s.lr, s.batch_size, cfg.train.seed,
                                         p.tokenizer.pad_token_id, on_step)
    out = write_hf(model, p.tokenizer, run.checkpoint_dir("sft"))
    result = {"model": str(out), "demos": len(demos), "demo_failures": len(tasks) - len(demos),
              "steps": len(losses), "final_loss": losses[-1] if losses else None, "epochs": s.epochs,
              "demo_seconds": demo_seconds, "seconds": time.perf_counter() - start}
    run.finish_phase("sft", result)
    return out


async def eval_phase(name: str, model, cfg: Config, p: Pieces, run: RunDir, console: Console,
                     shared=None) -> dict:
    """Episodes on an hf engine over `model`, or on the run's `shared` engine (vllm), holding its weights."""
    if done := run.phase(name):
        return done
    start = time.perf_counter()
    drop_episodes_after(run.path, name, -1)  # a killed eval restarts from scratch: its records go too
    engine = rollout_engine(model, shared, cfg.train.hf.prefix_cache_mb)
    async with _pools(p) as pools:
        rollouts = Rollouts(engine, p.tokenizer, pools, p.params, cfg.train.rl.concurrency, EpisodeLog(run.path, name))
        with progress_bar(console, f"{name}: held-out episodes", len(p.eval_tasks)) as advance:
            episodes = await rollouts.evaluate(p.eval_tasks, cfg.train.eval.temperature, cfg.train.eval.seed, advance)
    await engine.close()
    s = outcome_summary([Scored(e.family, e.reward, e.status) for e in episodes])
    result = {"pass_at_1": s["pass_at_1"], "episodes": s["episodes"], "scored": s["scored"],
              "infra_errors": s["infra_errors"], "status": s["status"], "per_family": s["per_family"],
              "seconds": time.perf_counter() - start}
    run.finish_phase(name, result)
    return result


def grpo_config(cfg: Config) -> GRPOConfig:
    r = cfg.train.rl
    opt_steps = r.steps * r.minibatches
    decay = max(opt_steps - r.warmup_steps, 1) if r.lr_decay == "cosine" else 0
    return GRPOConfig(lr=r.lr, adam_eps=r.adam_eps, warmup_steps=r.warmup_steps, decay_steps=decay,
                      min_lr_ratio=r.min_lr_ratio, grad_clip=r.grad_clip, minibatches=r.minibatches,
                      clip_low=r.clip_low, clip_high=r.clip_high, tis_cap=r.tis_cap, kl_coef=r.kl_coef,
                      off_policy=r.off_policy, mask_level=r.mask_level, is_low=r.is_low, is_high=r.is_high,
                      normalize_std=r.normalize_std, negative_weight=r.negative_weight,
                      filter_zero_variance=r.filter_zero_variance, micro_batch_size=r.micro_batch_size,
                      temperature=r.temperature, sft_coef=r.sft_coef, sft_batch=r.sft_batch, seed=cfg.train.seed)


def rollout_metrics(episodes: list[Episode], version: int) -> dict:
    n = max(len(episodes), 1)
    keys = ",".join(f"{e.task_id}#{e.group_id}.{e.sample_id}" for e in episodes)
    lags = [version - min(v for v, m in zip(e.token_weight_versions, e.loss_mask) if m)
            for e in episodes if e.response_len]
    out = {f"time_{k}": sum(getattr(e.timing, k) for e in episodes) / n
           for k in ("sandbox_start", "model_wait", "agent_commands", "verifier", "other")}
    out.update({"episodes": len(episodes), "turns_mean": sum(e.turns for e in episodes) / n,
                "tool_errors": sum(e.tool_errors for e in episodes),
                **{f"status_{k}": v for k, v in status_counts(e.status for e in episodes).items()},
                "sample_lag_mean": sum(lags) / max(len(lags), 1),
                "samples_sha": hashlib.sha256(keys.encode()).hexdigest()[:16]})
    return out


def _policy_models(cfg: Config, sft_dir: Path):
    """The trainer's model and the engine's: plain copies, or both wrapped with the same LoRA adapters."""
    if not cfg.train.lora.enabled:
        return load_model(sft_dir), load_model(sft_dir)
    from furlong.model.lora import LoraSpec, wrap_lora

    lo = cfg.train.lora
    spec = LoraSpec(rank=lo.rank, alpha=lo.alpha, targets=lo.targets)
    return wrap_lora(load_model(sft_dir), spec, seed=cfg.train.seed), wrap_lora(load_model(sft_dir), spec)


def _weights_for_engine(cfg: Config, trainer: Trainer) -> dict:
    """With LoRA only the adapter tensors travel: the engine's frozen base is already the same."""
    if not cfg.train.lora.enabled:
        return trainer.state_dict_for_engine()
    from furlong.model.lora import adapter_state_dict

    return adapter_state_dict(trainer.model)


async def rl_phase(cfg: Config, p: Pieces, run: RunDir, console: Console, sft_dir: Path, shared=None) -> Trainer:
    r = cfg.train.rl
    policy, engine_model = _policy_models(cfg, sft_dir)
    # The KL reference is the SFT model itself (with LoRA too: fresh adapters start as the identity).
    ref = load_model(sft_dir).requires_grad_(False) if r.kl_coef > 0 else None
    # a finished RL phase trains no more, so it needs no anchor: a run from before demos.jsonl still resumes
    done, config = bool(run.phase("rl")), grpo_config(cfg)
    trainer = Trainer(policy, replace(config, sft_coef=0.0) if done else config, ref_model=ref,
                      demos=[] if done else anchor_demos(cfg, run))
    start, last = 0, run.state()["last_checkpoint"]
    if last:  # resuming: continue after the last complete step; its later metrics are redone
        trainer.load(run.checkpoint_dir(last["name"]))
        start = last["step"] + 1
        run.drop_metrics_after("rl", last["step"])
    if done:
        return trainer
    drop_episodes_after(run.path, "rl", start - 1)  # the records of steps redone after a kill
    link = await open_link(cfg, run.path, engine_model, sft_dir, _lora_spec(cfg), shared)
    async with _pools(p) as pools:
        rollouts = Rollouts(BusyMeter(link.engine), p.tokenizer, pools, p.params, r.concurrency)
        await link.push(_weights_for_engine(cfg, trainer), trainer.version)
        await _rl_steps(cfg, trainer, rollouts, link, p, run, console, start)
    await link.close()
    # summed over the logged steps, so time spent before a kill and resume is counted once
    rows = run.metrics("rl")
    episodes = {k: sum(row.get(f"episodes_{k}", 0) for row in rows) for k in ("started", *OUTCOMES)}
    # stopped by rl.time_budget_s: episodes still running or untrained then are cancelled, never trained
    episodes["cancelled_at_stop"] = rows[-1].get("episodes_in_flight", 0) if rows else 0
    run.finish_phase("rl", {"steps": len(rows), "seconds": sum(row["step_seconds"] for row in rows),
                            "status": {k: sum(row.get(f"status_{k}", 0) for row in rows) for k in STATUSES},
                            "episodes": episodes})
    return trainer


def anchor_demos(cfg: Config, run: RunDir) -> list:
    """SFT's demonstrations, for rl.sft_coef; none when the anchor is off."""
    if cfg.train.rl.sft_coef == 0:
        return []
    path = run.path / DEMOS_FILE
    if not path.is_file():
        raise ConfigError(f"train.rl.sft_coef: {cfg.train.rl.sft_coef} needs SFT's demonstrations, but {path} "
                          "is missing (a run whose SFT phase predates it): set train.rl.sft_coef=0 or start a new run")
    demos = load_demos(path)
    if not demos:
        raise ConfigError(f"train.rl.sft_coef: {cfg.train.rl.sft_coef} needs demonstrations, but SFT collected "
                          f"none ({path}): check train.sft.families and train.sft.instances_per_family")
    return demos


def _scheduler(cfg: Config, rollouts: Rollouts, p: Pieces, start: int, run: RunDir) -> Scheduler:
    """Sync and async are one loop: sync runs one step's groups at a time with zero lookahead, so the
    next step's episodes start only once this step's weights are in the engine."""
    r, cursor, rows = cfg.train.rl, _cursor(run), run.metrics("rl")
    tasks = p.train_tasks if r.families is None else [t for t in p.train_tasks if t.family in r.families]
    if not tasks:
        raise ConfigError(f"train.rl.families: no train task is of {list(r.families or ())} (the train tasks' "
                          f"families: {sorted({t.family for t in p.train_tasks})})")
    return Scheduler(rollouts, GroupStream(tasks, r.tasks_per_step, r.group_size, cfg.train.seed),
                     temperature=r.temperature, steps_left=r.steps - start, first_step=start,
                     inflight=r.inflight_groups(), lookahead=0 if r.mode == "sync" else r.max_staleness,
                     max_staleness=r.max_staleness, requeue=r.stale_policy == "requeue", cursor=cursor,
                     counted=rows[-1].get("episodes_in_flight", 0) if cursor and rows else 0)


def settled_records(batch: Batch, step: int, filter_zero_variance: bool) -> list[dict]:
    """episodes.jsonl lines for the episodes this step settled: `step` is the step that trained (or
    dropped) them, `plan_step` the step the group was planned for (later in async mode)."""
    return [{**episode_record(e, "rl", step), "plan_step": step_of(e), "attempt": g.spec.attempt,
             "slot": g.spec.group_id % ATTEMPT_STRIDE, "in_batch": any(g is b for b in batch.groups),
             "outcome": outcome}
            for g, e, outcome in settled_episodes(batch, filter_zero_variance)]


def batch_metrics(batch: Batch, filter_zero_variance: bool) -> dict:
    """Where every episode went: started this step, and how those settled by this batch ended."""
    counts = outcome_counts(batch, filter_zero_variance)
    return {"episodes_started": batch.started, **{f"episodes_{k}": v for k, v in counts.items()},
            "episodes_in_flight": batch.in_flight, "groups_stale": len(batch.stale),
            "trainer_wait_s": batch.wait_s, **staleness_stats(batch.groups, batch.version)}


def _cursor(run: RunDir) -> dict | None:
    last = run.state()["last_checkpoint"]
    path = run.checkpoint_dir(last["name"]) / CURSOR_FILE if last else None
    return json.loads(path.read_text()) if path and path.exists() else None


async def _rl_steps(cfg: Config, trainer: Trainer, rollouts: Rollouts, link, p: Pieces, run: RunDir,
                    console: Console, start: int) -> None:
    r, records = cfg.train.rl, EpisodeLog(run.path, "rl")
    scheduler = _scheduler(cfg, rollouts, p, start, run)
    spent = sum(row["step_seconds"] for row in run.metrics("rl"))  # RL time so far, a killed run's included
    try:
        with progress_bar(console, f"rl: GRPO steps ({r.mode})", r.steps, completed=start) as advance:
            for step in range(start, r.steps):
                if r.time_budget_s is not None and spent >= r.time_budget_s:
                    break  # a resumed run whose budget was already spent
                step_start, window = time.perf_counter(), StepWindow(rollouts.engine)
                batch = await scheduler.next_batch(trainer.version)
                if step + 1 < r.steps:
                    scheduler.prestart()
                stats = await asyncio.to_thread(trainer.train_step, batch.episodes)
                synced = await link.push(_weights_for_engine(cfg, trainer), trainer.version)
                scheduler.step_done()
                spent += (seconds := time.perf_counter() - step_start)
                run.log("rl", step, {**asdict(stats), **rollout_metrics(batch.episodes, batch.version),
                                     **window.diagnostics(batch.episodes, batch.version, stats.seconds),
                                     **batch_metrics(batch, r.filter_zero_variance), **synced,
                                     **prefix_metrics(link.engine),
                                     "step_seconds": seconds})
                records.write(settled_records(batch, step, r.filter_zero_variance))
                last = step == r.steps - 1 or (r.time_budget_s is not None and spent >= r.time_budget_s)
                if (step + 1) % r.checkpoint_every == 0 or last:
                    _checkpoint(trainer, scheduler, p, run, step)
                advance(f"reward {stats.reward_mean:.2f}")
                if last:
                    break
    finally:
        await scheduler.close()


def _checkpoint(trainer: Trainer, scheduler: Scheduler, p: Pieces, run: RunDir, step: int) -> None:
    """checkpoints/rl-N: trainer state, the policy as a Hugging Face directory (hf/), the rollout cursor;
    recorded as the last checkpoint only once all three are written."""
    path = run.checkpoint_dir(f"rl-{step}")
    trainer.save(path)
    export_policy(trainer, p, run, path)
    atomic_write(path / CURSOR_FILE, json.dumps(scheduler.cursor()))
    run.record_checkpoint(f"rl-{step}", step)


def export_policy(trainer: Trainer, p: Pieces, run: RunDir, checkpoint: Path) -> Path:
    """`checkpoint`/hf: the policy for plain transformers (with LoRA, merged, plus hf/adapter over the SFT model)."""
    return write_hf(trainer.model, p.tokenizer, checkpoint / HF_DIR, base_model=run.checkpoint_dir("sft"))


def _final_model(trainer: Trainer, p: Pieces, run: RunDir) -> Path:
    """The end of the run as a Hugging Face directory: the last RL checkpoint's hf/ (the last step always
    checkpoints), exported now if that checkpoint predates exports."""
    last = run.state()["last_checkpoint"]
    checkpoint = run.checkpoint_dir(last["name"]) if last else run.checkpoint_dir("final")
    hf = checkpoint / HF_DIR
    return hf if (hf / "config.json").is_file() else export_policy(trainer, p, run, checkpoint)


def _phase_status(result: dict) -> dict[str, int]:
    """Every status of a phase's episodes (zeros for a phase recorded before statuses were kept)."""
    return {k: result.get("status", {}).get(k, 0) for k in STATUSES}


def _summary(cfg: Config, run: RunDir, before: dict, after: dict, began: float, final: Path) -> dict:
    """summary.json: held-out pass@1 before and after RL, the paired gain per family and per group
    (reward-only, demonstrated) with 90% intervals, every status, where the time went, the final model."""
    phases, t = run.state()["phases"], cfg.train
    return {
        "run_dir": str(run.path), "hf_model": str(final),
        "hf_adapter": str(final / "adapter") if (final / "adapter").is_dir() else None,
        "heldout_pass_at_1_before_rl": before["pass_at_1"], "heldout_pass_at_1_after_rl": after["pass_at_1"],
        "improvement_points": 100 * (after["pass_at_1"] - before["pass_at_1"]),
        "eval_episodes": after["episodes"], "eval_temperature": cfg.train.eval.temperature,
        "eval_infra_errors": before["infra_errors"] + after["infra_errors"],
        "per_family_before": before["per_family"], "per_family_after": after["per_family"],
        "seed": t.seed, "demonstrated_families": list(t.demonstrated()), "reward_only_families": list(t.reward_only()),
        "heldout_gain": heldout_gains(run.path, {"reward_only": t.reward_only(), "demonstrated": t.demonstrated()}),
        "status": {name: _phase_status(phases[name]) for name in ("eval_before", "rl", "eval_after")},
        "rl_steps": t.rl.steps, "rl_mode": t.rl.mode, "rl_episodes": phases["rl"].get("episodes", {}),
        "families": list(t.families),
        "phase_seconds": {name: round(phases[name]["seconds"], 1) for name in ("sft", "eval_before", "rl", "eval_after")},
        "wall_seconds_this_invocation": round(time.perf_counter() - began, 1),
    }


async def train(cfg: Config, run: RunDir, console: Console) -> dict:
    began = time.perf_counter()
    torch.set_num_threads(cfg.train.torch_threads)
    p = await asyncio.to_thread(build, cfg)
    sft_dir = await sft_phase(cfg, p, run, console)
    # vllm: one engine serves the whole run (it takes up to a minute to start), its weights pushed between phases
    shared = shared_vllm(cfg, sft_dir, run.path) if cfg.train.engine == "vllm" else None
    try:
        before = await eval_phase("eval_before", load_model(sft_dir), cfg, p, run, console, shared)
        trainer = await rl_phase(cfg, p, run, console, sft_dir, shared)
        if shared is not None:  # RL pushed its last weights there, but a resumed run may have skipped RL
            await shared.update_weights(_weights_for_engine(cfg, trainer), trainer.version)
        after = await eval_phase("eval_after", trainer.model, cfg, p, run, console, shared)
    finally:
        if shared is not None:
            await shared.close()
    summary = _summary(cfg, run, before, after, began, _final_model(trainer, p, run))
    atomic_write(run.path / "summary.json", json.dumps(summary, indent=1))
    return summary
