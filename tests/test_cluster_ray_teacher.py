"""train.distill.teacher.engine=hf on train.cluster=ray (docs/distill.md "Where the teacher lives"): the
teacher's engine is an engine actor in the run's teacher bundle (the engine bundle after the rollout
engines'), it scores the episodes as the trainer-held teacher does (fp32: within 1e-5), and once the actor is
dead its episodes fail their term, the pass still returns."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import ray
import torch
from fsdp2_support import prompted_episodes
from test_cluster_ray import _left, _train

from furlong.build.training import engine_teacher
from furlong.cluster.session import RaySession, Roles
from furlong.config import DEFAULT_SYSTEM_PROMPT, load_config
from furlong.model.loading import load_model, load_tokenizer
from furlong.train.distill import teacher_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BRIEF = "Answer in as few words as you can."
TEMPERATURE = 0.8
LONGER = f"{DEFAULT_SYSTEM_PROMPT} Use as few commands as you can."  # the run's prompt, and a brevity rule


def _config(small_dir: Path):
    """The run's config: a frozen self-teacher under a brevity prompt (its engine loads the SFT checkpoint,
    `small_dir` here), so the engine's prompts are its own rendering, not the episodes'."""
    return load_config(None, [
        "train.cluster=ray", "train.ray.engines=1", "train.ray.engine_cpus=0.5", "train.ray.trainer_cpus=0.5",
        "train.distill.mode=opd", f"train.distill.teacher.system_prompt={BRIEF}", "train.distill.teacher.frozen=true",
        "train.distill.teacher.engine=hf", f"train.rl.temperature={TEMPERATURE}", "train.torch_threads=1",
    ])


def test_the_teacher_engine_is_an_actor_in_its_bundle_scoring_as_the_trainer_held_teacher(small_dir: Path):
    import furlong.build.cluster as ray_build

    cfg = _config(small_dir)
    session = ray_build.session(cfg.train)
    assert session is not None and session.roles.teachers == 1
    try:
        _score_in_the_teacher_bundle(session, cfg, small_dir)
    finally:
        session.close()


def _score_in_the_teacher_bundle(session: RaySession, cfg, small_dir: Path) -> None:
    episodes = prompted_episodes(load_tokenizer(small_dir))
    held = teacher_for(small_dir, path=small_dir, system_prompt=BRIEF, hints={}, temperature=TEMPERATURE,
                       micro_batch_size=4, device=torch.device("cpu"), load=load_model)
    want = held.score(episodes, load_model(small_dir))
    # a task asking for the teacher's bundle (its engine_cpus) runs only once the teacher's actor is gone (a
    # lambda: Ray's workers cannot import this module, so it travels by value)
    probe = ray.remote(lambda: os.getpid()).options(num_cpus=cfg.train.ray.engine_cpus,
                                                    scheduling_strategy=session.slot("teacher"))

    async def go():
        served = await engine_teacher(cfg.train, small_dir, {}, session)
        assert served is not None
        try:
            pids = served.engine.actors.pids()
            waiting = probe.remote()
            got = await served.score(episodes)
            held_bundle = not ray.wait([waiting], timeout=5)[0]
            ray.kill(served.engine.actors.handles[0], no_restart=True)  # the actor dies: not restarted
            for _ in range(600):  # ray.kill returns at once: wait until the actor's process is gone
                if not Path(f"/proc/{pids[0]}").exists():
                    break
                await asyncio.sleep(0.1)
            dead = await served.score(episodes[:3])
        finally:
            await served.engine.close()
        return pids, held_bundle, ray.get(waiting, timeout=120), got, dead

    pids, held_bundle, probe_pid, got, dead = asyncio.run(go())
    assert len(pids) == 1 and pids[0] != os.getpid() and probe_pid != pids[0]  # an actor, not the driver
    assert held_bundle  # the teacher's actor held its bundle; once killed, the probe got it
    assert [e.distill.status for e in got.episodes] == ["scored"] * len(episodes)
    for a, b in zip(got.episodes, want.episodes, strict=True):
        assert a.teacher_logprobs == pytest.approx(b.teacher_logprobs, abs=1e-5)
    assert got.tokens == want.tokens and got.metrics()["distill_scored"] == len(episodes)
    assert all(e.distill.status == "teacher_failed" and e.teacher_logprobs is None for e in dead.episodes)
    assert dead.metrics()["distill_failed"] == 3, [e.distill.error for e in dead.episodes]


def test_the_teacher_engine_is_one_more_engine_bundle_in_either_placement():
    roles = Roles(engines=2, engine_cpus=0.5, trainer_cpus=1.0, placement="disaggregated", engine_gpus=0.25,
                  teachers=1)
    assert roles.groups()["engines"] == ([{"CPU": 0.5, "GPU": 0.25}] * 3, "SPREAD")  # engine 0, engine 1, teacher
    assert (roles.cpus, roles.gpus) == (2.5, 0.75)
    colocated = Roles(engines=1, engine_cpus=0.5, trainer_cpus=1.0, placement="colocated", teachers=1)
    assert colocated.groups()["run"] == ([{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}], "STRICT_PACK")


def test_train_on_ray_distils_from_a_teacher_engine_actor_and_leaves_nothing(tmp_path: Path):
    """1 RL step of the smoke recipe on Ray, a frozen self-teacher under a longer prompt on an hf engine: the
    driver says the engine is a Ray actor, every RL episode is scored, and the actor went with the run."""
    run = tmp_path / "run"
    res = _train("train.cluster=ray", "train.rl.steps=1", "train.distill.mode=grpo+opd", "train.distill.weight=0.5",
                 f"train.distill.teacher.system_prompt={LONGER}", "train.distill.teacher.frozen=true",
                 "train.distill.teacher.engine=hf", f"train.run_dir={run}", mark="teacher-actor")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "the teacher's hf engine is a Ray engine actor (pid" in " ".join(res.stderr.split()), res.stderr[-2000:]
    assert not _left("teacher-actor")  # Ray, its actors (the teacher's engine too), the watchdogs: all gone
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["phase"] == "rl" and r["outcome"] == "trained"]
    assert trained and all(r["distill"]["status"] == "scored" for r in trained), trained[:1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["phase"] == "rl"]
    assert row["distill_scored"] == len(trained) and row["distill_failed"] == 0 and row["teacher_seconds"] > 0
    # the teacher prefilled its longer prompt, so it read more tokens than the episodes hold
    assert row["teacher_tokens"] > sum(r["tokens_total"] for r in trained)
