"""Weight publishing end to end: publisher -> transport -> relay -> a real HF engine, and faults."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from furlong.engine import SamplingParams
from furlong.engine.hf import HFEngine
from furlong.model import init_tiny, load_model
from furlong.sync import WeightReceiver, read_update
from furlong.sync.publish import Publisher
from furlong.sync.relay import Relay, SyncFailed, SyncReport
from furlong.sync.transport import (
    DirectoryTransport,
    HttpTransport,
    InProcessTransport,
    Transport,
    TransportError,
    UpdateNotFound,
    UpdateServer,
    update_name,
)
from furlong.sync.update import pack_payload, unpack_payload

Weights = dict[str, torch.Tensor]
NOISE = 3e-6  # per step: ~2-3% of the bf16 weights change, as reported for RL steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return init_tiny()  # the shared cache: built once per machine


@pytest.fixture(scope="module")
def master(tiny_dir: Path) -> Weights:
    """fp32 trainer weights (tied lm_head included, as a trainer's state_dict has it)."""
    return dict(load_model(tiny_dir).state_dict())


def train_step(w: Weights, seed: int) -> Weights:
    """New fp32 weights, tied tensors kept tied (one storage, several names) as in a trainer."""
    g = torch.Generator().manual_seed(seed)
    out: Weights = {}
    stepped: dict[int, torch.Tensor] = {}
    for k, v in w.items():
        if v.data_ptr() not in stepped:
            stepped[v.data_ptr()] = v + NOISE * torch.randn(v.shape, generator=g)
        out[k] = stepped[v.data_ptr()]
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bits(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """`got` (any float dtype) equals `want` bit for bit once cast to want's dtype."""
    for name, w in want.items():
        assert torch.equal(bits(got[name].to(w.dtype)), bits(w)), f"{name} differs"


def assert_engine_has(engine: HFEngine, weights: Mapping[str, torch.Tensor], version: int) -> None:
    assert engine.weight_version == version
    live = engine.model.state_dict()
    assert_bits(live, weights)
    assert torch.equal(live["lm_head.weight"], live["model.embed_tokens.weight"])  # still tied


def snapshot(pub: Publisher) -> Weights:
    assert pub.published is not None
    return {k: v.clone() for k, v in pub.published.items()}


def run(coro):
    return asyncio.run(coro)


async def sync_during_generation(engine: HFEngine, relay: Relay) -> tuple[SyncReport, tuple[int, ...]]:
    """sync_once() while a long request decodes: returns its report and the token versions."""
    task = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=10_000)))
    await tokens_generated(engine, 3)
    report = await relay.sync_once()
    await tokens_generated(engine, engine.stats.generated_tokens + 3)
    await engine.abort_all()  # ends the request, keeping its tokens
    return report, (await task).token_weight_versions


async def tokens_generated(engine: HFEngine, n: int) -> None:
    while engine.stats.generated_tokens < n:
        await asyncio.sleep(0.002)


# --- publisher -------------------------------------------------------------------------------


def test_publisher_kinds_sizes_and_bit_exact_chain(master: Weights) -> None:
    transport = InProcessTransport()
    pub = Publisher(transport, full_every=3)
    w, reports, rx = master, [], WeightReceiver()
    for v in range(1, 6):
        w = train_step(w, v)
        reports.append(pub.publish(w, v))
        rx.apply(memoryview(transport.get(v)))
        assert_bits(rx.tensors, snapshot(pub))
    assert [(r.kind, r.base_version, r.reason) for r in reports] == [
        ("full", None, "first"), ("delta", 1, "delta"), ("delta", 2, "delta"),
        ("full", None, "full_every"), ("delta", 4, "delta")]
    for r in reports:
        print(f"v{r.version} {r.kind:5} {r.payload_bytes / 1e6:5.2f} MB of {r.full_bytes / 1e6:.2f} "
              f"MB ({r.ratio:.1%}) encode {r.encode_s * 1e3:.0f} ms")
        assert r.encode_s > 0 and r.full_bytes == reports[0].full_bytes
        assert r.ratio < (0.8 if r.kind == "full" else 0.15)
    published = snapshot(pub)
    tied = {"lm_head.weight", "model.embed_tokens.weight"}
    assert len(tied & published.keys()) == 1  # tied weights are sent once
    assert all(t.dtype == torch.bfloat16 for t in published.values())
    w["model.norm.weight"].add_(1.0)  # the published copy never aliases trainer tensors
    assert_bits(published, snapshot(pub))
    with pytest.raises(ValueError, match="newer"):
        pub.publish(w, 5)
    transport.request_full()
    assert pub.publish(w, 6).reason == "requested" and pub.publish(w, 7).kind == "delta"
    assert pub.publish(w, 8, force_full=True).reason == "forced"


# --- transports ------------------------------------------------------------------------------


