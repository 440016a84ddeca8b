"""Tests that try to break out of a sandbox, or to take the host down from inside one."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from pathlib import Path

from conftest import init_host_uid, run, spec
from furlong.sandbox.runtime.cgroups import VERIFIER_PIDS


def _host_server() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    threading.Thread(target=lambda: [srv.accept()[0].close() for _ in range(4)], daemon=True).start()
    return srv, srv.getsockname()[1]


CONNECT = ("python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', {port}), timeout=3); "
           "print('CONNECTED')\"")


# the mirror the image was built from, so no host name is written here
RESOLVE_MIRROR = ("python3 -c \"import socket; "
                  "host=open('/etc/apt/sources.list').read().split('://')[1].split('/')[0]; "
                  "print('RESOLVED', socket.getaddrinfo(host, 80)[0][4][0])\"")


def test_no_network_unless_the_task_declares_it(backend, base_image):
    srv, port = _host_server()

    async def go():
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec(CONNECT.format(port=port), timeout_s=10)
            assert "CONNECTED" not in r.stdout and r.exit_code != 0
            r = await box.exec(RESOLVE_MIRROR, timeout_s=20)
            assert r.exit_code != 0 and "gaierror" in r.stderr
            r = await box.exec("cat /proc/net/dev | grep -v -E 'lo:|Inter|face' | wc -l")
            assert r.stdout.strip() == "0", "only loopback may exist"
        finally:
            await box.close()
        # declared: the same name resolves (so the probe above can fail), yet host loopback stays out of
        # reach, since the sandbox has a network namespace of its own (tests/test_network.py goes further)
        box = await backend.create(spec(base_image, network=True))
        try:
            assert "RESOLVED" in (await box.exec(RESOLVE_MIRROR, timeout_s=20)).stdout
            assert "CONNECTED" not in (await box.exec(CONNECT.format(port=port), timeout_s=10)).stdout
        finally:
            await box.close()

    run(go())
    srv.close()


def test_files_do_not_leak_between_episodes_or_into_the_image(backend, base_image, store):
    async def go():
        box = await backend.create(spec(base_image))
        r = await box.exec("echo secret > /root/left-behind && echo x >> /etc/passwd && rm -rf /usr/bin/git && echo ok")
        assert r.stdout == "ok\n"
        await box.close()
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec("ls /root/left-behind; grep -c '^x$' /etc/passwd; test -x /usr/bin/git && echo git-ok")
            assert "No such file" in r.stderr and r.stdout.splitlines() == ["0", "git-ok"]
        finally:
            await box.close()

    run(go())
    rootfs = store.layer_dir(base_image.layers[0])
    assert not (rootfs / "root" / "left-behind").exists()
    assert (rootfs / "usr" / "bin" / "git").exists()


def test_host_paths_and_kernel_settings_are_out_of_reach(backend, base_image, tmp_path: Path):
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    hostname_before = Path("/proc/sys/kernel/hostname").read_text()

    async def go():
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec(f"cat {marker}; echo pwned > /proc/sys/kernel/hostname; "
                               "echo 1 > /proc/sys/vm/drop_caches; echo 1 > /proc/sysrq-trigger; "
                               "mount -t tmpfs x /mnt; ls /sys/fs/cgroup; "
                               # listed first, then filtered: a grep running beside ls could be caught
                               # with a library open by its loader, which is no leak
                               "fds=$(ls -l /proc/[0-9]*/fd/ 2>/dev/null); "
                               "echo \"$fds\" | grep ' -> /' | grep -v -E ' -> /(dev|proc)/' >&2; "
                               "echo \"$fds\" | grep ' -> /' | grep -c -v -E ' -> /(dev|proc)/'")
            assert "No such file" in r.stderr  # the host's files are simply not there
            refused = r.stderr.lower()  # /proc/sys is read-only (the IPC settings, docs/sandboxes.md)
            assert refused.count("permission denied") + refused.count("read-only file system") >= 3, r.stderr
            assert r.stdout.strip().splitlines()[-1] == "0", f"a host file or directory fd leaked: {r.stderr}"
            caps = (await box.exec("grep CapEff /proc/self/status")).stdout
            assert caps.split()[1] == "0000000000000000"
            # a user namespace inside the sandbox would give the agent capabilities again
            r = await box.exec("python3 -c \"import os; os.unshare(os.CLONE_NEWUSER); print('NEWUSER')\"")
            assert "NEWUSER" not in r.stdout
        finally:
            await box.close()

    run(go())
    assert Path("/proc/sys/kernel/hostname").read_text() == hostname_before
    assert marker.read_text() == "host"


def test_processes_run_as_an_unprivileged_host_uid(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec("sleep 30 & echo $!")
            assert r.exit_code == 0
            pids = box._cgroup.pids()
            uids = {_uid(p) for p in pids} - {None}
            assert uids - {init_host_uid(backend)} == {backend.host_uid} and 0 not in uids | {backend.host_uid}
            assert (await box.exec("id -u")).stdout == "0\n"  # root only inside its own namespace
        finally:
            await box.close()

    run(go())


def _uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective uid
    except OSError:
        return None
    return None


def _host_latency_s() -> float:
    t = time.perf_counter()
    subprocess.run(["true"], check=True)
    return time.perf_counter() - t


def test_fork_bomb_is_contained_and_host_stays_responsive(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image, pids=64, cpus=0.5))
        try:
            bomb = asyncio.create_task(box.exec("bomb() { bomb | bomb & }; bomb; sleep 4", timeout_s=4))
            await asyncio.sleep(1.5)
            worst = max([await asyncio.to_thread(_host_latency_s) for _ in range(5)])
            assert len(box._cgroup.pids()) <= 64 + VERIFIER_PIDS  # the sandbox's whole limit, init side included
            assert 0 < len(box._cgroup.agent_pids()) <= 64 + 1  # the task's limit, and the child waiting for a command
            res = await bomb
            assert res.timed_out or res.exit_code != 0 or "retry" in res.stderr or "fork" in res.stderr
            return worst
        finally:
            await box.close()

    assert run(go()) < 1.0


def test_memory_bomb_is_killed_and_the_sandbox_survives(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image, memory_mb=256))
        try:
            r = await box.exec("python3 -c \"x = bytearray(2 << 30); print('ALLOCATED')\"", timeout_s=30)
            assert "ALLOCATED" not in r.stdout and r.exit_code != 0
            r = await box.exec("python3 -c \"xs = []\nwhile True: xs.append(bytearray(16 << 20))\"", timeout_s=30)
            assert r.exit_code == 137, r  # SIGKILL from the OOM killer, inside the sandbox only
            assert (await box.exec("echo alive")).stdout == "alive\n"
            peak = box.memory_peak_bytes()
            assert peak is not None and peak <= (256 << 20) + (1 << 20)
        finally:
            await box.close()

    run(go())


def test_cpu_limit_caps_cpu_time(backend, base_image):
    busy = "python3 -c \"import time; t=time.time()\nwhile time.time()-t < 2: pass\" & "

    async def go():
        box = await backend.create(spec(base_image, cpus=0.5))
        try:
            r = await box.exec(busy * 2 + "wait; cat /proc/self/stat > /dev/null; times", timeout_s=20)
            children_user = r.stdout.splitlines()[-1].split()[0]  # "XmY.YYYs" of waited children
            minutes, seconds = children_user.rstrip("s").split("m")
            return float(minutes) * 60 + float(seconds)
        finally:
            await box.close()

    cpu = run(go())
    assert cpu < 1.4, f"two 2-second busy loops at cpus=0.5 used {cpu:.2f}s of CPU (cap 1.0s)"
