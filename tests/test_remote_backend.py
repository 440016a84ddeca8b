"""The `remote` sandbox backend over real hosts (furlong sandbox serve's app on uvicorn, over real bwrap
sandboxes): the Sandbox protocol through a host, images built on the hosts, eval and training unchanged,
and a host SIGKILLed mid-run whose episodes are run again on another host, each recorded once."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from conftest import run, spec
from furlong.config import BUNDLED_TASKS
from furlong.eval.agents import NoopAgent, OracleAgent
from furlong.eval.run import run_eval
from furlong.sandbox.base import HostLost, Prebuilt, SandboxDied, SandboxError
from furlong.sandbox.remote.images import HostImages
from furlong.sandbox.remote.hosts import Hosts
from furlong.sandbox.remote.backend import RemoteBackend
from furlong.tasks.loader import load_task
from host_support import REPO, TOKEN, ProcessHost, ThreadHost, remote
from registry_support import free_port
from tests_support import make_task

QUIET = Console(file=open(os.devnull, "w"))


@pytest.fixture(scope="module")
def hosts(backend, store, base_image):
    pair = [ThreadHost(backend, base_image, store, capacity=3) for _ in range(2)]
    yield pair
    for h in pair:
        h.stop()
        assert not h.reg.entries, "a host's shutdown leaves no sandbox"


def test_the_sandbox_protocol_through_a_host(hosts, base_image, tmp_path: Path):
    rb, _ = remote([hosts[0].url])

    async def go():
        box = await rb.create(spec(base_image))
        r = await box.exec("echo hi; echo err >&2; exit 3", cwd="/tmp", env={"X": "1"})
        assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "err\n")
        assert (await box.exec("sleep 5", timeout_s=0.5)).timed_out
        await box.write_file("/work/x", b"\x00bin", mode=0o600)
        assert await box.read_file("/work/x") == b"\x00bin"
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / "f.txt").write_text("dir")
        await box.put_dir(tmp_path / "d", "/data")
        assert await box.read_file("/data/f.txt") == b"dir"
        listed = {e.name: e for e in await box.list_dir("/data")}
        assert listed["f.txt"].type == "file" and listed["f.txt"].size == 3 and listed["f.txt"].path == "/data/f.txt"
        with pytest.raises(SandboxError, match="No such file"):
            await box.list_dir("/nowhere")
        assert box.verifier_uid is not None, "the host's sandboxes have a verifier identity"
        assert (await box.exec("touch /tests/v", as_verifier=True)).exit_code == 0
        assert (await box.exec("touch /tests/a")).exit_code != 0, "the agent cannot write the verifier's /tests"
        changed = await box.changes(["/work"])
        assert any(c.path == "/work/x" and c.kind == "added" for c in changed)
        assert await box.image_has(["/etc/passwd", "/work/x"]) == frozenset({"/etc/passwd"})
        with pytest.raises(SandboxError):
            await box.read_file("/no/such/file")
        assert box.alive
        await box.close()
        with pytest.raises(SandboxError):
            await box.exec("true")

    run(go())
    assert not hosts[0].reg.entries and rb.hosts.hosts[0].active == 0


def test_a_sandbox_reaped_on_a_live_host_is_died_not_lost(hosts, base_image):
    """The distinction the runner scores by: this sandbox alone gone is SandboxDied; only a host that stops
    answering (or restarts) is HostLost."""
    rb, _ = remote([hosts[0].url])

    async def go():
        box = await rb.create(spec(base_image))
        run_on_host = hosts[0].reg
        sid = next(iter(run_on_host.entries))
        hosts[0].c.delete(f"/v1/sandboxes/{sid}", headers={"X-Sandbox-Token": run_on_host.entries[sid].token})
        with pytest.raises(SandboxDied) as err:
            await box.exec("true")
        assert not isinstance(err.value, HostLost) and not box.alive
        await box.close()

    run(go())



def test_sandboxes_started_one_at_a_time_take_the_hosts_in_turn(hosts, base_image):
    """Both hosts idle before each create (the usual case when episodes run one at a time): the tie goes to
    the host that has started fewer, not always to the first one configured."""
    rb, _ = remote([h.url for h in hosts])
    before = [len(h.reg.starts) for h in hosts]

    async def go():
        for _ in range(4):
            box = await rb.create(spec(base_image))
            await box.close()

    run(go())
    assert [len(h.reg.starts) - b for h, b in zip(hosts, before)] == [2, 2]
    assert [h.started for h in rb.hosts.hosts] == [2, 2] and all(h.active == 0 for h in rb.hosts.hosts)

def test_eval_through_two_hosts_builds_images_there_and_scores_as_locally(hosts):
    """Tasks with and without a Dockerfile: the hosts build them (POST /v1/images), sandboxes spread over
    both hosts, the oracle passes and a do-nothing agent fails, exactly as with the local backend."""
    tasks = [load_task(BUNDLED_TASKS / n) for n in ("csv-report", "crlf-cleanup", "fix-median", "json-to-csv")]
    rb, images = remote([h.url for h in hosts])
    before = [len(h.reg.starts) for h in hosts]
    oracle = run(run_eval(tasks, OracleAgent(), rb, images, 4, None, QUIET))
    noop = run(run_eval(tasks, NoopAgent(), rb, images, 4, None, QUIET))
    assert [(r.reward, r.status) for r in oracle] == [(1.0, "ok")] * 4, [r.error for r in oracle]
    assert [r.reward for r in noop] == [0.0] * 4, [r.error for r in noop]
    assert all(r.integrity_checked for r in oracle + noop), "the hosts check every reward as locally"
    started = [len(h.reg.starts) - b for h, b in zip(hosts, before)]
    assert all(n > 0 for n in started), f"sandboxes went to one host only: {started}"
    assert all(not h.reg.entries for h in hosts)


def test_a_host_without_an_images_layers_is_sent_the_build_first(hosts, tmp_path: Path):
    """A create naming layers the host lacks is 409 with their digests and starts nothing; the client then
    sends the request that built them and creates again."""
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM furlong/base\nRUN echo made-on-the-host > /made\n")
    _, images = remote([hosts[0].url])
    image = run(images.image(context / "Dockerfile"))
    forged = {"digest": "nope", "layers": [{"digest": "layer-nope", "path": "layer-nope/upper"}]}
    r = hosts[0].c.post("/v1/sandboxes", json={"image": forged})
    assert r.status_code == 409 and r.json()["detail"]["missing_layers"] == ["layer-nope"]
    assert not hosts[0].reg.entries and hosts[0].reg.reserved == 0

    calls = []
    real = images.provide

    async def counting(host, missing):
        calls.append(missing)
        await real(host, missing)

    rb = RemoteBackend(images.hosts, counting)
    gone = image.layers[0]
    moved = type(gone)(gone.digest, gone.path + "-elsewhere")  # as if another host had stored it elsewhere
    with pytest.raises(SandboxError, match="no sandbox host could start"):
        run(rb.create(spec(type(image)(image.digest, (moved, *image.layers[1:])))))
    assert calls == [[gone.digest]], "the host was sent the build that made the layer it lacked"

    async def made():
        box = await rb.create(spec(image))
        try:
            return (await box.exec("cat /made")).stdout
        finally:
            await box.close()

    assert run(made()) == "made-on-the-host\n"


def test_a_prebuilt_image_is_served_by_the_host(hosts, tmp_path: Path):
    """A task's [environment] docker_image, resolved on the host: its registry unreachable, the task's
    Dockerfile (sent as the context) is built there, the note naming this machine's path; without one, the
    host's one line naming the setting."""
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM furlong/base\nRUN echo from-the-dockerfile > /made\n")
    gone = f"127.0.0.1:{free_port()}/x/y:1"
    rb, images = remote([hosts[0].url])
    image = run(images.image(Prebuilt(gone, context / "Dockerfile", "task 't': task.toml: environment.docker_image")))
    assert image.note.startswith(f"{gone}: not pulled (registry 127.0.0.1:") and \
        image.note.endswith(f"built from {context / 'Dockerfile'} instead"), image.note

    async def made():
        box = await rb.create(spec(image))
        try:
            return (await box.exec("cat /made")).stdout
        finally:
            await box.close()

    assert run(made()) == "from-the-dockerfile\n"
    with pytest.raises(SandboxError) as err:
        run(images.image(Prebuilt(gone, None, "task 't': task.toml: environment.docker_image")))
    assert f"task 't': task.toml: environment.docker_image: {gone}: registry 127.0.0.1:" in str(err.value)
    assert hosts[0].c.post("/v1/images", params={"kind": "prebuilt"}).status_code == 400  # no ref


