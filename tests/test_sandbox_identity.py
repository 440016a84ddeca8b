"""The sandbox's two identities, attacked from the agent's side and checked on the host.

The agent is uid 0 without capabilities; the verifier is uid 65533 of the sandbox, root of a user
namespace of its own, and owns /tests and /logs (docs/sandboxes.md, "The verifier's own identity").
CI runs this file as root and again as an ordinary user (with a subordinate id range).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import pytest

from conftest import run, spec
from furlong.sandbox.runtime import idmap
from furlong.sandbox.base import SandboxError

CAPS = "grep -E '^Cap(Eff|Bnd)' /proc/self/status | awk '{print $2}' | tr '\\n' ' '"


@pytest.fixture
def many_uids(backend):
    assert backend.subids is not None, f"sandboxes here have one uid: {idmap.problem()}"
    return backend


def test_the_agent_has_no_capability_and_the_verifier_is_root_of_its_own_namespace(many_uids, base_image):
    async def go():
        box = await many_uids.create(spec(base_image))
        try:
            agent = await box.exec(f"id -u; {CAPS}")
            # the kernel's view, without the ownership shim (which shows the agent's uid as root's too)
            verifier = await box.exec(f"id -u; {CAPS}; env -u LD_PRELOAD stat -c %u /tests /logs/verifier /logs/agent",
                                      as_verifier=True)
            seen_by_agent = await box.exec("stat -c %u /tests /logs /logs/verifier /logs/agent")
            return agent.stdout.split(), verifier.stdout.split(), seen_by_agent.stdout.split()
        finally:
            await box.close()

    agent, verifier, owners = run(go())
    assert agent == ["0", "0000000000000000", "0000000000000000"]
    assert verifier[0] == "0" and verifier[1] == verifier[2] != "0000000000000000"
    assert verifier[3:] == ["0", "0", str(idmap.VERIFIER_UID)]  # its own mounts are root's in its view
    assert owners == [str(idmap.VERIFIER_UID)] * 3 + ["0"]  # ... and the verifier's uid in the agent's


def test_the_agent_cannot_write_rename_or_remove_the_verifiers_mounts(many_uids, base_image):
    attacks = ["echo 1 > /logs/verifier/reward.txt", "mv /logs /logs2", "mv /tests /t2", "rmdir /tests",
               "touch /tests/x", "rm -rf /logs/verifier", "chmod 777 /tests", "ln -s /tmp /tests/link"]

    async def go():
        box = await many_uids.create(spec(base_image))
        try:
            results = [await box.exec(a) for a in attacks]
            listing = await box.exec("ls -A /tests /logs/verifier; stat -c %a /tests", as_verifier=True)
            return results, listing.stdout
        finally:
            await box.close()

    results, listing = run(go())
    for attack, res in zip(attacks, results):
        assert res.exit_code != 0, f"{attack!r} succeeded: {res}"
    assert listing == "/logs/verifier:\n\n/tests:\n711\n"  # listable by nobody else; its files owner-only


def test_the_agent_cannot_signal_trace_or_read_the_verifiers_processes(many_uids, base_image):
    probe = ("pid=$(pgrep -u 65533 -f 'sleep 4' | head -1); echo pid=$pid; kill -9 $pid; kill -STOP $pid; "
             "kill -9 -1; python3 -c \"import ctypes, os, sys; l = ctypes.CDLL(None, use_errno=True); "
             "print('ptrace', l.ptrace(16, int(sys.argv[1]), 0, 0), os.strerror(ctypes.get_errno()))\" $pid; "
             "cat /proc/$pid/environ /proc/$pid/mem 2>&1 | head -c 300")

    async def go():
        box = await many_uids.create(spec(base_image))
        try:
            tests = asyncio.create_task(box.exec("sleep 4; echo survived", timeout_s=30, as_verifier=True))
            await asyncio.sleep(0.5)
            attack = await box.exec(probe)
            return attack, await tests
        finally:
            await box.close()

    attack, tests = run(go())
    assert "pid=" in attack.stdout and attack.stdout.split()[0] != "pid="
    assert "ptrace -1 Operation not permitted" in attack.stdout
    assert "Permission denied" in attack.stdout
    assert (tests.exit_code, tests.stdout) == (0, "survived\n")


def test_the_verifier_installs_and_removes_packages_as_root_would(many_uids, base_image):
    async def go():
        box = await many_uids.create(spec(base_image))
        try:
            agent_file = await box.exec("echo mine > /usr/local/agent.txt && stat -c %u /usr/local/agent.txt")
            verifier = await box.exec("apt-get remove -y procps >/dev/null 2>&1; echo rc=$?; command -v ps; "
                                      "echo x >> /usr/local/agent.txt && echo appended", as_verifier=True)
            return agent_file.stdout, verifier.stdout
        finally:
            await box.close()

    agent_file, verifier = run(go())
    assert agent_file == "0\n"
    assert verifier == "rc=0\nappended\n"  # dpkg ran as root, and ps is gone


def test_verifier_calls_never_use_the_agents_shell_state(many_uids, base_image):
    async def go():
        box = await many_uids.create(spec(base_image))
        try:
            await box.exec("mkdir -p /tmp/evil && printf '#!/bin/sh\\necho forged\\n' > /tmp/evil/python3 && "
                           "chmod +x /tmp/evil/python3; export PATH=/tmp/evil:$PATH; cd /tmp")
            assert (await box.exec("python3 -V")).stdout == "forged\n"  # the agent's own state persists
            return await box.exec("pwd; python3 -c 'print(1)'", as_verifier=True)
        finally:
            await box.close()

    res = run(go())
    assert res.stdout == "/\n1\n"


@pytest.mark.parametrize("uid", [idmap.INIT_UID, idmap.VERIFIER_UID])
def test_an_image_whose_user_is_the_init_or_the_verifier_is_refused(many_uids, base_image, uid: int):
    image = dataclasses.replace(base_image, digest=f"{base_image.digest}-user{uid}", user=str(uid))
    with pytest.raises(SandboxError, match=f"USER {uid} is uid {uid}, which furlong keeps"):
        run(many_uids.create(spec(image)))


def test_the_init_is_neither_root_nor_the_agent_and_ends_with_bwrap(many_uids, base_image):
    """The init leaves uid 0 (an agent's `kill -9 -1` cannot reach what it forks); bwrap's end is still its end."""
    async def go():
        box = await many_uids.create(spec(base_image))
        await box.exec("true")
        init = _children(box._proc.pid)
        seen = await box.exec("ps -o uid= -p 1; kill -9 -1; sleep 0.2; echo alive")
        os.kill(box._proc.pid, signal.SIGKILL)
        for _ in range(300):
            if not box.alive and not any(_running(p) for p in init):
                break
            await asyncio.sleep(0.01)
        await box.close()
        return seen, init, box.alive, [p for p in init if _running(p)]

    seen, init, alive, left = run(go())
    assert seen.stdout.split() == [str(idmap.INIT_UID), "alive"] and init
    assert not alive and not left


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except OSError:
        return False
