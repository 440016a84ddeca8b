"""The sandbox as an agent sees it: commands, files, shell state, timeouts, output limits, death."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import run, spec
from furlong.envs.harbor import GuardedSandbox
from furlong.sandbox.base import SandboxDied, SandboxError
from furlong.sandbox.runtime.bwrap import BwrapBackend


def test_exec_files_and_shell_state(backend, base_image, tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("bee")
    (tmp_path / "a.sh").write_text("echo run-me")
    (tmp_path / "a.sh").chmod(0o755)

    async def go():
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec("echo out; echo err >&2; exit 3")
            assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, "out\n", "err\n", False)
            await box.write_file("/work/x.bin", b"\x00\x01hello")
            assert await box.read_file("/work/x.bin") == b"\x00\x01hello"
            await box.put_dir(tmp_path, "/data")
            assert (await box.exec("cat /data/sub/b.txt; /data/a.sh")).stdout == "beerun-me\n"
            # cd and export persist between calls, as in a terminal
            await box.exec("mkdir -p /work/deep && cd /work/deep && export GREETING='hi there'")
            r = await box.exec('pwd; echo "$GREETING"')
            assert r.stdout == "/work/deep\nhi there\n"
            # an explicit cwd/env applies to that command only
            r = await box.exec('pwd; echo "$GREETING"', cwd="/tmp", env={"GREETING": "once"})
            assert r.stdout == "/tmp\nonce\n"
            with pytest.raises(SandboxError, match="No such file"):
                await box.read_file("/nope")
        finally:
            await box.close()

    run(go())


def test_hung_command_is_killed_and_sandbox_stays_usable(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            t = time.perf_counter()
            r = await box.exec("echo before; sleep 60; echo after", timeout_s=0.5)
            assert r.timed_out and r.exit_code == 124 and r.stdout == "before\n"
            assert time.perf_counter() - t < 5
            assert (await box.exec("echo still-here")).stdout == "still-here\n"
            assert "sleep 60" not in (await box.exec("ps -eo args")).stdout
        finally:
            await box.close()

    run(go())


def test_large_output_truncated_with_marker_and_bad_utf8_replaced(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            r = await box.exec("head -c 3000000 /dev/zero | tr '\\0' a; printf END")
            assert r.truncated and r.exit_code == 0
            assert "bytes truncated" in r.stdout and r.stdout.endswith("END")
            assert len(r.stdout.encode()) < (1 << 20) + 200
            r = await box.exec("printf 'ok \\xff\\xfe done'")
            assert r.stdout == "ok \ufffd\ufffd done" and not r.truncated
        finally:
            await box.close()

    run(go())


def test_background_processes_outlive_the_command_but_not_the_sandbox(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        host_pids = box._cgroup.pids() if box._cgroup else set()
        r = await box.exec("python3 -m http.server 8765 --bind 127.0.0.1 & sleep 0.5; echo started")
        assert r.stdout.strip().endswith("started")
        r = await box.exec("python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8765/').status)\"")
        assert r.stdout.strip() == "200", r
        pids = box._cgroup.pids() if box._cgroup else host_pids
        await box.close()
        await asyncio.sleep(0.2)
        assert pids, "the sandbox's processes should be visible in its cgroup"
        assert not [p for p in pids if _is_sandbox_process(p)], "processes survived the sandbox"

    run(go())


def _is_sandbox_process(pid: int) -> bool:
    try:  # pids get reused: count only live (not zombie) processes of the sandbox uid
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except OSError:
        return False
    return fields["Uid"].split()[0] == "61000" and not fields["State"].strip().startswith("Z")


def test_concurrent_commands_in_one_sandbox(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            t = time.perf_counter()
            slow = asyncio.create_task(box.exec("sleep 1; echo slow"))
            fast = await box.exec("echo fast")
            assert fast.stdout == "fast\n" and time.perf_counter() - t < 0.9
            assert (await slow).stdout == "slow\n"
        finally:
            await box.close()

    run(go())


def test_streamed_output_arrives_while_the_command_runs(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        try:
            chunks: list[tuple[str, bytes, float]] = []
            r = await box.exec("echo a; echo e >&2; sleep 2; echo b",
                               on_output=lambda stream, data: chunks.append((stream, data, time.monotonic())))
            end = time.monotonic()
            stdout = [(data, at) for stream, data, at in chunks if stream == "stdout"]
            assert stdout[0][0] == b"a\n" and stdout[0][1] < end - 1, "the first line came before the sleep ended"
            assert b"".join(data for data, _ in stdout).decode() == r.stdout == "a\nb\n"
            assert b"".join(data for stream, data, _ in chunks if stream == "stderr").decode() == r.stderr == "e\n"
            assert (await box.exec("echo plain")).stdout == "plain\n"  # without on_output, as before

            def fail(stream: str, data: bytes) -> None:
                raise ValueError(f"caller's bug on {data!r}")
            with pytest.raises(ValueError, match="caller's bug"):
                await box.exec("echo once; echo twice", on_output=fail)
            assert (await box.exec("echo still")).stdout == "still\n", "a failing callback is not the sandbox's death"
        finally:
            await box.close()

    run(go())


def test_an_episodes_guarded_sandbox_streams_and_leaves_a_failing_callback_to_its_caller(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        guarded = GuardedSandbox(box)
        try:
            seen: list[tuple[str, bytes]] = []
            r = await guarded.exec("echo hi", on_output=lambda stream, data: seen.append((stream, data)))
            assert seen == [("stdout", b"hi\n")] and r.stdout == "hi\n"

            def fail(stream: str, data: bytes) -> None:
                raise ValueError("the agent's own bug")
            with pytest.raises(ValueError) as failed:
                await guarded.exec("echo hi", on_output=fail)
            assert not guarded.caused(failed.value), "the sandbox is not blamed for its caller's callback"
            assert guarded.commands == 2 and box.alive
        finally:
            await box.close()

    run(go())


def test_a_streamed_flood_stops_at_the_output_cap(store, base_image):
    cap = 64 << 10
    capped = BwrapBackend(layers=store, output_cap=cap)

    async def go():
        box = await capped.create(spec(base_image))
        try:
            sent = {"stdout": 0, "stderr": 0}

            def count(stream: str, data: bytes) -> None:
                sent[stream] += len(data)
            r = await box.exec("yes | head -c 50M; yes | head -c 50M >&2", on_output=count, timeout_s=60)
            assert r.truncated and sent == {"stdout": cap, "stderr": cap}
            assert len(r.stdout.encode()) < cap + 200  # the result is capped as without streaming
            # a background flood keeps the command's pipes past its end: capped too, and nothing follows the reply
            sent = {"stdout": 0, "stderr": 0}
            r = await box.exec("(touch /tmp/flooding; exec yes flood) & "
                               "until [ -e /tmp/flooding ]; do sleep 0.05; done; sleep 1", on_output=count, timeout_s=10)
            assert r.exit_code == 0 and r.truncated and sent == {"stdout": cap, "stderr": 0}
            await asyncio.sleep(0.5)
            assert (await box.exec("echo quiet", on_output=count)).stdout == "quiet\n" and box.alive
            assert sent == {"stdout": cap + len("quiet\n"), "stderr": 0}
        finally:
            await box.close()

    run(go())


def test_a_dead_sandbox_raises_sandbox_died(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image))
        await box.exec("true")
        os.kill(box._proc.pid, signal.SIGKILL)  # the infrastructure fails under the episode
        for _ in range(500):  # the init dies a moment after bwrap (its parent-death signal)
            if not box.alive:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(SandboxDied):
            await box.exec("echo hi")
        assert not box.alive
        await box.close()

    run(go())


def test_lifetime_limit_closes_the_sandbox(backend, base_image):
    async def go():
        box = await backend.create(spec(base_image, lifetime_s=1.0))
        await box.exec("true")
        await asyncio.sleep(1.5)
        with pytest.raises(SandboxDied):
            await box.exec("true")

    run(go())


def test_warm_pool_hands_out_each_fresh_sandbox_once(backend, base_image):
    from furlong.sandbox.pool import WarmPool

    async def go():
        pool = WarmPool(backend, spec(base_image), size=2)
        await pool.start()
        first = await pool.acquire()
        await first.exec("echo mine > /root/mark")
        second = await pool.acquire()
        assert second is not first
        assert (await second.exec("cat /root/mark")).exit_code != 0  # nothing from another episode
        for box in (first, second):
            await box.close()
        await pool.close()
        assert all(not b.alive for b in (first, second))

    run(go())


def test_a_layer_rebuilt_at_the_same_path_is_reopened(backend, base_image, store):
    import shutil
    import tempfile

    from furlong.sandbox.base import ImageRef

    root = Path(tempfile.mkdtemp(dir=store.root))  # layers are found inside an image store
    layer = root / "layer"
    try:
        for version in ("one", "two"):
            shutil.rmtree(layer, ignore_errors=True)
            layer.mkdir(parents=True)
            (layer / "version").write_text(version)
            for p in (root, layer, layer / "version"):
                p.chmod(0o755 if p.is_dir() else 0o644)
            image = ImageRef(digest=f"rebuilt-{version}", layers=(store.layer(version, layer), *base_image.layers))

            async def go():
                box = await backend.create(spec(image))
                try:
                    return (await box.exec("cat /version")).stdout
                finally:
                    await box.close()

            assert run(go()) == version
    finally:
        shutil.rmtree(root)


def test_a_shell_state_file_inside_an_image_is_ignored(backend, base_image, store):
    """A state file baked into an image (e.g. by a build step) must not set a sandbox's first cwd or PATH."""
    import dataclasses
    import shutil
    import tempfile

    from furlong.sandbox.base import ImageRef

    root = Path(tempfile.mkdtemp(dir=store.root))
    state = root / "layer" / "run" / "furlong-shell" / "state"
    try:
        state.parent.mkdir(parents=True)
        state.write_text("export PATH=/nowhere\ncd -- / 2>/dev/null\n")
        for p in [root, *root.rglob("*")]:  # this process's, as a built layer is: the sandbox's root inside
            p.chmod(0o755 if p.is_dir() else 0o644)
        layer = store.layer("stale-state", root / "layer")
        image = dataclasses.replace(ImageRef(digest="stale-state", layers=(layer, *base_image.layers)),
                                    workdir="/tmp", env=(("PATH", "/usr/local/bin:/usr/bin:/bin"),))

        async def go():
            box = await backend.create(spec(image))
            try:
                return (await box.exec("pwd; echo $PATH")).stdout.split()
            finally:
                await box.close()

        assert run(go()) == ["/tmp", "/usr/local/bin:/usr/bin:/bin"]
    finally:
        shutil.rmtree(root)
