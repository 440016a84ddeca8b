"""`train.ray.address`: `furlong train` joins a Ray cluster it did not start (a real head from `ray start`),
places its actors there, finishes, and leaves the cluster up with none of its actors; and a local cluster
that cannot start fails with the place and the tails of its logs, not Ray's bare "timed out"."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from furlong.cluster.session import RaySession, Roles
from furlong.config import RECIPES
from scripts.ray_head import ray_head

ACTORS = (b"ray::TrainerHost", b"ray::EngineHost")  # the process titles of the run's actors


def _actors() -> list[bytes]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (line := (entry / "cmdline").read_bytes()).startswith(ACTORS):
                found.append(line[:60])
        except OSError:
            continue
    return found


def test_train_joins_a_running_cluster_and_leaves_it_up_without_its_actors(tmp_path: Path):
    run = tmp_path / "run"
    assert not _actors(), "another run's actors are on this host: the check below would prove nothing"
    with ray_head(num_cpus=3) as head:
        cmd = [sys.executable, "-m", "furlong.cli", "train", "--config", str(RECIPES / "smoke.yaml"),
               "train.cluster=ray", f"train.ray.address={head.address}", "train.rl.steps=1", f"train.run_dir={run}"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert (run / "summary.json").exists()
        assert head.up(), "the run stopped a cluster it did not start"
        deadline = time.monotonic() + 60
        while left := _actors():
            assert time.monotonic() < deadline, f"the run's actors outlived its job: {left}"
            time.sleep(0.5)
        logs = [p for p in head.temp.glob("session_*/logs/worker-*.out") if b"TrainerHost" in p.read_bytes()]
        assert logs, "the run's trainer actor did not run on the joined cluster (no worker log of it there)"


def test_a_local_cluster_that_cannot_start_names_its_logs(tmp_path: Path, monkeypatch):
    long = tmp_path / ("x" * 110)  # past AF_UNIX's 107 bytes: the session's sockets cannot be made
    long.mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(long))
    roles = Roles(engines=1, engine_cpus=0.5, trainer_cpus=0.5, placement="colocated")
    with pytest.raises(RuntimeError, match="the local Ray cluster did not start") as err:
        RaySession(roles, timeout_s=30)
    assert f"its logs: {long}/ray/session_" in str(err.value)


def test_a_local_cluster_for_fractional_bundles_gets_whole_cpus():
    """Bundles of 1.5 CPUs in all: Ray counts a node's CPUs in whole numbers, so the run asks for 2."""
    code = ("import ray\nfrom furlong.cluster.session import RaySession, Roles\n"
            "s = RaySession(Roles(engines=2, engine_cpus=0.5, trainer_cpus=0.5, placement='colocated'), "
            "timeout_s=120)\nprint(ray.cluster_resources()['CPU'])\ns.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "2.0"
