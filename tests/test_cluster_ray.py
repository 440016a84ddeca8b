"""`train.cluster: ray` on a real local Ray cluster: placement groups, rank actors in a torch.distributed group,
engine actors behind the router (an actor SIGKILLed: its requests finish elsewhere, Ray restarts it, it
rejoins at the live weight version), and `furlong train` on Ray killed, resumed and compared with local mode,
with no Ray process or sandbox left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import ray
import skips
import torch
from fsdp2_support import fixed_episodes
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tests_support import alive, grpo

import furlong.build.cluster as ray_build
from furlong.build.links import weight_link
from furlong.build.training import grpo_config, local_trainer
from furlong.cluster.engines import CHILD_ENV
from furlong.cluster.ranks import RayRanks
from furlong.cluster.session import RaySession, Roles, place
from furlong.config import DEFAULT_SYSTEM_PROMPT, RECIPES, load_config
from furlong.engine.base import SamplingParams
from furlong.engine.router import Router
from furlong.engine.vllm import vllm_available
from furlong.model.loading import load_model
from furlong.paths import SHM, arena_owner
from furlong.sync.handover import SharedWeights
from furlong.train.fsdp2 import FSDP2Spec, FSDP2Trainer
from furlong.train.ranks import RankFailed, RankGroup
from furlong.train.trainer import LocalTrainer
from tests.ranks_support import SumSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROLES = Roles(engines=2, engine_cpus=0.5, trainer_cpus=0.5, placement="colocated")


@pytest.fixture(scope="module")
def session():
    s = RaySession(ROLES, num_cpus=4, timeout_s=120)  # room beside the bundles for the rank actors
    yield s
    s.close()


def _until(check, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def test_both_placements_build_their_placement_groups(session: RaySession):
    table = {g["name"]: g for g in placement_group_table().values()}
    run = table[f"{session.tag}-run"]
    assert run["strategy"] == "STRICT_PACK" and run["state"] == "CREATED"
    assert [b["CPU"] for b in run["bundles"].values()] == [0.5, 0.5, 0.5]  # trainer, engine 0, engine 1
    apart = Roles(engines=2, engine_cpus=0.25, trainer_cpus=0.25, placement="disaggregated")
    groups = place(apart, f"{session.tag}-apart", timeout_s=60)
    try:
        table = {g["name"]: g for g in placement_group_table().values()}
        trainer, engines = table[f"{session.tag}-apart-trainer"], table[f"{session.tag}-apart-engines"]
        assert (trainer["strategy"], len(trainer["bundles"])) == ("STRICT_PACK", 1)
        assert (engines["strategy"], len(engines["bundles"])) == ("SPREAD", 2)
        assert trainer["state"] == engines["state"] == "CREATED"
    finally:
        for g in groups.values():
            remove_placement_group(g)
    with pytest.raises(ValueError, match="train.ray.placement"):
        Roles(engines=1, engine_cpus=1, trainer_cpus=1, placement="sideways").groups()


def test_gpu_roles_reserve_gpus_and_a_cluster_without_them_is_refused_at_once(session: RaySession):
    """One GPU shared colocated (0.5 each): each bundle holds its fraction. This cluster has no GPU, so placing
    the roles fails before any placement group waits (scripts/gpu_check.sh places them on a real GPU)."""
    shared = Roles(engines=1, engine_cpus=0.25, trainer_cpus=0.25, placement="colocated", trainer_gpus=0.5,
                   engine_gpus=0.5)
    assert shared.gpus == 1.0
    assert shared.groups()["run"][0] == [{"CPU": 0.25, "GPU": 0.5}, {"CPU": 0.25, "GPU": 0.5}]
    before = len(placement_group_table())
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"reserve 1 GPUs .* but the cluster has 0"):
        place(shared, f"{session.tag}-gpu", timeout_s=60)
    assert time.monotonic() - start < 10 and len(placement_group_table()) == before


def test_ray_ranks_form_one_process_group_and_report_a_dead_rank(session: RaySession):
    ranks = RayRanks(SumSpec(offset=1.0), 2, cpus=0.25, timeout_s=60)
    try:
        assert isinstance(ranks, RankGroup)
        assert ranks.call("all_sum", 2.0) == [(0, 6.0), (1, 6.0)]  # (1 + 2) * 2 over both ranks
        with pytest.raises(RankFailed, match="rank 1 raised KeyError") as failed:
            ranks.call("explode", 1)
        assert "boom" in failed.value.detail
        with pytest.raises(RuntimeError, match="closed"):
            ranks.call("pid")
    finally:
        ranks.close()
    ranks = RayRanks(SumSpec(), 2, cpus=0.25, timeout_s=60)
    try:
        pids = ranks.call("pid")
        assert len(set(pids)) == 2 and os.getpid() not in pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankFailed, match="rank 1 died"):
            ranks.call("all_sum", 1.0)
    finally:
        ranks.close()


def test_fsdp2_ranks_on_ray_in_the_runs_trainer_bundles_match_the_local_trainer(session: RaySession,
                                                                                 small_dir: Path):
    """train.trainer=fsdp2 with train.cluster=ray: RayRanks in the bundles a RaySession reserves for
    trainer_ranks=2 (the slots the builder passes), one step equal to LocalTrainer's (test_fsdp2's tolerance)."""
    roles = Roles(engines=1, engine_cpus=0.25, trainer_cpus=0.25, placement="colocated", trainer_ranks=2)
    assert roles.cpus == 0.75 and [len(b) for b, _ in roles.groups().values()] == [3]
    groups = place(roles, f"{session.tag}-fsdp2", timeout_s=60)
    slots = [PlacementGroupSchedulingStrategy(placement_group=groups["run"], placement_group_bundle_index=r)
             for r in range(2)]
    spec = FSDP2Spec(small_dir, grpo(lr=1e-3, micro_batch_size=2, minibatches=2))
    local = LocalTrainer(load_model(small_dir), spec.config)
    fsdp = FSDP2Trainer(RayRanks(spec, 2, cpus=0.25, timeout_s=120, slots=slots), spec)
    try:
        want, got = local.train_step(fixed_episodes()), fsdp.train_step(fixed_episodes())
        assert got.loss == pytest.approx(want.loss, rel=1e-4) and got.version == 1
        weights = dict(fsdp.engine_weights())
        worst = max(float((weights[k] - v).abs().max()) for k, v in local.engine_weights().items())
        assert worst <= 1e-5, f"weights differ by {worst}"
    finally:
        fsdp.close()
        for g in groups.values():
            remove_placement_group(g)


def _sampling(n: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=200, seed=n)


def test_a_killed_engine_actor_is_restarted_and_rejoins_at_the_live_version(session: RaySession, tiny_dir: Path,
                                                                             tmp_path: Path):
    cfg = load_config(None, ["train.cluster=ray", "train.ray.engines=2", "train.ray.engine_cpus=0.5",
                             "train.sync.transport=http"])
    weights = load_model(tiny_dir).state_dict()

    async def main() -> None:
        link = await weight_link(cfg, tmp_path, tiny_dir, cluster=session)
        router = link.engine
        try:
            assert isinstance(router, Router)
            await link.push(weights, 0)
            await link.push({k: v + 1e-3 for k, v in weights.items()}, 1)
            pids = await asyncio.to_thread(link.actors.pids)
            assert len(set(pids)) == 2 and os.getpid() not in pids
            tasks = [asyncio.create_task(router.generate([5, 17, 300 + n], _sampling(n))) for n in range(6)]
            deadline = time.monotonic() + 60
            while not all(i.in_flight == 3 for i in router.instances):
                assert time.monotonic() < deadline, "the requests never spread over both engines"
                await asyncio.sleep(0.02)
            os.kill(pids[0], signal.SIGKILL)
            gens = await asyncio.gather(*tasks)
            dead, alive = router.instances
            assert all(len(g.output_ids) == 200 and set(g.token_weight_versions) == {1} for g in gens)
            assert not dead.live and dead.failures == 3 and alive.retries == 3
            # an update while it is out reaches the survivor; the restarted actor catches up when put back
            await link.push({k: v + 2e-3 for k, v in weights.items()}, 2)
            assert router.weight_version == 2
            deadline = time.monotonic() + 120
            while not dead.live:
                assert time.monotonic() < deadline, "Ray did not restart the engine actor, or it was not put back"
                await asyncio.sleep(0.2)
            assert dead.readmitted == 1 and (await dead.engine.health())["weight_version"] == 2
            restarted = await asyncio.to_thread(link.actors.pids)
            assert restarted[0] != pids[0] and restarted[1] == pids[1]
            gen = await dead.engine.generate([5, 17, 300], _sampling(0))
            assert gen.weight_version == 2
        finally:
            await link.close()

    asyncio.run(main())


def test_a_trainer_actor_hands_over_its_weights_from_its_own_memory(session: RaySession, tiny_dir: Path):
    t = load_config(None, ["train.cluster=ray", "train.sync.transport=shared", "train.rl.sft_coef=0"]).train
    trainer = ray_build.trainer(session, partial(local_trainer, t, tiny_dir, grpo_config(t), []), t)
    try:
        weights = trainer.engine_weights()
        owners = {arena_owner(p.name) for p in SHM.glob("furlong-weights-*")}
        expected = load_model(tiny_dir).state_dict()
        # read here through a handle: views of the actor's arena, which the driver never copied
        assert isinstance(weights, SharedWeights) and weights.nbytes >= 16e6
        assert set(weights) == set(expected) and all(torch.equal(weights[k], expected[k]) for k in expected)
    finally:
        trainer.close()
    assert len(owners) == 1 and os.getpid() not in owners  # the arena is the actor's
    assert not [p for p in SHM.glob("furlong-weights-*") if arena_owner(p.name) in owners]  # closed with it


STANDIN = "tests.sglang_standin"  # SGLangStandIn: a TEST DOUBLE of an SGLang server (SGLang is not installable here)


def _engine_children(actor_pids: list[int]) -> dict[int, str]:
    """The processes that engine actors started (their ChildGuard's tag names the actor's pid)."""
    want = tuple(f"{CHILD_ENV}=engine-{pid}-".encode() for pid in actor_pids)
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(v.startswith(want) for v in (entry / "environ").read_bytes().split(b"\0")):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
        except OSError:
            continue
    return found


def _restarted(actors) -> list[int] | None:
    """The actors' pids once Ray has restarted them (None while one is restarting)."""
    try:
        return actors.pids()
    except ray.exceptions.ActorUnavailableError:
        return None


