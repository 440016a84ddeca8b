"""Weights handed over in place: engines on the trainer's host open the trainer's copy and load from it.

The trainer's process keeps an `Arena`, one buffer that holds the engines' weights, refilled each version:

* CPU: a file of furlong's own in /dev/shm (`furlong-weights-PIDNS-PID-HEX`, mode 0600, its blocks
  reserved up front so a full /dev/shm fails the allocation, not a later write), mapped shared. The arena
  deletes it when it closes or reallocates; a receiver's mapping outlives that, so a late reader never
  faults. What a killed process left is deleted by the next arena on the host (the file names its owner's
  pid and pid namespace) and, on Ray, by the run's watchdog (furlong.cluster.reaper).
* CUDA: device memory, sent as torch's CUDA IPC handles (the form SGLang's colocated trainers send).

Each engine receives only a handle, in SGLang's `/update_weights_from_tensor` shape: a pickle of
`[(name, tensor), ...]`, base64 (the MultiprocessingSerializer form); a CPU tensor travels as (file, offset,
dtype, shape, stride), a CUDA tensor as torch's IPC handle. Nothing is encoded, checksummed or sent over a
socket but these handles, about a hundred bytes a tensor.

The receiving end (`load_named_tensors`) unpickles with an allow-list: the arena's view opener (which maps
only furlong-weights files of this user) and torch's CUDA tensor rebuild with its dtypes. Any other global
(os.system, ...) is refused before it is looked up, so a body that is not a weight handle runs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from furlong.paths import SHM, is_arena, new_arena_path, remove_arenas

ALIGN = 64  # bytes: every view starts at a multiple, so it can be viewed as any dtype
_DTYPES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
_ALLOWED = {
    "furlong.sync.handover": frozenset({"open_view"}),
    "torch.multiprocessing.reductions": frozenset({"rebuild_cuda_tensor"}),
    "torch.storage": frozenset({"UntypedStorage"}),
    "torch": frozenset({"Tensor", "Size", "device"}) | _DTYPES,
}


class HandoverRefused(ValueError):
    """A serialized handover that is not a list of (name, weight handle) pairs, or cannot be opened here."""


@contextmanager
def file_system_sharing() -> Iterator[None]:
    """torch's `file_system` strategy for the block: a CPU storage is then shared under a file name that any
    process of this user on this host can open (the default passes file descriptors, to children only)."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One entry of SGLang's `serialized_named_tensors` in torch's own sharing (what an SGLang server
    unpickles): a ForkingPickler dump, base64 for JSON. Moves a CPU tensor that is not shared yet into
    shared memory (its storage, in place)."""
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def open_view(
    path: str,
    size: int,
    offset: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    mapped: dict[tuple[str, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A tensor over bytes of an arena's file, mapped copy-on-write (this process never changes the file);
    `mapped`: the files this load has mapped already, so that each is mapped once."""
    mapped = {} if mapped is None else mapped
    if (path, size) not in mapped:
        mapped[(path, size)] = _map(path, size)
    base = mapped[(path, size)]
    if not (isinstance(dtype, torch.dtype) and offset >= 0 and offset % ALIGN == 0):
        raise HandoverRefused(f"serialized_named_tensors: bad view of {path} (dtype {dtype!r}, offset {offset})")
    try:  # set_ checks the view against the mapping's size
        return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset // dtype.itemsize, shape, stride)
    except RuntimeError as e:
        raise HandoverRefused(f"serialized_named_tensors: bad view of {path}: {e}") from None


def _map(path: str, size: int) -> torch.Tensor:
    if not isinstance(path, str) or Path(path).parent != SHM or not is_arena(Path(path).name):
        raise HandoverRefused(f"serialized_named_tensors: {path!r} is not a furlong weight arena")
    name = Path(path)
    try:
        if name.stat().st_uid != os.getuid():
            raise HandoverRefused(f"serialized_named_tensors: {path} belongs to another user")
        return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        raise HandoverRefused(f"serialized_named_tensors: could not map {path}: {e}") from None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._mapped: dict[tuple[str, int], torch.Tensor] = {}

    def find_class(self, module: str, name: str) -> Any:
        if name not in _ALLOWED.get(module, ()):
            raise HandoverRefused(f"serialized_named_tensors: {module}.{name} is not part of a weight handle")
        if (module, name) == ("furlong.sync.handover", "open_view"):
            return lambda *args: open_view(*args, mapped=self._mapped)  # type: ignore[misc]  # pickle passes the others
        return super().find_class(module, name)


