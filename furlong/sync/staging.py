"""Delta publishing from weights on an accelerator, without a full host copy of them per step.

The Publisher (furlong.sync.publish) uses DeviceStage when the trainer's tensors are not on the CPU, or
when asked to (`device_base=True`: the same torch code then runs on CPU tensors, which is how the tests
run it). It keeps the last published engine-dtype weights twice:

* the device base, on the tensors' device: each step's engine-dtype copy is compared with it there, word
  by word (bit patterns as integer views), so finding the ~1-5% of changed words costs no transfer;
* one host mirror of it (pinned memory when the weights are on CUDA), allocated at the first snapshot
  (again only if the layout changes) and patched in place: it is what relays hold, it gives the encoder
  the old words, and each tensor's checksum is taken over it once patched.

Per tensor, a delta moves from device to host what its layout needs (furlong.sync.sections): a few
scalars (the sampled density, the change count); "sparse": the changed positions (int32 below 2**31
words) and their new words; "bitmap": the change mask (a bit per word) and the new words; "dense" (at
least half the words changed): every new word, into one staging buffer reused across tensors and steps.
A snapshot copies every tensor into the mirror. The sections' own encoders code these, and each choice is
made from the same numbers as on the host, so the payload is byte for byte the host path's.

Memory: on the device, the base plus the new copy during a publish (two engine-dtype copies of the
weights) and per-tensor masks; on the host, the mirror plus the staging buffer (the largest dense tensor).

A publish whose encoding or transport put fails is rolled back: every mirror tensor it touched is copied
again from the device base (which changes only on commit), so both stay at the previous version.

Only the CPU run of this code is tested here (no GPU was available): pinned memory and CUDA transfers are
not exercised by the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch
import zstandard as zstd

from furlong.model.fp8 import is_quantized
from furlong.sync import codec, scan
from furlong.sync.checksum import DEFAULT_ALGO, tensor_digest
from furlong.sync.delta import Section, encode_full, pack_delta
from furlong.sync.momentum import Momentum
from furlong.sync.sections import delta_meta, encode_change

Tensors = Mapping[str, torch.Tensor]


def engine_copy(state_dict: Tensors, dtype: torch.dtype, device: torch.device | None) -> dict[str, torch.Tensor]:
    """Detached copies on `device` (None: each tensor's own), floating tensors cast to `dtype` (not an fp8
    weight or its scale: furlong.model.fp8), aliases (tied weights) dropped: each storage is sent once, under
    the first name met.

    Always a copy (copy=True): keeping a view of the trainer's live tensors as the next delta's base would
    make it drift as the optimizer steps."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in state_dict.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        to = dtype if t.is_floating_point() and not is_quantized(name, t) else t.dtype
        out[name] = t.detach().to(device=device or t.device, dtype=to, copy=True).contiguous()
    return out


def same_layout(a: Tensors, b: Tensors) -> bool:
    """Same names, shapes, dtypes and devices: a delta from a to b can be taken."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype and a[k].device == b[k].device for k in a
    )


def nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class DeviceStage:
    """The device base and host mirror of one publisher (see the module doc). Per publish: full() or
    delta(), then commit(new) once the transport took the payload, or rollback()."""

    def __init__(self, engine_dtype: torch.dtype, checksum_algo: str = DEFAULT_ALGO) -> None:
        self.engine_dtype, self.algo = engine_dtype, checksum_algo
        self.base: dict[str, torch.Tensor] | None = None  # last published engine-dtype copy, on device
        self.mirror: dict[str, torch.Tensor] | None = None  # the same words in host memory
        self.host_bytes = 0  # moved device -> host by the current publish
        self._fresh: dict[str, torch.Tensor] | None = None  # a new mirror (new layout), adopted on commit
        self._touched: list[str] = []  # mirror tensors written by the current publish
        self._staging: torch.Tensor | None = None  # dense tensors' new words (bytes), grown, never shrunk

    @property
    def published(self) -> dict[str, torch.Tensor] | None:
        return self.mirror

    def copy(self, state_dict: Tensors) -> dict[str, torch.Tensor]:
        """The engine-dtype copy, made on the tensors' own device."""
        return engine_copy(state_dict, self.engine_dtype, None)

    def full(self, new: dict[str, torch.Tensor], *, version: int, level: int | None) -> bytes:
        """A snapshot of `new`, copied whole into the mirror (a fresh one if the layout changed)."""
        self._begin()
        reuse = self.base is not None and same_layout(self.base, new)
        if reuse:
            assert self.mirror is not None
            mirror = self.mirror
        else:  # allocated here only: first publish or new layout
            mirror = self._fresh = {k: _host_like(t) for k, t in new.items()}
        for name, t in new.items():
            self._touched.append(name)
            mirror[name].copy_(t)
        self.host_bytes = nbytes(new)
        return encode_full(mirror, version=version, level=level, checksum_algo=self.algo)

    def delta(
        self,
        new: dict[str, torch.Tensor],
        *,
        version: int,
        base_version: int,
        level: int | None,
        momentum: Momentum | None,
        out: bytearray | None,
    ) -> bytes | memoryview:
        """The delta payload from the base to `new` (same layout), patching the mirror to `new` tensor by
        tensor."""
        assert self.base is not None and self.mirror is not None and same_layout(self.base, new)
        self._begin()

        def section(name: str, cctx: zstd.ZstdCompressor) -> Section:
            return self._section(name, new[name], cctx, momentum, base_version)

        return pack_delta(
            list(new),
            section,
            version=version,
            base_version=base_version,
            level=level,
            checksum_algo=self.algo,
            momentum=momentum,
            out=out,
        )

    def commit(self, new: dict[str, torch.Tensor]) -> None:
        """The transport took the payload: `new` is the base, the mirror holds it."""
        if self._fresh is not None:
            self.mirror = self._fresh
        self.base, self._fresh, self._touched = new, None, []

    def rollback(self) -> None:
        """The publish failed: put back the words it wrote into the mirror (a new mirror is dropped)."""
        if self._fresh is None and self.mirror is not None and self.base is not None:
            for name in self._touched:
                self.mirror[name].copy_(self.base[name])
        self._fresh, self._touched = None, []

    def fetch(self, t: torch.Tensor) -> np.ndarray:
        """`t` in host memory, counted in host_bytes."""
        self.host_bytes += t.numel() * t.element_size()
        return t.cpu().numpy()

    def scalar(self, t: torch.Tensor) -> int:
        self.host_bytes += t.element_size()
        return int(t.item())

    def staged(self, words: torch.Tensor) -> np.ndarray:
        """All of a dense tensor's new `words` (codec.int_words) in the reused staging buffer, as host
        words (codec.UINT); valid until the next call."""
        size = words.numel() * words.element_size()
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=_pinned(words))
        host = self._staging[:size].view(words.dtype)
        host.copy_(words)
        self.host_bytes += size
        return host.numpy().view(codec.UINT[words.element_size()])

    def _begin(self) -> None:
        self.host_bytes, self._fresh, self._touched = 0, None, []

    def _section(
        self, name: str, new: torch.Tensor, cctx: zstd.ZstdCompressor, momentum: Momentum | None, base_version: int
    ) -> Section:
        assert self.base is not None and self.mirror is not None
        host = self.mirror[name]
        change = DeviceChange(codec.int_words(self.base[name]), codec.int_words(new), codec.as_words(host), self)
        meta, data = encode_change(delta_meta(name, new, ""), change, cctx, momentum, base_version)
        self._touched.append(name)
        change.patch()
        return replace(meta, checksum=tensor_digest(host, self.algo)), data