def _transports(tmp_path: Path) -> list[tuple[str, Transport, Transport, Callable[[], None]]]:
    """(name, writer, reader, close) for each transport."""
    mem = InProcessTransport()
    directory = DirectoryTransport(tmp_path / "dir")
    served = DirectoryTransport(tmp_path / "http")
    server = UpdateServer(served)
    return [("memory", mem, mem, lambda: None), ("directory", directory, directory, lambda: None),
            ("http", served, HttpTransport(server.url), server.close)]


def test_transport_contract(tmp_path: Path) -> None:
    payloads = {v: os.urandom(1000 + v) for v in range(1, 5)}
    for name, writer, reader, close in _transports(tmp_path):
        try:
            assert reader.latest() is None and reader.latest_full_at_or_before(9) is None, name
            for v, kind in [(1, "full"), (2, "delta"), (3, "full"), (4, "delta")]:
                writer.put(v, kind, payloads[v])
            assert reader.latest() == 4 and bytes(reader.get(2)) == payloads[2], name
            assert [reader.latest_full_at_or_before(v) for v in (0, 2, 3, 9)] == [None, 1, 3, 3]
            with pytest.raises(UpdateNotFound):
                reader.get(7)
            with pytest.raises(TransportError, match="not newer"):
                writer.put(4, "full", b"again")  # versions are immutable
            assert not writer.take_full_request()
            reader.request_full()
            assert writer.take_full_request() and not writer.take_full_request(), name
        finally:
            close()
    with pytest.raises(TransportError, match="read-only"):
        HttpTransport("http://127.0.0.1:9").put(1, "full", b"")


def test_directory_publication_is_atomic_and_prunable(tmp_path: Path) -> None:
    root = tmp_path / "updates"
    transport = DirectoryTransport(root)  # with fsync: the production path
    # Debris of a writer that crashed mid-put, and an unrelated file: never visible.
    root.joinpath(".tmp-" + update_name(1, "full") + ".123.dead").write_bytes(b"partial")
    root.joinpath("notes.txt").write_text("hello")
    assert transport.latest() is None and transport.listing() == []
    pub = Publisher(transport, full_every=4)
    g = torch.Generator().manual_seed(0)
    w = {f"w{i}": torch.randn(256, 256, generator=g) * 0.02 for i in range(4)}
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:  # polls as fast as it can while versions land
        try:
            while not done.is_set():
                v = transport.latest()
                if v is not None:
                    assert read_update(memoryview(transport.get(v))).version == v  # complete, undamaged
                    seen.append(v)
        except BaseException as e:  # noqa: BLE001 - reported to the main thread below
            errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    for v in range(1, 11):
        w = train_step(w, v)
        pub.publish(w, v)
        time.sleep(0.005)
    done.set()
    thread.join()
    assert not errors, errors
    assert seen and seen == sorted(seen)  # the LATEST pointer never goes back
    assert (root / "LATEST").read_text() == "10 delta\n"
    assert [k for _, k in transport.listing()] == ["full", "delta", "delta", "delta"] * 2 + [
        "full", "delta"]
    deleted = transport.prune(keep=2, temp_age_s=0)  # newest full is v9: keep v7, v8 and on
    pruned = [(1, "full"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "full"), (6, "delta")]
    debris = ".tmp-" + update_name(1, "full") + ".123.dead"
    assert sorted(deleted) == sorted([update_name(v, k) for v, k in pruned] + [debris])
    assert [v for v, _ in transport.listing()] == [7, 8, 9, 10]


# --- relay + HF engine ------------------------------------------------------------------------


def test_relay_overlaps_pull_with_generation_and_pushes_bit_exact(
        tiny_dir: Path, master: Weights) -> None:
    transport = InProcessTransport()
    pub = Publisher(transport, full_every=100)

    async def main() -> None:
        async with HFEngine(load_model(tiny_dir), eos_token_ids=()) as engine:
            relay = Relay(transport, engine)
            pub.publish(train_step(master, 1), 1)
            first = await relay.sync_once()
            assert first.applied == (1,) and first.pushed_tensors == len(snapshot(pub))
            assert_engine_has(engine, snapshot(pub), 1)
            w = master
            for v in (2, 3):  # two deltas land before the relay looks again
                w = train_step(w, v)
                pub.publish(w, v)
            report, versions = await sync_during_generation(engine, relay)
            assert report.applied == (2, 3) and report.engine_version == 3 and not report.faults
            assert versions[0] == 1 and versions[-1] == 3  # generation went on around the update
            assert 0 < report.pushed_tensors <= first.pushed_tensors
            assert report.bytes_pulled == sum(len(transport.get(v)) for v in (2, 3))
            assert_engine_has(engine, snapshot(pub), 3)
            print(f"pull+rebuild {report.stage_s * 1e3:.1f} ms (engine generating), drain "
                  f"{report.drain_s * 1e3:.1f} ms, paused {report.pause_s * 1e3:.1f} ms, "
                  f"{report.bytes_pulled / 1e6:.2f} MB pulled")
            assert report.pause_s < 1.0
            again = await relay.sync_once()  # nothing new: a no-op, never a re-application
            assert not again.updated and again.applied == () and again.bytes_pulled == 0

    run(main())