def test_sglang_servers_in_engine_actors_load_each_update_and_die_with_their_actor(session: RaySession,
                                                                                  tiny_dir: Path, tmp_path: Path):
    cfg = load_config(None, ["train.cluster=ray", "train.engine=sglang", f"train.sglang.launch_module={STANDIN}",
                             "train.ray.engine_cpus=0.5", "train.sync.transport=http",
                             "train.sglang.start_timeout_s=120"])
    weights = load_model(tiny_dir).state_dict()

    async def main() -> None:
        link = await weight_link(cfg, tmp_path, tiny_dir, cluster=session)
        try:
            await link.push(weights, 0)
            await link.push({k: v + 1e-3 for k, v in weights.items()}, 1)
            gen = await link.engine.generate([5, 17, 300], _sampling(0))
            assert gen.weight_version == 1 and len(gen.output_ids) == 200
            # the actor's SGLang server loaded v1 from the checkpoint its relay staged (local mode's disk path)
            assert (tmp_path / "engine-0" / "weights" / "v1" / "model.safetensors").is_file()
            assert (tmp_path / "engine-0" / "sglang-server.log").is_file()
            pids = await asyncio.to_thread(link.actors.pids)
            children = _engine_children(pids)
            assert any(STANDIN in cmd for cmd in children.values()), children
            os.kill(pids[0], signal.SIGKILL)  # the actor alone: its server must follow it
            _until(lambda: not any(alive(pid) for pid in children), "the killed actor's SGLang server to stop", 30)
            restarted = await asyncio.to_thread(_until, lambda: _restarted(link.actors), "the actor's restart")
            assert restarted != pids and _engine_children(restarted)  # with a server of its own
        finally:
            await link.close()
        assert not _engine_children(pids + restarted)  # stopping the link stopped the servers

    asyncio.run(main())


