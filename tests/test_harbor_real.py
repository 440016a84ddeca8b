"""The real `harbor` (the test extra's pin) running furlong's environment: `harbor run` on a bundled task,
its trials in sandboxes of a `furlong sandbox serve` host (sandbox.backend=remote), the rewards read from
harbor's own result files.

harbor needs Python 3.12+. Where this Python has it, it runs here; else in the Debian trixie chroot that
scripts/harbor_env.sh builds (`bash install.sh --harbor`; CI builds it), which has harbor but no bwrap and
no torch: the host makes the sandboxes and builds the task's image.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import skips
from host_support import REPO, ProcessHost
from test_harbor_environment import IMPLEMENTED, TASK

ENV = "furlong.build.harbor_environment:FurlongEnvironment"
SCRIPT = REPO / "scripts" / "harbor_env.sh"
HARBOR_MAIN = "import sys; from harbor.cli.main import app; sys.argv[0] = 'harbor'; app()"
CONTRACT = """
import inspect, json
from harbor.environments.base import BaseEnvironment
from furlong.build.harbor_environment import FurlongEnvironment
print(json.dumps({"abstract": sorted(BaseEnvironment.__abstractmethods__),
                  "left": sorted(FurlongEnvironment.__abstractmethods__),
                  "exec": list(inspect.signature(BaseEnvironment.exec).parameters),
                  "ours": list(inspect.signature(FurlongEnvironment.exec).parameters)}))
"""


def harbor_python(binds: list[Path]) -> list[str]:
    """The command prefix of a Python with harbor (and this checkout) importable: this one, or the chroot's."""
    if importlib.util.find_spec("harbor") is not None:
        return [sys.executable]
    if subprocess.run(["bash", str(SCRIPT), "path"], capture_output=True).returncode != 0:
        skips.skip("extra:harbor", "harbor needs Python 3.12+ or its chroot, which is not built: bash install.sh --harbor")
    if os.geteuid() != 0:
        skips.skip("root", "harbor's chroot (scripts/harbor_env.sh) runs as root only")
    return ["bash", str(SCRIPT), "run", *(a for b in binds for a in ("--bind", str(b))), "--", "python"]


