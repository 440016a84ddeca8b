"""The harbor environment backend (furlong.build.harbor_box, furlong.build.harbor_environment).

The trial tests drive a real bwrap sandbox through HarborBox the way harbor 0.25's trial does (oracle:
upload /solution, run solve.sh as the default user; verifier: upload /tests, run test.sh as the default
user, download /logs/verifier), locally and through a sandbox host (sandbox.backend=remote). The real
`harbor` drives furlong's environment in tests/test_harbor_real.py.
"""

from __future__ import annotations

import ast
import asyncio
import shutil
from pathlib import Path

import pytest

from furlong.build.harbor_box import HarborBox, harbor_box, split_overrides, task_dir_of
from furlong.config import load_config
from furlong.sandbox.network import NO_NETWORK, PUBLIC, NetworkPolicy
from furlong.sandbox.pool import StoreImages
from furlong.tasks.loader import load_task
from host_support import ProcessHost

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "tasks" / "crlf-cleanup"
IMPLEMENTED = {"type", "_validate_definition", "start", "stop", "exec", "upload_file", "upload_dir",
               "download_file", "download_dir"}
HOOKS = {"_apply_network_policy"}  # harbor's optional hooks it overrides (dynamic_network_policy)


def trial(box: HarborBox, tmp: Path, oracle: bool) -> str:
    async def go() -> str:
        await box.start()
        try:
            if oracle:
                await box.upload_dir(TASK / "solution", "/solution")
                res = await box.exec("bash /solution/solve.sh > /logs/agent/oracle.txt 2>&1")
                assert res.return_code == 0, res
            await box.exec("rm -f /logs/verifier/reward.txt", user="root")
            await box.upload_dir(TASK / "tests", "/tests")
            await box.exec("bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1")
            await box.download_dir("/logs/verifier", tmp / "verifier")
            return (tmp / "verifier" / "reward.txt").read_text().strip()
        finally:
            await box.stop()
    return asyncio.run(go())


@pytest.fixture()
def make_box(store, backend):
    def make() -> HarborBox:
        return HarborBox(load_task(TASK), backend, StoreImages(store, backend))
    return make


def test_oracle_passes_and_nop_fails(make_box, tmp_path: Path):
    assert trial(make_box(), tmp_path / "oracle", oracle=True) == "1"
    assert trial(make_box(), tmp_path / "nop", oracle=False) == "0"


def test_agent_cannot_touch_the_verifiers_files(make_box):
    async def go() -> tuple[int, int, str]:
        box = make_box()
        await box.start()
        try:
            await box.upload_dir(TASK / "tests", "/tests")
            as_agent = await box.exec("echo 1 > /logs/verifier/reward.txt", user="agent")
            tamper = await box.exec("echo x >> /tests/test.sh", user="agent")
            who = await box.exec("id -u", user="root")
            return as_agent.return_code, tamper.return_code, who.stdout.strip()
        finally:
            await box.stop()
    agent_code, tamper_code, root_uid = asyncio.run(go())
    assert agent_code != 0 and tamper_code != 0
    assert root_uid != "" and int(root_uid) >= 0  # harbor's "root" is the sandbox's verifier, not host root


def test_oracle_passes_and_nop_fails_through_a_host_with_nothing_built_here(tmp_path: Path, monkeypatch):
    """harbor_box as harbor's `--ek overrides=...` makes it: the sandboxes and the task's image on a
    `furlong sandbox serve` host. This process's furlong cache stays untouched: no image store, no bwrap
    (so a client without either, harbor in its chroot, works)."""
    host = ProcessHost(tmp_path / "host")  # its environment (and cache) captured before the one below
    here = tmp_path / "client-cache"
    monkeypatch.setenv("FURLONG_CACHE", str(here))
    overrides = split_overrides(f"sandbox.backend=remote,sandbox.hosts=[{host.url}],"
                                f"sandbox.host_token_file={tmp_path / 'host' / 'tok'}")
    try:
        for oracle, reward in ((True, "1"), (False, "0")):
            box = harbor_box(TASK / "environment", network=PUBLIC, overrides=overrides)
            assert trial(box, tmp_path / f"trial-{oracle}", oracle) == reward
        assert host.metrics()["start_s"]["p50"] is not None, "the sandboxes ran on the host"
    finally:
        host.stop()
    assert not here.exists(), f"the client built or cached something: {sorted(here.rglob('*'))}"


