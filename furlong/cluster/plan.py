"""`furlong train --plan`: where each role runs, what a trainer rank and an engine GPU hold, what an update moves.

A dry run: it reads a ClusterSpec and computes; it starts no process and loads no model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from furlong.cluster.shapes import (
    ModelParams,
    activation_elements,
    kv_bytes_per_token,
    lora_params,
    model_params,
)
from furlong.cluster.spec import DTYPE_BYTES, ClusterSpec, NodeGroup
from furlong.cluster.timing import GIB, StepTime, step_time
from furlong.cluster.updates import (
    Relays,
    SyncPath,
    Transfer,
    sync_paths,
    weight_updates,
)


@dataclass(frozen=True)
class Node:
    name: str
    group: NodeGroup


@dataclass(frozen=True)
class Assignment:
    role: str  # "trainer", "engine 3", "relay", "sandboxes"
    devices: str  # "gpu0:0-3", "gpu1 (cpu)"
    detail: str


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    formula: str


@dataclass(frozen=True)
class Memory:
    role: str
    terms: tuple[Term, ...]
    capacity: float  # bytes

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class Plan:
    spec: ClusterSpec
    params: ModelParams
    placement: tuple[Assignment, ...]
    trainer: Memory
    engine: Memory
    updates: tuple[Transfer, ...]
    paths: tuple[SyncPath, ...]  # the chosen update path, and full vs delta to compare
    step: StepTime | None  # with a `step:` section
    problems: tuple[str, ...]  # each a "does not fit" line naming the role and the numbers
    teacher: Memory | None = None  # a teacher on an engine of its own (teacher.engine hf|vllm): one of its GPUs


def nodes(spec: ClusterSpec) -> list[Node]:
    return [Node(f"{g.name}{i}", g) for g in spec.nodes for i in range(g.count)]


def _ranges(slots: list[tuple[Node, int]]) -> str:
    """(node, gpu) slots as `node:a-b` ranges, one per node."""
    by_node: dict[str, list[int]] = {}
    for node, gpu in slots:
        by_node.setdefault(node.name, []).append(gpu)
    return ", ".join(f"{n}:{g[0]}-{g[-1]}" if len(g) > 1 else f"{n}:{g[0]}" for n, g in by_node.items())


def _compress(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)} nodes)"


def _trainer_slots(spec: ClusterSpec) -> list[tuple[Node, int]]:
    return [(n, g) for n in nodes(spec) for g in range(n.group.gpus)][: spec.trainer.gpus]


def place(spec: ClusterSpec) -> tuple[list[Assignment], list[Node], list[str]]:
    """Trainer GPUs first, node by node; engines after them (or on the same GPUs when colocated), each engine
    inside one node when it fits one; a relay on each engine node; sandboxes on the CPU nodes."""
    t, r = spec.trainer, spec.rollout
    slots = [(n, g) for n in nodes(spec) for g in range(n.group.gpus)]
    need = (t.gpus if spec.colocate else t.gpus + r.gpus) + _teacher_gpus(spec)
    if spec.colocate and r.gpus > t.gpus:
        raise ValueError(f"colocate: rollout.gpus ({r.gpus}) exceeds trainer.gpus ({t.gpus})")
    if need > len(slots):
        added = " + teacher.gpus" if _teacher_gpus(spec) else ""
        raise ValueError(f"trainer.gpus + rollout.gpus{added} = {need} but the nodes have {len(slots)} GPUs")
    if r.gpus % r.tp:
        raise ValueError(f"rollout.gpus ({r.gpus}) is not a multiple of rollout.tp ({r.tp})")
    trainer = slots[: t.gpus]
    rest = trainer if spec.colocate else slots[t.gpus :]
    out = [Assignment("trainer", _ranges(trainer), _trainer_layout(spec))]
    engines, free, notes = [], list(rest), list[str]()
    for i in range(r.gpus // r.tp):
        block = _engine_block(free, r.tp)
        if block is None:
            raise ValueError(f"rollout: engine {i} needs {r.tp} GPUs on one node (or whole nodes); none left")
        free = [s for s in free if s not in block]
        engines.append(block)
    kind = f"{r.engine} tp{r.tp}" + (f" ep{r.ep}" if r.ep > 1 else "") + (" dp-attention" if r.dp_attention else "")
    for i, block in enumerate(engines):
        out.append(Assignment(f"engine {i}", _ranges(block), f"{kind}, {r.dtype} weights, {r.kv_dtype} KV"))
    engine_nodes = list(dict.fromkeys(n for block in engines for n, _ in block))
    teacher = spec.teacher
    if teacher is not None and teacher.on_engine:  # after the rollout engines, on GPUs of its own
        block = _engine_block(free if not spec.colocate else slots[t.gpus :], teacher.gpus)
        if block is None:
            raise ValueError(f"teacher: its {teacher.engine} engine needs {teacher.gpus} GPUs on one node; none left")
        out.append(
            Assignment(
                "teacher engine",
                _ranges(block),
                f"{teacher.engine} tp{teacher.gpus}, {teacher.dtype} weights: scores every sample (prefill only)",
            )
        )
    out.append(
        Assignment(
            "relay",
            _compress([n.name for n in engine_nodes]) + " (cpu)",
            "one per engine node: pulls each update once, loads the node's engines",
        )
    )
    out.append(_sandboxes(spec, notes))
    return out, engine_nodes, notes


def _engine_block(free: list[tuple[Node, int]], size: int) -> list[tuple[Node, int]] | None:
    by_node: dict[str, list[tuple[Node, int]]] = {}
    for slot in free:
        by_node.setdefault(slot[0].name, []).append(slot)
    for group in by_node.values():
        if len(group) >= size:
            return group[:size]
    whole = [s for group in by_node.values() if len(group) == group[0][0].group.gpus for s in group]
    return whole[:size] if len(whole) >= size > max(len(g) for g in by_node.values()) else None


def _trainer_layout(spec: ClusterSpec) -> str:
    t = spec.trainer
    if t.gpus % (t.tp * t.pp * t.cp):
        raise ValueError(f"trainer.gpus ({t.gpus}) is not a multiple of tp x pp x cp = {t.tp * t.pp * t.cp}")
    dp = t.gpus // (t.tp * t.pp * t.cp)
    if (t.tp * t.cp * dp) % t.ep:
        raise ValueError(f"trainer.ep ({t.ep}) must divide tp x cp x dp = {t.tp * t.cp * dp}")
    if spec.model.moe is None and t.ep > 1:
        raise ValueError("trainer.ep > 1 needs a model with moe")
    per_node = max(g.gpus for g in spec.nodes)
    where = "inside a node" if t.tp <= per_node else "ACROSS nodes (slow)"
    split = f" (layers {'/'.join(map(str, t.pp_layers))})" if t.pp_layers else ""
    return (
        f"tp{t.tp} pp{t.pp}{split} cp{t.cp} ep{t.ep} dp{dp}, shard={t.shard}; TP groups {where}, "
        f"stage s on GPUs s*{t.gpus // t.pp}.."
    )


def _sandboxes(spec: ClusterSpec, notes: list[str]) -> Assignment:
    s = spec.sandboxes
    hosts = [n for n in nodes(spec) if n.group.gpus == 0]
    if not s.concurrent:
        return Assignment("sandboxes", "-", "none asked for")
    if not hosts:
        notes.append(f"does not fit: sandboxes: {s.concurrent} asked for, but the spec has no CPU node (gpus: 0)")
        return Assignment("sandboxes", "-", "no CPU node")
    room = sum(min(int(n.group.cpus // s.cpus), int(n.group.memory_gib // s.memory_gib)) for n in hosts)
    if room < s.concurrent:
        notes.append(
            f"does not fit: sandboxes: {s.concurrent} x ({s.cpus:g} CPU, {s.memory_gib:g} GiB) but the "
            f"CPU nodes hold {room}"
        )
    per_host = math.ceil(s.concurrent / len(hosts))
    return Assignment(
        "sandboxes",
        _compress([n.name for n in hosts]),
        f"{s.concurrent} at once, ~{per_host} per host ({s.cpus:g} CPU, {s.memory_gib:g} GiB each; room for {room})",
    )


def _stage_params(spec: ClusterSpec, p: ModelParams) -> list[tuple[int, int, int]]:
    """Per pipeline stage: (non-expert params, expert params, layers). Layers as `pp_layers` says, else split
    evenly with the first stages taking the remainder; the embedding on the first stage, final norm and lm_head
    on the last."""
    pp, n = spec.trainer.pp, len(p.layers)
    sizes = list(spec.trainer.pp_layers) or [n // pp + (1 if s < n % pp else 0) for s in range(pp)]
    out, start = [], 0
    for s, size in enumerate(sizes):
        layers = p.layers[start : start + size]
        dense = sum(lp.dense for lp in layers) + (p.embedding if s == 0 else 0) + (p.head if s == pp - 1 else 0)
        out.append((dense, sum(lp.experts for lp in layers), size))
        start += size
    return out


def trainer_memory(spec: ClusterSpec, p: ModelParams) -> Memory:
    """The fullest trainer rank: the stage whose parameters, gradients, optimizer state and activations sum
    highest."""
    best = max((_rank_terms(spec, p, s) for s in range(spec.trainer.pp)), key=lambda ts: sum(t.bytes for t in ts))
    gpu = _trainer_gpu(spec)
    return Memory("trainer rank", tuple(best), gpu * GIB)


def _trainer_gpu(spec: ClusterSpec) -> float:
    """GiB a trainer rank may fill: the GPU less reserved_gib, and less the engine's memory_fraction of it when the
    engines are colocated (they hold that share of the same GPU)."""
    gpu = next(g for g in spec.nodes if g.gpus).gpu_memory_gib
    engine = gpu * spec.rollout.memory_fraction if spec.colocate else 0
    return gpu - spec.trainer.reserved_gib - engine


def _rank_terms(spec: ClusterSpec, p: ModelParams, stage: int) -> list[Term]:
    t, m = spec.trainer, spec.model
    dp = t.gpus // (t.tp * t.pp * t.cp)
    edp = t.gpus // (t.pp * t.ep)
    dense, experts, n_layers = _stage_params(spec, p)[stage]
    rank = dense / t.tp + experts / t.ep  # parameters this rank computes with
    sharded = dense / t.tp / dp + experts / t.ep / edp  # its share over data parallel
    pb, gb = DTYPE_BYTES[t.param_dtype], DTYPE_BYTES[t.grad_dtype]
    state = (4 if t.master_weights else 0) + 2 * DTYPE_BYTES[t.moment_dtype]
    full = t.shard == "full"
    split = f" / dp{dp} (experts / edp{edp})"
    terms = [
        Term(
            "parameters",
            (sharded if full else rank) * pb,
            f"({dense:,} / tp{t.tp} + {experts:,} / ep{t.ep}){split if full else ''} x {pb} B",
        )
    ]
    if t.lora_rank:
        trainable = opt = lora_params(m, t.lora_rank, t.lora_targets) / (t.tp * t.pp)
        terms.append(Term("LoRA adapters", trainable * pb, f"r{t.lora_rank} x (in + out) per target / tp / pp"))
    else:
        trainable, opt = (sharded if full else rank), (rank if t.shard == "none" else sharded)
    terms.append(Term("gradients", trainable * gb, f"trainable params held x {gb} B"))
    on_gpu = t.optimizer_offload == "none"
    terms.append(
        Term(
            "optimizer" + ("" if on_gpu else f" (offloaded to {t.optimizer_offload})"),
            opt * state if on_gpu else 0,
            f"{'fp32 master + ' if t.master_weights else ''}2 Adam moments = {state} B x trainable params"
            + (split if t.shard != "none" and not t.lora_rank else "")
            + ("" if on_gpu else f"; {opt * state / GIB:,.1f} GiB held there"),
        )
    )
    terms.append(_activations(spec, p, stage, n_layers))
    if spec.teacher is not None and spec.teacher.kind == "checkpoint" and not spec.teacher.on_engine:
        terms.append(teacher_weights(spec, dp, edp))
    if stage == t.pp - 1:
        tokens = t.seq_len * t.micro_batch / t.cp
        terms.append(Term("logits", tokens * m.vocab / t.tp * 4, "seq/cp x micro_batch x vocab / tp x 4 B (fp32)"))
    return terms


def teacher_weights(spec: ClusterSpec, dp: int, edp: int) -> Term:
    """A checkpoint teacher's frozen weights on one trainer rank: split like the policy (an even share of
    each pipeline stage), or whole. Its prefill runs before training, forward only and one micro-batch at a
    time, so its activations and logits fit in what the policy's own step uses after it."""
    teacher = spec.teacher
    assert teacher is not None
    tp, t = model_params(teacher.model or spec.model), spec.trainer
    wb, dense = DTYPE_BYTES[teacher.dtype], tp.total - tp.experts
    if not teacher.shard:
        return Term("teacher weights (frozen)", tp.total * wb, f"{tp.total:,} x {wb} B, whole on every rank")
    full = t.shard == "full"
    held = (dense / t.tp / (dp if full else 1) + tp.experts / t.ep / (edp if full else 1)) / t.pp
    split = f" / dp{dp} (experts / edp{edp})" if full else ""
    return Term(
        "teacher weights (frozen)",
        held * wb,
        f"({dense:,} / tp{t.tp} + {tp.experts:,} / ep{t.ep}){split} / pp{t.pp} x {wb} B",
    )


