"""Weight-delta codec: bit-exact round trips, size vs XOR+zstd, and refusal of bad updates."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import zstandard as zstd

from furlong.sync import (
    BaseVersionMismatch,
    ChecksumMismatch,
    CorruptUpdate,
    IncompatibleBase,
    StaleUpdate,
    WeightReceiver,
    apply_delta,
    apply_full,
    delta_entropy_bound,
    encode_delta,
    encode_full,
    kernels,
    read_update,
    xor_zstd_apply,
    xor_zstd_encode,
)
from furlong.sync.update import pack_payload, unpack_payload

Model = dict[str, torch.Tensor]


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so equality is bitwise (NaN payloads, -0.0 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: Model, want: Model) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), f"{name} differs"


def clone(m: Model) -> Model:
    return {k: v.clone() for k, v in m.items()}


def make_model(seed: int = 0) -> Model:
    """bf16 weights shaped like a small transformer, plus fp32 / int / odd tensors."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(4096, 1024, generator=g) * 0.02).bfloat16(),  # 4M
        "layers.0.attn.qkv": (torch.randn(1024, 768, generator=g) * 0.02).bfloat16(),
        "layers.0.mlp.up": (torch.randn(512, 1024, generator=g) * 0.05).bfloat16(),
        "layers.0.norm.weight": (1 + 0.1 * torch.randn(1024, generator=g)).bfloat16(),  # 1-D
        "head.bias": torch.randn(1000, generator=g),  # fp32
        "step_count": torch.tensor(7, dtype=torch.int64),  # 0-d int
        "empty": torch.empty(0, dtype=torch.bfloat16),
    }


