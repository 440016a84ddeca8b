"""Input, reattaching, terminals and watchers through the real e2b SDK against furlong's E2B-compatible app
on loopback, over real bwrap sandboxes: stdin (send_stdin, stream_input, close_stdin), commands.connect,
PTYs (send_stdin, resize, kill), files.watch_dir (sync and async SDK), the limits get_info reports; and
what is refused cleanly (unknown or finished pids, a resize of a command that has no terminal, another
sandbox's pid or watcher, a wrong token on every new call)."""

from __future__ import annotations

import asyncio
import threading
import time

import e2b
import httpx
import pytest
from e2b.sandbox.commands.command_handle import PtySize
from host_support import ProcessHost, on_loopback
from test_e2b_api import KEY, TEMPLATE, monkeypatch_module, server  # noqa: F401  (fixtures)

from furlong.sandbox.base import Limits, SandboxError
from furlong.sandbox.e2b import e2b_app
from furlong.sandbox.host.serve import e2b_limits


@pytest.fixture(scope="module")
def sbx(server):  # noqa: F811
    box = e2b.Sandbox.create(TEMPLATE, timeout=120)
    yield box
    box.kill()


def _until(check, what: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


def test_stdin_reaches_the_command_and_close_ends_it(sbx):
    seen: list[str] = []
    # bash's read takes one byte at a time from a pipe: it leaves the next input to cat, however fast it comes
    handle = sbx.commands.run('read -r a; echo "got $a"; cat; echo after-eof', background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "first line\n")
    sbx.commands.send_stdin(handle.pid, b"two\n")
    sbx.commands.stream_input(handle.pid, ["three ", b"four\n"])
    sbx.commands.close_stdin(handle.pid)  # EOF: cat ends, the command goes on to its end
    result = handle.wait(on_stdout=seen.append)
    assert result.exit_code == 0
    assert result.stdout == "got first line\ntwo\nthree four\nafter-eof\n"
    assert "".join(seen) == result.stdout


def test_connect_reattaches_to_a_running_command(sbx):
    handle = sbx.commands.run("read x; echo before-$x; read y; echo after-$y; exit 4", background=True, stdin=True,
                              timeout=0)  # no deadline: it runs till it ends
    sbx.commands.send_stdin(handle.pid, "1\n")
    handle.disconnect()  # the first handle leaves: the command runs on
    assert handle.pid in {p.pid for p in sbx.commands.list()}
    again = sbx.commands.connect(handle.pid)
    assert again.pid == handle.pid
    sbx.commands.send_stdin(handle.pid, "2\n")
    with pytest.raises(e2b.CommandExitException) as ended:
        again.wait()
    assert ended.value.exit_code == 4
    assert "after-2\n" in ended.value.stdout  # written after connect: it reached the new handle
    assert handle.pid not in {p.pid for p in sbx.commands.list()}


def test_a_pty_is_a_real_terminal_that_resizes(sbx):
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80), envs={"PS1": "$ "})
    ended: list[int] = []

    def wait() -> None:
        try:
            term.wait(on_pty=out.extend)
        except e2b.CommandExitException as e:  # killed: 137
            ended.append(e.exit_code)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        sbx.pty.send_stdin(term.pid, b"tty; stty size\n")
        _until(lambda: b"24 80" in out, f"stty size never said 24 80: {bytes(out)!r}")
        assert b"/dev/pts/" in out  # a terminal, not a pipe
        sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size\n")
        _until(lambda: b"40 100" in out, f"stty size never said 40 100: {bytes(out)!r}")
        assert term.pid in {p.pid for p in sbx.commands.list()}
        again = sbx.pty.connect(term.pid)  # a second handle on the same terminal
    finally:
        assert sbx.pty.kill(term.pid) is True
    with pytest.raises(e2b.CommandExitException) as killed:
        again.wait()
    assert killed.value.exit_code == 137  # its end reached the second handle too
    waiter.join(10)
    assert not waiter.is_alive() and ended == [137], "the pty's stream ended with its kill"
    assert term.pid not in {p.pid for p in sbx.commands.list()}
    assert "bash -i -l" not in sbx.commands.run("ps -eo args").stdout  # its shell went with it


