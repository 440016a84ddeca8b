"""The parity suite (tasks-parity/): tasks that pass under Harbor with Docker pass here too.

Each task's tests use something that behaves differently when furlong's sandbox is not what Docker gives
Harbor: tools that check who owns a file (git, ssh, sudo, Python's netrc, a server that checks its data
directory as PostgreSQL does), a service the agent left running, a C extension built with the image's
python while furlong's verifier toolchain is stacked on the image, packages fetched at test time, and an
allowlisted host. The oracle scores 1 on every task and the no-op agent 0, through `furlong eval` as a user
runs it (CI runs this module as root and again as an ordinary user: .ci/user-tests).

The network: tasks that name no network mode get the package indexes in their verifier phase
(`sandbox.network.verifier=packages`, the setting that lets Terminal-Bench 2's test-time installs work
while the agent stays offline), and networked sandboxes trust the host's CA, as this machine's
TLS-intercepting proxy needs. Both are what a user running these tasks here would set.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from furlong.config import REPO_ROOT

SUITE = REPO_ROOT / "tasks-parity"
OVERRIDES = ("sandbox.network.verifier=packages", "images.trust_host_ca=true")


def _eval(agent: str, out: Path) -> dict[str, dict]:
    res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(SUITE), "--agent", agent,
                          "--out", str(out), *OVERRIDES], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return {r["task"]: r for r in map(json.loads, out.read_text().splitlines())}


def _failures(records: dict[str, dict], reward: float) -> dict[str, tuple]:
    return {task: (r["reward"], r["status"], r.get("error"), (r.get("verifier_output") or "")[-600:])
            for task, r in records.items() if (r["reward"], r["status"]) != (reward, "ok")}


@pytest.mark.slow
def test_oracle_passes_every_task_and_noop_none(tmp_path: Path):
    expected = {p.name for p in SUITE.iterdir() if (p / "task.toml").is_file()}
    oracle = _eval("oracle", tmp_path / "oracle.jsonl")
    assert set(oracle) == expected
    assert not _failures(oracle, 1.0), _failures(oracle, 1.0)
    assert not any(r["tampered_paths"] for r in oracle.values()), {t: r["tampered_paths"] for t, r in oracle.items()}
    noop = _eval("noop", tmp_path / "noop.jsonl")
    assert set(noop) == expected
    assert not _failures(noop, 0.0), _failures(noop, 0.0)


def test_the_docs_figures_are_bench_results_parity_json():
    """docs/tasks.md's parity figures are those bench/parity_bench.py recorded, for the commits it names."""
    result = json.loads((REPO_ROOT / "bench/results/parity.json").read_text())
    doc = " ".join((REPO_ROOT / "docs/tasks.md").read_text().split())
    base, cur = result["baseline"], result["current"]
    assert result["provenance"]["commit"] == cur["commit"] and not result["provenance"]["dirty"]
    assert (f"at {base['commit'][:7]}, before this work, the oracle scored 1 on {base['oracle_pass']} of the "
            f"{base['n']} tasks") in doc
    assert f"at {cur['commit'][:7]} it scored 1 on all {cur['oracle_pass']}" in doc and cur["oracle_pass"] == cur["n"]
    assert f"the no-op agent 0 on all {cur['noop_zero']}" in doc and cur["noop_zero"] == cur["n"]
