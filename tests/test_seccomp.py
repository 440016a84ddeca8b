"""The seccomp filter, tried from inside real sandboxes: denied calls get EPERM, a task can lift one name,
a 32-bit syscall is no way around it, and ordinary tools still work under it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run, spec
from furlong.sandbox.runtime import seccomp
from furlong.sandbox.base import SandboxError, SyscallPolicy
from furlong.sandbox.runtime.bwrap import BwrapBackend
from furlong.tasks.loader import load_task
from furlong.tasks.model import TaskError

# Each call is made with arguments that would succeed, or fail for a reason other than the filter,
# so a result of EPERM everywhere means the filter answered.
PROBE = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(256)
CALLS = {
    "io_uring_setup": (1, params), "userfaultfd": (1,), "keyctl": (0, -3, 0), "bpf": (0, None, 0),
    "perf_event_open": (None, 0, -1, -1, 0), "mount": (b"none", b"/mnt", b"tmpfs", 0, None),
    "unshare": (0x20000,), "kexec_load": (0, 0, None, 0),
}
for name, args in CALLS.items():
    ret = libc.syscall(NUMBERS[name], *args)
    print(name, errno.errorcode.get(ctypes.get_errno(), "?") if ret < 0 else "ok")
"""
NUMBERS = {name: seccomp._number(name) for name in
           ("io_uring_setup", "userfaultfd", "keyctl", "bpf", "perf_event_open", "mount", "unshare", "kexec_load")}

# Machine code run from an executable page: a getpid through another ABI than x86_64's.
FOREIGN_ABI = r"""
import ctypes, mmap, sys
code = {"i386": bytes.fromhex("b814000000cd80c3"),   # mov eax, 20 (i386 getpid); int 0x80; ret
        "x32": bytes.fromhex("b8270000400f05c3")}[sys.argv[1]]  # mov eax, 0x40000027 (x32 getpid); syscall
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
print("returned", ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(page)))())
"""


async def _probe(backend, image, policy: SyscallPolicy) -> dict[str, str]:
    box = await backend.create(dataclasses.replace(spec(image), syscalls=policy))
    try:
        await box.write_file("/tmp/probe.py", f"NUMBERS = {NUMBERS!r}\n" + PROBE)
        r = await box.exec("python3 /tmp/probe.py")
        assert r.exit_code == 0, r.stderr
        return dict(line.split() for line in r.stdout.splitlines())
    finally:
        await box.close()


def test_denied_calls_get_eperm_and_allow_lifts_one(backend, base_image):
    async def go():
        return [await _probe(backend, base_image, p) for p in
                (SyscallPolicy(), SyscallPolicy(enabled=False), SyscallPolicy(allow=("io_uring_setup",)))]

    on, off, lifted = run(go())
    assert on == {name: "EPERM" for name in NUMBERS}
    # without the filter the kernel answers: io_uring, userfaultfd and keyrings work for this process
    assert {name for name in NUMBERS if off[name] != "EPERM"} >= {"io_uring_setup"}
    assert lifted == {**on, "io_uring_setup": off["io_uring_setup"]}


@pytest.mark.skipif(os.uname().machine != "x86_64",  # CI is x86_64: a strict run elsewhere fails here
                    reason="int 0x80 and x32 syscalls exist on x86_64 only (the test runs their machine code)")
def test_32bit_and_x32_syscalls_kill_instead_of_bypassing(backend, base_image):
    async def go():
        results = {}
        for enabled in (True, False):
            box = await backend.create(dataclasses.replace(spec(base_image), syscalls=SyscallPolicy(enabled)))
            try:
                await box.write_file("/tmp/abi.py", FOREIGN_ABI)
                for abi in ("i386", "x32"):
                    r = await box.exec(f"python3 /tmp/abi.py {abi}; echo rc=$?")
                    results[enabled, abi] = r.stdout.split()[-1]
                assert (await box.exec("echo alive")).stdout == "alive\n"  # only the caller died
            finally:
                await box.close()
        return results

    results = run(go())
    assert results[True, "i386"] == results[True, "x32"] == "rc=159"  # 128 + SIGSYS
    assert results[False, "i386"] == "rc=0"  # the kernel runs i386 syscalls: without a filter, a way round


