"""The publisher's device path (furlong.sync.staging), run on CPU tensors (`device_base=True`; no GPU here):
its payloads are the host path's byte for byte, receivers rebuild every version, it moves far fewer bytes
to the host per delta, and a failed transport put leaves it at the previous version."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from furlong.sync import WeightReceiver, read_update
from furlong.sync.codec import CHUNK
from furlong.sync.publish import Publisher
from furlong.sync.staging import DeviceStage
from furlong.sync.transport import InProcessTransport

Weights = dict[str, torch.Tensor]

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# bf16 masters of sizes around the codec's edges: the density sample (16 blocks of 4096 words), CHUNK
# runs, bitmaps not a whole number of bytes, one word, none.
SIZES = {"big": CHUNK + 3, "sampled": 65_537, "exact": 65_536, "mid": 1001, "odd": 7, "one": 1}
SPARSE, BITMAP, DENSE = 0.02, 0.35, 0.8  # fractions of words changed: one per layout


def model(seed: int = 0) -> Weights:
    g = torch.Generator().manual_seed(seed)
    w: Weights = {k: (torch.randn(n, generator=g) * 0.02).bfloat16() for k, n in SIZES.items()}
    w["norm"] = 1 + 0.1 * torch.randn(300, generator=g)  # fp32: cast to bf16 by the publisher
    w["tied"] = w["sampled"]  # shares storage: sent once
    w["count"] = torch.tensor([3, 4, 5], dtype=torch.int64)  # not floating: kept as int64
    w["flags"] = torch.tensor([True, False, True])
    w["scalar"] = torch.tensor(0.5)
    w["empty"] = torch.empty(0, dtype=torch.bfloat16)
    return w


def step(w: Weights, densities: Mapping[str, float], seed: int) -> Weights:
    """New weights: in each named tensor the given fraction of words moves by a few bf16 ulps."""
    g = torch.Generator().manual_seed(seed)
    out = {k: t.clone() for k, t in w.items() if k != "tied"}
    for name, p in densities.items():
        t = out[name]
        if t.dtype == torch.float32:
            t += p * 0.01 * torch.randn(t.shape, generator=g)
            continue
        words = t.view(torch.int16)
        pos = torch.randperm(words.numel(), generator=g)[: round(p * words.numel())]
        words[pos] += torch.randint(-3, 4, (pos.numel(),), generator=g, dtype=torch.int16) | 1  # odd: nonzero
    out["tied"] = out["sampled"]
    out["count"] = out["count"] + seed % 2
    out["flags"] = out["flags"] ^ bool(seed % 3 == 0)
    return out


def schedule(v: int) -> dict[str, float]:
    """Every publish mixes layouts; "exact" stays dense so momentum predicts it from the previous delta."""
    cycle = (SPARSE, BITMAP, DENSE, 0.0)
    out = {name: cycle[(i + v) % len(cycle)] for i, name in enumerate(SIZES)}
    return {**out, "exact": DENSE, "norm": 1.0 if v % 2 else 0.0}


def layouts(payload: bytes) -> set[str]:
    return {("predicted " if t.predicted else "") + t.encoding for t in read_update(payload).tensors}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(bits(got[k]), bits(t)), f"{k} differs"


class FailingPut(InProcessTransport):
    """Refuses the versions in `fail`."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail = fail

    def put(self, version: int, kind: str, payload: bytes | memoryview) -> None:
        if version in self.fail:
            raise OSError(f"disk full (test) at v{version}")
        super().put(version, kind, payload)


