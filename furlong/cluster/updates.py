"""What one weight update moves and how long it takes: a full copy, a delta (furlong/sync), or LoRA adapters.

Pure arithmetic on a ClusterSpec, like the rest of `furlong train --plan`: nothing is encoded here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from furlong.cluster.shapes import ModelParams, lora_params
from furlong.cluster.spec import DTYPE_BYTES, ClusterSpec, Delta, NodeGroup


@dataclass(frozen=True)
class Transfer:
    what: str
    bytes: float
    link: str
    seconds: float


@dataclass(frozen=True)
class Relays:
    """Where the weight relays sit: one per engine node."""

    local: int  # on a node with trainer GPUs: the update arrives through host memory
    remote: int  # elsewhere: over the network
    node: NodeGroup  # an engine node, for its network and GPU-link bandwidth


@dataclass(frozen=True)
class SyncPath:
    kind: str  # "full", "delta", "lora"
    sent: float  # bytes each relay receives
    seconds: float  # the update end to end, its stages one after another


def position_bits(f: float) -> float:
    """Bits per element that saying which elements changed costs at least: the binary entropy of f."""
    return 0.0 if f >= 1 else -f * math.log2(f) - (1 - f) * math.log2(1 - f)


def delta_bytes(params: int, d: Delta) -> float:
    """A delta's size: positions at their entropy bound plus `value_bits` per changed value.

    furlong's codec (gaps, a bitmap or a dense stream by density, then zstd) lands within ~2% of that bound
    on real GRPO steps (bench/results/weight_sync.json), and this formula reproduces its measured sizes from
    0.5% to 93% changed with value_bits between 1.7 and 4.4 (docs/plan.md)."""
    return params * (position_bits(d.changed_fraction) + d.changed_fraction * d.value_bits) / 8


def _copy(spec: ClusterSpec, p: ModelParams) -> tuple[float, float, str]:
    """(bytes sent to each relay, bytes each relay loads into an engine, what they are)."""
    r, t = spec.rollout, spec.trainer
    full = p.total * DTYPE_BYTES[r.dtype]
    if spec.sync == "lora":
        if not t.lora_rank:
            raise ValueError("sync: lora needs trainer.lora_rank > 0")
        one = lora_params(spec.model, t.lora_rank, t.lora_targets) * DTYPE_BYTES[t.param_dtype]
        return one, one, f"LoRA r{t.lora_rank} ({', '.join(t.lora_targets)}), {t.param_dtype}"
    what = f"full, {p.total:,} params x {DTYPE_BYTES[r.dtype]} B ({r.dtype})"
    if spec.sync == "full":
        return full, full, what
    d = spec.delta
    sent = delta_bytes(p.total, d)
    return (
        sent,
        full,
        (
            f"delta, {d.changed_fraction:.1%} changed: {position_bits(d.changed_fraction):.2f} "
            f"position bits + {d.changed_fraction:.3f} x {d.value_bits:g} value bits per param"
        ),
    )


def weight_updates(spec: ClusterSpec, p: ModelParams, relays: Relays) -> list[Transfer]:
    """One update: the trainer sends it once to each engine node's relay over the network (colocated: no
    network), and each relay loads every engine on its node over the GPU links. A delta is encoded first on
    the trainer and applied on each relay (CPU work at the measured rates in `delta:`)."""
    r, node = spec.rollout, relays.node
    engines = r.gpus // r.tp
    sent, loaded, what = _copy(spec, p)
    out = [Transfer(what, sent, "one copy", 0.0)]
    if spec.sync == "delta":
        d = spec.delta
        out.append(
            Transfer(
                f"encode on the trainer ({d.encoders} core{'s' * (d.encoders > 1)})",
                loaded,
                f"CPU, {d.encode_gbs:g} GB/s a core",
                loaded / (d.encode_gbs * 1e9 * d.encoders),
            )
        )
    if relays.local:
        out.append(
            Transfer(
                f"trainer -> {relays.local} relays on its own nodes",
                sent * relays.local,
                "host memory (same node)",
                0.0,
            )
        )
    if relays.remote:
        out.append(
            Transfer(
                f"trainer -> {relays.remote} relays",
                sent * relays.remote,
                f"network, {node.network_gbs:g} GB/s per node",
                sent / (node.network_gbs * 1e9),
            )
        )
    if spec.sync == "delta":
        d = spec.delta
        out.append(
            Transfer(
                "apply on each relay",
                loaded,
                f"CPU, {d.apply_gbs:g} GB/s a core",
                loaded / (d.apply_gbs * 1e9 * d.encoders),
            )
        )
    out.append(
        Transfer(
            f"relays -> {engines} engines",
            loaded * engines,
            f"GPU links, {node.gpu_link_gbs:g} GB/s",
            loaded / r.tp / (node.gpu_link_gbs * 1e9),
        )
    )
    return out


def sync_paths(spec: ClusterSpec, p: ModelParams, relays: Relays) -> tuple[SyncPath, ...]:
    """The chosen update path, and for full weights the other one (full vs delta) to compare."""
    kinds = ("lora",) if spec.sync == "lora" else ("full", "delta")
    out = []
    for kind in kinds:
        rows = weight_updates(spec.model_copy(update={"sync": kind}), p, relays)
        out.append(SyncPath(kind, rows[0].bytes, sum(row.seconds for row in rows)))
    return tuple(out)
