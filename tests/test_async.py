"""Asynchronous RL (train.rl.mode=async): the off-policy corrections on crafted logprobs, and the real RL
loop (furlong.run.driver.rl_steps: real engine, sandboxes, trainer) under random episode durations
and sandbox failures: the staleness bound holds, every episode is accounted for exactly once, tokens on
both sides of a mid-episode weight update keep their versions, and sync mode draws today's samples."""

from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from conftest import run
from furlong.agent.episode import Episode
from furlong.config import load_config
from furlong.metrics.episodes import read_jsonl
from furlong.metrics.run import RunDir
from furlong.report.data import load_run
from furlong.report.timing import episode_lags
from furlong.model.loading import load_model, load_tokenizer
from furlong.rollout.groups import Rollouts
from furlong.rollout.scheduler import OUTCOMES, GroupStream, Scheduler
from furlong.sandbox.base import ImageRef, SandboxError
from furlong.sandbox.pool import WarmPools, fixed_image
from furlong.build.training import grpo_config
from furlong.run.driver import rl_steps
from furlong.timing import EpisodeTiming
from furlong.train.grpo import OffPolicy, policy_loss
from furlong.train.trainer import LocalTrainer
from furlong.train.weights import DirectLink
from furlong.engine.hf import HFEngine
from tests_support import agent_params, grpo, make_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUIET = Console(file=open(os.devnull, "w"))
LN = math.log


def _lp(*ratios: float) -> torch.Tensor:
    """logp_old - logp_rollout = log(ratio), with logp_rollout = 0."""
    return torch.tensor([[LN(r) for r in ratios]])


@pytest.mark.parametrize("correction, ratios, weights, cut", [
    (OffPolicy("tis", cap=2.0), (0.5, 3.0), (0.5, 2.0), (False, True)),
    (OffPolicy("masked_is", low=0.5, high=2.0), (0.4, 1.5, 2.5), (0.0, 1.5, 0.0), (True, False, True)),
    (OffPolicy("decoupled_ppo", cap=2.0), (1.5, 3.0), (1.5, 0.0), (False, True)),
])
def test_off_policy_weights_on_crafted_ratios(correction, ratios, weights, cut):
    w, c = correction.weights(_lp(*ratios), torch.ones(1, len(ratios), dtype=torch.bool))
    assert w[0].tolist() == pytest.approx(weights) and c[0].tolist() == list(cut)


def test_masked_is_sequence_level_judges_the_geometric_mean_of_each_episode():
    log_ratio = torch.cat([_lp(0.5, 2.0, 1.0), _lp(3.0, 3.0, 1.0)])
    keep = torch.tensor([[True, True, False], [True, True, False]])  # the third token is not sampled
    w, cut = OffPolicy("masked_is", low=0.5, high=2.0, level="sequence").weights(log_ratio, keep)
    assert w[0, :2].tolist() == pytest.approx([0.5, 2.0])  # geometric mean 1: kept, each token its ratio
    assert w[1].tolist() == [0.0, 0.0, 0.0] and cut[1].all()  # geometric mean 3: the whole episode goes


@pytest.mark.parametrize("correction", ["tis", "masked_is", "decoupled_ppo"])
def test_policy_loss_value_and_gradient_follow_the_weights(correction):
    old = _lp(0.25, 1.5, 4.0)  # rollout logprobs are 0
    new = old.clone().requires_grad_(True)
    adv, mask = torch.tensor([2.0]), torch.ones(1, 3)
    loss, m = policy_loss(new, old, torch.zeros(1, 3), adv, mask, off_policy=OffPolicy(correction, cap=2.0))
    w = {"tis": [0.25, 1.5, 2.0], "masked_is": [0.0, 1.5, 0.0], "decoupled_ppo": [0.25, 1.5, 0.0]}[correction]
    assert loss.item() == pytest.approx(-2.0 * sum(w) / 3)  # ratio new/old is 1: loss = -A * mean(w)
    loss.backward()
    assert new.grad[0].tolist() == pytest.approx([-2.0 * x / 3 for x in w])
    assert m.tis_weight_mean == pytest.approx(sum(w) / 3) and m.tis_capped_frac == pytest.approx(
        {"tis": 1 / 3, "masked_is": 2 / 3, "decoupled_ppo": 1 / 3}[correction])


