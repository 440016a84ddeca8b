"""Episode outcomes through the one runner (furlong.agent.runner): who is to blame when a sandbox breaks,
what is scored, and that no sandbox failure aborts an eval run or an RL step. Real sandboxes throughout."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from conftest import run, spec
from furlong.agent.runner import STATUSES, AgentRun, run_outcome
from furlong.engine.hf import HFEngine
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.harness import run_task_episode
from furlong.eval.run import run_eval, summarize
from furlong.model.loading import load_model, load_tokenizer
from furlong.rollout.groups import Rollouts, pass_rate, plan_step
from furlong.sandbox.base import ImageRef, LayerRef
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.pool import MAX_START_FAILURES, FreshSandboxes, WarmPool, WarmPools, fixed_image
from furlong.rollout.records import rollout_metrics
from furlong.train.trainer import LocalTrainer
from tests_support import agent_params, grpo, make_task

QUIET = Console(file=open(os.devnull, "w"))
REWARD_IF_DONE = "test -f /tmp/done && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt"


class CommandAgent:
    """A scripted agent: runs fixed commands, as a model's tool calls would."""

    def __init__(self, *commands: str, name: str = "commands"):
        self.commands, self.name = commands, name

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        for cmd in self.commands:
            await sandbox.exec(cmd, timeout_s=timeout_s)
        return AgentRun(commands=len(self.commands))


class DaemonKiller:
    """Tries to kill the sandbox's init from an agent command, as a policy that cannot solve a task
    might, to make its episode vanish. The init survives, so the episode is simply scored."""

    name = "daemon-killer"

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        await sandbox.exec("touch /tmp/done; kill -9 1; kill -STOP 1; kill -9 -1", timeout_s=10)
        return AgentRun(commands=1)


class SandboxEnder:
    """The sandbox dies under the agent (whatever the cause): scored, never dropped."""

    name = "sandbox-ender"

    async def run(self, task, tools, timeout_s):
        sandbox = tools.sandbox  # a Harbor episode's toolbox holds its sandbox
        await sandbox.exec("touch /tmp/done", timeout_s=10)
        await sandbox.inner.close()
        await sandbox.exec("true")
        return AgentRun(commands=2)


class RaisingSandbox:
    """Test double for a sandbox whose replies are malformed: delegates to a real sandbox, but the
    chosen method raises KeyError (what a reply missing a field raises) once `after` calls have gone."""

    def __init__(self, inner, method: str, after: int = 0):
        self.inner, self.method, self.after = inner, method, after

    def __getattr__(self, name: str):
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        async def call(*args, **kwargs):
            if self.after <= 0:
                raise KeyError("exit_code")
            self.after -= 1
            return await real(*args, **kwargs)
        return call


class Breaking:
    """A sandbox source whose first acquires hand out broken sandboxes (`doom` maps acquire number ->
    how), every later one a healthy fresh sandbox."""

    def __init__(self, inner, doom: dict):
        self.inner, self.doom, self.acquired = inner, doom, 0

    async def image(self, task):
        return await self.inner.image(task)

    def reserve(self, task):
        self.inner.reserve(task)

    async def acquire(self, spec_):
        box = await self.inner.acquire(spec_)
        how, self.acquired = self.doom.get(self.acquired), self.acquired + 1
        if how == "killed":
            await box.close()  # the sandbox is gone before the agent's first command
            return box
        return RaisingSandbox(box, *how) if how else box


def fresh(backend, image):
    return FreshSandboxes(backend, fixed_image(image))


def test_killing_the_init_does_nothing_and_a_dead_sandbox_is_scored_zero(backend, store, tmp_path: Path):
    tasks = [make_task(tmp_path, "kill", "k", REWARD_IF_DONE), make_task(tmp_path, "end", "e", REWARD_IF_DONE),
             make_task(tmp_path, "fine", "f", REWARD_IF_DONE)]
    agents = {"kill": DaemonKiller(), "end": SandboxEnder(), "fine": CommandAgent("touch /tmp/done")}

    class Mixed:
        name = "mixed"

        async def run(self, task, tools, timeout_s):
            return await agents[task.id].run(task, tools, timeout_s)

    killer, ended, fine = run(run_eval(tasks, Mixed(), backend, store, 2, None, QUIET))
    assert (killer.reward, killer.status) == (1.0, "ok"), killer.error  # the init survived kill -9 -1
    assert (ended.reward, ended.status) == (0.0, "agent_broke_sandbox") and "SandboxDied" in ended.error
    assert (fine.reward, fine.status) == (1.0, "ok")
    s = summarize([killer, ended, fine])
    assert s["status"] == {**dict.fromkeys(STATUSES, 0), "ok": 2, "agent_broke_sandbox": 1}
    assert (s["scored"], s["pass_rate"], s["infra_errors"]) == (3, 2 / 3, 0)