def in_harbor(args: list[str], binds: list[Path], cwd: Path, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    res = subprocess.run([*harbor_python(binds), *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{args[:3]} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def test_furlong_environment_implements_harbors_abstract_methods(tmp_path: Path):
    found = json.loads(in_harbor(["-c", CONTRACT], [tmp_path], tmp_path).strip().splitlines()[-1])
    assert set(found["abstract"]) == IMPLEMENTED
    assert found["left"] == []
    assert found["ours"] == found["exec"]


def rewards(job: Path) -> dict[str, float]:
    """agent name -> reward, from each trial's result.json that harbor wrote (none may have raised)."""
    out = {}
    for result in job.glob("*/result.json"):
        trial = json.loads(result.read_text())
        assert trial["exception_info"] is None, trial["exception_info"]
        out[trial["agent_info"]["name"]] = trial["verifier_result"]["rewards"]["reward"]
    return out


def test_harbor_run_oracle_passes_and_nop_fails_in_a_hosts_sandboxes(tmp_path: Path):
    host = ProcessHost(tmp_path / "host")
    (tmp_path / "agents.json").write_text(json.dumps({"agents": [{"name": "oracle"}, {"name": "nop"}]}))
    overrides = (f"overrides=sandbox.backend=remote,sandbox.hosts=[{host.url}],"
                 f"sandbox.host_token_file={tmp_path / 'host' / 'tok'}")
    try:
        in_harbor(["-c", HARBOR_MAIN, "run", "-y", "-q", "-c", "agents.json", "-p", str(TASK),
                   "-o", str(tmp_path / "jobs"), "--job-name", "furlong", "--env", ENV, "--ek", overrides],
                  [tmp_path], tmp_path)
        assert host.metrics()["start_s"]["p50"] is not None, "the trials' sandboxes ran on the host"
    finally:
        host.stop()
    assert rewards(tmp_path / "jobs" / "furlong") == {"oracle": 1.0, "nop": 0.0}


def test_harbor_scores_separate_verifiers_and_steps_as_furlong_does(tmp_path: Path):
    """harbor's own trials of tests/fixtures/harbor (its separate verifier and multi-step logic; furlong's
    sandboxes for every environment it asks for, a verifier's own included) give the rewards furlong's
    `eval` gives them (tests/test_harbor_steps.py)."""
    fixtures = REPO / "tests" / "fixtures" / "harbor"
    host = ProcessHost(tmp_path / "host")
    (tmp_path / "agents.json").write_text(json.dumps({"agents": [{"name": "oracle"}, {"name": "nop"}]}))
    overrides = (f"overrides=sandbox.backend=remote,sandbox.hosts=[{host.url}],"
                 f"sandbox.host_token_file={tmp_path / 'host' / 'tok'}")
    try:
        in_harbor(["-c", HARBOR_MAIN, "run", "-y", "-q", "-c", "agents.json", "-p", str(fixtures),
                   "-o", str(tmp_path / "jobs"), "--job-name", "steps", "--env", ENV, "--ek", overrides],
                  [tmp_path, fixtures], tmp_path)
    finally:
        host.stop()
    found = {}
    for result in (tmp_path / "jobs" / "steps").glob("*/result.json"):
        trial = json.loads(result.read_text())
        assert trial["exception_info"] is None, trial["exception_info"]
        steps = [(s["step_name"], s["verifier_result"]["rewards"]["reward"]) for s in trial["step_results"] or []]
        found[trial["task_name"], trial["agent_info"]["name"]] = (trial["verifier_result"]["rewards"]["reward"], steps)
    assert found == {("separate-verifier", "oracle"): (1.0, []), ("separate-verifier", "nop"): (0.0, []),
                     ("multi-step", "oracle"): (1.0, [("create", 1.0), ("extend", 1.0), ("publish", 1.0)]),
                     ("multi-step", "nop"): (0.0, [("create", 0.0)])}


NETWORK_TOML = """[agent]
timeout_sec = 120.0
network_mode = "no-network"

[verifier]
timeout_sec = 300.0
network_mode = "allowlist"
allowed_hosts = ["deb.debian.org"]
"""


def test_harbor_run_switches_the_network_per_phase_through_a_host(tmp_path: Path):
    """A task whose agent phase is offline and whose tests may reach the Debian mirror: harbor hands the
    phases' policies to the environment at creation and switches them (dynamic_network_policy) through the
    host's API; the oracle's apt-get fails, the tests' succeeds."""
    task = tmp_path / "phases"
    shutil.copytree(TASK / "environment", task / "environment")
    for d in ("solution", "tests"):
        (task / d).mkdir()
    (task / "task.toml").write_text(NETWORK_TOML)
    (task / "instruction.md").write_text("Try apt-get update.")
    (task / "solution" / "solve.sh").write_text("apt-get update > /tmp/agent-apt 2>&1; echo $? > /tmp/agent-apt-exit\n")
    (task / "tests" / "test.sh").write_text(
        "apt-get update > /tmp/tests-apt 2>&1 && ! grep -q '^Err:' /tmp/tests-apt && "
        "[ \"$(cat /tmp/agent-apt-exit)\" != 0 ] && grep -q '403' /tmp/agent-apt && echo 1 > /logs/verifier/reward.txt "
        "|| echo 0 > /logs/verifier/reward.txt\n")
    host = ProcessHost(tmp_path / "host", allow_network=True)
    (tmp_path / "agents.json").write_text(json.dumps({"agents": [{"name": "oracle"}]}))
    overrides = (f"overrides=sandbox.backend=remote,sandbox.hosts=[{host.url}],"
                 f"sandbox.host_token_file={tmp_path / 'host' / 'tok'}")
    try:
        in_harbor(["-c", HARBOR_MAIN, "run", "-y", "-q", "-c", "agents.json", "-p", str(task),
                   "-o", str(tmp_path / "jobs"), "--job-name", "furlong", "--env", ENV, "--ek", overrides],
                  [tmp_path], tmp_path)
    finally:
        host.stop()
    assert rewards(tmp_path / "jobs" / "furlong") == {"oracle": 1.0}
