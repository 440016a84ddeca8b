"""A task's network per phase, through whole episodes (furlong's runner, real sandboxes, the real egress
proxy): the agent phase offline, the tests with their own policy; the control run with the tests' policy;
a task that names no mode under a configured default; the same switch through a sandbox host."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run
from host_support import ThreadHost, remote
from network_support import BODY, NAME, serve_allowed
from rich.console import Console

from furlong.build.sandbox import network_default
from furlong.config import load_config
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.run import run_eval
from furlong.sandbox import network
from furlong.sandbox.base import SandboxSpec
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.sandbox.runtime.egress import host_egress
from furlong.tasks.loader import load_task
from furlong.tasks.network import with_default

QUIET = Console(quiet=True)
PHASES = f'[agent]\nnetwork_mode = "no-network"\n[verifier]\nnetwork_mode = "allowlist"\nallowed_hosts = ["{NAME}"]\n'


@pytest.fixture(scope="module")
def allowed(store, tmp_path_factory):
    served = serve_allowed(tmp_path_factory.mktemp("allowed"), store)
    yield served
    served.close()


def _task(root: Path, name: str, toml: str, solve: str, test: str):
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("Leave the network alone.")
    (d / "solution" / "solve.sh").write_text(solve)
    (d / "tests" / "test.sh").write_text(test)
    return load_task(d)


def _fetch(port: int) -> str:
    return (f"python3 -c \"import urllib.request; print(urllib.request.urlopen('http://{NAME}:{port}/', "
            f"timeout=10).read().decode())\"")


def test_the_tests_get_their_phases_network_and_the_agent_stays_offline(allowed, store, tmp_path: Path):
    """The oracle's solution cannot reach the allowed host, nor can the process it leaves running once the
    tests have the network; the tests reach it. The no-op agent's tests run as well, and score 0."""
    fetch = _fetch(allowed.http_port)
    solve = (f"{fetch} > /app/agent-got 2>&1 || true\n"
             f"nohup sh -c 'while true; do {fetch.replace(chr(39), chr(34))} >/dev/null 2>&1 && "
             f"touch /app/leaked; sleep 0.1; done' >/dev/null 2>&1 &\n")
    test = (f"sleep 1; got=$({fetch}) && [ \"$got\" = '{BODY}' ] && grep -q 'HTTP Error 403' /app/agent-got && "
            "[ ! -e /app/leaked ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    task = _task(tmp_path, "phases", PHASES, "mkdir -p /app\n" + solve, test)
    assert (task.agent_network, task.verifier_network) == (network.NO_NETWORK, network.policy("allowlist", [NAME]))
    oracle = run(run_eval([task], OracleAgent(), allowed.backend, store, 1, None, QUIET))
    noop = run(run_eval([task], NoopAgent(), allowed.backend, store, 1, None, QUIET))
    assert [(r.reward, r.status) for r in oracle + noop] == [(1.0, "ok"), (0.0, "ok")], oracle + noop


def test_the_control_run_has_the_verifier_phases_network(allowed, store, tmp_path: Path):
    """Tests that leave no reward in the agent's sandbox but do in a fresh one blame the agent, which they can
    only where the fresh sandbox gives the tests their own phase's network (the agent's has none)."""
    test = (f"[ -e /tmp/broken ] && exit 1\n{_fetch(allowed.http_port)} | grep -qx '{BODY}' && "
            "echo 1 > /logs/verifier/reward.txt\n")
    task = _task(tmp_path, "control", PHASES, "touch /tmp/broken\n", test)
    [result] = run(run_eval([task], OracleAgent(), allowed.backend, store, 1, None, QUIET))
    assert (result.reward, result.status) == (0.0, "agent_broke_sandbox"), result


def test_each_step_of_a_multi_step_task_gets_its_phases_network(allowed, store, tmp_path: Path):
    """Step one: the agent offline, its tests on the allowlist; step two the other way round. The sandbox
    switches for each step's agent phase and for each step's tests."""
    fetch, policy = _fetch(allowed.http_port), f'network_mode = "allowlist"\nallowed_hosts = ["{NAME}"]\n'
    d = tmp_path / "stepped"
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text("two steps")
    (d / "task.toml").write_text('[environment]\nnetwork_mode = "no-network"\n'
                                 '[[steps]]\nname = "one"\n[steps.verifier]\n' + policy +
                                 '[[steps]]\nname = "two"\n[steps.agent]\n' + policy)
    for name, solve, test in (
            ("one", f"{fetch} > /app/one 2>&1 || true", f"grep -q 'HTTP Error 403' /app/one && {fetch} | grep -qx '{BODY}'"),
            ("two", f"{fetch} > /app/two 2>&1 || true", f"grep -qx '{BODY}' /app/two && ! {fetch}")):
        home = d / "steps" / name
        for sub in ("solution", "tests"):
            (home / sub).mkdir(parents=True)
        (home / "instruction.md").write_text(f"step {name}")
        (home / "solution" / "solve.sh").write_text(f"mkdir -p /app\n{solve}\n")
        (home / "tests" / "test.sh").write_text(f"echo 0 > /logs/verifier/reward.txt\n{test} && "
                                                "echo 1 > /logs/verifier/reward.txt\n")
    task = load_task(d)
    assert [(s.network.agent.mode, s.network.verifier.mode) for s in task.steps] == [
        ("no-network", "allowlist"), ("allowlist", "no-network")]
    oracle = run(run_eval([task], OracleAgent(), allowed.backend, store, 1, None, QUIET))
    noop = run(run_eval([task], NoopAgent(), allowed.backend, store, 1, None, QUIET))
    assert [(r.reward, r.status, [s.reward for s in r.steps]) for r in oracle + noop] == [
        (1.0, "ok", [1.0, 1.0]), (0.0, "ok", [0.0, 0.0])], oracle + noop


def test_a_task_without_a_mode_installs_packages_at_test_time_under_the_packages_default(store, tmp_path: Path):
    """A task that names no network mode, run with sandbox.network.verifier=packages and the host's CA lent:
    its agent phase is offline; its tests install a Debian package and reach PyPI over HTTPS, and nothing
    else."""
    solve = "apt-get update > /tmp/agent-apt 2>&1; echo $? > /tmp/agent-apt-exit\n"
    test = ("set -e; [ \"$(cat /tmp/agent-apt-exit)\" != 0 ]\n"
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-six > /dev/null\n"
            "python3 -c 'import six'\n"
            "python3 -c \"import urllib.request as u; assert b'six' in u.urlopen('https://pypi.org/simple/six/', "
            "timeout=30).read()\"\n"
            "if python3 -c \"import urllib.request as u; u.urlopen('https://example.com/', timeout=10)\"; then exit 1; fi\n"
            "echo 1 > /logs/verifier/reward.txt\n")
    task = _task(tmp_path, "unnamed", "[verifier]\ntimeout_sec = 300\n", solve, test)
    assert not task.network.named
    default = network_default(load_config(None, ["sandbox.network.verifier=packages"]).sandbox)
    [task] = with_default([task], default)
    assert (task.agent_network.mode, task.verifier_network.mode) == ("no-network", "packages")
    lent = host_egress(True, None, "none")
    backend = BwrapBackend(layers=store, egress=lent)
    [result] = run(run_eval([task], OracleAgent(), backend, store, 1, None, QUIET))
    assert (result.reward, result.status) == (1.0, "ok"), result


def test_a_sandbox_host_switches_its_sandboxs_network(allowed, store, base_image):
    """The remote backend's sandbox: created offline with a later phase named, switched through the host's
    API for the verifier alone."""
    host = ThreadHost(allowed.backend, base_image, store, allow_network=True)
    rb, _ = remote([host.url])
    allow = network.policy("allowlist", [NAME])

    async def go():
        box = await rb.create(SandboxSpec(base_image, network_phases=(allow,)))
        try:
            before = await box.exec(_fetch(allowed.http_port), as_verifier=True)
            await box.set_network(allow, verifier_only=True)
            return before, await box.exec(_fetch(allowed.http_port), as_verifier=True), box.verifier_uid
        finally:
            await box.close()

    try:
        before, after, _ = run(go())
    finally:
        host.stop()
    assert "HTTP Error 403" in before.stderr and after.stdout == BODY + "\n"