def train_step(model: Model, lr: float, seed: int = 1) -> Model:
    """fp32 master = weights as fp32, + lr*randn + AdamW-like lr*sign update, cast back."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.items():
        if not t.is_floating_point() or t.numel() == 0:
            out[name] = t + 1 if t.numel() else t.clone()
            continue
        master = t.to(torch.float32, copy=True)  # never alias fp32 inputs
        master += lr * torch.randn(master.shape, generator=g)
        master += lr * torch.sign(torch.randn(master.shape, generator=g))
        out[name] = master.to(t.dtype)
    return out


def density(prev: Model, new: Model) -> float:
    changed = total = 0
    for k in new:
        a, b = bits(prev[k]), bits(new[k])
        w = prev[k].element_size()
        changed += int((a.reshape(-1, w) != b.reshape(-1, w)).any(dim=1).sum()) if a.numel() else 0
        total += prev[k].numel()
    return changed / total


def round_trip(prev: Model, new: Model) -> bytes:
    payload = encode_delta(prev, new, version=2, base_version=1)
    base = clone(prev)
    assert apply_delta(base, payload, current_version=1) is base
    assert_bit_equal(base, new)
    return payload


@pytest.mark.parametrize("lr", [1e-5, 1e-4, 1e-3])
def test_round_trip_training_step(lr: float) -> None:
    prev = make_model()
    new = train_step(prev, lr)
    assert 0 < density(prev, new) < 1
    round_trip(prev, new)


def test_payload_beats_xor_zstd_on_training_steps() -> None:
    prev = make_model()
    for lr in (1e-6, 1e-5, 1e-4, 1e-3):  # ~2% .. ~100% of bf16 values change
        new = train_step(prev, lr, seed=3)
        ours = len(encode_delta(prev, new, version=2, base_version=1))
        ref = len(xor_zstd_encode(prev, new))
        assert ours < 0.8 * ref, f"lr={lr}: {ours} vs xor+zstd {ref}"


def test_payload_near_entropy_bound() -> None:
    prev = {"w": make_model()["embed.weight"]}
    new = train_step(prev, 1e-6)
    assert 0.005 < density(prev, new) < 0.05
    payload = len(encode_delta(prev, new, version=2, base_version=1))
    bound = delta_entropy_bound(prev, new).bytes
    assert bound < payload < 1.2 * bound


def _set_density(t: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """Copy of bf16 `t` with round(frac * numel) values moved by +-1..3 ulp."""
    g = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = out.view(torch.int16).reshape(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: round(frac * flat.numel())]
    step = torch.randint(1, 4, (idx.numel(),), generator=g, dtype=torch.int16)
    flat[idx] += step * (
        torch.randint(0, 2, (idx.numel(),), generator=g, dtype=torch.int16) * 2 - 1
    )
    return out


@pytest.mark.parametrize("frac", [0.0, 1e-5, 0.003, 0.02, 0.1, 0.2, 0.3, 0.5, 0.9, 1.0])
def test_round_trip_any_density(frac: float) -> None:
    prev = {"w": (torch.randn(1 << 20) * 0.02).bfloat16()}
    new = {"w": _set_density(prev["w"], frac, seed=4)}
    payload = round_trip(prev, new)
    (td,) = read_update(payload).tensors
    assert td.n_changed == round(frac * (1 << 20))
    expected = {0.0: "same", 0.003: "sparse", 0.02: "sparse", 0.3: "bitmap", 0.9: "dense"}
    assert td.encoding == expected.get(frac, td.encoding)


def test_round_trip_edge_cases() -> None:
    g = torch.Generator().manual_seed(5)
    prev = {
        "single": torch.zeros(1000, dtype=torch.bfloat16),
        "all_random_bits": torch.randint(-32768, 32767, (3000,), dtype=torch.int16).view(
            torch.bfloat16
        ),
        "fp32": torch.randn(2048, generator=g),
        "fp16": torch.randn(100, 7, generator=g).half(),
        "int8": torch.randint(-128, 127, (999,), dtype=torch.int8, generator=g),
        "bool": torch.zeros(77, dtype=torch.bool),
        "complex": torch.randn(33, dtype=torch.complex128, generator=g),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 5),
        "far_apart": torch.zeros(300_000, dtype=torch.bfloat16),
        "clustered": torch.zeros(100_000, dtype=torch.bfloat16),
        "heavy_tailed": torch.zeros(100_000, dtype=torch.bfloat16),
    }
    new = clone(prev)
    new["single"][517] = 1.0
    new["all_random_bits"] = torch.randint(-32768, 32767, (3000,), dtype=torch.int16).view(
        torch.bfloat16
    )
    new["fp32"] += 1e-6 * torch.randn(2048, generator=g)  # fp32: most bits of every value change
    new["fp16"][3] = float("nan")
    new["int8"][::3] += 1
    new["bool"][::5] = True
    new["complex"][4] += 1j
    new["scalar"] = torch.tensor(-0.0)
    new["far_apart"][[0, 70_000, 70_001, 299_999]] = -2.0  # gaps beyond uint16: escapes
    new["clustered"][:500] = 1.0  # dense enough for uint8 gaps ...
    new["clustered"][-1] = 1.0  # ... then one gap far beyond 255: an escape
    steps = (torch.rand(3000, generator=g) ** -2).to(torch.int16)  # 1 .. 32767 ulp: every tier
    new["heavy_tailed"].view(torch.int16)[torch.randperm(100_000, generator=g)[:3000]] += steps
    round_trip(prev, new)
    round_trip(new, prev)


def test_full_snapshot_then_deltas_through_receiver() -> None:
    v1 = make_model()
    rx = WeightReceiver()
    rx.apply(encode_full(v1, version=1))
    assert rx.version == 1
    assert_bit_equal(rx.tensors, v1)
    v2 = train_step(v1, 1e-5, seed=6)
    v3 = train_step(v2, 1e-4, seed=7)
    rx.apply(encode_delta(v1, v2, version=2, base_version=1))
    rx.apply(encode_delta(v2, v3, version=3, base_version=2))
    assert rx.version == 3
    assert_bit_equal(rx.tensors, v3)
    adapter = {"lora.A": torch.randn(8, 64).bfloat16(), "lora.B": torch.zeros(64, 8).bfloat16()}
    rx.apply(encode_full(adapter, version=4, kind="adapter"))  # merged in by name
    assert rx.version == 4
    assert_bit_equal(rx.tensors, v3 | adapter)
    assert_bit_equal(apply_full(encode_full(v3, version=9, level=1)), v3)


def test_blake2b_checksums_when_chosen() -> None:
    """The stdlib fallback (used when xxhash is missing) round-trips and is recorded."""
    prev = {"w": make_model()["layers.0.mlp.up"]}
    new = train_step(prev, 1e-5)
    payload = encode_delta(prev, new, version=2, base_version=1, checksum_algo="blake2b-128")
    assert read_update(payload).checksum_algo == "blake2b-128"
    base = clone(prev)
    apply_delta(base, payload, current_version=1)
    assert_bit_equal(base, new)


def test_xor_zstd_reference_round_trip() -> None:
    prev = make_model()
    new = train_step(prev, 1e-4)
    base = clone(prev)
    xor_zstd_apply(base, xor_zstd_encode(prev, new), list(new))
    assert_bit_equal(base, new)


# --- refusal: each bad update raises its specific error and leaves the receiver untouched ---


@pytest.fixture(scope="module")
def step() -> tuple[Model, Model, bytes]:
    prev = make_model()
    new = train_step(prev, 1e-4)
    return prev, new, encode_delta(prev, new, version=2, base_version=1)


def _refused(prev: Model, payload: bytes, error: type[Exception], current_version: int = 1) -> None:
    base = clone(prev)
    with pytest.raises(error):
        apply_delta(base, payload, current_version=current_version)
    assert_bit_equal(base, prev)


@pytest.mark.parametrize("where", [0, 5, 20, 60, 0.5, -1])
def test_flipped_byte_is_corrupt(step: tuple[Model, Model, bytes], where: float) -> None:
    prev, _, payload = step
    bad = bytearray(payload)
    i = int(where * len(bad)) if isinstance(where, float) else where
    bad[i] ^= 0x10
    _refused(prev, bytes(bad), CorruptUpdate)


@pytest.mark.parametrize("keep", [0, 10, 36, 100, 0.5, -1])
def test_truncated_payload_is_corrupt(step: tuple[Model, Model, bytes], keep: float) -> None:
    prev, _, payload = step
    n = int(keep * len(payload)) if isinstance(keep, float) else keep
    _refused(prev, payload[:n], CorruptUpdate)


def _repack(payload: bytes, edit_last: dict[str, Any], section: bytes | None = None) -> bytes:
    """Re-frame a payload (valid digest) after editing its last tensor's header or section."""
    upd, body = unpack_payload(payload)
    tds = list(upd.tensors)
    secs = [bytes(body[t.offset : t.offset + t.length]) for t in tds]
    if section is not None:
        secs[-1] = section
        edit_last = {**edit_last, "length": len(section)}
    tds[-1] = dataclasses.replace(tds[-1], **edit_last)
    return pack_payload(dataclasses.replace(upd, tensors=tuple(tds)), secs)