def test_decoupled_ppo_clips_against_the_proximal_policy():
    prox, behaviour = _lp(1.2), torch.zeros(1, 1)  # weight pi_prox / pi_behav = 1.2
    new = prox + LN(1.5)  # 1.5x the proximal policy: past clip_high 0.28
    loss, m = policy_loss(new, prox, behaviour, torch.tensor([1.0]), torch.ones(1, 1),
                          off_policy=OffPolicy("decoupled_ppo", cap=2.0))
    assert float(loss) == pytest.approx(-1.2 * 1.28) and m.clip_frac == 1.0


def _episode(tokenizer, reward: float, sample: int) -> Episode:
    prompt = tokenizer.encode("run the thing")
    out = tokenizer.encode(" ls -la /app" if reward else " cat x")
    n = len(prompt)
    return Episode(task_id="t", group_id=0, sample_id=sample, prompt_len=n, tokens=tuple(prompt + out),
                   loss_mask=(0,) * n + (1,) * len(out), rollout_logprobs=(0.0,) * n + (-3.0,) * len(out),
                   token_weight_versions=(-1,) * n + (0,) * len(out), reward=reward, status="ok",
                   timing=EpisodeTiming(), turns=1)


@pytest.mark.parametrize("correction", ["tis", "masked_is", "decoupled_ppo"])
def test_one_real_train_step_with_each_correction(tiny_dir, correction):
    tok = load_tokenizer(tiny_dir)
    trainer = LocalTrainer(load_model(tiny_dir), grpo(off_policy=correction, is_low=1e-6, is_high=1e6,
                                                 tis_cap=1e6, lr=1e-3))
    before = [p.clone() for p in trainer.model.parameters()]
    stats = trainer.train_step([_episode(tok, r, i) for i, r in enumerate((1.0, 0.0, 1.0, 0.0))])
    assert stats.updated and math.isfinite(stats.loss) and stats.tis_weight_mean > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


# --- the real loop -------------------------------------------------------------------------------------

RANDOM_TEST = ("sleep 0.$((RANDOM % 9)); mkdir -p /logs/verifier; "
               "echo $((RANDOM % 2)) > /logs/verifier/reward.txt")  # a random duration and a random reward


class FailingStarts:
    """A sandbox source where every `every`-th start fails (the episode is an infra error)."""

    def __init__(self, inner, every: int):
        self.inner, self.every, self.acquired = inner, every, 0

    async def image(self, task):
        return await self.inner.image(task)

    def reserve(self, task):
        self.inner.reserve(task)

    async def acquire(self, spec_):
        self.acquired += 1
        if self.acquired % self.every == 0:
            raise SandboxError("injected: the sandbox did not start")
        return await self.inner.acquire(spec_)


def per_task_image(image: ImageRef):
    """The base image, but a distinct ImageRef (so a distinct sandbox spec and warm pool) per task."""
    async def lookup(task) -> ImageRef:
        return replace(image, env=(*image.env, ("FURLONG_TEST_TASK", task.id)))
    return lookup


class ColdAcquires:
    """A sandbox source that records, for each acquire, the engine's weight version and whether the
    acquire found no sandbox started for it beforehand (its episode then waits for a cold start)."""

    def __init__(self, inner: WarmPools, engine: HFEngine) -> None:
        self.inner, self.engine, self.log, self.reserved = inner, engine, [], 0

    async def image(self, task):
        return await self.inner.image(task)

    def reserve(self, task):
        self.reserved += 1
        self.inner.reserve(task)

    async def acquire(self, spec_):
        pool = self.inner.pools.get(spec_)
        task = dict(spec_.image.env).get("FURLONG_TEST_TASK")  # per_task_image's mark
        self.log.append((self.engine.weight_version, pool is None or pool.spare <= 0, task))
        return await self.inner.acquire(spec_)