def load_named_tensors(serialized: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one handover entry, mapped from the sender's memory (no copy);
    HandoverRefused for anything else (the reason names what was wrong)."""
    try:
        raw = base64.b64decode(serialized, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HandoverRefused(f"serialized_named_tensors: not base64 ({e})") from None
    try:
        named = _Unpickler(io.BytesIO(raw)).load()
    except HandoverRefused:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated pickle, a CUDA handle that cannot open: all refusals
        raise HandoverRefused(f"serialized_named_tensors: could not open ({type(e).__name__}: {e})") from None
    if not (
        isinstance(named, list)
        and all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is torch.Tensor for p in named
        )
    ):
        raise HandoverRefused("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return named


class Arena:
    """One shared copy of a weight set, refilled for every version: a flat buffer with a view per tensor
    (tied tensors share one). The layout is kept while names, shapes and dtypes stay the same."""

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> None:
        """`dtype`: floating tensors are stored cast to it (the engines' dtype); None keeps theirs."""
        self.device, self.dtype = torch.device(device), dtype
        self._layout: tuple = ()
        self._buffer: torch.Tensor | None = None
        self._path: Path | None = None  # CPU: the buffer's file
        self._views: dict[str, torch.Tensor] = {}
        self._offsets: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._views)

    def fill(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy `weights` in (reallocating first if their layout changed)."""
        first: dict[tuple, str] = {}
        alias: dict[str, str] = {}  # every name -> the first name of its storage
        for name, t in weights.items():
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            alias[name] = first.setdefault(key, name) if t.numel() else name
        layout = tuple((name, tuple(t.shape), self._dtype_of(t), alias[name]) for name, t in weights.items())
        if layout != self._layout:
            self._allocate(layout)
        with torch.no_grad():
            for name, t in weights.items():
                if alias[name] == name:
                    self._views[name].copy_(t.detach())

    def handles(self, copies: int) -> list[str]:
        """`copies` serialized handles to the current contents, one for each receiver."""
        if self._buffer is None:
            raise RuntimeError("Arena.handles: nothing was filled in yet")
        if self._path is None:  # CUDA: torch's IPC handles, one pickling per receiver (torch counts them)
            return [serialize_named_tensors(list(self._views.items())) for _ in range(copies)]
        size, path = self.nbytes, str(self._path)
        named = [(name, _View(path, size, self._offsets[name], t)) for name, t in self._views.items()]
        return [base64.b64encode(pickle.dumps(named, protocol=pickle.HIGHEST_PROTOCOL)).decode()] * copies

    def close(self) -> None:
        """Drop the buffer and delete its file (engines that still map it keep their mapping)."""
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        self._buffer, self._path, self._views, self._offsets, self._layout = None, None, {}, {}, ()

    def _dtype_of(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def _allocate(self, layout: tuple) -> None:
        offsets, total = dict[str, int](), 0
        for name, shape, dtype, first in layout:
            offsets[name] = offsets[first] if first != name else total
            if first == name:
                total += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGN) * ALIGN
        self.close()
        total = max(total, ALIGN)
        if self.device.type == "cpu":
            remove_arenas()  # what killed trainers of this host left
            self._path = new_arena_path()
            buffer = _shared_file(self._path, total)
        else:  # CUDA memory is shared by IPC handle as it is
            buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        views: dict[str, torch.Tensor] = {}
        for name, shape, dtype, first in layout:
            size = torch.Size(shape).numel() * dtype.itemsize
            own = first == name
            views[name] = buffer[offsets[name] : offsets[name] + size].view(dtype).view(shape) if own else views[first]
        self._buffer, self._views, self._offsets, self._layout = buffer, views, offsets, layout


def _shared_file(path: Path, size: int) -> torch.Tensor:
    """A new file of `size` bytes in /dev/shm, its blocks reserved (a full /dev/shm fails here, not with a
    SIGBUS at the first write), mapped shared."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        path.unlink(missing_ok=True)
        raise OSError(
            e.errno,
            f"weight arena: could not reserve {size / 2**20:.1f} MiB in {SHM} ({e.strerror}); "
            f"free or enlarge it, or use train.sync.transport=http",
        ) from None
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


class _View:
    """Pickles as `open_view(...)`: a CPU tensor of an arena, by file, offset, dtype, shape and stride."""

    def __init__(self, path: str, size: int, offset: int, t: torch.Tensor) -> None:
        self.args = (path, size, offset, t.dtype, tuple(t.shape), tuple(t.stride()))

    def __reduce__(self):
        return open_view, self.args


class SharedWeights(Mapping[str, torch.Tensor]):
    """Weights another process of this host holds in its Arena (a trainer actor's), as the Trainer protocol's
    engine_weights: a handover link asks `handles(n)` for one handle per engine; read as a Mapping, one
    handle is opened here (a view of the other process's memory, not a copy). Valid until that process
    refills its arena (the trainer's next step)."""

    def __init__(self, share: Callable[[int], list[str]], names: tuple[str, ...], nbytes: int) -> None:
        self._share, self.names, self.nbytes = share, names, nbytes
        self._opened: dict[str, torch.Tensor] | None = None

    def handles(self, copies: int) -> list[str]:
        return self._share(copies)

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._opened is None:
            self._opened = dict(load_named_tensors(self._share(1)[0]))
        return self._opened

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