def _encode_with_last(prev: Model, new: Model, last: str) -> bytes:
    """A delta whose final section is `last`, so every other tensor is patched before it."""
    order = {k: new[k] for k in new if k != last} | {last: new[last]}
    payload = encode_delta(prev, order, version=2, base_version=1)
    assert read_update(payload).tensors[-1].name == last
    return payload


def test_wrong_checksum_rolls_back_every_tensor(step: tuple[Model, Model, bytes]) -> None:
    prev, new, _ = step
    payload = _encode_with_last(prev, new, "layers.0.mlp.up")
    _refused(prev, _repack(payload, {"checksum": "00" * 16}), ChecksumMismatch)


def test_drifted_receiver_base_is_checksum_mismatch(step: tuple[Model, Model, bytes]) -> None:
    prev, _, payload = step
    drifted = clone(prev)
    drifted["head.bias"][0] += 1.0  # receiver's v1 is not the sender's v1
    _refused(drifted, payload, ChecksumMismatch)


@pytest.mark.parametrize(("frac", "encoding"), [(0.01, "sparse"), (0.3, "bitmap"), (0.9, "dense")])
def test_undecodable_section_with_valid_digest_is_corrupt(frac: float, encoding: str) -> None:
    """A section that decodes short (after an earlier tensor was patched) is rolled back."""
    w = (torch.randn(1 << 19, generator=torch.Generator().manual_seed(8)) * 0.02).bfloat16()
    prev = {"first": w[: 1 << 18].clone(), "last": w.clone()}
    new = {"first": _set_density(prev["first"], 0.02, 9), "last": _set_density(w, frac, 10)}
    payload = encode_delta(prev, new, version=2, base_version=1)
    upd, body = unpack_payload(payload)
    td = upd.tensors[-1]
    assert td.encoding == encoding
    truncated = bytes(body[td.offset : td.offset + td.length - 7])
    _refused(prev, _repack(payload, {}, section=truncated), CorruptUpdate)


