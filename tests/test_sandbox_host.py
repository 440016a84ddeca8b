"""The sandbox host (furlong/sandbox/host): a real uvicorn server on loopback over real bwrap sandboxes.
Every refusal is checked to have changed nothing on the host."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest
from host_support import TOKEN, ThreadHost
from tests_support import alive, subtree


E2B_KEY = "e2b_" + "5e" * 16  # the shape the SDK expects of E2B_API_KEY
Host = ThreadHost


@pytest.fixture
def host(backend, base_image):
    h = Host(backend, base_image, capacity=2, max_body=1 << 20)
    yield h
    h.stop()
    assert not h.reg.entries, "shutdown leaves no sandbox"


def test_exec_files_tar_verifier_and_close(host):
    sid, tok = host.create()
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo hi; echo err >&2; exit 3"}, headers=tok)
    assert r.json()["exit_code"] == 3 and r.json()["stdout"] == "hi\n" and r.json()["stderr"] == "err\n"
    data = base64.b64encode(b"\x00bin").decode()
    assert host.c.post(f"/v1/sandboxes/{sid}/files/write", json={"path": "/work/x", "data_b64": data},
                       headers=tok).status_code == 200
    r = host.c.post(f"/v1/sandboxes/{sid}/files/read", json={"path": "/work/x"}, headers=tok)
    assert base64.b64decode(r.json()["data_b64"]) == b"\x00bin"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("d/f.txt")
        info.size = 3
        t.addfile(info, io.BytesIO(b"tar"))
    r = host.c.post(f"/v1/sandboxes/{sid}/put_tar", params={"dest": "/data"}, content=buf.getvalue(), headers=tok)
    assert r.status_code == 200, r.text
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /data/d/f.txt", "as_verifier": True},
                    headers=tok)
    assert r.json()["stdout"].startswith("tar")
    # /tests is the verifier's: the host passes as_verifier through, and the agent still cannot write there
    ex = {"cmd": "touch /tests/v", "as_verifier": True}
    assert host.c.post(f"/v1/sandboxes/{sid}/exec", json=ex, headers=tok).json()["exit_code"] == 0
    ex = {"cmd": "touch /tests/a"}
    assert host.c.post(f"/v1/sandboxes/{sid}/exec", json=ex, headers=tok).json()["exit_code"] != 0
    changes = host.c.post(f"/v1/sandboxes/{sid}/changes", json={"paths": ["/work"]}, headers=tok).json()["changes"]
    assert any(c["path"] == "/work/x" and c["kind"] == "added" for c in changes)
    has = host.c.post(f"/v1/sandboxes/{sid}/image_has", json={"paths": ["/etc/passwd", "/work/x"]}, headers=tok)
    assert has.json()["paths"] == ["/etc/passwd"]
    m = host.c.get("/v1/metrics").json()
    assert m["active"] == 1 and m["exec_s"]["p50"] > 0 and m["start_s"]["p95"] > 0
    assert host.c.delete(f"/v1/sandboxes/{sid}", headers=tok).status_code == 200
    assert host.c.get("/v1/sandboxes").json() == {"sandboxes": []}


def test_refusals_change_nothing(host):
    sid, tok = host.create()
    probe = {"cmd": "touch /work/pwned"}
    assert httpx.post(f"{host.url}/v1/sandboxes", json={}).status_code == 401
    assert httpx.post(f"{host.url}/v1/sandboxes", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert len(host.reg.entries) == 1
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/openapi.json"):  # the schema is the token holder's only
        assert httpx.get(f"{host.url}{path}").status_code in (401, 404), path
    assert "/v1/sandboxes/{sid}/exec" in host.c.get("/v1/openapi.json").json()["paths"]
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json=probe, headers={"X-Sandbox-Token": "wrong"})
    assert r.status_code == 403
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": 5, "bogus": 1}, headers=tok)
    assert r.status_code == 422 and "bogus" in r.text
    for bad in ("../etc/passwd", "/work/../../etc/x", "relative"):
        r = host.c.post(f"/v1/sandboxes/{sid}/files/write", json={"path": bad, "data_b64": "eA=="}, headers=tok)
        assert r.status_code == 422 and "absolute path inside the sandbox" in r.text, bad
    r = host.c.post(f"/v1/sandboxes/{sid}/put_tar", params={"dest": "/x/../.."}, content=b"x", headers=tok)
    assert r.status_code == 400
    big = base64.b64encode(b"x" * (1 << 20)).decode()
    r = host.c.post(f"/v1/sandboxes/{sid}/files/write", json={"path": "/work/big", "data_b64": big}, headers=tok)
    assert r.status_code == 413
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls -A /work"}, headers=tok)
    assert r.json()["stdout"] == "", "no refused request wrote anything"
    assert len(host.reg.entries) == 1


def _stream_exec(host, sid: str, tok: dict, cmd: str) -> list[tuple[dict, float]]:
    """The NDJSON lines of a streamed exec, each with the time it arrived."""
    with host.c.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd, "stream": True}, headers=tok) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        return [(json.loads(line), time.monotonic()) for line in r.iter_lines()]


def _joined(lines: list[tuple[dict, float]], stream: str) -> bytes:
    return b"".join(base64.b64decode(line[stream]) for line, _ in lines if stream in line)


def test_streamed_exec_lines_arrive_while_the_command_runs(host):
    sid, tok = host.create()
    lines = _stream_exec(host, sid, tok, "echo a; echo e >&2; sleep 2; echo b")
    end = time.monotonic()
    first_out = next((line, at) for line, at in lines if "stdout" in line)
    assert first_out[0] == {"stdout": base64.b64encode(b"a\n").decode()} and first_out[1] < end - 1
    result = lines[-1][0]["result"]
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (0, "a\nb\n", "e\n")
    assert (_joined(lines, "stdout"), _joined(lines, "stderr")) == (b"a\nb\n", b"e\n")
    assert host.reg.execs, "a streamed exec is timed like any other"
    # the sandbox's own token is checked before anything runs, streamed or not
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "touch /work/pwned", "stream": True},
                    headers={"X-Sandbox-Token": "wrong"})
    assert r.status_code == 403
    assert host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls -A /work"}, headers=tok).json()["stdout"] == ""
    # a sandbox that ends while its command streams: the last line is the error the plain exec would have been
    with host.c.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo a; sleep 30", "stream": True},
                       headers=tok) as r:
        lines = r.iter_lines()
        assert "stdout" in json.loads(next(lines))
        assert host.c.delete(f"/v1/sandboxes/{sid}", headers=tok).status_code == 200
        last = json.loads(next(lines))
    assert last["error"]["status"] == 410 and "SandboxDied" in last["error"]["detail"]


def test_a_streaming_exec_keeps_its_sandbox_from_idle_reaping(backend, base_image):
    h = Host(backend, base_image, idle_s=0.5, reap_every_s=0.1)
    try:
        sid, tok = h.create()
        lines = [line for line, _ in _stream_exec(h, sid, tok, "sleep 2; echo done")]
        assert len(lines) == 2 and lines[0] == {"stdout": base64.b64encode(b"done\n").decode()}
        assert lines[1]["result"]["stdout"] == "done\n" and h.reg.reaped == 0
    finally:
        h.stop()


def test_capacity_429_and_idle_reaping(backend, base_image):
    h = Host(backend, base_image, capacity=1, idle_s=1.0, reap_every_s=0.2)
    try:
        sid, tok = h.create()
        r = h.c.post("/v1/sandboxes", json={})
        assert r.status_code == 429 and "capacity" in r.text and len(h.reg.entries) == 1
        deadline = time.monotonic() + 10
        while h.reg.entries and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not h.reg.entries and h.reg.reaped == 1
        assert h.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}, headers=tok).status_code == 404
        h.create()  # capacity is free again
    finally:
        h.stop()
    assert not h.reg.entries


def test_serve_cli_token_rule_e2b_on_the_same_port_and_clean_shutdown(tmp_path, monkeypatch):
    import e2b

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    cli = [sys.executable, "-m", "furlong.cli", "sandbox", "serve"]
    r = subprocess.run([*cli, "--host", "0.0.0.0"], check=False, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--token-file" in r.stdout + r.stderr
    (tmp_path / "tok").write_text(TOKEN + "\n")
    (tmp_path / "e2b-key").write_text(E2B_KEY + "\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([*cli, "--port", str(port), "--token-file", str(tmp_path / "tok"), "--capacity", "2",
                             "--e2b-key-file", str(tmp_path / "e2b-key")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if c.get("/v1/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = c.post("/v1/sandboxes", json={}).json()
        r = c.post(f"/v1/sandboxes/{body['id']}/exec", json={"cmd": "echo up"}, headers={"X-Sandbox-Token": body["token"]})
        assert r.json()["stdout"] == "up\n"
        for var in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(var, f"http://127.0.0.1:{port}")
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/openapi.json"):  # not open with E2B's app at / either
            assert httpx.get(f"http://127.0.0.1:{port}{path}").status_code in (401, 404), path
        assert c.get("/v1/openapi.json").status_code == 200
        sbx = e2b.Sandbox.create("base", api_key=E2B_KEY, timeout=60)  # the real SDK, through the same port
        sbx.files.write("/tmp/hello.txt", "from e2b")
        assert sbx.files.read("/tmp/hello.txt") == "from e2b"
        # Connect-RPC streams its request body (no Content-Length) through the host's body limit
        assert sbx.commands.run("cat /tmp/hello.txt").stdout == "from e2b"
        with pytest.raises(e2b.AuthenticationException):
            e2b.Sandbox.create("base", api_key="e2b_" + "0" * 32)
        sandbox_pids = subtree(proc.pid) - {proc.pid}
        assert sandbox_pids, "the sandbox runs below the host"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert "sandbox host on http://127.0.0.1" in out and "E2B-compatible API" in out
        time.sleep(0.5)  # a process killed at shutdown may still be exiting
        outlived = {p for p in sandbox_pids if alive(p)}
        assert not outlived, f"shutdown left sandbox processes {outlived}"
    finally:
        proc.kill()
        proc.wait()


def test_a_chunked_body_is_counted_as_it_arrives(host):
    """A body of no stated length (the e2b SDK streams its Connect-RPC requests so) is let through while
    small and refused with 413 once over the limit, having written nothing."""
    sid, tok = host.create()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("small.txt")
        info.size = 2
        t.addfile(info, io.BytesIO(b"ok"))
    small = buf.getvalue()
    r = host.c.post(f"/v1/sandboxes/{sid}/put_tar", params={"dest": "/work"}, content=iter([small]), headers=tok)
    assert r.status_code == 200, r.text
    big = (b"x" * (1 << 16) for _ in range(40))  # 2.5 MiB against the fixture's 1 MiB
    r = host.c.post(f"/v1/sandboxes/{sid}/put_tar", params={"dest": "/big"}, content=big, headers=tok)
    assert r.status_code == 413
    r = host.c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "ls -A /work; ls /big 2>&1"}, headers=tok)
    assert r.json()["stdout"].startswith("small.txt\n") and "No such file" in r.json()["stdout"]


def test_the_e2b_api_and_v1_share_one_capacity(backend, base_image):
    """A host's capacity counts the sandboxes of both its APIs: neither can start one past it."""
    h = Host(backend, base_image, capacity=1, e2b_api_key=E2B_KEY)
    e2b_create = {"templateID": "base", "timeout": 30}
    try:
        sid, tok = h.create()
        r = httpx.post(f"{h.url}/sandboxes", json=e2b_create, headers={"X-API-KEY": E2B_KEY})
        assert r.status_code == 429 and h.c.get("/v1/metrics").json()["active"] == 1
        h.c.delete(f"/v1/sandboxes/{sid}", headers=tok)
        r = httpx.post(f"{h.url}/sandboxes", json=e2b_create, headers={"X-API-KEY": E2B_KEY})
        assert r.status_code == 201, r.text
        assert h.c.post("/v1/sandboxes", json={}).status_code == 429
        assert h.c.get("/v1/metrics").json()["active"] == 1
        httpx.delete(f"{h.url}/sandboxes/{r.json()['sandboxID']}", headers={"X-API-KEY": E2B_KEY})
        h.create()
    finally:
        h.stop()
