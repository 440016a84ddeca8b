"""One episode never ends a run (issue 48): an exception while an episode is scored is that episode's
infra_error, its traceback recorded, and the scheduler hands out its group with the other episodes scored.
(tests/test_openenv_consume.py has the same through `furlong train` on a real OpenEnv server.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import run
from tests_support import agent_params, make_task

from furlong.agent.runner import AgentRun, run_outcome
from furlong.engine.hf import HFEngine
from furlong.envs.base import Score
from furlong.model.loading import load_model, load_tokenizer
from furlong.rollout.groups import Rollouts
from furlong.rollout.records import settled_records
from furlong.rollout.scheduler import GroupStream, Scheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScorerBug(RuntimeError):
    """What the environment's score raises for one episode."""


@dataclass
class Answers:
    """A toolbox without tools: the model's first turn is its answer, and ends the conversation."""

    schemas: tuple = ()


class AnswerEpisode:
    """One opened episode (furlong.envs.base.EpisodeEnv) that scores 1.0, or raises ScorerBug; with
    `close_fails`, closing it raises."""

    note = None
    seconds, calls = 0.0, 0

    def __init__(self, fails: bool, close_fails: bool = False):
        self.tools, self.fails, self.close_fails = Answers(), fails, close_fails

    def caused(self, exc: BaseException) -> bool:
        return False

    async def score(self) -> Score:
        if self.fails:
            raise ScorerBug("the scorer could not read the server's reply")
        return Score(reward=1.0)

    async def close(self) -> None:
        if self.close_fails:
            raise ScorerBug("the session would not close")


class OneScoreFails:
    """An Environment whose `fail_at`-th opened episode (0-based) raises from its score."""

    def __init__(self, fail_at: int):
        self.fail_at, self.opened = fail_at, 0

    def reserve(self, spec) -> None:
        pass

    async def open(self, spec, clock) -> AnswerEpisode:
        self.opened += 1
        return AnswerEpisode(fails=self.opened - 1 == self.fail_at)


def test_an_exception_scoring_one_episode_does_not_leave_the_scheduler(tiny_dir, tmp_path):
    tasks = [make_task(tmp_path / "tasks", f"t{i}", "Say something", "true") for i in range(2)]
    stream = GroupStream(tasks, tasks_per_step=2, group_size=2, seed=0)
    env = OneScoreFails(fail_at=1)

    async def go():
        engine = HFEngine(load_model(tiny_dir), eos_token_ids=())
        rollouts = Rollouts(engine, load_tokenizer(tiny_dir), env,
                            agent_params(max_turns=1, max_new_tokens=4, max_context_tokens=512), concurrency=2)
        scheduler = Scheduler(rollouts, stream, temperature=1.0, steps_left=1, first_step=0, inflight=2,
                              lookahead=0, max_staleness=0, requeue=False)
        try:
            return await scheduler.next_batch(0)
        finally:
            await scheduler.close()
            await engine.close()

    batch = run(go())
    assert env.opened == 4 and len(batch.groups) == 2
    failed = [e for e in batch.episodes if e.status == "infra_error"]
    assert len(failed) == 1, [(e.status, e.error) for e in batch.episodes]
    bad = failed[0]
    assert bad.reward is None and bad.error == "scoring failed: ScorerBug: the scorer could not read the server's reply"
    assert bad.traceback.startswith("Traceback") and "in score" in bad.traceback and "ScorerBug" in bad.traceback
    assert bad.response_len > 0  # the agent phase ran and its tokens are kept: only the score is missing
    # the group's other episode, and the other group, scored as usual
    assert sorted(e.reward for e in batch.episodes if e is not bad) == [1.0, 1.0, 1.0]
    records = settled_records(batch, step=0, filter_zero_variance=False)
    assert [(r["outcome"], r["traceback"] is None) for r in records].count(("infra_error", False)) == 1
    assert [r["outcome"] for r in records].count("trained") == 3


def test_an_environment_that_fails_to_close_keeps_the_decided_outcome(tmp_path):
    """The score is in when the environment closes: a close that raises is logged, the episode stays scored."""
    class ClosesBadly(OneScoreFails):
        async def open(self, spec, clock) -> AnswerEpisode:
            return AnswerEpisode(fails=False, close_fails=True)

    class Done:
        name = "done"

        async def run(self, spec, tools, timeout_s) -> AgentRun:
            return AgentRun()

    task = make_task(tmp_path / "tasks", "t", "Say something", "true")
    outcome = run(run_outcome(task, Done(), ClosesBadly(fail_at=-1)))
    assert (outcome.status, outcome.reward, outcome.traceback) == ("ok", 1.0, None)