def test_misuse_is_refused_and_changes_nothing(sbx, server):  # noqa: F811
    with pytest.raises(e2b.NotFoundException):
        sbx.commands.send_stdin(999999, "x")
    with pytest.raises(e2b.NotFoundException):
        sbx.commands.connect(999999)
    done = sbx.commands.run("true", background=True, stdin=True)
    done.wait()
    with pytest.raises(e2b.NotFoundException):  # finished: no longer a command
        sbx.commands.send_stdin(done.pid, "late")
    plain = sbx.commands.run("sleep 30", background=True)
    sbx.files.make_dir("/tmp/mine")
    watch = sbx.files.watch_dir("/tmp/mine")
    try:
        with pytest.raises(e2b.SandboxException, match="stdin is closed"):  # started without stdin
            sbx.commands.send_stdin(plain.pid, "x")
        with pytest.raises(e2b.SandboxException, match="not a running PTY"):
            sbx.pty.resize(plain.pid, PtySize(rows=10, cols=10))
        with pytest.raises(e2b.SandboxException, match="no open stdin"):
            sbx.commands.close_stdin(plain.pid)
        other = e2b.Sandbox.create(TEMPLATE, timeout=30)  # another sandbox cannot reach this one's command
        try:
            with pytest.raises(e2b.NotFoundException):
                other.commands.send_stdin(plain.pid, "x")
            with pytest.raises(e2b.NotFoundException):
                other.commands.connect(plain.pid)
            assert other.commands.kill(plain.pid) is False  # the SDK's answer to NOT_FOUND
            # nor this one's watcher: asked with the other sandbox's own id and token, it is not found
            url, _app = server
            r = httpx.post(f"{url}/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": watch._watcher_id},
                           headers={"E2b-Sandbox-Id": other.sandbox_id, "X-Access-Token": other._envd_access_token})
            assert r.status_code == 404 and "no such watcher" in r.text, r.text
        finally:
            other.kill()
        assert plain.pid in {p.pid for p in sbx.commands.list()}  # still running, untouched
        assert watch.get_new_events() == []  # and the watcher still answers its own sandbox
    finally:
        sbx.commands.kill(plain.pid)
        watch.stop()
    left = [n for n in sbx.commands.run("ls -a /tmp").stdout.split() if n.startswith(".furlong-e2b-")]
    assert len(left) == 1 and left[0].endswith(".pid"), left  # the ls's own: nothing left behind


def test_every_new_call_needs_the_sandboxs_own_token(sbx, server):  # noqa: F811
    url, _app = server
    handle = sbx.commands.run('read -r x; echo "got $x"', background=True, stdin=True)
    sbx.files.make_dir("/tmp/tok")
    watch = sbx.files.watch_dir("/tmp/tok")
    pid = {"process": {"pid": handle.pid}}
    calls = {  # Connect's JSON form of each unary call, aimed at the live command and watcher
        "process.Process/SendInput": {**pid, "input": {"stdin": "aW5qZWN0ZWQK"}},  # "injected\n"
        "process.Process/CloseStdin": pid,
        "process.Process/Update": {**pid, "pty": {"size": {"rows": 5, "cols": 5}}},
        "process.Process/SendSignal": {**pid, "signal": "SIGNAL_SIGKILL"},
        "filesystem.Filesystem/CreateWatcher": {"path": "/tmp/tok"},
        "filesystem.Filesystem/GetWatcherEvents": {"watcherId": watch._watcher_id},
        "filesystem.Filesystem/RemoveWatcher": {"watcherId": watch._watcher_id},
    }
    for route, body in calls.items():
        for token in ("wrong", ""):
            r = httpx.post(f"{url}/{route}", json=body,
                           headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token})
            assert r.status_code == 401 and "unauthenticated" in r.text, (route, r.status_code, r.text)
    r = httpx.post(f"{url}/process.Process/Update", json=calls["process.Process/Update"],  # the right token: the
                   headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token})  # body
    assert "not a running PTY" in r.text, r.text  # reached the command, so the bodies above were well formed
    # nothing above reached the command: its first input is still ours, and its stdin still open
    sbx.commands.send_stdin(handle.pid, "ours\n")
    assert handle.wait().stdout == "got ours\n"
    assert watch.get_new_events() == []  # the watcher is still there
    watch.stop()


def _seen(watch, wanted: tuple[str, e2b.FilesystemEventType], got: list) -> None:
    """Collects `watch`'s new events into `got` until `wanted` (name, type) is among them."""
    _until(lambda: (got.extend((e.name, e.type) for e in watch.get_new_events()), wanted in got)[1],
           f"no {wanted} event: {got}")


def test_watch_dir_sees_what_the_agent_creates_writes_and_removes(sbx):
    sbx.files.make_dir("/tmp/watched/sub")
    sbx.commands.run("echo old > /tmp/watched/old")
    watch = sbx.files.watch_dir("/tmp/watched")
    got: list = []
    T = e2b.FilesystemEventType
    sbx.commands.run("echo one > /tmp/watched/a.txt")
    _seen(watch, ("a.txt", T.CREATE), got)
    sbx.commands.run("echo two >> /tmp/watched/a.txt")
    _seen(watch, ("a.txt", T.WRITE), got)
    sbx.commands.run("rm /tmp/watched/a.txt; echo deep > /tmp/watched/sub/deep")
    _seen(watch, ("a.txt", T.REMOVE), got)
    assert ("old", T.CREATE) not in got and not any(name.startswith("sub/") for name, _ in got)  # not recursive
    watch.stop()
    with pytest.raises(e2b.SandboxException, match="already stopped"):
        watch.get_new_events()
    deep = sbx.files.watch_dir("/tmp/watched", recursive=True)
    sbx.commands.run("echo more >> /tmp/watched/sub/deep")
    _seen(deep, ("sub/deep", T.WRITE), [])
    deep.stop()
    with pytest.raises(e2b.NotFoundException):
        sbx.files.watch_dir("/tmp/no-such-dir")