def test_a_refusal_whose_text_holds_429_is_not_taken_for_a_full_host(hosts, base_image):
    """Only a 429 answer means "wait for room": a refusal naming a layer (or a port) with 429 in it fails
    at once, after the one build it asks for, rather than resending the build every second for START_WAIT_S."""
    calls = []

    async def provide(host, missing):  # builds nothing: the layer stays missing
        calls.append(missing)

    rb = RemoteBackend(Hosts([hosts[0].url], TOKEN), provide)
    forged = type(base_image)("digest-429", (type(base_image.layers[0])("layer-429", "layer-429/upper"),))
    with pytest.raises(SandboxError, match="no sandbox host could start.*layer-429"):
        run(rb.create(spec(forged)))
    assert calls == [["layer-429"]]
    assert not hosts[0].reg.entries and hosts[0].reg.reserved == 0


def test_a_context_that_unpacks_past_the_limit_is_413_and_writes_nothing(hosts, backend, store, base_image):
    """A gzip body far smaller than what it unpacks to: refused by its members' sizes, before any file is
    written; the same body under the default limit unpacks (and then has no Dockerfile)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("zeros")
        info.size = 2 << 20
        t.addfile(info, io.BytesIO(bytes(info.size)))
    body = buf.getvalue()
    assert len(body) < 16 << 10  # 2 MiB of zeros in a few kB
    contexts = store.root.parent / "host-contexts"
    before = sorted(contexts.iterdir()) if contexts.is_dir() else []
    small = ThreadHost(backend, base_image, store, capacity=1, max_context_bytes=1 << 20)
    try:
        r = small.c.post("/v1/images", content=body)
        assert r.status_code == 413 and "unpacks to more than 1048576 bytes" in r.text, r.text
        assert (sorted(contexts.iterdir()) if contexts.is_dir() else []) == before
    finally:
        small.stop()
    r = hosts[0].c.post("/v1/images", content=body)
    assert r.status_code == 400 and "dockerfile" in r.text, r.text


def test_unpacked_contexts_unused_for_a_day_are_pruned(hosts, store):
    """Each new unpack removes the contexts nobody unpacked or reused for CONTEXT_TTL_S; one used within it stays."""
    contexts = store.root.parent / "host-contexts"
    contexts.mkdir(parents=True, exist_ok=True)
    recent = contexts / "recent-context"
    old = contexts / "stale-context"
    for d in (old, recent):
        (d / "sub").mkdir(parents=True, exist_ok=True)
        (d / "sub" / "f").write_text("x")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    os.utime(recent, (time.time() - 3600, time.time() - 3600))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:  # a context of its own (no Dockerfile: 400 once unpacked)
        info = tarfile.TarInfo(f"note-{time.time_ns()}")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    try:
        r = hosts[0].c.post("/v1/images", content=buf.getvalue())
        assert r.status_code == 400 and "dockerfile" in r.text, r.text
        assert not old.exists() and (recent / "sub" / "f").exists()
    finally:
        shutil.rmtree(recent, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def test_bad_image_requests_are_refused_and_change_nothing(hosts, store, tmp_path: Path):
    c = hosts[0].c
    contexts = store.root.parent / "host-contexts"
    assert c.post("/v1/images", content=b"not a tar").status_code == 400
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    r = c.post("/v1/images", content=buf.getvalue())
    assert r.status_code == 400 and "tar" in r.text
    assert not (contexts / "escape").exists() and not list(contexts.glob(".*.tmp"))
    r = httpx.post(f"{hosts[0].url}/v1/images", content=b"", params={"kind": "base"})
    assert r.status_code == 401
    assert c.post("/v1/images", params={"kind": "nonsense"}).status_code == 422
    bad = tmp_path / "env"
    bad.mkdir()
    (bad / "Dockerfile").write_text("FROM furlong/base\nRUN exit 7\n")
    _, images = remote([hosts[0].url])
    with pytest.raises(SandboxError, match="image build failed") as err:
        run(images.image(bad / "Dockerfile"))
    assert str(bad / "Dockerfile") in str(err.value), "the failing step is named by the client's own path"


def test_a_wrong_token_is_one_clear_line(hosts, base_image):
    rb = RemoteBackend(Hosts([hosts[0].url], "not-the-token-at-all"))
    with pytest.raises(SandboxError, match="host_token_file"):
        run(rb.create(spec(base_image)))
    assert not hosts[0].reg.entries


def _slow_tasks(root: Path, n: int) -> list:
    test = 'test "$(cat /tmp/done)" = ok && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt'
    return [make_task(root, f"slow-{i}", "wait", test, solve="sleep 4; echo ok > /tmp/done") for i in range(n)]


def test_a_host_killed_mid_episode_is_run_again_on_another(tmp_path: Path, caplog):
    """SIGKILL one of two hosts while its episodes run: those episodes end HostLost, run again on the other
    host, and every episode is recorded once, scored by its tests."""
    a, b = ProcessHost(tmp_path / "a", capacity=4), ProcessHost(tmp_path / "b", capacity=4)
    try:
        tasks = _slow_tasks(tmp_path / "tasks", 4)
        rb, images = remote([a.url, b.url])
        killed = threading.Event()

        def kill_a_once_busy():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if a.metrics()["active"] >= 1:
                    time.sleep(1.0)  # into the agent's `sleep 4`
                    a.kill()
                    killed.set()
                    return
                time.sleep(0.1)

        killer = threading.Thread(target=kill_a_once_busy)
        killer.start()
        out = tmp_path / "episodes.jsonl"
        results = run(run_eval(tasks, OracleAgent(), rb, images, 4, out, QUIET))
        killer.join()
        assert killed.is_set(), "host a never ran an episode"
        again = [r.message for r in caplog.records if "running it again" in r.message]
        assert again and all("sandbox host" in m and "lost" in m for m in again), again
        assert [(r.reward, r.status) for r in results] == [(1.0, "ok")] * 4, [r.error for r in results]
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert sorted(x["task"] for x in lines) == sorted(t.id for t in tasks), "each episode recorded once"
        assert b.metrics()["active"] == 0
    finally:
        a.kill()
        b.stop()


def test_train_runs_unchanged_through_a_host(tmp_path: Path):
    """The smoke recipe's whole loop (SFT demos, held-out evals, GRPO episodes) on sandbox.backend=remote."""
    host = ProcessHost(tmp_path / "host", capacity=4)
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "furlong.cli", "train", "--config", str(REPO / "recipes/smoke.yaml"),
               "sandbox.backend=remote", f"sandbox.hosts=[{host.url}]",
               f"sandbox.host_token_file={tmp_path / 'host' / 'tok'}", f"train.run_dir={tmp_path / 'run'}"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        episodes = [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()]
        assert episodes and all(e["status"] != "infra_error" for e in episodes), \
            {e["error"] for e in episodes if e["status"] == "infra_error"}
        assert host.metrics()["active"] == 0 and len(host.metrics()) > 0
    finally:
        host.stop()