def test_a_sandbox_that_cannot_start_is_infra_error(backend, base_image, tmp_path: Path):
    task = make_task(tmp_path, "t", "t", REWARD_IF_DONE)
    missing = ImageRef(digest="missing", layers=(LayerRef("missing", "no-such-layer"),))
    res = run(run_task_episode(task, OracleAgent(), backend, missing))
    assert (res.reward, res.status) == (None, "infra_error") and res.error.startswith("sandbox did not start")

    async def pooled():
        async with WarmPools(backend, fixed_image(missing)) as pools:
            pools.reserve(task)
            return await asyncio.wait_for(run_outcome(task, NoopAgent(), pools), 60)  # bounded, never a hang

    out = run(pooled())
    assert (out.reward, out.status) == (None, "infra_error") and f"{MAX_START_FAILURES} sandboxes" in out.error


@pytest.mark.parametrize("method", ["exec", "read_file"])
def test_a_malformed_reply_is_scored_and_never_propagates(backend, base_image, tmp_path: Path, method: str):
    """exec raises in the agent phase; read_file (reading the reward) in the verifier phase."""
    task = make_task(tmp_path, "t", "t", REWARD_IF_DONE)
    source = Breaking(fresh(backend, base_image), {0: (method, 0)})
    out = run(run_outcome(task, CommandAgent("touch /tmp/done"), source))
    assert (out.reward, out.status) == (0.0, "agent_broke_sandbox") and "KeyError" in out.error
    assert source.acquired == (1 if method == "exec" else 2)  # a verifier failure is checked in a clean sandbox


def test_tests_that_write_no_reward_are_a_task_bug(backend, base_image, tmp_path: Path):
    task = make_task(tmp_path, "silent", "s", "echo no reward")
    out = run(run_outcome(task, CommandAgent("touch /tmp/done"), fresh(backend, base_image)))
    assert (out.reward, out.status) == (None, "infra_error") and "task bug" in out.error


SABOTAGES = [
    "rm -rf /logs && touch /logs",  # the verifier cannot even make its log directory
    "(while :; do rm -f /logs/verifier/reward.txt; sleep 0.01; done) >/dev/null 2>&1 &",  # eats the reward
    "head -c 600M /dev/zero > /logs/agent/fill",  # fills the agent's log mount, beside the verifier's
]


@pytest.mark.parametrize("sabotage", SABOTAGES)
def test_an_agent_cannot_keep_the_tests_from_scoring(backend, base_image, tmp_path: Path, sabotage: str):
    """/logs and /tests are the verifier's (docs/sandboxes.md): the sabotage fails, the tests score."""
    assert backend.subids is not None, "this machine maps many uids (root, or a user with /etc/subuid)"
    task = make_task(tmp_path, "t", "t", REWARD_IF_DONE + "; sleep 0.3")
    out = run(run_outcome(task, CommandAgent(sabotage), fresh(backend, base_image)))
    assert (out.reward, out.status, out.error) == (0.0, "ok", None)


@pytest.mark.parametrize("sabotage", SABOTAGES[:2])
def test_with_one_uid_an_agent_that_keeps_the_tests_from_scoring_gets_zero(store, base_image, tmp_path: Path,
                                                                          sabotage: str):
    one_uid = BwrapBackend(layers=store, many_uids=False)  # the verifier is the agent: the sabotage works
    task = make_task(tmp_path, "t", "t", REWARD_IF_DONE + "; sleep 0.3")
    out = run(run_outcome(task, CommandAgent(sabotage), fresh(one_uid, base_image)))
    assert (out.reward, out.status) == (0.0, "agent_broke_sandbox") and "not in a fresh one" in out.error


