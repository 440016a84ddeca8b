"""The weight-update server and its client over real loopback HTTP: refusals, retries, keep-alive."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from furlong.engine.hf import HFEngine
from furlong.model import init_tiny, load_model
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay
from furlong.sync.serving import BackgroundServer, bound_socket
from furlong.sync.transport import (
    DirectoryTransport,
    HttpTransport,
    TransportError,
    UpdateNotFound,
    UpdateServer,
    update_app,
)

PAYLOAD = os.urandom(300_000)


def _published(tmp_path: Path) -> DirectoryTransport:
    directory = DirectoryTransport(tmp_path / "updates", fsync=False)
    directory.put(1, "full", PAYLOAD)
    return directory


def _files(directory: DirectoryTransport) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.root.iterdir())}


def test_server_refuses_unauthenticated_requests_and_changes_nothing(tmp_path: Path) -> None:
    directory = _published(tmp_path)
    before = _files(directory)
    with UpdateServer(directory, token="s3cret") as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            assert httpx.post(f"{server.url}/want-full", headers=headers).status_code == 401
            refused = httpx.get(f"{server.url}/updates/1", headers=headers)
            assert refused.status_code == 401 and PAYLOAD not in refused.content
        with HttpTransport(server.url, backoff_s=0.01) as anonymous:
            with pytest.raises(TransportError, match="HTTP 401: missing or wrong bearer token"):
                anonymous.request_full()
        assert _files(directory) == before and not directory.take_full_request()
        with HttpTransport(server.url, token="s3cret") as client:
            assert client.latest() == 1 and bytes(client.get(1)) == PAYLOAD
            client.request_full()
    assert directory.take_full_request()


def test_server_answers_malformed_requests_with_one_line_errors_and_changes_nothing(tmp_path: Path) -> None:
    directory = _published(tmp_path)
    before = _files(directory)
    with UpdateServer(directory) as server:
        bad_version = httpx.get(f"{server.url}/updates/latest")
        assert bad_version.status_code == 400 and bad_version.json()["detail"].startswith("path.version: ")
        bad_bound = httpx.get(f"{server.url}/latest-full", params={"at_or_before": "x"})
        assert bad_bound.status_code == 400 and bad_bound.json()["detail"].startswith("query.at_or_before: ")
        assert httpx.get(f"{server.url}/want-full").status_code == 405  # a GET never sets the flag
        assert httpx.put(f"{server.url}/updates/2", content=b"forged").status_code == 405  # read-only
        assert httpx.get(f"{server.url}/updates/7").status_code == 404
        assert _files(directory) == before and not directory.take_full_request()
        with HttpTransport(server.url) as client, pytest.raises(UpdateNotFound, match="v7 is not in"):
            client.get(7)


class _Flaky:
    """An ASGI app in front of the update server's: its first `failures` requests fail as `how` says."""

    def __init__(self, app: Any, failures: int, how: str) -> None:
        self.app, self.failures, self.how = app, failures, how
        self.requests: list[tuple[str, int]] = []  # (path, client port) of every request received

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.requests.append((scope["path"], scope["client"][1]))
        if len(self.requests) > self.failures:
            return await self.app(scope, receive, send)
        if self.how == "503":
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
        else:  # "cut": announce the whole payload, send a tenth, end the response (uvicorn drops the connection)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(PAYLOAD)).encode())]})
            await send({"type": "http.response.body", "body": PAYLOAD[: len(PAYLOAD) // 10]})


@pytest.mark.parametrize("how", ["503", "cut"])
def test_client_retries_transient_failures_then_gets_the_payload(tmp_path: Path, how: str) -> None:
    flaky = _Flaky(update_app(_published(tmp_path)), failures=3, how=how)
    with BackgroundServer(flaky) as server, HttpTransport(server.url, attempts=4, backoff_s=0.01) as client:
        assert bytes(client.get(1)) == PAYLOAD
    assert [path for path, _ in flaky.requests] == ["/updates/1"] * 4


@pytest.mark.parametrize("how", ["503", "cut"])
def test_client_gives_up_after_its_attempts_with_the_last_failure(tmp_path: Path, how: str) -> None:
    flaky = _Flaky(update_app(_published(tmp_path)), failures=100, how=how)
    with BackgroundServer(flaky) as server, HttpTransport(server.url, attempts=3, backoff_s=0.01) as client:
        expected = "HTTP 503" if how == "503" else "transfer failed after 30000 bytes"
        with pytest.raises(TransportError, match=f"gave up after 3 attempts: .*/updates/1: {expected}"):
            client.get(1)
    assert len(flaky.requests) == 3


def test_client_does_not_retry_a_final_answer(tmp_path: Path) -> None:
    recorder = _Flaky(update_app(_published(tmp_path), token="s3cret"), failures=0, how="503")
    with BackgroundServer(recorder) as server:
        with HttpTransport(server.url, token="s3cret", backoff_s=0.01) as client, pytest.raises(UpdateNotFound):
            client.get(9)
        with HttpTransport(server.url, backoff_s=0.01) as anonymous, pytest.raises(TransportError, match="HTTP 401"):
            anonymous.latest()
    assert len(recorder.requests) == 2


def test_client_gives_up_on_a_server_that_is_not_there() -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with HttpTransport(url, attempts=2, backoff_s=0.01) as client:
            with pytest.raises(TransportError, match="gave up after 2 attempts: .*/latest: ConnectError"):
                client.latest()


def test_client_pulls_several_versions_over_one_kept_alive_connection(tmp_path: Path) -> None:
    directory = _published(tmp_path)
    for v in (2, 3):
        directory.put(v, "delta", PAYLOAD[v:])
    recorder = _Flaky(update_app(directory), failures=0, how="503")
    with BackgroundServer(recorder) as server, HttpTransport(server.url) as client:
        assert client.latest() == 3
        assert [len(client.get(v)) for v in (3, 2, 1)] == [len(PAYLOAD) - 3, len(PAYLOAD) - 2, len(PAYLOAD)]
    assert len(recorder.requests) == 4 and len({port for _, port in recorder.requests}) == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_a_relay_syncs_its_engine_through_a_server_that_fails_transiently(tmp_path: Path) -> None:
    from test_sync_publish import train_step

    model_dir = init_tiny()
    directory = DirectoryTransport(tmp_path / "updates", fsync=False)
    pub = Publisher(directory, full_every=3)
    w = dict(load_model(model_dir).state_dict())
    for v in (1, 2):
        w = train_step(w, v)
        pub.publish(w, v)
    flaky = _Flaky(update_app(directory), failures=3, how="503")

    async def main(url: str) -> None:
        async with HFEngine(load_model(model_dir), eos_token_ids=()) as engine:
            with HttpTransport(url, backoff_s=0.01) as client:
                report = await Relay(client, engine).sync_once()
            assert report.applied == (1, 2) and engine.weight_version == 2
            for name, tensor in engine.model.state_dict().items():
                assert torch.equal(tensor, w[name].to(torch.bfloat16).to(tensor.dtype)), name

    with BackgroundServer(flaky) as server:
        asyncio.run(main(server.url))
    assert [path for path, _ in flaky.requests[:4]] == ["/latest"] * 4


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_served_connections_reply_without_waiting_for_the_clients_ack(host: str):
    """Every connection a furlong server accepts has TCP_NODELAY: without it, a reply written in two parts
    (uvicorn writes headers, then body) waits for the client's delayed ACK on every request of a kept-alive
    connection but its first (40 ms each on Linux). uvicorn accepts through asyncio, as here."""
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    sock = bound_socket(host, 0)
    sock.listen()
    seen: list[int] = []

    async def main() -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            await reader.read()  # until the server closes it: the accept callback has run
            writer.close()

    asyncio.run(main())
    assert seen == [1]
