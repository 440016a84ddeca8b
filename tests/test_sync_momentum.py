"""Momentum prediction of dense deltas (furlong.sync.momentum): exact, smaller on persistent steps, and
refused or rolled back cleanly when the two ends' states could disagree."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from furlong.sync import (
    ChecksumMismatch,
    CorruptUpdate,
    InProcessTransport,
    Publisher,
    WeightReceiver,
    apply_delta,
    encode_delta,
    kernels,
    read_update,
)
from furlong.sync.momentum import Momentum, MomentumMismatch
from furlong.sync.update import pack_payload, unpack_payload

Model = dict[str, torch.Tensor]


def adam_like_chain(steps: int, n: int = (1 << 20) + 5, seed: int = 0) -> list[Model]:
    """bf16 versions of weights moved by a persistent per-weight direction (Adam's momentum) plus noise;
    some words jump by thousands of ulps (beyond what one byte of state predicts)."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    direction = torch.sign(torch.randn(n, generator=g)) * 2e-4
    small = torch.randn(4096, generator=g)
    out = [{"w": master.bfloat16(), "small": small.bfloat16()}]
    for _ in range(steps):
        master += direction + 5e-5 * torch.randn(n, generator=g)
        w = master.bfloat16()
        w.view(torch.int16)[::9973] += 3000  # wraps freely: any bit pattern must survive
        out.append({"w": w, "small": out[-1]["small"].clone()})
    return out


def bits_equal(a: Model, b: Model) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def run_chain(versions: list[Model], momentum: bool) -> list[bytes]:
    """Encode each link (version i -> i+1) and apply it at a receiver; checks every version bit for bit."""
    sender, receiver = (Momentum(), Momentum()) if momentum else (None, None)
    held = {k: v.clone() for k, v in versions[0].items()}
    payloads = []
    for v, (prev, new) in enumerate(zip(versions, versions[1:])):
        payload = encode_delta(prev, new, version=v + 1, base_version=v, momentum=sender)
        if sender is not None:
            sender.commit()
        apply_delta(held, payload, current_version=v, momentum=receiver)
        assert bits_equal(held, new)
        payloads.append(payload)
    return payloads


def test_chain_is_exact_and_predicted_links_are_smaller() -> None:
    versions = adam_like_chain(4)
    plain, predicted = run_chain(versions, False), run_chain(versions, True)
    flags = [[(t.name, t.encoding, t.predicted) for t in read_update(p).tensors] for p in predicted]
    assert flags[0] == [("w", "dense", False), ("small", "same", False)]  # nothing to predict from yet
    assert all(f == [("w", "dense", True), ("small", "same", False)] for f in flags[1:])
    assert len(predicted[0]) == len(plain[0])
    for p, q in zip(predicted[1:], plain[1:]):
        assert len(p) < 0.85 * len(q), (len(p), len(q))


def test_compiled_and_numpy_paths_agree_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = adam_like_chain(3, n=(1 << 20) + 3, seed=1)
    compiled = run_chain(versions, True)
    monkeypatch.setattr(kernels, "available", lambda dtype: False)
    assert run_chain(versions, True) == compiled


def _at_version_one(momentum: Momentum | None) -> tuple[list[Model], Model, bytes]:
    """Three versions; the receiver applied 0 -> 1 (recording into `momentum` if given); 1 -> 2 is predicted."""
    versions = adam_like_chain(2, n=50_000)
    sender = Momentum()
    first = encode_delta(versions[0], versions[1], version=1, base_version=0, momentum=sender)
    sender.commit()
    second = encode_delta(versions[1], versions[2], version=2, base_version=1, momentum=sender)
    assert read_update(second).tensors[0].predicted
    held = {k: v.clone() for k, v in versions[0].items()}
    apply_delta(held, first, current_version=0, momentum=momentum)
    return versions, held, second


def test_receiver_without_the_state_refuses_before_writing() -> None:
    for momentum in (None, Momentum()):  # no state object at all, or one that never recorded
        versions, held, second = _at_version_one(None)
        with pytest.raises(MomentumMismatch):
            apply_delta(held, second, current_version=1, momentum=momentum)
        assert bits_equal(held, versions[1])


def test_failed_predicted_update_rolls_back_and_keeps_the_state() -> None:
    momentum = Momentum()
    versions, held, second = _at_version_one(momentum)
    state = {k: v.copy() for k, v in momentum.state.items()}
    upd, body = unpack_payload(second)
    bad_sum = dataclasses.replace(upd.tensors[-1], checksum="0" * len(upd.tensors[-1].checksum))
    bad = pack_payload(dataclasses.replace(upd, tensors=upd.tensors[:-1] + (bad_sum,)),
                       [bytes(body[t.offset : t.offset + t.length]) for t in upd.tensors])
    with pytest.raises(ChecksumMismatch):  # "w" is patched first, then "small" fails
        apply_delta(held, bad, current_version=1, momentum=momentum)
    assert bits_equal(held, versions[1])
    assert momentum.version == 1 and all(np.array_equal(state[k], momentum.state[k]) for k in state)
    apply_delta(held, second, current_version=1, momentum=momentum)  # the intact update still applies
    assert bits_equal(held, versions[2]) and momentum.version == 2


def test_publisher_and_receiver_restart_prediction_at_each_snapshot() -> None:
    versions = adam_like_chain(7, n=60_000, seed=2)
    transport = InProcessTransport()
    pub, rx = Publisher(transport, full_every=3, engine_dtype=torch.bfloat16), WeightReceiver()
    kinds = []
    for v, w in enumerate(versions):
        pub.publish(w, v)
        upd = rx.apply(transport.get(v))
        assert bits_equal(rx.tensors, w)
        kinds.append("full" if upd.kind == "full" else ("predicted" if upd.tensors[0].predicted else "delta"))
    assert kinds == ["full", "delta", "predicted", "full", "delta", "predicted", "full", "delta"]
    plain = Publisher(InProcessTransport(), momentum=False)
    plain.publish(versions[0], 0)
    plain.publish(versions[1], 1)
    assert not read_update(plain.transport.get(1)).momentum  # receivers record nothing for it


@pytest.mark.parametrize("edit", [{"momentum": "yes"}, "predicted-sparse"])
def test_header_momentum_fields_are_validated(edit) -> None:
    versions = adam_like_chain(1, n=50_000)
    payload = encode_delta(versions[0], versions[1], version=1, base_version=0, momentum=Momentum())
    upd, body = unpack_payload(payload)
    if edit == "predicted-sparse":
        upd = dataclasses.replace(upd, tensors=(upd.tensors[0],
                                                dataclasses.replace(upd.tensors[1], predicted=True)))
    else:
        upd = dataclasses.replace(upd, **edit)
    bad = pack_payload(upd, [bytes(body[t.offset : t.offset + t.length]) for t in upd.tensors])
    with pytest.raises(CorruptUpdate):
        read_update(bad)