def test_pass_rate_and_per_family_rates_share_the_scored_denominator(backend, store, tmp_path: Path):
    def fam(name, family, test):
        return replace(make_task(tmp_path, name, name, test), family=family)

    tasks = [fam("a1", "a", REWARD_IF_DONE), fam("a2", "a", "echo 0 > /logs/verifier/reward.txt"),
             fam("b1", "b", REWARD_IF_DONE), fam("b2", "b", "echo no reward")]
    results = run(run_eval(tasks, CommandAgent("touch /tmp/done"), backend, store, 2, None, QUIET))
    s = summarize(results)
    assert [r.status for r in results] == ["ok", "ok", "ok", "infra_error"]
    assert (s["episodes"], s["scored"], s["infra_errors"], s["pass_rate"]) == (4, 3, 1, 2 / 3)
    assert s["per_family"]["a"] == {"pass_at_1": 0.5, "mean_reward": 0.5, "episodes": 2, "scored": 2, "infra_errors": 0,
                                    "pass_at_k": {"1": 0.5}}
    assert s["per_family"]["b"] == {"pass_at_1": 1.0, "mean_reward": 1.0, "episodes": 2, "scored": 1, "infra_errors": 1,
                                    "pass_at_k": {"1": 1.0}}
    weighted = sum(f["pass_at_1"] * f["scored"] for f in s["per_family"].values()) / s["scored"]
    assert weighted == pytest.approx(s["pass_rate"])


class Recording:
    """The real backend, remembering what it made, so a test can see and kill pooled sandboxes."""

    def __init__(self, backend):
        self.backend, self.made = backend, []

    async def create(self, spec_):
        self.made.append(await self.backend.create(spec_))
        return self.made[-1]


def test_warm_pool_hands_each_sandbox_out_once_and_replaces_dead_ones(backend, base_image):
    async def go():
        rec = Recording(backend)
        pool = WarmPool(rec, spec(base_image), size=2)
        await pool.start()
        await rec.made[0].close()  # dies while waiting in the pool
        boxes = await asyncio.gather(*(pool.acquire() for _ in range(5)))
        assert rec.made[0] not in boxes and len({id(b) for b in boxes}) == 5 and all(b.alive for b in boxes)
        for i, box in enumerate(boxes):  # each is fresh: nothing of another episode's writes
            assert (await box.exec(f"test -e /tmp/mine && echo seen; echo {i} > /tmp/mine")).stdout == ""
        await asyncio.gather(*(b.close() for b in boxes))
        await pool.close()
        assert not any(b.alive for b in rec.made)  # nothing left running after close

    run(go())


def test_reserved_sandboxes_are_used_by_the_episodes_and_closed_after(backend, base_image, tmp_path: Path):
    tasks = [make_task(tmp_path, f"t{i}", "t", REWARD_IF_DONE) for i in range(2)]

    async def go():
        rec = Recording(backend)
        async with WarmPools(rec, fixed_image(base_image)) as pools:
            for task in (*tasks, tasks[0]):  # one more than will be used
                pools.reserve(task)
            while len(rec.made) < 3 or not all(b.alive for b in rec.made):
                await asyncio.sleep(0.01)
            outs = await asyncio.gather(*(run_outcome(t, CommandAgent("touch /tmp/done"), pools) for t in tasks))
            assert [o.reward for o in outs] == [1.0, 1.0] and len(rec.made) == 3  # no start on demand
        assert not any(b.alive for b in rec.made) and not pools.pools  # the spare is closed with the phase

    run(go())


def test_rollout_with_broken_sandboxes_returns_every_episode_and_trains(tiny_dir, backend, base_image, tmp_path):
    tokenizer = load_tokenizer(tiny_dir)
    tasks = [make_task(tmp_path, f"t{i}", "Create /tmp/done", REWARD_IF_DONE) for i in range(2)]
    plan = plan_step(tasks, 0, tasks_per_step=2, group_size=2, seed=0)

    async def go():
        engine = HFEngine(load_model(tiny_dir), eos_token_ids=())
        try:
            async with WarmPools(backend, fixed_image(base_image)) as pools:
                source = Breaking(pools, {0: "killed", 1: ("exec", 0)})
                rollouts = Rollouts(engine, tokenizer, source, agent_params(max_turns=2, max_new_tokens=24), 4)
                return await rollouts.run(plan.episodes(), temperature=1.0)
        finally:
            await engine.close()

    episodes = run(go())
    assert len(episodes) == 4 and all(e.response_len > 0 for e in episodes)
    broke = [e for e in episodes if e.status == "agent_broke_sandbox"]
    assert len(broke) == 2 and {e.reward for e in broke} == {0.0}
    assert all(e.status in ("ok", "truncated") and e.reward in (0.0, 1.0) for e in episodes if e not in broke)
    assert rollout_metrics(episodes)["status_agent_broke_sandbox"] == 2 and pass_rate(episodes) == 0.0
    stats = LocalTrainer(load_model(tiny_dir), grpo(filter_zero_variance=False)).train_step(episodes)
    assert stats.episodes_dropped == 0  # scored episodes: trained on
