"""Weights broadcast over a torch.distributed group: the trainer is rank 0, engine servers ranks 1..n.

The wire shape is SGLang's (`python/sglang/srt/managers/io_struct.py`): an engine joins with
InitWeightsUpdateGroupReqInput (`master_address`, `master_port`, `rank_offset`, `world_size`, `group_name`,
`backend`), then each update is announced by UpdateWeightsFromDistributedReqInput (`names`, `dtypes`,
`shapes`, `group_name`, `flush_cache`, `weight_version`, `load_format`) while rank 0 broadcasts the tensors
in `names` order, one broadcast per tensor; or, with `load_format="flattened_bucket"` (SGLang's
FlattenedTensorBucket layout: each tensor's bytes, in `names` order, concatenated into one uint8 tensor), one
broadcast per request, which cuts a model's hundreds of small calls to one per bucket.

The group is built on its own TCPStore (hosted by rank 0 on a free port) without torch.distributed's default
group, so a trainer that runs its own process group (FSDP) keeps it. Anyone who reaches the store's port can
join it under a free rank, so with a secret (the run's engine token) every member proves it before any weight
moves: the init body carries an extra `auth_nonce`, and the members all-gather and check each rank's
HMAC of it (furlong.sync.group_auth); a member without the secret fails the group before anything is sent.
Without `auth_nonce` (an SGLang server, which does not run the handshake) the rendezvous is not
authenticated: keep the store on loopback or a private network. The tensors are never encrypted.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from furlong.sync.group_auth import MAC_BYTES, check_nonce, proof, refusal, unproven

GROUP_NAME = "weight_update_group"  # SGLang's default group_name
FLAT = "flattened_bucket"
BACKENDS = ("gloo", "nccl")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", as SGLang's clients write dtypes."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class GroupSpec:
    """One engine's InitWeightsUpdateGroupReqInput; the engine's rank is `rank_offset` (tensor parallel 1)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP_NAME
    backend: str = "gloo"
    auth_nonce: str | None = None  # furlong's extra field: the group's handshake nonce (None: no handshake)

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (the trainer and an engine), got {self.world_size}")
        if not 0 <= self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset must be in 0..{self.world_size - 1} (world_size {self.world_size}), "
                f"got {self.rank_offset}"
            )
        if not self.group_name:
            raise ValueError("group_name must not be empty")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        check_nonce(self.auth_nonce)

    def body(self) -> dict:
        """SGLang's fields, plus `auth_nonce` only when set (so an unauthenticated body is SGLang's exactly)."""
        body = {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }
        return body if self.auth_nonce is None else {**body, "auth_nonce": self.auth_nonce}