def test_base_version_mismatch(step: tuple[Model, Model, bytes]) -> None:
    prev, _, payload = step
    _refused(prev, payload, BaseVersionMismatch, current_version=0)


def test_reapply_is_rejected(step: tuple[Model, Model, bytes]) -> None:
    prev, new, payload = step
    rx = WeightReceiver(clone(prev), version=1)
    rx.apply(payload)
    with pytest.raises(StaleUpdate):  # a BaseVersionMismatch: v2 is not newer than v2
        rx.apply(payload)
    assert rx.version == 2
    assert_bit_equal(rx.tensors, new)
    _refused(new, payload, BaseVersionMismatch, current_version=2)


def test_incompatible_base(step: tuple[Model, Model, bytes]) -> None:
    prev, _, payload = step
    missing = {k: v for k, v in prev.items() if k != "head.bias"}
    _refused(missing, payload, IncompatibleBase)
    reshaped = clone(prev)
    reshaped["head.bias"] = reshaped["head.bias"][:999]
    _refused(reshaped, payload, IncompatibleBase)
    tied = clone(prev)
    tied["layers.0.mlp.up"] = tied["embed.weight"][:512]  # tied weights: would be patched twice
    before = clone(tied)  # (_refused's clone would untie them)
    with pytest.raises(IncompatibleBase):
        apply_delta(tied, payload, current_version=1)
    assert_bit_equal(tied, before)


@pytest.mark.parametrize(("frac", "spread", "encoding"), [
    (1.0, 1, "dense"), (1.0, 6, "dense"), (1.0, 200, "dense"),  # 2-, 4- and 8-bit first value tiers
    (0.45, 1, "bitmap"), (0.45, 200, "bitmap")])
def test_compiled_path_matches_the_numpy_path_byte_for_byte(monkeypatch: pytest.MonkeyPatch, frac: float,
                                                            spread: int, encoding: str) -> None:
    g = torch.Generator().manual_seed(spread)
    prev = {"w": torch.randn(2 * (1 << 20) + 3, generator=g).to(torch.bfloat16)}  # 2 runs + a partial byte
    step = torch.randint(-spread, spread + 1, prev["w"].shape, generator=g, dtype=torch.int16)
    step[::97] = 3000  # some entries escape every tier
    step[torch.rand(step.shape, generator=g) >= frac] = 0
    step[-2:] = 3000  # ... also in the last, partly filled byte of the first value tier
    new = {"w": (prev["w"].view(torch.int16) + step).view(torch.bfloat16)}  # int16 adds wrap: any bits
    compiled = encode_delta(prev, new, version=1, base_version=0)
    assert read_update(compiled).tensors[0].encoding == encoding

    def applied(payload: bytes) -> torch.Tensor:
        out = {"w": prev["w"].clone()}
        apply_delta(out, payload, current_version=0)
        return out["w"]

    fast = applied(compiled)
    monkeypatch.setattr(kernels, "available", lambda dtype: False)
    assert encode_delta(prev, new, version=1, base_version=0) == compiled
    slow = applied(compiled)
    assert torch.equal(fast.view(torch.int16), new["w"].view(torch.int16))
    assert torch.equal(slow.view(torch.int16), new["w"].view(torch.int16))