def _activations(spec: ClusterSpec, p: ModelParams, stage: int, n_layers: int) -> Term:
    """1F1B keeps pp micro-batches in flight on the first stage (pp - stage on stage `stage`); sequence parallel
    shards every saved value by tp; checkpointing keeps each layer's input and recomputes one layer at a time."""
    t, m = spec.trainer, spec.model
    tokens = t.seq_len * t.micro_batch / t.cp
    in_flight = t.pp - stage
    first = sum(_stage_params(spec, p)[s][2] for s in range(stage))
    per_layer = [activation_elements(m, i) for i in range(first, first + n_layers)]
    if t.activation_checkpointing:
        saved = tokens * 2 * (n_layers * in_flight * m.hidden + max(per_layer)) / t.tp
        return Term(
            "activations (checkpointed)",
            saved,
            f"seq/cp x mb x 2 B x (layers {n_layers} x in-flight {in_flight} x hidden + one layer) / tp",
        )
    saved = tokens * 2 * in_flight * sum(per_layer) / t.tp
    return Term("activations", saved, f"seq/cp x mb x 2 B x in-flight {in_flight} x saved values per layer / tp")


def engine_memory(spec: ClusterSpec, p: ModelParams) -> Memory:
    r, m = spec.rollout, spec.model
    gpu = [g for g in spec.nodes if g.gpus][-1].gpu_memory_gib * GIB
    wb, dense = DTYPE_BYTES[r.dtype], p.total - p.experts
    dense_split = 1 if r.dp_attention else r.tp
    weights = (dense / dense_split + p.experts / (r.ep if r.ep > 1 else r.tp)) * wb
    budget = gpu * r.memory_fraction
    per_token = kv_bytes_per_token(m, DTYPE_BYTES[r.kv_dtype], r.tp, r.dp_attention)
    kv = max(budget - weights, 0)
    return Memory(
        "engine GPU",
        (
            Term("weights", weights, f"(non-expert / {dense_split} + experts / {r.ep if r.ep > 1 else r.tp}) x {wb} B"),
            Term(
                "KV cache",
                kv,
                f"memory_fraction {r.memory_fraction} x GPU - weights = {kv / per_token:,.0f} tokens "
                f"at {per_token:,.0f} B/token",
            ),
        ),
        budget,
    )