@pytest.mark.parametrize("momentum", [True, False])
def test_device_payloads_are_the_host_payloads_and_rebuild_every_version(momentum: bool) -> None:
    host_t, dev_t = InProcessTransport(), InProcessTransport()
    host = Publisher(host_t, full_every=4, momentum=momentum, device_base=False)
    dev = Publisher(dev_t, full_every=4, momentum=momentum, device_base=True)
    rx, w, seen = WeightReceiver(), model(), set()
    for v in range(1, 11):
        w = step(w, schedule(v), seed=v) if v > 1 else w
        if v == 8:  # a new tensor: layout change
            w = {**w, "extra": torch.ones(5, 5)}
        got, want = dev.publish(w, v), host.publish(w, v)
        payload = bytes(dev_t.get(v))
        assert payload == bytes(host_t.get(v)), f"v{v}: device payload differs"
        assert (got.kind, got.reason, got.payload_bytes) == (want.kind, want.reason, want.payload_bytes)
        rx.apply(memoryview(payload))
        assert dev.published is not None and host.published is not None
        assert_same(rx.tensors, host.published)
        assert_same(dev.published, host.published)
        seen |= layouts(payload)
    assert dev.on_device and not host.on_device
    want = {"planes", "sparse", "bitmap", "dense", "same"} | ({"predicted dense"} if momentum else set())
    assert want <= seen, seen  # every layout (and prediction) went through the device path
    assert "tied" not in rx.tensors and rx.tensors["count"].dtype == torch.int64


def test_host_bytes_sparse_delta_is_a_fraction_of_full_and_full_for_snapshots() -> None:
    dev, host = Publisher(InProcessTransport(), device_base=True), Publisher(InProcessTransport())
    w = model()
    first = dev.publish(w, 1)
    assert host.publish(w, 1).host_bytes == first.host_bytes == first.full_bytes
    w = step(w, {name: SPARSE for name in SIZES}, seed=1)
    sparse, on_host = dev.publish(w, 2), host.publish(w, 2)
    encodings = {t.name: t.encoding for t in read_update(dev.transport.get(2)).tensors}
    assert sparse.kind == "delta" and all(encodings[k] == "sparse" for k in ("big", "sampled", "exact"))
    assert on_host.host_bytes == on_host.full_bytes  # the host path copies everything, every step
    assert 0 < sparse.host_bytes < 0.2 * sparse.full_bytes, sparse
    w = step(w, {name: DENSE for name in SIZES}, seed=2)
    dense = dev.publish(w, 3)
    assert sparse.host_bytes < dense.host_bytes <= dense.full_bytes  # dense words must come over
    forced = dev.publish(w, 4, force_full=True)
    assert forced.kind == "full" and forced.host_bytes == forced.full_bytes


@pytest.mark.parametrize("case", ["delta", "forced", "layout"])
def test_failed_put_leaves_the_previous_version_and_the_next_delta_applies(case: str) -> None:
    """v3 fails: a delta of every layout, a snapshot into the mirror, or one into a new mirror (a new
    tensor, gone again at v4). v4 is then a delta against v2, which the receiver must apply exactly."""
    transport = FailingPut({3})
    pub, rx = Publisher(transport, full_every=10, device_base=True), WeightReceiver()
    w = model()
    for v in range(1, 7):
        w = step(w, schedule(v), seed=v) if v > 1 else w
        sent = {**w, "extra": torch.ones(3)} if case == "layout" and v == 3 else w
        assert pub.published is not None or v == 1
        before = {k: t.clone() for k, t in pub.published.items()} if pub.published is not None else {}
        if v == 3:
            with pytest.raises(OSError, match="disk full"):
                pub.publish(sent, v, force_full=case == "forced")
            assert pub.version == 2
            assert_same(pub.published, before)  # rolled back, word for word
            continue
        got = pub.publish(sent, v)
        assert (got.kind, got.base_version) == (("full", None) if v == 1 else ("delta", v - 1 - (v == 4)))
        rx.apply(memoryview(transport.get(v)))  # each tensor's checksum checks the publisher's mirror
        assert_same(rx.tensors, pub.published)
    assert rx.version == 6


def test_the_path_follows_the_weights_device() -> None:
    pub = Publisher(InProcessTransport())
    pub.publish(model(), 1)
    assert not pub.on_device  # CPU weights: the host path, as before
    assert all(t.device.type == "cpu" for t in pub.published.values())
    # Off the CPU (a CUDA trainer; "meta" stands in here, no GPU): the device path, chosen at the first publish.
    off_cpu = Publisher(InProcessTransport())
    assert isinstance(off_cpu._stage_for({"w": torch.empty(4, device="meta")}), DeviceStage)