def test_compiled_apply_rolls_back_a_dense_section_broken_in_a_later_run() -> None:
    w = (torch.randn(3 << 20, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    prev = {"w": w}
    payload = encode_delta(prev, {"w": _set_density(w, 0.9, 2)}, version=2, base_version=1)
    upd, body = unpack_payload(payload)
    td = upd.tensors[-1]
    assert td.encoding == "dense" and td.n_words > 2 * td.chunk
    cut = bytes(body[td.offset : td.offset + td.length * 3 // 4])  # runs 1-2 decode, run 3 is cut short
    _refused(prev, _repack(payload, {}, section=cut), CorruptUpdate)


@pytest.mark.parametrize("compiled", [True, False])
def test_undecodable_zstd_in_a_later_run_is_corrupt_and_rolled_back(monkeypatch: pytest.MonkeyPatch,
                                                                    compiled: bool) -> None:
    """Garbage where a dense section's later runs should be (valid payload digest) is CorruptUpdate, a
    SyncError the relay recovers from, not zstd's own error; the runs already added are undone."""
    if not compiled:
        monkeypatch.setattr(kernels, "available", lambda dtype: False)
    w = (torch.randn(3 << 20, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    prev = {"w": w}
    payload = encode_delta(prev, {"w": _set_density(w, 0.9, 2)}, version=2, base_version=1)
    upd, body = unpack_payload(payload)
    td = upd.tensors[-1]
    section = bytearray(body[td.offset : td.offset + td.length])
    half = len(section) // 2
    section[half:] = torch.randint(0, 256, (len(section) - half,), generator=torch.Generator().manual_seed(3),
                                   dtype=torch.uint8).numpy().tobytes()
    _refused(prev, _repack(payload, {}, section=bytes(section)), CorruptUpdate)


@pytest.mark.parametrize("compiled", [True, False])
def test_escape_symbol_in_the_padding_of_a_dense_run_is_corrupt(monkeypatch: pytest.MonkeyPatch,
                                                                compiled: bool) -> None:
    """A capped symbol hidden after the last word of a run (valid digest) would make the compiled escape
    pass write past the tensor; both paths refuse it and write nothing."""
    if not compiled:
        monkeypatch.setattr(kernels, "available", lambda dtype: False)
    g = torch.Generator().manual_seed(4)
    prev = {"w": torch.randn(1001, generator=g).bfloat16()}  # an odd count: the last nibble byte is half full
    step = torch.randint(-6, 7, (1001,), generator=g, dtype=torch.int16)
    new = {"w": (prev["w"].view(torch.int16) + step).view(torch.bfloat16)}
    payload = encode_delta(prev, new, version=2, base_version=1)
    upd, body = unpack_payload(payload)
    td = upd.tensors[-1]
    assert td.encoding == "dense" and td.value_tiers[0] == 4
    raw = bytearray(zstd.ZstdDecompressor().decompress(bytes(body[td.offset : td.offset + td.length]),
                                                       max_output_size=td.raw_length))
    raw[1001 // 2] |= 0xF0  # the padding nibble of the first tier's last byte becomes the cap
    section = zstd.ZstdCompressor().compress(bytes(raw))
    _refused(prev, _repack(payload, {}, section=section), CorruptUpdate)


def test_payload_written_into_a_reused_buffer_is_the_same_payload() -> None:
    prev = make_model()
    steps = [train_step(prev, 1e-4, seed=s) for s in (1, 2)]
    out = bytearray()
    for new in steps:  # the second, different update reuses (and overwrites) the first one's buffer
        view = encode_delta(prev, new, version=2, base_version=1, out=out)
        assert isinstance(view, memoryview) and view.obj is out
        assert bytes(view) == encode_delta(prev, new, version=2, base_version=1)
        base = clone(prev)
        apply_delta(base, view, current_version=1)
        assert_bit_equal(base, new)
        view.release()