class PushMidGeneration(DirectLink):
    """A DirectLink whose every push lands while a generation is part-way through: it holds the engine
    paused until one has sampled tokens and not finished, then updates and resumes, so that generation's
    next token is the new version's. Mid-episode updates by construction, not by the machine's timing."""

    def __init__(self, engine: HFEngine) -> None:
        super().__init__(engine)
        self.split = 0  # pushes that landed inside a generation

    async def push(self, weights, version: int) -> dict[str, float]:
        # up to about 5 s: the episodes in flight may all be between turns, and the last steps' pushes find
        # none (no groups are left to start), so a longer wait only costs time
        for _ in range(2500):
            # look first, pause only when a generation is part-way (pausing on every look starves the engine),
            # then look again: the step the pause waited for may have finished it
            if any(r.output_ids for r in self.engine._batch.rows):
                await self.engine.pause()
                if any(r.output_ids for r in self.engine._batch.rows):  # finished rows leave the batch
                    self.split += 1
                    break
                await self.engine.resume()
            await asyncio.sleep(0.002)
        try:
            return await super().push(weights, version)
        finally:
            await self.engine.resume()


def _loop(tmp_path: Path, tiny_dir: Path, backend, base_image, overrides: list[str], fail_every: int = 0,
          link_type: type[DirectLink] = DirectLink, sources: list | None = None):
    """furlong.run.driver's RL loop itself on hand-made tasks; returns the logged rows and the run.
    With `sources`, episodes take their sandboxes through a ColdAcquires, appended to it, from 12 tasks
    each with an image of its own, as family instances have (so a sandbox started for one task never
    serves another's episode), none leaving its reward out (that reruns in a control sandbox)."""
    n = 4 if sources is None else 12
    tasks = [make_task(tmp_path / "tasks", f"t{i}", "Create /tmp/done", RANDOM_TEST) for i in range(n)]
    if sources is None:
        tasks.append(make_task(tmp_path / "tasks", "bug", "Create /tmp/done", "echo no reward"))  # infra_error
    images = fixed_image(base_image) if sources is None else per_task_image(base_image)
    # scheduling under test: no KL reference model, no demonstrations for an anchor
    cfg = load_config(None, ["train.rl.tasks_per_step=2", "train.rl.group_size=3", "train.rl.concurrency=4",
                             "train.rl.checkpoint_every=100", "train.rl.lr=0.01", "train.rl.warmup_steps=0",
                             "train.rl.kl_coef=0", "train.rl.sft_coef=0", "train.rl.families=null", *overrides])
    run_dir = RunDir.create(tmp_path / "run", {})
    tokenizer = load_tokenizer(tiny_dir)
    trainer = LocalTrainer(load_model(tiny_dir), grpo_config(cfg.train))

    async def go():
        link = links[0] = link_type(HFEngine(load_model(tiny_dir), eos_token_ids=()))
        async with WarmPools(backend, images) as pools:
            source = FailingStarts(pools, fail_every) if fail_every else pools
            if sources is not None:
                sources.append(source := ColdAcquires(pools, link.engine))
            rollouts = Rollouts(link.engine, tokenizer, source, agent_params(max_turns=3, max_new_tokens=12),
                                cfg.train.rl.concurrency)
            pieces = SimpleNamespace(train_tasks=tasks, tokenizer=tokenizer)  # checkpoints export the policy too
            await rl_steps(cfg, trainer, rollouts, link, pieces, run_dir, QUIET, 0)
        await link.close()

    links: list[DirectLink] = [None]
    run(go())
    return run_dir.metrics("rl"), run_dir, links[0]


def test_async_bounds_staleness_and_accounts_for_every_episode(tiny_dir, backend, base_image, tmp_path):
    steps = 6
    rows, run_dir, _ = _loop(tmp_path, tiny_dir, backend, base_image,
                          [f"train.rl.steps={steps}", "train.rl.mode=async", "train.rl.max_staleness=1",
                           "train.rl.max_inflight_groups=4", "train.rl.stale_policy=drop"], fail_every=7)
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["staleness_max"] <= 1 for r in rows)  # the bound, in every trained batch
    started = settled = 0
    for r in rows:  # at every step: started = settled so far + still in flight
        started += r["episodes_started"]
        settled += sum(r[f"episodes_{k}"] for k in ("trained", "dropped_stale", "filtered", "infra_error"))
        assert started == settled + r["episodes_in_flight"]
    assert rows[-1]["episodes_in_flight"] == 0  # nothing left running or unaccounted for at the end
    total = {k: sum(r[f"episodes_{k}"] for r in rows) for k in ("trained", "filtered", "infra_error")}
    assert total["infra_error"] > 0 and total["trained"] > 0
    # each batch holds tasks_per_step groups: trained + filtered + infra = 6 episodes, the stale ones extra
    assert all(sum(r[f"episodes_{k}"] for k in ("trained", "dropped_stale", "filtered", "infra_error"))
               == 3 * (2 + r["groups_stale"]) for r in rows)
    assert any(r["updated"] for r in rows) and any(r["staleness_max"] >= 1 for r in rows)  # it did overlap
    assert json.loads((run_dir.checkpoint_dir("rl-5") / "rollout_cursor.json").read_text())["pending"] == []
    _check_records(run_dir.path, rows)