@dataclass(frozen=True)
class Manifest:
    """One UpdateWeightsFromDistributedReqInput: which tensors the next broadcasts carry, in order."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = GROUP_NAME
    weight_version: str | None = None
    flush_cache: bool = True
    load_format: str | None = None

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("names must list at least one tensor")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must be as long as each other, got {len(self.names)}, "
                f"{len(self.dtypes)} and {len(self.shapes)}"
            )
        if len(set(self.names)) != len(self.names):
            raise ValueError("names must not repeat a tensor")
        unknown = sorted(set(self.dtypes) - set(DTYPES))
        if unknown:
            raise ValueError(f"dtypes: {unknown} not among {sorted(DTYPES)}")
        bad = [n for n, s in zip(self.names, self.shapes) if any(d < 0 for d in s)]
        if bad:
            raise ValueError(f"shapes: negative dimension for {bad[:3]}")
        if self.load_format not in (None, FLAT):
            raise ValueError(f"load_format must be null or {FLAT!r}, got {self.load_format!r}")

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], **kw) -> Manifest:
        return cls(
            names=tuple(tensors),
            dtypes=tuple(dtype_name(t.dtype) for t in tensors.values()),
            shapes=tuple(tuple(t.shape) for t in tensors.values()),
            **kw,
        )

    @property
    def nbytes(self) -> int:
        return sum(DTYPES[d].itemsize * _numel(s) for d, s in zip(self.dtypes, self.shapes))

    def body(self) -> dict:
        return {
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
            "group_name": self.group_name,
            "flush_cache": self.flush_cache,
            "weight_version": self.weight_version,
            "load_format": self.load_format,
        }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def host_store(address: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (read back as `.port`); it does not wait for the others."""
    return dist.TCPStore(
        address, 0, world_size, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


class WeightGroup:
    """This process's member of a weight-update group: rank 0 sends, the others receive."""

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        timeout_s: float = 300.0,
        store: dist.Store | None = None,
        secret: str | None = None,
    ) -> None:
        """Blocks until all `spec.world_size` members have joined (or `timeout_s` passes: RuntimeError). With
        `spec.auth_nonce`, every member must then prove `secret` (RendezvousNotAuthenticated, group destroyed)."""
        if (secret is None) != (spec.auth_nonce is None):
            raise ValueError(
                "an authenticated group needs both the secret and spec.auth_nonce "
                f"(secret {'set' if secret else 'missing'}, auth_nonce {spec.auth_nonce!r})"
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(
                spec.master_address, spec.master_port, spec.world_size, is_master=False, timeout=timeout
            )
        self.spec, self.rank = spec, rank
        self.device = torch.device("cuda") if spec.backend == "nccl" else torch.device("cpu")
        prefixed = dist.PrefixStore(f"furlong/{spec.group_name}/", store)
        self._store = store  # rank 0's server must outlive the group
        if spec.backend == "nccl":
            # Any: torch types these backends apart from ProcessGroup, yet each serves as the group here
            self._pg: Any = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, dist.ProcessGroupNCCL.Options())
        else:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: not in torch's stubs
            options._timeout = timeout
            options._devices = [_gloo_device(spec.master_address)]
            self._pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, options)
        self._barrier()  # a group is usable once every member's connections are up
        if secret is not None:
            self._authenticate(secret)

    def _authenticate(self, secret: str) -> None:
        """Every rank's MAC, all-gathered and checked here; any other outcome destroys the group and raises."""
        spec = self.spec
        mine = torch.frombuffer(
            bytearray(proof(secret, spec.auth_nonce or "", self.rank, spec.group_name, spec.world_size)),
            dtype=torch.uint8,
        ).to(self.device)
        got = [torch.empty(MAC_BYTES, dtype=torch.uint8, device=self.device) for _ in range(spec.world_size)]
        try:
            pg = self._live()  # held while the collective runs (see _live)
            pg.allgather([got], [mine]).wait()
        except RuntimeError as e:  # a member sent something else than a MAC, or hung up
            self.close()
            raise refusal([], self.rank, spec.group_name, failed=e) from e
        bad = unproven([t.cpu().numpy().tobytes() for t in got], secret, spec.auth_nonce or "", spec.group_name)
        if bad:
            self.close()
            raise refusal(bad, self.rank, spec.group_name)

    def _barrier(self) -> None:
        self._broadcast(torch.zeros(1, device=self.device))

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg = self._live()  # held while the collective runs (see _live)
        pg.broadcast([tensor], opts).wait()

    def send(self, manifest: Manifest, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0: broadcast `tensors` (the manifest's, in its order) as the manifest's load_format lays them."""
        if manifest.load_format != FLAT:
            for t in tensors:
                self._broadcast(t.to(self.device).contiguous())
            return
        self._broadcast(torch.cat([t.to(self.device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]))

    def receive(self, manifest: Manifest) -> dict[str, torch.Tensor]:
        """Ranks 1..n: the manifest's tensors, by name, as rank 0 broadcasts them."""
        specs = list(zip(manifest.names, (DTYPES[d] for d in manifest.dtypes), manifest.shapes))
        if manifest.load_format != FLAT:
            out = {}
            for name, dtype, shape in specs:
                out[name] = torch.empty(shape, dtype=dtype, device=self.device)
                self._broadcast(out[name])
            return out
        flat = torch.empty(manifest.nbytes, dtype=torch.uint8, device=self.device)
        self._broadcast(flat)
        out, start = {}, 0
        for name, dtype, shape in specs:
            end = start + dtype.itemsize * _numel(shape)
            part = flat[start:end]
            # a view needs the offset aligned to the dtype; a tensor after an odd-sized one is copied instead
            out[name] = (part if start % dtype.itemsize == 0 else part.clone()).view(dtype).view(shape)
            start = end
        return out

    def _live(self) -> dist.ProcessGroup:
        # A caller keeps this reference in a local while its collective runs: a close() meanwhile (from
        # another thread, when the trainer abandons the group) must not drop the last one, because the
        # process group's destructor joins its worker threads, which would block the closer until the
        # stuck collective times out.
        if self._pg is None:
            raise RuntimeError(f"group {self.spec.group_name!r} is closed")
        return self._pg

    def close(self) -> None:
        """Drop this end: its connections close with the last reference, which a collective still running
        in another thread holds until it fails, so close() returns at once."""
        self._pg = None


def _gloo_device(master_address: str):
    """A loopback rendezvous binds gloo to loopback (a sandbox's hostname may not resolve); otherwise gloo
    picks the interface of this host's name, as torch.distributed does without GLOO_SOCKET_IFNAME."""
    try:
        loopback = ipaddress.ip_address(master_address).is_loopback
    except ValueError:
        loopback = master_address == "localhost"
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    """`tensors` in order, cut into runs of at most `bucket_bytes` (a larger tensor goes alone)."""
    out: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if out[-1] and size + n > bucket_bytes:
            out.append({})
            size = 0
        out[-1][name] = t
        size += n
    return out


def distinct(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors that share storage (tied embeddings) once, under the first name met: the receiving model ties
    them the same way, so one copy updates both."""
    seen: set[tuple] = set()
    out = {}
    for name, t in tensors.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out