class DeviceChange:
    """A sections.Change whose words are on a device (`a`, `b`: codec.int_words of base and new) and whose
    old words are also in host memory (`host`: the mirror's words, patched by patch() once encoded)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, host: np.ndarray, stage: DeviceStage) -> None:
        self.a, self.b, self.host, self.stage = a, b, host, stage
        self.n, self.dtype = host.size, host.dtype
        self._mask: torch.Tensor | None = None
        self._new: tuple[np.ndarray, np.ndarray] | np.ndarray | None = None  # what patch() writes

    def density(self) -> float:
        starts = scan.sample_starts(self.n)
        if starts is None:
            return self.stage.scalar(self.mask().sum()) / max(self.n, 1)
        dev = self.a.device
        idx = (torch.from_numpy(starts).to(dev)[:, None] + torch.arange(scan.SAMPLE_BLOCK, device=dev)).reshape(-1)
        return self.stage.scalar((self.a[idx] != self.b[idx]).sum()) / idx.numel()

    def sparse(self, max_sparse: int, grouped: bool) -> scan.Scan:
        """`grouped` only speeds up the host scan; the answer is the same."""
        mask = self.mask()
        count = self.stage.scalar(mask.sum())
        if count == 0:
            return scan.Scan()
        if count > max_sparse:
            return scan.Scan(count=count, dense=True)
        wide = torch.int32 if self.n < 1 << 31 else torch.int64  # positions: half the bytes when they fit
        pos = self.stage.fetch(mask.nonzero().reshape(-1).to(wide)).astype(np.int64)
        return scan.Scan(count, [scan.gaps(pos)], [self._values(pos, self.stage.fetch(self.b[mask]))])

    def bitmap(self) -> tuple[np.ndarray, np.ndarray]:
        mask = self.mask()
        bitmap = self.stage.fetch(_packbits(mask))
        pos = np.flatnonzero(np.unpackbits(bitmap, count=self.n, bitorder="little"))
        return bitmap, self._values(pos, self.stage.fetch(self.b[mask]))

    def words(self) -> tuple[np.ndarray, np.ndarray]:
        self._new = self.stage.staged(self.b)
        return self.host, self._new

    def patch(self) -> None:
        """Write the new words into the mirror (after encoding: the encoder reads the old ones there)."""
        if isinstance(self._new, tuple):
            np.put(self.host, *self._new)
        elif self._new is not None:
            np.copyto(self.host, self._new)

    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = self.a != self.b
        return self._mask

    def _values(self, pos: np.ndarray, new: np.ndarray) -> np.ndarray:
        """zigzag(new - old) at `pos`, the old words read from the mirror (as scan's values)."""
        new = new.view(self.dtype)
        self._new = (pos, new)
        return codec.zigzag(new - np.take(self.host, pos))  # unsigned: wraps like the host scan


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """np.packbits(mask, bitorder="little"), computed on mask's device."""
    m = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8, device=mask.device)
    m[: mask.numel()] = mask
    m = m.view(-1, 8)
    packed = m[:, 0].clone()
    for i in range(1, 8):
        packed |= m[:, i] << i
    return packed


def _pinned(t: torch.Tensor) -> bool:
    """Page-locked host memory for copies from a CUDA device: faster DMA, and no extra driver-side copy."""
    return t.device.type == "cuda" and torch.cuda.is_available()


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=_pinned(t))
