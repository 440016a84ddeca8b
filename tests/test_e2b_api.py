"""The real e2b SDK against furlong's E2B-compatible app on loopback, over real bwrap sandboxes."""

from __future__ import annotations

import json
import re
import time

import e2b  # pinned in the test extra: CI runs these against the real SDK
import httpx
import pytest
from host_support import on_loopback

from furlong.sandbox.e2b import e2b_app

KEY = "e2b_test_key"
TEMPLATE = "furlong-base"


@pytest.fixture(scope="module")
def server(backend, base_image, monkeypatch_module):
    async def resolve(template: str):
        return base_image if template == TEMPLATE else None

    app = e2b_app(backend, resolve, api_key=KEY, max_sandboxes=3)
    with on_loopback(app) as url:
        monkeypatch_module.setenv("E2B_API_URL", url)
        monkeypatch_module.setenv("E2B_SANDBOX_URL", url)
        monkeypatch_module.setenv("E2B_API_KEY", KEY)
        yield url, app


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_lifecycle_files_timeout_list_kill(server):
    _url, app = server
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        assert sbx.sandbox_id in {s.sandbox_id for s in e2b.Sandbox.list().next_items()}
        sbx.files.write("/tmp/hello.txt", "hi from the sdk")
        assert sbx.files.read("/tmp/hello.txt") == "hi from the sdk"
        before = app.state.registry.live[sbx.sandbox_id].end
        sbx.set_timeout(600)
        assert app.state.registry.live[sbx.sandbox_id].end > before + 400
        assert sbx.get_info().template_id == TEMPLATE
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in app.state.registry.live
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.set_timeout(sbx.sandbox_id, 30)


def test_commands_run_in_the_foreground_in_the_sandbox(server):
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        sbx.files.write("/tmp/in.txt", "from the sdk\n")
        out = sbx.commands.run("cat /tmp/in.txt; echo oops >&2; echo $HOME_SET; pwd", envs={"HOME_SET": "yes"}, cwd="/tmp")
        assert (out.exit_code, out.stdout, out.stderr) == (0, "from the sdk\nyes\n/tmp\n", "oops\n")
        with pytest.raises(e2b.CommandExitException) as failed:  # the SDK raises on a non-zero exit
            sbx.commands.run("echo partial; exit 3")
        assert (failed.value.exit_code, failed.value.stdout) == (3, "partial\n")
        assert sbx.commands.run("ls /tmp").stdout.split() == ["in.txt"]  # the command ran in this sandbox
        assert sbx.commands.list() == []
    finally:
        sbx.kill()


def test_commands_run_calls_on_stdout_while_the_command_runs(server):
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        seen: list[tuple[str, float]] = []
        out = sbx.commands.run("echo a; sleep 2; echo b", on_stdout=lambda text: seen.append((text, time.monotonic())))
        end = time.monotonic()
        assert seen[0][0] == "a\n" and seen[0][1] < end - 1, "the first line came before the sleep ended"
        assert "".join(text for text, _ in seen) == out.stdout == "a\nb\n"
        # past the output cap (1 MiB a stream) the streamed first MiB is followed by what the capped result adds
        out = sbx.commands.run("head -c 1200000 /dev/zero | tr '\\0' a; printf END")
        assert out.stdout == "a" * 1200000 + "END", "nothing is lost or repeated where the cap dropped nothing"
        out = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' a; printf END")
        marker = re.search(r"\n\[\.\.\. furlong: (\d+) bytes truncated \.\.\.\]\n", out.stdout)
        shown = len(out.stdout) - len(marker.group(0))
        assert out.stdout.endswith("END") and shown + int(marker.group(1)) == 3000003, "shown + dropped = all"
    finally:
        sbx.kill()


def test_a_background_command_is_listed_and_killed_with_its_children(server):
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        handle = sbx.commands.run("sleep 300 & sleep 301; echo never", background=True)
        assert [p.pid for p in sbx.commands.list()] == [handle.pid]
        deadline = time.monotonic() + 10
        while "sleep 301" not in sbx.commands.run("ps -eo args").stdout:
            assert time.monotonic() < deadline, "the background command never started"
            time.sleep(0.05)
        assert sbx.commands.kill(handle.pid) is True
        with pytest.raises(e2b.CommandExitException) as ended:
            handle.wait()
        assert ended.value.exit_code != 0 and "never" not in ended.value.stdout
        assert "Killed" not in ended.value.stderr and "setsid" not in ended.value.stderr  # no wrapper line
        assert "sleep 30" not in sbx.commands.run("ps -eo args").stdout  # the group went, the & child too
        assert sbx.commands.list() == [] and sbx.commands.kill(handle.pid) is False
    finally:
        sbx.kill()