def _check_records(path: Path, rows: list[dict]) -> None:
    """episodes.jsonl of an async run: each RL record carries the step that settled it (not the step its
    group was planned for), so its outcomes add up to that step's counts, its lags to that step's
    staleness, and `furlong report`'s sample lags are the trained ones."""
    records = [r for r in read_jsonl(path / "episodes.jsonl") if r["phase"] == "rl"]
    assert len({(r["step"], r["group"], r["attempt"], r["sample"]) for r in records}) == len(records)
    assert all(r["error"] for r in records if r["status"] == "infra_error")  # each one says why
    lags = []
    for row in rows:
        mine = [r for r in records if r["step"] == row["step"]]
        counts = {k: sum(r["outcome"] == k for r in mine) for k in OUTCOMES}
        assert counts == {k: row[f"episodes_{k}"] for k in OUTCOMES}
        trained_at = row["version"] - row["updated"]
        step_lags = [trained_at - r["version_first"] for r in mine if r["in_batch"] and r["version_first"] is not None]
        assert max(step_lags, default=0) == row["staleness_max"]
        lags += step_lags
    assert sorted(episode_lags(load_run(path))[0]) == sorted(lags)


def _record(step: int, plan_step: int, version_first: int, in_batch: bool = True, reward: float = 1.0) -> dict:
    return {"phase": "rl", "step": step, "plan_step": plan_step, "group": plan_step, "sample": 0,
            "version_first": version_first, "in_batch": in_batch, "reward": reward, "seconds": 1.0,
            "outcome": "trained" if in_batch else "dropped_stale"}


def test_report_measures_lag_at_the_step_that_trained_a_group_not_the_one_it_was_planned_for(tmp_path):
    """Async: a group planned for step 0 but trained at step 2 lagged 2 versions (trained at version 2),
    not 0 (the plan step's version); a group dropped as stale was never trained, so it has no lag and is
    not in its step's reward."""
    from furlong.metrics.episodes import EpisodeLog
    from furlong.report.parts import by_step

    run = RunDir.create(tmp_path / "run", {})
    for step in range(3):  # each step updates the weights: step s trains at version s
        run.log("rl", step, {"version": step + 1, "updated": True, "step_seconds": 1.0})
    EpisodeLog(run.path, "rl").write([_record(0, 0, 0), _record(1, 1, 0), _record(2, 0, 0),
                                      _record(2, 2, 2, reward=0.0), _record(2, 1, 0, in_batch=False)])
    data = load_run(run.path)
    assert sorted(episode_lags(data)[0]) == [0.0, 0.0, 1.0, 2.0]
    assert {k: len(v) for k, v in by_step(data.batch_episodes()).items()} == {0: 1, 1: 1, 2: 2}


