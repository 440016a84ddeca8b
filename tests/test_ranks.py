"""The rank-group seam (furlong.train.ranks.LocalRanks): real spawned processes in one gloo group."""

from __future__ import annotations

import os
import signal

import pytest

from furlong.train.ranks import LocalRanks, RankFailed, RankGroup
from tests.ranks_support import SumSpec


def test_calls_run_every_rank_in_order_and_a_rank_that_raises_closes_the_group():
    group = LocalRanks(SumSpec(offset=1.0), 2)
    assert isinstance(group, RankGroup)
    assert group.call("all_sum", 2.0) == [(0, 6.0), (1, 6.0)]  # (1 + 2) * 2 on each rank
    assert group.call("pid") == group.pids
    with pytest.raises(RankFailed, match=r"^rank [01] raised .*pickle"):  # a result that cannot travel
        group.call("unpicklable")
    group = LocalRanks(SumSpec(), 2)
    with pytest.raises(RankFailed) as info:
        group.call("explode", 1)
    assert info.value.rank == 1 and str(info.value) == "rank 1 raised KeyError: 'boom'"
    assert "Traceback" in info.value.detail
    with pytest.raises(RuntimeError, match="closed"):
        group.call("pid")


def test_a_rank_that_fails_to_start_is_named():
    with pytest.raises(RankFailed, match=r"^rank 1 raised ValueError: rank 1 refuses to start$"):
        LocalRanks(SumSpec(fail_rank=1), 2)


def test_a_killed_rank_fails_the_next_call_without_hanging():
    group = LocalRanks(SumSpec(), 2)
    os.kill(group.pids[1], signal.SIGKILL)
    with pytest.raises(RankFailed, match=r"^rank 1 died: killed by SIGKILL$"):
        group.call("all_sum", 1.0)
    group.close()  # already closed: a no-op