def test_overrides_split_at_commas_outside_lists():
    """harbor's `--ek overrides=...` is one string; a YAML list in it keeps its commas."""
    text = "sandbox.hosts=[http://a:1, http://b:2],sandbox.seccomp=true, images.x={a: 1, b: '2,3'},"
    assert split_overrides(text) == ("sandbox.hosts=[http://a:1, http://b:2]", "sandbox.seccomp=true",
                                     "images.x={a: 1, b: '2,3'}")
    assert split_overrides("") == ()
    cfg = load_config(None, list(split_overrides("sandbox.backend=remote,sandbox.hosts=[http://a:1,http://b:2]")))
    assert cfg.sandbox.hosts == ["http://a:1", "http://b:2"]


def test_a_task_without_a_network_mode_gets_furlongs_default_not_harbors_public(tmp_path: Path):
    """harbor gives a task that names no mode `public`; the hook gives it sandbox.network's phases. A task
    that names a mode runs with harbor's policies as harbor passes them (its switches: test_network_phases)."""
    assert not load_task(TASK).network.named
    box = harbor_box(TASK / "environment", network=PUBLIC, phases=(PUBLIC, PUBLIC))
    assert (box.network, box.phases, box.follow_harbor) == (NO_NETWORK, (NO_NETWORK,), False)
    box = harbor_box(TASK / "environment", network=PUBLIC, overrides=("sandbox.network.verifier=packages",))
    assert (box.network, box.phases[0].mode) == (NO_NETWORK, "packages")
    named = tmp_path / "named"
    shutil.copytree(TASK, named)
    toml = (named / "task.toml").read_text()
    (named / "task.toml").write_text(toml.replace("[verifier]\n", '[verifier]\nnetwork_mode = "allowlist"\n'
                                                                  'allowed_hosts = ["pypi.org"]\n'))
    allow = NetworkPolicy("allowlist", ("pypi.org",))
    box = harbor_box(named / "environment", network=PUBLIC, phases=(PUBLIC, allow))
    assert (box.network, box.phases, box.follow_harbor) == (PUBLIC, (PUBLIC, allow), True)


def test_download_and_upload_single_files(make_box, tmp_path: Path):
    src = tmp_path / "hello.txt"
    src.write_text("hi\n")

    async def go() -> str:
        box = make_box()
        await box.start()
        try:
            await box.upload_file(src, "/app/sub/hello.txt")
            await box.download_file("/app/sub/hello.txt", tmp_path / "back" / "hello.txt")
            return (tmp_path / "back" / "hello.txt").read_text()
        finally:
            await box.stop()
    assert asyncio.run(go()) == "hi\n"


def test_task_dir_must_hold_task_toml(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="task.toml"):
        task_dir_of(tmp_path / "environment")
    assert task_dir_of(TASK / "environment") == TASK


def test_adapter_defines_every_abstract_method_named_here():
    """Without harbor installed: the adapter's source defines exactly IMPLEMENTED and HOOKS (and capabilities,
    empty_dirs)."""
    tree = ast.parse((ROOT / "furlong" / "build" / "harbor_environment.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FurlongEnvironment")
    names = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    # empty_dirs is harbor's, overridden so that the verifier's own directories stay its own
    assert names - {"__init__", "capabilities", "empty_dirs"} == IMPLEMENTED | HOOKS


def test_emptying_the_tests_hands_the_sandbox_back_to_the_agent(make_box):
    """harbor's multi-step trial empties /tests and /logs/verifier before its next step: the default user is
    the agent again, and /logs/verifier stays the verifier's (harbor's `chmod 777` there is not applied)."""
    box = make_box()

    async def go():
        await box.start()
        try:
            await box.upload_dir(TASK / "tests", "/tests")
            assert box.verifying
            await box.exec("echo 1 > /logs/verifier/reward.txt")
            await box.empty_verifier_dirs(["/tests", "/logs/verifier"])
            return box.verifying, await box.exec("ls -A /tests /logs/verifier; touch /logs/verifier/reward.txt")
        finally:
            await box.stop()
    verifying, res = asyncio.run(go())
    assert not verifying and res.return_code != 0 and "reward.txt" not in res.stdout