def test_a_mid_episode_weight_update_keeps_each_tokens_version_and_trains(tiny_dir, backend, base_image, tmp_path):
    """Async rollouts keep generating across pushes. Every push here waits until a generation is part-way
    (PushMidGeneration), so the episodes it splits hold tokens of two versions whatever the machine's load,
    and they are trained like the others."""
    rows, run_dir, link = _loop(tmp_path, tiny_dir, backend, base_image,
                                ["train.rl.steps=6", "train.rl.mode=async", "train.rl.max_staleness=4",
                                 "train.rl.max_inflight_groups=6", "train.rl.filter_zero_variance=false"],
                                link_type=PushMidGeneration)
    assert link.split >= 1
    records = [r for r in read_jsonl(run_dir.path / "episodes.jsonl") if r["phase"] == "rl" and r["version_first"] is not None]
    assert any(r["version_first"] < r["version_last"] for r in records), "no episode spanned a weight update"
    assert sum(r["episodes_multi_version"] for r in rows) > 0, "no trained episode spanned a weight update"
    assert all(r["staleness_max"] <= 4 for r in rows) and sum(r["updated"] for r in rows) >= 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_episodes_after_the_first_step_never_wait_for_a_cold_sandbox_start(tiny_dir, backend, base_image, tmp_path,
                                                                           mode):
    """Each step_done starts a step's worth of groups at once (sync: the next step; async: those the
    staleness window held back, or the in-flight cap until a group finishes), into slots left free:
    their sandboxes must have started while the trainer trained (Scheduler.prestart), not when the
    episodes asked. Only the first groups, started with the loop, may find none started. Deterministic:
    with as many slots as episodes in flight, every episode takes a slot the moment its group starts,
    so each must have been reserved before; prestart reserves them before the trainer's thread runs.
    A group re-queued as stale starts at once, in the batch that dropped it, with no prestart before it;
    its task's acquires are let off (an update can land a decode step late, so a group may go stale)."""
    sources: list[ColdAcquires] = []
    rows, run_dir, _ = _loop(tmp_path, tiny_dir, backend, base_image,
                             ["train.rl.steps=5", f"train.rl.mode={mode}", "train.rl.max_staleness=1",
                              "train.rl.max_inflight_groups=4", "train.rl.concurrency=12",  # 4 groups x 3
                              "train.rl.filter_zero_variance=false"], sources=sources)
    log = sources[0].log
    assert len(log) == sum(r["episodes_started"] for r in rows) and sum(r["updated"] for r in rows) == 5
    assert sum(v >= 1 for v, _, _ in log) >= 12  # steps 1-4's episodes, at least (2 groups of 3 a step)
    requeued = {r["task"] for r in read_jsonl(run_dir.path / "episodes.jsonl") if r.get("attempt")}
    cold_later = [(v, task) for v, cold, task in log if cold and v >= 1 and task not in requeued]
    assert cold_later == [], f"episodes waited for a sandbox start (weight version, task): {cold_later}"
    if not requeued:  # one sandbox started ahead per episode: none twice, none wasted
        assert sources[0].reserved == len(log)


def test_prestart_reserves_the_next_groups_first_window_once(tmp_path):
    """Called again before step_done (async, where the window or the in-flight cap can hold the
    predicted groups back for a step), prestart starts no second sandbox for the same episodes."""

    class Reservations:  # a SandboxSource that only records what is reserved: no episode runs here
        def __init__(self) -> None:
            self.tasks: list[str] = []

        def reserve(self, task) -> None:
            self.tasks.append(task.id)

    tasks = [make_task(tmp_path / "tasks", f"t{i}", "Create /tmp/done", RANDOM_TEST) for i in range(4)]
    source, stream = Reservations(), GroupStream(tasks, tasks_per_step=2, group_size=3, seed=0)
    rollouts = Rollouts(None, None, source, agent_params(), concurrency=4)
    scheduler = Scheduler(rollouts, stream, temperature=1.0, steps_left=3, first_step=0, inflight=4, lookahead=1,
                          max_staleness=1, requeue=True)
    scheduler.prestart()
    first, second = stream.spec(0).task.id, stream.spec(1).task.id
    assert source.tasks == [first, first, first, second]  # the first `concurrency` episodes of groups 0 and 1
    scheduler.prestart()
    assert len(source.tasks) == 4