def test_watch_dir_streams_to_the_async_sdk(server):  # noqa: F811
    async def main() -> list:
        box = await e2b.AsyncSandbox.create(TEMPLATE, timeout=60)
        try:
            got: list = []
            await box.files.make_dir("/tmp/w")
            handle = await box.files.watch_dir("/tmp/w", on_event=lambda e: got.append((e.name, e.type)))
            await box.commands.run("touch /tmp/w/x")
            deadline = time.monotonic() + 10
            while ("x", e2b.FilesystemEventType.CREATE) not in got and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await handle.stop()
            return got
        finally:
            await box.kill()

    assert ("x", e2b.FilesystemEventType.CREATE) in asyncio.run(main())


def _reports_limits(url: str, monkeypatch, cpus: int, memory_mb: int, disk_mb: int, template: str = TEMPLATE,
                    key: str = KEY) -> None:
    """A sandbox made through the SDK at `url` reports these limits in get_info, get_metrics, list and `df /`."""
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", key)
    box = e2b.Sandbox.create(template, timeout=30)
    try:
        info = box.get_info()
        (sample,) = box.get_metrics()  # from the sandbox's cgroup
        assert (info.cpu_count, info.memory_mb) == (cpus, memory_mb) == (sample.cpu_count, sample.mem_total >> 20)
        (listed,) = httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": key}).json()
        df_mb = int(box.commands.run("df -m --output=size / | tail -1").stdout)
        assert (listed["cpuCount"], listed["memoryMB"], listed["diskSizeMB"]) == (cpus, memory_mb, df_mb)
        assert df_mb == disk_mb
    finally:
        box.kill()


def test_info_and_list_report_the_sandboxs_own_limits(backend, base_image, monkeypatch):
    async def resolve(template: str):
        return base_image

    limits = Limits(cpus=2.0, memory_mb=1024, disk_mb=300)
    with on_loopback(e2b_app(backend, resolve, api_key=KEY, limits=limits)) as url:
        _reports_limits(url, monkeypatch, 2, 1024, 300)


def test_serve_gives_its_e2b_sandboxes_its_limits(base_image, tmp_path, monkeypatch):
    """`furlong sandbox serve --e2b-*` (the command, in its own process): its E2B sandboxes get those limits."""
    key = "e2b-key-of-a-served-host"  # serve wants 16 characters or more
    (tmp_path / "e2b-key").write_text(key + "\n")
    flags = ("--e2b-key-file", str(tmp_path / "e2b-key"), "--e2b-cpus", "3", "--e2b-memory-mb", "768",
             "--e2b-disk-mb", "200", "--e2b-pids", "128")
    host = ProcessHost(tmp_path / "host", capacity=2, flags=flags)
    try:
        _reports_limits(host.url, monkeypatch, 3, 768, 200, template="base", key=key)  # the host's image
    finally:
        host.stop()
    assert "each sandbox 3 CPUs, 768 MB memory, 200 MB disk, 128 pids" in host.proc.stdout.read()


@pytest.mark.parametrize(("flag", "value"), [("cpus", 0), ("memory_mb", 8), ("disk_mb", 1), ("pids", 2)])
def test_serve_refuses_e2b_limits_out_of_bounds(flag, value):
    given = {"cpus": 1.0, "memory_mb": 2048, "disk_mb": 1024, "pids": 512, flag: value}
    with pytest.raises(SandboxError, match=f"^--e2b-{flag.replace('_', '-')}: .*, got {value}$"):
        e2b_limits(**given, lifetime_s=60)



STATE = "/run/furlong-shell/state"  # furlong.sandbox.runtime.shell.STATE_DIR's file: the agent's cwd and exports


def _state_mtime(sbx) -> str:
    return sbx.commands.run(f"stat -c %y {STATE}", cwd="/").stdout  # a cwd: this read leaves the state alone


def test_files_calls_leave_the_agents_shell_state_alone(sbx):
    """ListDir, Stat (files.list, get_info, exists) and the files calls that run a command (make_dir, rename,
    remove) never save the agent's shell state over what its commands left (tests/test_listing.py: a `cd`)."""
    sbx.commands.run("mkdir -p /tmp/here/sub")  # without a cwd: the state file is written
    before = _state_mtime(sbx)
    time.sleep(0.02)  # a rewrite would show in the mtime
    assert {e.name for e in sbx.files.list("/tmp/here")} == {"sub"}
    assert sbx.files.get_info("/tmp/here/sub").type == e2b.FileType.DIR and sbx.files.exists("/tmp/here")
    sbx.files.make_dir("/tmp/here/made")
    sbx.files.rename("/tmp/here/made", "/tmp/here/moved")
    sbx.files.remove("/tmp/here/moved")
    assert _state_mtime(sbx) == before