MARK = "FURLONG_TEST_RUN"


def _left(mark: str) -> dict[int, str]:
    """The processes (pid -> command) on this host that inherited the run's mark: its Ray head, agents and
    workers, its reaper, its sandboxes; other users of the host are not counted."""
    want, found = f"{MARK}={mark}".encode(), {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and want in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:120].decode()
        except OSError:
            continue
    return found


def _train(*args: str, mark: str = "", wait: bool = True):
    config = [] if args[0] == "--resume" else ["--config", str(RECIPES / "smoke.yaml")]
    cmd = [sys.executable, "-m", "furlong.cli", "train", *config, *args]
    env = {**os.environ, MARK: mark}
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)


def _rl_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r["phase"] == "rl"]


def _files(run: Path) -> set[str]:
    return {p.name for p in run.iterdir()}


def _kill_resume_and_leave_nothing(killed: Path) -> None:
    """A smoke run on Ray, its driver SIGKILLed after RL step 1: everything it started goes; --resume finishes."""
    proc = _train("train.cluster=ray", f"train.run_dir={killed}", mark="killed", wait=False)
    try:
        _until(lambda: any(r["step"] >= 1 for r in _rl_rows(killed)) or proc.poll() is not None, "RL step 1", 300)
        assert proc.poll() is None, "the run ended before it could be killed"
        running = _left("killed")
        assert len(running) > 3, f"the run's processes were not found, so the count below proves nothing: {running}"
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone: what it started must go without it
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while left := _left("killed"):
        assert time.monotonic() < deadline, f"left behind by the killed driver: {left}"
        time.sleep(0.2)
    assert not (killed / "summary.json").exists()
    res = _train("--resume", str(killed), mark="resumed")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not _left("resumed")