def test_write_is_sent_as_base64(hosts, base_image):
    """The host's write route takes base64 (JSON-safe for any bytes): the client's bytes arrive exact."""
    rb, _ = remote([hosts[0].url])
    data = bytes(range(256)) * 4

    async def go():
        box = await rb.create(spec(base_image))
        try:
            await box.write_file("/tmp/all-bytes", data)
            return (await box.exec("base64 -w0 /tmp/all-bytes")).stdout
        finally:
            await box.close()

    assert base64.b64decode(run(go())) == data


def test_streamed_output_through_a_host(hosts, base_image):
    """exec(on_output=...) through the host's NDJSON stream: the first piece arrives while the command
    still runs, and the pieces add up to the result's output."""
    rb, _ = remote([hosts[0].url])
    seen: list[tuple[float, str, bytes]] = []

    async def go():
        box = await rb.create(spec(base_image))
        try:
            t0 = time.monotonic()
            r = await box.exec("echo a; sleep 2; echo b; echo e >&2",
                               on_output=lambda s, d: seen.append((time.monotonic() - t0, s, d)))
            return r, time.monotonic() - t0
        finally:
            await box.close()

    r, took = run(go())
    assert r.stdout == "a\nb\n" and r.stderr == "e\n"
    assert b"".join(d for _, s, d in seen if s == "stdout") == b"a\nb\n"
    assert seen[0][1:] == ("stdout", b"a\n") and seen[0][0] < took - 1.0, seen


def test_a_create_naming_an_unknown_syscall_is_refused(hosts):
    """Found by the schema fuzz (tests/test_host_fuzz.py): it was a 500 from the backend's seccomp build."""
    r = hosts[0].c.post("/v1/sandboxes", json={"allow_syscalls": ["", "no_such_call"]})
    assert r.status_code == 400 and "unknown syscall name" in r.text
    assert not hosts[0].reg.entries and hosts[0].reg.reserved == 0


def test_image_commands_refuse_the_remote_backend_in_one_line():
    r = subprocess.run([sys.executable, "-m", "furlong.cli", "image", "list", "sandbox.backend=remote"],
                       env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "hosts build and keep the images" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
