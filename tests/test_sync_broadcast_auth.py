"""The broadcast group's handshake (furlong.sync.group_auth): a stranger that reaches the trainer's TCPStore and
really joins the gloo group, or a member holding the wrong token, is refused before any weight is broadcast.
Real processes: an engine server (token-guarded routes), the trainer's gloo group, and the stranger's own
process (tests/group_intruder.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from furlong.engine.base import EngineError
from furlong.engine.remote import EngineProcess, RemoteEngine
from furlong.sync.broadcast import GROUP_NAME, GroupSpec, WeightGroup, host_store
from furlong.sync.group_auth import RendezvousNotAuthenticated, proof
from furlong.train.weights import BroadcastLink, start_engines

TOKEN = "test-engine-token"
HELPER = str(Path(__file__).resolve().parent / "group_intruder.py")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engine(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> EngineProcess:
    [proc] = asyncio.run(start_engines(1, tiny_dir, None, tmp_path_factory.mktemp("engine"), 1, None, 16,
                                       engine_token=TOKEN))
    yield proc
    proc.stop()


class Intercepted:
    """A member whose announcement never reaches its engine, while a stranger who scanned the trainer's port
    (and knows no secret: it is given the port, the rank and the world size, not the body) joins in its place."""

    def __init__(self) -> None:
        self.stranger: asyncio.subprocess.Process | None = None

    async def init_weights_update_group(self, body: dict) -> dict:
        self.stranger = await asyncio.create_subprocess_exec(
            sys.executable, HELPER, "intruder", body["master_address"], str(body["master_port"]),
            str(body["rank_offset"]), str(body["world_size"]), GROUP_NAME, stdout=asyncio.subprocess.PIPE)
        await asyncio.Event().wait()  # the lost request: no answer, until the open gives up on it
        raise AssertionError("unreachable")

    async def update_weights_from_distributed(self, body: dict) -> dict:
        raise AssertionError("no weights may be announced to a group that failed its handshake")

    async def destroy_weights_update_group(self, group_name: str) -> dict:
        raise AssertionError("the open failed: there is no link to close")


@pytest.mark.parametrize("rank", [1, 2], ids=["in-the-engines-place", "as-an-extra-rank"])
def test_a_stranger_in_the_group_fails_the_open_before_any_weight_moves(engine: EngineProcess, rank: int):
    async def main() -> None:
        real, stranger = RemoteEngine(engine.url, token=TOKEN), Intercepted()
        members = [stranger, real] if rank == 1 else [real, stranger]
        before = await real.health()
        began = time.perf_counter()
        with pytest.raises((EngineError, RendezvousNotAuthenticated)) as failed:
            await BroadcastLink.open(real, members, cleanup=real.close, timeout_s=60, secret=TOKEN)
        assert f"rank {rank} did not prove the run's secret" in str(failed.value)
        assert "not authenticated" in str(failed.value) and time.perf_counter() - began < 30
        assert stranger.stranger is not None
        out, _ = await asyncio.wait_for(stranger.stranger.communicate(), 60)
        seen = json.loads(out)
        # it was in the gloo group, got nothing, and saw the group go away (not its own 20 s timeout)
        assert seen["joined"] and not seen["received"] and seen["error"], seen
        probe = RemoteEngine(engine.url, token=TOKEN)
        after = await probe.health()
        await probe.close()
        assert after["weight_groups"] == [] and after["weight_version"] == before["weight_version"]

    asyncio.run(main())


def test_a_member_with_the_wrong_token_fails_the_handshake_on_both_sides():
    """The trainer (rank 0, this process) holds the run's secret; the member (its own process) another one. Each
    side names the other: the trainer rank 1, the member the trainer (and that its own token may be wrong)."""
    store = host_store("127.0.0.1", 2, 30)
    spec = GroupSpec("127.0.0.1", store.port, 0, 2, auth_nonce="n" * 32)
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            WeightGroup(spec, 0, 30, store, secret=TOKEN)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    done = subprocess.run([sys.executable, HELPER, "member", "127.0.0.1", str(store.port), "1", "2", GROUP_NAME,
                           spec.auth_nonce, "not-the-token"], capture_output=True, text=True, timeout=90, check=False)
    thread.join(60)
    assert done.returncode == 0, done.stderr[-2000:]
    member = json.loads(done.stdout)
    assert not member["joined"] and "rank 0 (the trainer) did not prove the run's secret" in member["error"]
    assert "this member's own token" in member["error"]
    assert len(errors) == 1 and isinstance(errors[0], RendezvousNotAuthenticated)
    assert "rank 1 did not prove" in str(errors[0]) and "before any weights were sent" in str(errors[0])


def test_a_token_guarded_engine_joins_only_an_authenticated_group(engine: EngineProcess):
    """An SGLang-shaped body without auth_nonce would let a stranger take a rank: refused before joining."""
    sglang_body = GroupSpec("127.0.0.1", 1234, 1, 2).body()

    async def main() -> None:
        client = RemoteEngine(engine.url, token=TOKEN)
        try:
            for body, reason in ((sglang_body, "joins only an authenticated group"),
                                 ({**sglang_body, "auth_nonce": "short"}, "at least 32 characters")):
                with pytest.raises(EngineError, match="HTTP 400") as refused:
                    await client.init_weights_update_group(body)
                assert reason in str(refused.value)
            assert (await client.health())["weight_groups"] == []
        finally:
            await client.close()

    asyncio.run(main())


def test_the_proof_binds_the_secret_the_nonce_the_rank_and_the_group():
    mac = proof(TOKEN, "n" * 32, 1, GROUP_NAME, 3)
    assert len(mac) == 32 and mac == proof(TOKEN, "n" * 32, 1, GROUP_NAME, 3)
    others = {proof("other", "n" * 32, 1, GROUP_NAME, 3), proof(TOKEN, "m" * 32, 1, GROUP_NAME, 3),
              proof(TOKEN, "n" * 32, 2, GROUP_NAME, 3), proof(TOKEN, "n" * 32, 1, "other", 3),
              proof(TOKEN, "n" * 32, 1, GROUP_NAME, 4)}
    assert mac not in others and len(others) == 5
    with pytest.raises(ValueError, match="auth_nonce"):
        GroupSpec("127.0.0.1", 1234, 1, 2, auth_nonce="short")
    with pytest.raises(ValueError, match="both the secret and spec.auth_nonce"):
        WeightGroup(GroupSpec("127.0.0.1", 1234, 1, 2), 1, 1, secret=TOKEN)
    assert "auth_nonce" not in GroupSpec("127.0.0.1", 1234, 1, 2).body()  # SGLang's body, exactly
