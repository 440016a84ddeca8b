"""The engine server is closed by default (issue 48): every route but /health needs its bearer token, a
request without it (missing, wrong, non-ASCII) gets 401 and changes nothing, a non-loopback --host without a
token is refused at start, and furlong's clients (RemoteEngine, the Router) send the token and work. Real
server processes on loopback (the tiny model), real HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from furlong.engine.base import EngineRefused, SamplingParams
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.engine.router import Router
from furlong.engine.server import ENGINE_TOKEN_ENV, READY_PREFIX
from furlong.model.loading import load_model
from furlong.sync.publish import Publisher
from furlong.sync.serving import require_token_off_loopback, server_token
from furlong.sync.transport import DirectoryTransport

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# every route but /health, with a body that would be accepted (or reach the route) if the token were right
PROTECTED = {
    "/generate": {"input_ids": [5, 17, 99], "sampling": {"max_new_tokens": 2}},
    "/score": {"input_ids": [5, 17, 99], "start": 1},
    "/sync": None,
    "/pause": None,
    "/resume": None,
    "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                                   "world_size": 2, "group_name": "g", "auth_nonce": "0" * 32},
    "/update_weights_from_distributed": {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                         "group_name": "g", "weight_version": "5"},
    "/destroy_weights_update_group": {"group_name": "g"},
    "/update_weights_from_tensor": {"serialized_named_tensors": ["eA=="], "weight_version": "5"},
}
STRANGERS = {"missing": {}, "wrong": {"Authorization": "Bearer not-the-token-at-all"},
             "not bearer": {"Authorization": "Basic dXNlcjpwYXNz"},
             "non-ASCII": {"Authorization": "Bearer tok\u00e9n\u00e9".encode("latin-1")}}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENGINE_TOKEN_ENV}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine server with a relay (v0 and v1 published; it has loaded neither), and its publisher."""
    tmp = tmp_path_factory.mktemp("auth")
    publisher = Publisher(DirectoryTransport(tmp / "updates"), engine_dtype=torch.float32)
    state = load_model(tiny_dir).state_dict()
    publisher.publish(state, 0)
    publisher.publish({k: v + 0.01 for k, v in state.items()}, 1)
    proc = EngineProcess(tiny_dir, updates=str(tmp / "updates"), log=tmp / "engine.log", prefix_cache_mb=16)
    yield proc
    proc.stop()


def test_every_route_but_health_refuses_a_stranger_and_changes_nothing(served: EngineProcess):
    async def main() -> None:
        async with httpx.AsyncClient(base_url=served.url, trust_env=False, timeout=60) as raw:
            before = (await raw.get("/health")).json()  # open: no token
            assert before["weight_version"] == 0 and not before["paused"] and before["weight_groups"] == []
            for route, body in PROTECTED.items():
                for who, headers in STRANGERS.items():
                    resp = await raw.post(route, json=body, headers=headers)
                    assert resp.status_code == 401, (route, who, resp.text)
                    assert resp.headers["www-authenticate"] == "Bearer"
            after = (await raw.get("/health")).json()
        # no pause, no sync (v1 was there to load), no group joined
        assert after == before

    asyncio.run(main())


def test_the_token_holder_pauses_syncs_and_generates(served: EngineProcess):
    async def main() -> None:
        engine = RemoteEngine(served.url, token=served.token)
        try:
            await engine.pause()
            assert (await engine.health())["paused"]
            await engine.resume()
            assert (await engine.sync())["engine_version"] == 1  # what the strangers' /sync could not load
            gen = await engine.generate([5, 17, 99], SamplingParams(max_new_tokens=3, seed=1))
            assert gen.weight_version == 1 and len(gen.output_ids) == 3
        finally:
            await engine.close()
        router = Router([RemoteEngine(served.url, token=served.token)])
        try:
            gen = await router.generate([5, 17, 100], SamplingParams(max_new_tokens=3, seed=2))
            assert len(gen.output_ids) == len(gen.logprobs) == 3 and router.weight_version == 1
        finally:
            await router.close()
        stranger = RemoteEngine(served.url)
        try:
            with pytest.raises(EngineRefused, match="HTTP 401.*token"):
                await stranger.pause()
        finally:
            await stranger.close()

    asyncio.run(main())


@pytest.mark.parametrize("argv", [["-m", "furlong.cli", "engine", "serve"], ["-m", "furlong.engine.server"]])
def test_a_non_loopback_host_without_a_token_is_refused_at_start(tiny_dir: Path, tmp_path: Path, argv: list[str]):
    res = subprocess.run([sys.executable, *argv, "--model", str(tiny_dir), "--host", "0.0.0.0", "--port", "0"],
                         check=False, capture_output=True, text=True, timeout=300,
                         env=_env(FURLONG_CACHE=str(tmp_path)))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--host 0.0.0.0 is not loopback: give --token-file" in res.stdout + res.stderr
    assert READY_PREFIX not in res.stdout and not (tmp_path / "engine-token").exists()


def test_the_token_rule_on_its_own(tmp_path: Path):
    """Off loopback only with a token (also the rule a Ray engine actor applies to its node address); a
    token file must hold a token a client can send."""
    with pytest.raises(ValueError, match="--host 10.1.2.3 is not loopback: give EngineSpec.engine_token"):
        require_token_off_loopback("10.1.2.3", "", "EngineSpec.engine_token")
    require_token_off_loopback("10.1.2.3", "a-token", "EngineSpec.engine_token")
    require_token_off_loopback("::1", None, "--token-file")
    odd = tmp_path / "odd"
    odd.write_text("t\u00f6ken-with-an-umlaut-in-it\n")
    with pytest.raises(ValueError, match="printable ASCII"):
        server_token(odd, "0.0.0.0", tmp_path / "gen", print, "clients")


def test_engine_serve_with_a_token_file_serves_its_token_holder(tiny_dir: Path, tmp_path: Path):
    token_file = tmp_path / "engine.token"
    token_file.write_text("a-token-of-at-least-sixteen-chars\n")
    cmd = [sys.executable, "-m", "furlong.cli", "engine", "serve", "--model", str(tiny_dir), "--port", "0",
           "--token-file", str(token_file), "--prefix-cache-mb", "16"]
    with open(tmp_path / "server.log", "w") as log:
        # $FURLONG_ENGINE_TOKEN is there too: the flag wins over it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=_env(FURLONG_CACHE=str(tmp_path), **{ENGINE_TOKEN_ENV: "the-environment-token"}))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith(READY_PREFIX), (tmp_path / "server.log").read_text()[-2000:]
        assert asyncio.run(_generate_and_refuse(line[len(READY_PREFIX):])) == (2, 0)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


async def _generate_and_refuse(url: str) -> tuple[int, int]:
    """Output length of a generation with the file's token; the version /health reports to the env's token."""
    engine, wrong = RemoteEngine(url, token="a-token-of-at-least-sixteen-chars"), RemoteEngine(
        url, token="the-environment-token")
    try:
        gen = await engine.generate([5, 17, 99], SamplingParams(max_new_tokens=2, seed=1))
        with pytest.raises(EngineRefused, match="HTTP 401"):
            await wrong.generate([5, 17, 99], SamplingParams(max_new_tokens=2, seed=1))
        return len(gen.output_ids), (await wrong.health())["weight_version"]
    finally:
        await engine.close()
        await wrong.close()