def test_train_on_ray_killed_and_resumed_matches_local_mode_and_leaves_nothing(tmp_path: Path, smoke_run: Path):
    killed, local = tmp_path / "ray", smoke_run  # local mode's run of the same recipe: conftest's, shared
    _kill_resume_and_leave_nothing(killed)
    rows, want = _rl_rows(killed), _rl_rows(local)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # nothing logged twice
    assert [r["samples_sha"] for r in rows] == [r["samples_sha"] for r in want]  # local mode's samples exactly
    records = [json.loads(line) for line in (killed / "episodes.jsonl").read_text().splitlines()]
    keys = [(r["phase"], r["step"], r["group"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == 4 * 2 * 2 + 2 * 4  # every RL and held-out episode, once
    assert _files(killed) - {"weights"} == _files(local)  # weights/: the published updates the engines pull
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["rl_steps"] == 4 and summary["eval_episodes"] == 4
    ours, theirs = (load_model(run / "checkpoints" / "rl-3" / "hf").state_dict() for run in (killed, local))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)  # the trainer actor trained as local mode's


@skips.skipif("extra:vllm", not vllm_available(), "vLLM is not installed (bash install.sh --vllm)")
def test_train_on_ray_with_vllm_engine_actors_advances_their_weights_and_leaves_nothing(tmp_path: Path):
    """train.sync.transport=http: each step's update staged by the engine actor's relay, loaded by its vLLM (the
    shared transport's handover to vLLM engine actors is the run of `hosts_and_shared` below)."""
    run = tmp_path / "run"
    res = _train("train.cluster=ray", "train.engine=vllm", "train.rl.steps=2", f"train.run_dir={run}",
                 "train.sync.transport=http", "train.rl.filter_zero_variance=false", mark="vllm")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not _left("vllm")  # Ray, the actors, their vLLM engine cores, the watchdogs: all gone
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 * 2 * 2 and all(r["reward"] is not None for r in records)  # every episode scored
    # sync mode: step s samples only from version s, which the engine actor's vLLM loaded from its relay
    assert all(r["version_first"] == r["version_last"] == r["step"] for r in rl)
    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1] and all(r["sync_pause_s"] > 0 for r in rows)
    # every group trained (filter_zero_variance=false), so the logprobs below were compared, not skipped
    assert all(r["groups_used"] == 2 for r in rows) and (run / "weights" / "LATEST").is_file()
    assert max(r["logprob_diff_max"] for r in rows) < 1e-3  # vLLM's fp32 logprobs are the trainer's
    assert (run / "summary.json").exists()


def _arenas() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("furlong-weights-")}


# The engines of the shared run: vLLM's where it is installed (CI), so one Ray run (Ray, SFT, the evals and the
# engines' start, the costly parts) checks the handover to vLLM engine actors too; else the hf engine's.
SHARED_ENGINE = "vllm" if vllm_available() else "hf"
BRIEF = f"{DEFAULT_SYSTEM_PROMPT} Use as few commands as you can."


