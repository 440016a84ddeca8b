"""`furlong openenv serve` driven by the `openenv` package's own client: a solved task gets the tests'
reward, doing nothing gets 0, bad requests are refused without side effects, sessions are capped,
reaped when idle, and each closes its sandbox."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import httpx
import pytest
from openenv.core.generic_client import GenericEnvClient

from conftest import run
from openenv_support import HEADERS, ThreadServer
from furlong.config import BUNDLED_TASKS
from furlong.eval.openenv_server import TaskBook
from furlong.sandbox.pool import FreshSandboxes, StoreImages
from furlong.sandbox.network import NO_NETWORK, PACKAGES
from furlong.tasks.family import load_family
from furlong.tasks.model import TaskNetwork
from furlong.train.sft import solution_command


class CountedSandboxes(FreshSandboxes):
    """Fresh sandboxes, each one kept to ask whether it is still alive."""

    def __init__(self, backend, store):
        super().__init__(backend, StoreImages(store, backend))
        self.started: list = []

    async def acquire(self, spec):
        box = await super().acquire(spec)
        self.started.append(box)
        return box

    def alive(self) -> int:
        return sum(box.alive for box in self.started)


@pytest.fixture(scope="module")
def tasks():
    return load_family(BUNDLED_TASKS / "count-in-file").instances("all", 2)


@pytest.fixture
def served(backend, store, base_image, tasks, request):
    sandboxes = CountedSandboxes(backend, store)
    server = ThreadServer(tasks, sandboxes, **getattr(request, "param", {}))
    yield server, sandboxes
    server.stop()


def client(url: str, **kw) -> GenericEnvClient:
    return GenericEnvClient(base_url=url, headers=HEADERS, message_timeout_s=120, **kw)


def test_the_packages_client_gets_the_tests_reward(served, tasks):
    server, sandboxes = served
    task = tasks[0]

    async def episodes():
        async with client(server.url) as env:
            first = await env.reset(task_id=task.id)
            assert first.observation["instruction"] == task.instruction and not first.done
            assert [t["function"]["name"] for t in first.observation["tools"]] == ["bash"]
            step = await env.step({"command": solution_command(task)})
            assert step.observation["output"].startswith("exit code 0") and not step.done and step.reward is None
            solved = await env.step({"done": True})
            assert (solved.done, solved.reward, solved.observation["status"]) == (True, 1.0, "ok")
            with pytest.raises(RuntimeError, match="the episode is over"):
                await env.step({"command": "true"})
            # doing nothing: the tests score it 0; by the task API's split and index this time
            await env.reset(split="train", index=0)
            idle = await env.step({"done": True})
            assert (idle.done, idle.reward, idle.observation["status"]) == (True, 0.0, "ok")
            # a tool call names the tool; an unknown tool is a tool error the agent reads
            await env.reset(task_id=task.id)
            called = await env.step({"tool": "bash", "arguments": {"command": "echo hi"}})
            assert called.observation["output"] == "exit code 0\nhi"
            unknown = await env.step({"tool": "python", "arguments": {}})
            assert unknown.observation["output"] == "error: unknown tool 'python'; the tools: bash"
            assert sandboxes.alive() == 1  # a reset ended the episode before it, and its sandbox
        return True

    assert run(episodes())
    deadline = time.monotonic() + 30
    while sandboxes.alive() and time.monotonic() < deadline:  # the session closed with the connection
        time.sleep(0.1)
    assert sandboxes.alive() == 0 and len(sandboxes.started) == 3


def test_bad_requests_are_refused_without_side_effects(served, tasks):
    server, sandboxes = served
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/schema").status_code == 401
    assert httpx.get(f"{server.url}/schema", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert "command" in httpx.get(f"{server.url}/schema", headers=HEADERS).json()["action"]["properties"]
    assert httpx.post(f"{server.url}/reset", headers=HEADERS).status_code == 404  # no stateless episodes

    async def refused():
        with pytest.raises(ConnectionError, match="403"):
            async with GenericEnvClient(base_url=server.url) as env:
                await env.reset()
        async with client(server.url) as env:
            with pytest.raises(RuntimeError, match="no episode: reset first"):
                await env.step({"command": "true"})
            with pytest.raises(RuntimeError, match="unknown task_id 'nope'"):
                await env.reset(task_id="nope")
            with pytest.raises(RuntimeError, match="no task at split 'train' index 99"):
                await env.reset(split="train", index=99)
            assert sandboxes.started == []  # refused before anything started
            await env.reset(task_id=tasks[0].id)
            for bad in ({"nonsense": 1}, {"command": "ls", "tool": "bash"}, {}, {"command": 5}):
                with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                    await env.step(bad)
            ok = await env.step({"command": "echo still here"})  # the session and the server are still up
            assert ok.observation["output"] == "exit code 0\nstill here"
            tasks_listed = (await asyncio.to_thread(httpx.post, f"{server.url}/furlong/tasks", headers=HEADERS,
                                                    json={"split": "heldout"})).json()["tasks"]
            assert [t["id"] for t in tasks_listed] == [t.id for t in tasks if t.split == "heldout"]
        return len(sandboxes.started)

    assert run(refused()) == 1
    networked = dataclasses.replace(tasks[0], network=TaskNetwork(NO_NETWORK, PACKAGES))
    with pytest.raises(ValueError, match="has network in a phase"):
        TaskBook([networked], sandboxes).pick(networked.id, None, None)
    assert TaskBook([networked], sandboxes, allow_network=True).pick(networked.id, None, None) is networked


@pytest.mark.parametrize("served", [{"capacity": 1, "idle_s": 1.0}], indirect=True)
def test_sessions_are_capped_and_reaped_when_idle(served, tasks):
    server, sandboxes = served

    async def sessions():
        first = client(server.url)
        await first.reset(task_id=tasks[0].id)
        with pytest.raises(RuntimeError, match="CAPACITY_REACHED"):
            async with client(server.url) as second:
                await second.reset()
        deadline = time.monotonic() + 30  # the package's reaper looks every 5 s at least
        while sandboxes.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert sandboxes.alive() == 0  # reaped: its episode stopped and its sandbox closed
        with pytest.raises(RuntimeError, match="no episode"):
            await first.step({"command": "true"})
        await first.close()
        async with client(server.url) as third:  # the seat is free again
            assert (await third.reset(task_id=tasks[0].id)).observation["task_id"] == tasks[0].id

    run(sessions())


def test_the_agent_timeout_ends_the_episode_and_the_tests_still_score_it(backend, store, base_image, tasks):
    quick = dataclasses.replace(tasks[0], agent_timeout_s=1.0)
    sandboxes = CountedSandboxes(backend, store)
    server = ThreadServer([quick], sandboxes)

    async def late():
        async with client(server.url) as env:
            await env.reset()
            await env.step({"command": solution_command(quick)})
            await asyncio.sleep(2.0)  # past the agent timeout: the tests have run without waiting for us
            assert sandboxes.alive() == 0
            return await env.step({"command": "rm -rf /app"})  # too late to change anything

    try:
        ended = run(late())
    finally:
        server.stop()
    assert (ended.done, ended.reward, ended.observation["status"]) == (True, 1.0, "timeout")
    assert ended.observation["metadata"]["agent_timed_out"] is True