def _teacher_gpus(spec: ClusterSpec) -> int:
    return spec.teacher.gpus if spec.teacher is not None and spec.teacher.on_engine else 0


def teacher_engine_memory(spec: ClusterSpec) -> Memory | None:
    """A teacher on an engine of its own: its frozen weights split over its GPUs (tp), within the rollout
    engines' memory_fraction of one GPU; the rest of that share is its prefill's KV and activations."""
    teacher = spec.teacher
    if teacher is None or not teacher.on_engine:
        return None
    tp, wb = model_params(teacher.model or spec.model), DTYPE_BYTES[teacher.dtype]
    gpu = [g for g in spec.nodes if g.gpus][-1].gpu_memory_gib * GIB
    weights = tp.total * wb / teacher.gpus
    return Memory(
        "teacher engine GPU",
        (Term("teacher weights (frozen)", weights, f"{tp.total:,} x {wb} B / tp{teacher.gpus}"),),
        gpu * spec.rollout.memory_fraction,
    )


_ENGINE_SHARE = " and the colocated engines' memory_fraction"


def make_plan(spec: ClusterSpec) -> Plan:
    p = model_params(spec.model)
    placement, engine_nodes, problems = place(spec)
    trainer, engine = trainer_memory(spec, p), engine_memory(spec, p)
    if not trainer.fits:
        problems.append(
            f"does not fit: trainer rank needs {trainer.total / GIB:,.1f} GiB but a GPU has "
            f"{trainer.capacity / GIB:,.1f} GiB (after reserved_gib{_ENGINE_SHARE if spec.colocate else ''})"
        )
    weights = engine.terms[0].bytes
    if weights > engine.capacity:
        problems.append(
            f"does not fit: engine GPU weights need {weights / GIB:,.1f} GiB but memory_fraction x GPU "
            f"is {engine.capacity / GIB:,.1f} GiB"
        )
    teacher = teacher_engine_memory(spec)
    if teacher is not None and teacher.total > teacher.capacity:
        problems.append(
            f"does not fit: teacher engine GPU weights need {teacher.total / GIB:,.1f} GiB but memory_fraction x "
            f"GPU is {teacher.capacity / GIB:,.1f} GiB (teacher.gpus splits them)"
        )
    trainer_nodes = {n.name for n, _ in _trainer_slots(spec)}
    remote = sum(n.name not in trainer_nodes for n in engine_nodes)
    relays = Relays(len(engine_nodes) - remote, remote, engine_nodes[0].group if engine_nodes else spec.nodes[0])
    paths = sync_paths(spec, p, relays)
    step = None
    if spec.step:
        kv_tokens = engine.terms[1].bytes / kv_bytes_per_token(
            spec.model, DTYPE_BYTES[spec.rollout.kv_dtype], spec.rollout.tp, spec.rollout.dp_attention
        )
        step = step_time(spec, p, kv_tokens, next(x.seconds for x in paths if x.kind == spec.sync), problems)
    return Plan(
        spec,
        p,
        tuple(placement),
        trainer,
        engine,
        tuple(weight_updates(spec, p, relays)),
        paths,
        step,
        tuple(problems),
        teacher,
    )