class UnstartableSandboxes:
    """A SandboxSource whose episodes end 10 ms after asking for their image, as infra errors (no
    sandbox ever starts), logging ("reserve", task) for each sandbox reserved ahead and ("end", task)
    for each episode that ends: the order of reservations is what is under test, no episode runs."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def reserve(self, task) -> None:
        self.log.append(("reserve", task.id))

    async def image(self, task):
        await asyncio.sleep(0.01)
        raise SandboxError("injected: no image")

    async def acquire(self, spec_):
        raise SandboxError("injected: no sandbox")


def test_groups_held_back_by_the_inflight_cap_start_their_sandboxes_while_the_group_ahead_runs(tiny_dir, tmp_path):
    """prestart expects more episodes than the `concurrency` it may start sandboxes for at once (three
    groups of two, two slots): those past that first window must still have their sandboxes started ahead,
    as the episodes before them take their slots, not once their own group has started (cold, when the
    in-flight cap lets one group run at a time and a slot is free at once)."""
    tasks = [make_task(tmp_path / "tasks", f"t{i}", "Create /tmp/done", RANDOM_TEST) for i in range(6)]
    source, stream = UnstartableSandboxes(), GroupStream(tasks, tasks_per_step=2, group_size=2, seed=0)
    rollouts = Rollouts(None, load_tokenizer(tiny_dir), source, agent_params(), concurrency=2,
                        on_episode=lambda e: source.log.append(("end", e.task_id)))
    scheduler = Scheduler(rollouts, stream, temperature=1.0, steps_left=3, first_step=0, inflight=1, lookahead=1,
                          max_staleness=10, requeue=False)

    async def go() -> None:  # the driver's loop, with no training
        for step in range(3):
            await scheduler.next_batch(0)
            if step < 2:
                scheduler.prestart()
            scheduler.step_done()
        await scheduler.close()

    run(go())
    order = [stream.spec(i).task.id for i in range(6)]
    assert [e for e in source.log if e[0] == "end"] == [("end", t) for t in order for _ in range(2)]
    for ahead, task in zip(order[2:], order[3:]):  # every group from the first prestart's on
        reserved = [i for i, e in enumerate(source.log) if e == ("reserve", task)]
        first_end_ahead = source.log.index(("end", ahead))
        assert len(reserved) == 2 and max(reserved) < first_end_ahead, (task, source.log)


def test_sync_mode_draws_the_samples_of_the_loop_before_async(smoke_run):
    """samples_sha of `furlong train --config recipes/smoke.yaml` (seed 0; conftest's session run), recorded
    from the sync loop as it was before the scheduler replaced it (commit 14d2dff)."""
    rows = [r for r in map(json.loads, (smoke_run / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "rl"]
    assert [r["samples_sha"] for r in rows] == ["55d173e3e93e09d5", "7d440e08ec29e04d", "072b1648036dbd9a",
                                                "726c3a95e7332d6a"]
    assert all(r["staleness_max"] == 0 and r["episodes_in_flight"] == 0 for r in rows)  # zero overlap
    summary = json.loads((smoke_run / "summary.json").read_text())
    e = summary["rl_episodes"]
    assert e["started"] == 16 == e["trained"] + e["dropped_stale"] + e["filtered"] + e["infra_error"]


def test_async_kill_and_resume_trains_every_group_exactly_once(tmp_path):
    """`furlong train` in async mode, killed mid-RL with groups in flight, then `--resume`: the groups
    started but untrained at the checkpoint are re-planned, so every group of the stream is trained in
    exactly one batch (none twice, none skipped), and every episode is recorded and counted once."""
    import signal
    import subprocess
    import sys
    import time

    steps, tasks, group = 6, 2, 2
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "furlong.cli", "train", "--config", "recipes/smoke.yaml", f"train.run_dir={run_dir}",
           f"train.rl.steps={steps}", "train.rl.mode=async", "train.rl.max_staleness=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    rl = lambda: [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["phase"] == "rl"]  # noqa: E731
    while not any(r["step"] >= 2 for r in rl()) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    last = json.loads((run_dir / "state.json").read_text())["last_checkpoint"]["step"]
    assert last < steps - 1 and {r["step"]: r for r in rl()}[last]["episodes_in_flight"] > 0  # groups were in flight
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "train", "--resume", str(run_dir)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in rl()] == list(range(steps))
    records = [r for r in read_jsonl(run_dir / "episodes.jsonl") if r["phase"] == "rl"]
    assert len({(r["step"], r["group"], r["attempt"], r["sample"]) for r in records}) == len(records)
    batched: dict[int, list[dict]] = {}
    for r in records:
        if r["in_batch"]:
            batched.setdefault(r["group"], []).append(r)
    assert all(len(eps) == group for eps in batched.values())
    streams = sorted((eps[0]["plan_step"], eps[0]["slot"]) for eps in batched.values())
    assert streams == [(s, k) for s in range(steps) for k in range(tasks)]  # each group of the stream once
    e = json.loads((run_dir / "summary.json").read_text())["rl_episodes"]
    assert e["started"] == sum(e[k] for k in (*OUTCOMES, "cancelled_at_stop")) and e["cancelled_at_stop"] == 0
    assert e["trained"] + e["filtered"] + e["infra_error"] == steps * tasks * group