def test_ordinary_tools_work_under_the_filter(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            script = ("set -e; bash -c 'echo bash-ok'; python3 -c 'import subprocess, threading; "
                      "threading.Thread(target=print, args=(\"thread-ok\",)).start(); "
                      "subprocess.run([\"true\"], check=True)'; dpkg-query -W -f='${Package}\\n' python3; "
                      "cd /tmp && git init -q repo && git -C repo commit -q --allow-empty -m x && echo git-ok")
            return await box.exec(script, env={"GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@b",
                                               "GIT_COMMITTER_NAME": "a", "GIT_COMMITTER_EMAIL": "a@b"})
        finally:
            await box.close()

    r = run(go())
    assert (r.exit_code, r.stdout.split()) == (0, ["bash-ok", "thread-ok", "python3", "git-ok"]), r.stderr


def test_unknown_name_is_one_clear_error(backend, base_image, tmp_path: Path):
    with pytest.raises(seccomp.SeccompError, match=r"^unknown syscall name 'io_uring_setpu' in the seccomp"):
        seccomp.check(["io_uring_setup", "io_uring_setpu"])
    bad = dataclasses.replace(spec(base_image), syscalls=SyscallPolicy(allow=("nosuchcall",)))
    with pytest.raises(SandboxError, match="'nosuchcall'"):
        run(backend.create(bad))
    task = _task(tmp_path, "seccomp_allow = ['keyctl', 'nosuchcall']")
    with pytest.raises(TaskError, match=r"task.toml: field 'environment.seccomp_allow': unknown syscall name 'nosuchcall'"):
        load_task(task)


def test_task_toml_and_global_switch(backend, base_image, tmp_path: Path):
    assert load_task(_task(tmp_path / "a", "")).syscalls == SyscallPolicy()
    assert load_task(_task(tmp_path / "b", "seccomp = false")).syscalls == SyscallPolicy(enabled=False)
    lifted = load_task(_task(tmp_path / "c", "seccomp_allow = ['io_uring_setup']")).syscalls
    assert lifted == SyscallPolicy(allow=("io_uring_setup",))
    with pytest.raises(TaskError, match="field 'environment.seccomp_allow'"):
        load_task(_task(tmp_path / "d", "seccomp_allow = 'keyctl'"))
    # the backend-wide switch (config sandbox.seccomp) turns the filter off for every spec
    assert run(_probe(BwrapBackend(seccomp=False, layers=backend.layers), base_image, SyscallPolicy()))["io_uring_setup"] != "EPERM"


def test_filter_cost_per_sandbox_is_microseconds():
    policy = SyscallPolicy(allow=("keyctl",))
    os.close(seccomp.filter_fd(policy))  # the one compile for this policy
    start, n = time.perf_counter(), 200
    for _ in range(n):
        fd = seccomp.filter_fd(policy)
        assert os.pread(fd, 8, 0) and os.lseek(fd, 0, os.SEEK_CUR) == 0  # fresh offset: bwrap reads to EOF
        os.close(fd)
    assert (time.perf_counter() - start) / n < 1e-3
    assert seccomp.filter_fd(SyscallPolicy(enabled=False)) is None


def _task(root: Path, environment: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tests").mkdir()
    (root / "task.toml").write_text(f"[environment]\n{environment}\n")
    (root / "instruction.md").write_text("Do it.\n")
    (root / "tests" / "test.sh").write_text("true\n")
    return root


def test_config_switch_reaches_the_sandboxes_of_furlong_eval(tmp_path: Path):
    """sandbox.seccomp=false, given on the command line, lifts the filter in the episodes' sandboxes."""
    task = _task(tmp_path / "probe", "")
    (task / "tests" / "probe.py").write_text(f"NUMBERS = {NUMBERS!r}\n" + PROBE)
    (task / "tests" / "test.sh").write_text(
        "python3 /tests/probe.py | grep -q '^io_uring_setup EPERM$' && echo 0 > /logs/verifier/reward.txt "
        "|| echo 1 > /logs/verifier/reward.txt\n")

    def pass_rate(*overrides: str) -> float:
        res = subprocess.run([sys.executable, "-m", "furlong.cli", "eval", "--tasks", str(task), "--agent", "noop",
                              *overrides], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.splitlines()[-1])["pass_rate"]

    assert pass_rate() == 0.0  # filtered: io_uring_setup is refused with EPERM
    assert pass_rate("sandbox.seccomp=false") == 1.0