def test_relay_through_http_catches_up_across_a_full_snapshot(
        tmp_path: Path, tiny_dir: Path, master: Weights) -> None:
    directory = DirectoryTransport(tmp_path / "updates", fsync=False)
    pub = Publisher(directory, full_every=3)

    async def main(server: UpdateServer) -> None:
        async with HFEngine(load_model(tiny_dir), eos_token_ids=()) as engine:
            relay = Relay(HttpTransport(server.url), engine)
            w = master
            for v in (1, 2):
                w = train_step(w, v)
                pub.publish(w, v)
            assert (await relay.sync_once()).applied == (1, 2)
            for v in (3, 4, 5):  # v4 is a full snapshot: the chain restarts there
                w = train_step(w, v)
                pub.publish(w, v)
            report = await relay.sync_once()
            assert report.applied == (4, 5) and not report.recovered
            assert report.bytes_pulled == sum(directory.path_of(v).stat().st_size for v in (4, 5))
            assert_engine_has(engine, snapshot(pub), 5)

    with UpdateServer(directory) as server:
        run(main(server))


def _repack_wrong_checksum(payload: bytes) -> bytes:
    """Same update with one tensor's recorded checksum wrong (and a valid payload digest)."""
    upd, body = unpack_payload(payload)
    tds = list(upd.tensors)
    secs = [bytes(body[t.offset: t.offset + t.length]) for t in tds]
    tds[-1] = dataclasses.replace(tds[-1], checksum="00" * 16)
    return pack_payload(dataclasses.replace(upd, tensors=tuple(tds)), secs)


def _inject(fault: str, d: DirectoryTransport) -> None:
    """Damage v3 (a delta on the relay's v2; v4 is a delta on v3)."""
    v3 = d.path_of(3)
    data = v3.read_bytes()
    if fault == "flip":
        v3.write_bytes(data[:5000] + bytes([data[5000] ^ 0x01]) + data[5001:])
    elif fault == "truncate":
        v3.write_bytes(data[: len(data) // 2])
    elif fault == "wrong_checksum":
        v3.write_bytes(_repack_wrong_checksum(data))
    elif fault == "missing_base":
        v3.unlink()
    elif fault == "out_of_order":  # v4 delivered where v3 belongs
        v3.write_bytes(d.get(4))
    elif fault == "replay":  # v2, already applied, delivered again as v3
        v3.write_bytes(d.get(2))


@pytest.mark.parametrize("via", ["directory", "http"])
@pytest.mark.parametrize(
    "fault", ["flip", "truncate", "wrong_checksum", "missing_base", "out_of_order", "replay"])
def test_fault_keeps_engine_then_recovers_from_full(
        fault: str, via: str, tmp_path: Path, tiny_dir: Path, master: Weights) -> None:
    directory = DirectoryTransport(tmp_path / "updates", fsync=False)
    pub = Publisher(directory, full_every=100)

    async def main(pull: Transport) -> None:
        async with HFEngine(load_model(tiny_dir), eos_token_ids=()) as engine:
            relay = Relay(pull, engine)
            w = master
            for v in (1, 2):
                w = train_step(w, v)
                pub.publish(w, v)
            await relay.sync_once()
            v2 = snapshot(pub)
            for v in (3, 4):
                w = train_step(w, v)
                pub.publish(w, v)
            _inject(fault, directory)
            with pytest.raises(SyncFailed) as failed:
                await relay.sync_once()
            print(f"{fault} via {via}: {failed.value.faults}")
            assert_engine_has(engine, v2, 2)  # still serving v2, untouched
            assert relay.staged_version == 2
            assert_bits(relay.staged, v2)  # a failed delta was rolled back
            gen = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
            assert gen.token_weight_versions == (2, 2, 2)
            assert (directory.root / "WANT_FULL").exists()  # the relay asked for a snapshot
            w = train_step(w, 5)
            assert pub.publish(w, 5).reason == "requested"
            report = await relay.sync_once()
            assert report.applied == (5,) and report.engine_version == 5
            assert_engine_has(engine, snapshot(pub), 5)

    if via == "directory":
        run(main(directory))
    else:
        with UpdateServer(directory) as server:
            run(main(HttpTransport(server.url)))


def test_drifted_staging_copy_is_rebuilt_from_the_full_snapshot(
        tiny_dir: Path, master: Weights) -> None:
    transport = InProcessTransport()
    pub = Publisher(transport, full_every=100)

    async def main() -> None:
        async with HFEngine(load_model(tiny_dir), eos_token_ids=()) as engine:
            relay = Relay(transport, engine)
            w = train_step(master, 1)
            pub.publish(w, 1)
            await relay.sync_once()
            relay.staged["model.norm.weight"].view(torch.int16)[0] += 1  # e.g. a memory fault
            w = train_step(w, 2)
            pub.publish(w, 2)
            report = await relay.sync_once()
            assert report.recovered and "ChecksumMismatch" in report.faults[0]
            assert report.applied == (1, 2)
            assert_engine_has(engine, snapshot(pub), 2)

    run(main())