@pytest.fixture(scope="module")
def hosts_and_shared(tmp_path_factory: pytest.TempPathFactory):
    """One `furlong train` on Ray with both sandbox host actors and the trainer actor's weights handed over
    in place to two colocated engines (SHARED_ENGINE), every group trained (filter_zero_variance=false, so
    logprobs are compared), and self-distillation beside GRPO (the teacher: the trainer actor's live policy
    under a brevity prompt): the tests below each check their own part of it. The run's directory, its
    result, and the weight arenas before it."""
    run = tmp_path_factory.mktemp("hosts-shared") / "run"
    before = _arenas()
    res = _train("train.cluster=ray", "train.ray.sandbox_hosts=2", "train.ray.sandbox_host_cpus=0.5",
                 "train.sync.transport=shared", "train.ray.engines=2", "train.ray.engine_cpus=0.5",
                 f"train.engine={SHARED_ENGINE}", "train.rl.filter_zero_variance=false",
                 "train.distill.mode=grpo+opd", "train.distill.weight=0.5", f"train.distill.teacher.system_prompt={BRIEF}",
                 "train.rl.steps=2", f"train.run_dir={run}", mark="hosts-shared")
    return run, res, before


def test_train_on_ray_runs_its_sandboxes_on_host_actors_and_leaves_nothing(hosts_and_shared):
    run, res, _ = hosts_and_shared
    assert res.returncode == 0, res.stderr[-3000:]
    assert not _left("hosts-shared")  # the hosts' `furlong sandbox serve` processes and their sandboxes too
    hosts = json.loads((run / "sandbox_hosts.json").read_text())
    assert len(hosts) == 2 and not [h for h in hosts if "error" in h], hosts
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    assert records and all(r["reward"] is not None for r in records)  # every episode scored, none infra
    # every episode's sandbox (and SFT's demonstrations') was started by a host actor, over both hosts
    assert sum(h["created"] for h in hosts) >= len(records), (hosts, len(records))
    assert all(h["created"] > 0 for h in hosts), hosts


def test_train_on_ray_hands_the_trainer_actors_weights_to_colocated_engines_in_place(hosts_and_shared):
    run, res, before = hosts_and_shared
    assert res.returncode == 0, res.stderr[-3000:]
    assert not _left("hosts-shared") and _arenas() <= before  # the actors, and the trainer actor's shared memory
    assert not (run / "weights").exists()  # nothing was published
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl"]
    assert len(rl) == 2 * 2 * 2 and all(r["reward"] is not None for r in records)
    assert all(r["version_first"] == r["version_last"] == r["step"] for r in rl)  # sync mode: the live version
    rows = _rl_rows(run)
    assert [r["step"] for r in rows] == [0, 1] and all(r["sync_engines_live"] == 2 for r in rows)
    assert all(r["sync_pause_s"] > 0 and r["groups_used"] == 2 for r in rows) and (run / "summary.json").exists()
    # the weights stayed in the trainer actor's shared memory: each engine was sent a handle, not the tensors
    assert all(r["sync_shared_bytes"] > 16e6 and r["sync_payload_bytes"] < 40e3 for r in rows)
    # what the engines sampled with is what the trainer holds: their logprobs agree to float32 rounding
    assert max(r["logprob_diff_max"] for r in rows) < 1e-4


def test_train_on_ray_distils_in_the_trainer_actor(hosts_and_shared):
    """The teacher lives in the trainer actor: it scored every RL episode, its cost is in every step's row."""
    run, res, _ = hosts_and_shared
    assert res.returncode == 0, res.stderr[-3000:]
    records = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["phase"] == "rl" and r["outcome"] == "trained"]
    assert len(trained) == 2 * 2 * 2 and all(r["distill"]["status"] == "scored" for r in trained), trained[:1]
    assert all(r["distill"]["tokens"] == r["tokens_response"] for r in trained)
    rows = _rl_rows(run)
    assert [r["distill_scored"] for r in rows] == [4, 4] and all(r["distill_failed"] == 0 for r in rows)
    # the teacher prefilled the brevity prompt too, so it read more tokens than the episodes hold
    assert all(r["teacher_seconds"] > 0 for r in rows)
    assert sum(r["teacher_tokens"] for r in rows) > sum(r["tokens_total"] for r in trained)


@skips.skipif("extra:vllm", not vllm_available(), "vLLM is not installed (bash install.sh --vllm)")
def test_train_on_ray_hands_the_trainer_actors_weights_to_vllm_engine_actors_in_place(hosts_and_shared):
    """The run above, where vLLM is installed: its engines were vLLM's, each reading the trainer actor's arena."""
    run, res, _ = hosts_and_shared
    assert res.returncode == 0, res.stderr[-3000:]
    assert load_config(run / "config.yaml").train.engine == "vllm"
    rows = _rl_rows(run)
    assert [r["version"] for r in rows] == [1, 2] and all(r["sync_shared_bytes"] > 16e6 for r in rows)