def test_files_list_stat_make_dir_rename_remove(server):
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        assert sbx.files.make_dir("/tmp/d/e") is True
        assert sbx.files.make_dir("/tmp/d/e") is False  # already there
        sbx.files.write("/tmp/d/a.txt", "12345")
        sbx.commands.run("ln -s a.txt /tmp/d/link")
        entries = {e.name: e for e in sbx.files.list("/tmp/d")}
        assert sorted(entries) == ["a.txt", "e", "link"]
        assert (entries["a.txt"].type, entries["a.txt"].size, entries["a.txt"].path) == (
            e2b.FileType.FILE, 5, "/tmp/d/a.txt")
        assert entries["e"].type == e2b.FileType.DIR and entries["link"].symlink_target == "a.txt"
        assert sbx.files.exists("/tmp/d/a.txt") and not sbx.files.exists("/tmp/d/none")
        sbx.files.rename("/tmp/d/a.txt", "/tmp/d/e/b.txt")
        assert sbx.commands.run("cat /tmp/d/e/b.txt").stdout == "12345"  # moved in the sandbox itself
        sbx.files.remove("/tmp/d")
        assert not sbx.files.exists("/tmp/d")
        with pytest.raises(e2b.NotFoundException):
            sbx.files.list("/tmp/no-such-dir")
    finally:
        sbx.kill()


def test_commands_need_the_sandboxs_own_token(server):
    url, _app = server
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        message = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-c", "touch /tmp/was-run"]}}).encode()
        envelope = b"\x00" + len(message).to_bytes(4, "big") + message  # one Connect stream message
        for token in ("wrong", "", "clé".encode()):  # a non-ASCII token is refused too, not a crash
            r = httpx.post(f"{url}/process.Process/Start", content=envelope, headers={
                "E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token, "Content-Type": "application/connect+json"})
            assert b'"code":"unauthenticated"' in r.content.replace(b" ", b""), r.content
        assert sbx.commands.run("test -e /tmp/was-run || echo absent").stdout == "absent\n"  # nothing ran
    finally:
        sbx.kill()


def test_wrong_api_key_and_unknown_template(server):
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create(TEMPLATE, api_key="wrong")
    with pytest.raises(e2b.SandboxException, match="unknown template"):
        e2b.Sandbox.create("no-such-template")



def test_a_non_ascii_api_key_is_a_401_and_starts_nothing(server):
    url, _app = server
    before = httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": KEY}).json()
    r = httpx.post(f"{url}/sandboxes", json={"templateID": TEMPLATE, "timeout": 30},
                   headers={"X-API-KEY": "clé-ключ".encode()})
    assert r.status_code == 401, (r.status_code, r.text)
    assert httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": KEY}).json() == before


def test_malformed_create_bodies_are_400_and_start_nothing(server):
    url, _app = server
    before = httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": KEY}).json()
    for body in (b"{not json", b"[1, 2]", b'{"templateID": 7}', b'{"templateID": "furlong-base", "timeout": -1}'):
        r = httpx.post(f"{url}/sandboxes", content=body, headers={"X-API-KEY": KEY, "Content-Type": "application/json"})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["message"].split(":")[0] in ("body", "templateID", "timeout")
    r = httpx.post(f"{url}/sandboxes/any/timeout", content=b"{not json",
                   headers={"X-API-KEY": KEY, "Content-Type": "application/json"})
    assert (r.status_code, r.json()["message"]) == (400, "body: expected a JSON object")
    assert httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": KEY}).json() == before


def test_data_plane_refuses_wrong_token_and_changes_nothing(server):
    url, _app = server
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        sbx.files.write("/tmp/keep.txt", "original")
        for headers in ({"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": "wrong"},
                        {"E2b-Sandbox-Id": sbx.sandbox_id}):
            r = httpx.post(f"{url}/files", params={"path": "/tmp/keep.txt"}, headers=headers,
                           files={"file": ("keep.txt", b"overwritten")})
            assert r.status_code == 401
            assert httpx.get(f"{url}/files", params={"path": "/tmp/keep.txt"}, headers=headers).status_code == 401
        assert sbx.files.read("/tmp/keep.txt") == "original"
        r = httpx.get(f"{url}/files", params={"path": "/tmp/keep.txt"},
                      headers={"E2b-Sandbox-Id": "nope", "X-Access-Token": "x"})
        assert r.status_code == 404
    finally:
        sbx.kill()


def test_past_its_timeout_the_sandbox_is_gone(server):
    _url, app = server
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=1)
    time.sleep(1.5)
    with pytest.raises(e2b.NotFoundException):
        e2b.Sandbox.get_info(sbx.sandbox_id)
    assert sbx.sandbox_id not in app.state.registry.live


def test_too_many_sandboxes_is_429(server):
    url, app = server
    r = [httpx.post(f"{url}/sandboxes", json={"templateID": TEMPLATE, "timeout": 30}, headers={"X-API-KEY": KEY})
         for _ in range(4)]
    try:
        assert [x.status_code for x in r] == [201, 201, 201, 429]
    finally:
        for x in r[:3]:
            httpx.delete(f"{url}/sandboxes/{x.json()['sandboxID']}", headers={"X-API-KEY": KEY})
    assert not app.state.registry.live


def test_what_furlong_does_not_do_is_one_readable_error(server):
    """fork and snapshots through the real SDK: a SandboxException naming the call, not a body the SDK
    cannot parse; the sandbox keeps running. (pause, connect, get_metrics: tests/test_e2b_pause.py)"""
    sbx = e2b.Sandbox.create(TEMPLATE, timeout=60)
    try:
        for call in (sbx.create_snapshot, sbx.fork):
            with pytest.raises(e2b.SandboxException, match="not supported by furlong"):
                call()
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    finally:
        sbx.kill()

