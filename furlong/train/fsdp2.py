"""GRPO over FSDP2 ranks (`train.trainer: fsdp2`): the local trainer's step, its model sharded with
torch.distributed.fsdp.fully_shard (each decoder layer, then the root), one rank per process.

Every rank receives every episode and draws the same shuffles, so each computes the same minibatches and the
same token-level denominator (the whole minibatch's); it trains on its strided share of each one. FSDP's
reduce-scatter would average the ranks' gradients: its divide factor is 1, so they sum, and the sum of the
shares' losses (each over the global denominator) is the local trainer's loss. The anchor splits its picked
demonstrations the same way (furlong.train.sft.demo_nll's `tokens`).

`FSDP2Spec` is what a rank process needs to build its `FSDP2Worker` (furlong.train.ranks: LocalRanks here,
or another RankGroup); `FSDP2Trainer` is the facade in the driver process (furlong.train.protocol.Trainer).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from furlong.agent.episode import Episode
from furlong.model.loading import frozen_model, load_model
from furlong.train.atomic import fsync_dir, replace_dir, write_synced
from furlong.train.distill import Teacher, TeacherPass, TeacherSpec
from furlong.train.experts import KEY, gather_experts, split_experts, split_grad_norm
from furlong.train.export import is_peft, write_hf
from furlong.train.logprobs import token_logprobs
from furlong.train.ranks import RankGroup
from furlong.train.sft import Demo
from furlong.train.stats import TrainStats
from furlong.train.trainer import GRPOConfig, LocalTrainer, _rng_state, _set_rng_state

if TYPE_CHECKING:
    from furlong.model.lora import LoraSpec

SHARDS_DIR = "shards"  # torch.distributed.checkpoint's files: loadable at any world size
STATE_FILE = "trainer-state.pt"  # version, optimizer step count, RNG (the same on every rank)


@dataclass(frozen=True)
class FSDP2Spec:
    """One rank's trainer, as plain values (it is pickled to each rank process). `model_dir`: the policy's
    starting checkpoint, also the KL reference when config.kl_coef > 0; `lora`: wrap it with fresh adapters
    drawn under `lora_seed`; `teacher`: train.distill's, built on each rank (a checkpoint whole on each, not
    sharded; a self-distillation teacher is the sharded policy)."""

    model_dir: Path
    config: GRPOConfig
    lora: LoraSpec | None = None
    lora_seed: int | None = 0
    demos: tuple[Demo, ...] = ()
    device: str = "cpu"  # cuda: one GPU per rank, nccl, bf16 compute over fp32 masters
    threads: int = 1  # torch threads per rank
    teacher: TeacherSpec | None = None
    frozen_dtype: str = "float32"  # the KL reference's weights (train.model.frozen_dtype)
    expert_parallel: int = 1  # the ep of a (dp, ep) mesh: MoE experts split by expert (furlong.train.experts)

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def policy(self) -> torch.nn.Module:
        model = load_model(self.model_dir)
        if self.lora is None:
            return model
        from furlong.model.lora import wrap_lora  # peft loads slowly: only LoRA runs need it

        return wrap_lora(model, self.lora, seed=self.lora_seed)

    def make(self, rank: int, world_size: int) -> FSDP2Worker:
        torch.set_num_threads(self.threads)
        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        ref = frozen_model(self.model_dir, self.frozen_dtype).to(device) if self.config.kl_coef > 0 else None  # type: ignore[arg-type]  # transformers' wrapped .to() misleads mypy
        mixed = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.device == "cuda"
            else None
        )
        taught = self.teacher if self.config.distill_mode != "off" else None
        teacher = None if taught is None else taught.build(self.model_dir, self.config, device, load_model)
        mesh = Mesh.build(self.device, world_size, self.expert_parallel)
        return FSDP2Worker(self, self.policy().to(device), ref, mesh, mixed, teacher)


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the (dp, ep) mesh: FSDP shards over `dp` (the ranks with this rank's experts);
    the ranks of one `ep` group see the same tokens and split the experts (None: no expert parallelism)."""

    dp: DeviceMesh | None
    ep: DeviceMesh | None

    @staticmethod
    def build(device: str, world_size: int, ep: int) -> Mesh:
        if ep < 1 or world_size % ep:
            raise ValueError(f"{KEY}={ep} must divide train.fsdp2.world_size ({world_size})")
        if ep == 1:
            return Mesh(None, None)
        mesh = init_device_mesh(device, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))
        return Mesh(mesh["dp"], mesh["ep"])

    @property
    def rank(self) -> int:
        """This rank's share of every pass: its dp index (the ranks of an ep group share one)."""
        return dist.get_rank() if self.dp is None else self.dp.get_local_rank()

    @property
    def shares(self) -> int:
        return dist.get_world_size() if self.dp is None else self.dp.size()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the shares' results are gathered over (None: the world)."""
        return None if self.dp is None else self.dp.get_group()


class Entry(torch.nn.Module):
    """The root FSDP module: `entry(fn, *args)` runs `fn(model, *args)` inside its forward, so the root's
    parameters (embeddings, final norm, a tied head) are gathered even when `fn` calls the decoder and the
    head separately (furlong.train.logprobs does)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, fn: Callable, *args):
        return fn(self.inner, *args)


def shard(model: torch.nn.Module, mixed: MixedPrecisionPolicy | None, mesh: Mesh) -> tuple[Entry, tuple[str, ...]]:
    """Split the experts over ep (if any: their parameters' names are returned), then fully_shard each decoder
    layer, then the root, over dp; gradients summed over ranks, not averaged."""
    inner: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wraps the LM
    split: tuple[str, ...] = ()
    if mesh.ep is not None:
        ep = mesh.ep.size()
        split = split_experts(model, ep, mesh.ep.get_local_rank(), mesh.ep.get_group())
    kwargs: dict[str, Any] = {} if mixed is None else {"mp_policy": mixed}
    if mesh.dp is not None:
        kwargs["mesh"] = mesh.dp
    for layer in getattr(inner, inner.base_model_prefix).layers:
        fully_shard(layer, **kwargs)
    entry = Entry(model)
    fully_shard(entry, **kwargs)
    for module in entry.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)
    return entry, split


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FSDP2Worker(LocalTrainer):
    """One rank: LocalTrainer's step over its share of every pass, through the sharded root."""

    def __init__(
        self,
        spec: FSDP2Spec,
        model: torch.nn.Module,
        ref_model: torch.nn.Module | None,
        mesh: Mesh,
        mixed: MixedPrecisionPolicy | None,
        teacher: Teacher | None = None,
    ) -> None:
        entry, self.split = shard(model, mixed, mesh)
        entries = {id(model): entry}
        if ref_model is not None:
            entries[id(ref_model)] = shard(ref_model, mixed, mesh)[0]
        super().__init__(model, spec.config, ref_model=ref_model, demos=spec.demos, teacher=teacher)  # type: ignore[arg-type]
        self.spec, self._entries, self.mesh = spec, entries, mesh
        self.rank, self.world_size = mesh.rank, mesh.shares

    def _forward(self, model, fn: Callable, *args):
        return self._entries[id(model)](fn, *args)

    def _all_gather(self, obj: object) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.mesh.group)
        return out

    def score_teacher(self, episodes: Sequence[Episode]) -> TeacherPass | None:  # type: ignore[override]
        """This rank's strided share of the episodes (by length) scored by the teacher; rank 0 gets every
        rank's, in the episodes' order, as the local trainer's TeacherPass (the others None). A checkpoint
        teacher is whole on each rank: its forwards are this rank's own, and one that raises is retried one
        episode at a time as locally. A self-distillation teacher is the sharded policy: its forwards are
        collectives, so every rank makes as many (idle ones where its share is done)."""
        if self.teacher is None:
            raise ValueError("score_teacher: this trainer has no teacher (train.distill.mode is off)")
        start = time.perf_counter()
        order = sorted(range(len(episodes)), key=lambda i: len(episodes[i].tokens))
        mine = order[self.rank :: self.world_size]
        share = [episodes[i] for i in mine]
        out, todo = self.teacher.readable(share, self.model)
        with self._autocast():
            if self.teacher.model is not None:
                part = self.teacher.run(share, out, todo, self.model, start)
            else:
                most = max(self._all_gather(self.teacher.passes(todo)))
                forward = partial(self._forward, self.model, token_logprobs)
                part = self.teacher.run(share, out, todo, self.model, start, forward)
                for _ in range(most - self.teacher.passes(todo)):
                    self._idle(self.model, grad=False)
        gathered = self._all_gather((mine, part.episodes, part.tokens))
        if self.rank != 0:
            return None
        scored = list(episodes)
        for indices, eps, _ in gathered:
            for i, e in zip(indices, eps, strict=True):
                scored[i] = e
        return TeacherPass(tuple(scored), time.perf_counter() - start, sum(n for _, _, n in gathered))

    def _grad_norm(self, params: list[torch.Tensor]) -> torch.Tensor:
        if not self.split or self.mesh.ep is None:
            return super()._grad_norm(params)
        named = dict(self.model.named_parameters())
        split = {id(named[n]) for n in self.split}
        grads = [(id(p) in split, p.grad) for p in params if p.grad is not None]
        dense, experts = [g for s, g in grads if not s], [g for s, g in grads if s]
        return torch.tensor(split_grad_norm(dense, experts, self.mesh.ep.get_group()))

    def _full_state(self) -> dict[str, Any]:
        """The whole model's state on CPU at global rank 0 (every rank takes part); {} on the others. Under ep,
        every rank gathers over dp, then the split experts' blocks over ep."""
        if self.mesh.ep is None:
            return get_model_state_dict(self.model, options=FULL)
        state: dict[str, Any] = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        group, ep = self.mesh.ep.get_group(), self.mesh.ep.size()
        state.update({name: gather_experts(state[name], group, ep) for name in self.split})
        return {k: v.cpu() for k, v in state.items()} if dist.get_rank() == 0 else {}

    def logprobs(self, episodes: Sequence[Episode]) -> list[torch.Tensor]:
        """Per-episode logprobs under the policy (routes replayed where the episodes carry them), on CPU."""
        return [t.cpu() for t in self._logprobs(self.model, list(episodes))]

    def local_experts(self) -> dict[str, tuple[int, ...]]:
        """The shapes of this rank's blocks of the split expert parameters (before FSDP's dp sharding)."""
        named = dict(self.model.named_parameters())
        return {n: tuple(named[n].shape) for n in self.split}

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Every rank gathers; rank 0 gets the full CPU tensors (LoRA: the adapters only), the others None."""
        full = self._full_state()
        if dist.get_rank() != 0:
            return None
        if is_peft(self.model):
            from peft import get_peft_model_state_dict

            return dict(get_peft_model_state_dict(self.model, state_dict=full))
        return full

    def export(self, out: Path, tokenizer, base_model: Path | None) -> Path | None:
        """The local trainer's export of an unsharded copy (rank 0 writes it)."""
        full = self._full_state()
        if dist.get_rank() != 0:
            return None
        copy = self.spec.policy()
        copy.load_state_dict(full)
        return write_hf(copy, tokenizer, out, base_model=base_model)  # type: ignore[arg-type]  # a PreTrainedModel

    def _shards(self, directory: Path) -> tuple[Path, dist.ProcessGroup | None]:
        """Where this rank's part goes, and with which ranks. Under ep the blocks of an ep rank's experts share
        their names with the other ep ranks' blocks, so each ep index's dp group writes its own checkpoint
        (shards/ep<i>/, the dense weights in each): loadable at the same expert_parallel."""
        if self.mesh.ep is None:
            return directory / SHARDS_DIR, None
        return directory / SHARDS_DIR / f"ep{self.mesh.ep.get_local_rank()}", self.mesh.group

    def save_shards(self, directory: Path) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        where, group = self._shards(directory)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=where, process_group=group)
        if self.rank == 0:
            state = {"version": self.version, "opt_steps": self._opt_steps, "rng": _rng_state(self.generator)}
            write_synced(directory / STATE_FILE, lambda f: torch.save(state, f))
        dist.barrier()

    def load_shards(self, directory: Path) -> int:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        where, group = self._shards(directory)
        dcp.load(state, checkpoint_id=where, process_group=group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        self.version, self._opt_steps = int(extra["version"]), int(extra["opt_steps"])
        _set_rng_state(self.generator, extra["rng"])
        return self.version


class FSDP2Trainer:
    """The Trainer facade over a RankGroup of FSDP2Workers: rank 0's answers (its TrainStats are the group's:
    every metric is gathered over ranks in the step itself)."""

    def __init__(self, ranks: RankGroup, spec: FSDP2Spec) -> None:
        self.ranks, self.spec = ranks, spec
        self.version = 0
        self._weights: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # what the facade hands out (weights, stats) lives here

    def train_step(self, episodes: Sequence[Episode]) -> TrainStats:
        stats = self.ranks.call("train_step", list(episodes))[0]
        self.version = stats.version
        return stats

    def score_teacher(self, episodes: Sequence[Episode]) -> TeacherPass:
        """Each rank scores its share; rank 0's answer holds them all (FSDP2Worker.score_teacher)."""
        return self.ranks.call("score_teacher", list(episodes))[0]

    def engine_weights(self) -> Mapping[str, torch.Tensor]:
        """Gathered once per version (a push and a checkpoint of one step share it)."""
        if self._weights is None or self._weights[0] != self.version:
            self._weights = (self.version, self.ranks.call("full_weights")[0])
        return self._weights[1]

    def export_hf(self, out: Path, tokenizer, base_model: Path | None = None) -> Path:
        return self.ranks.call("export", Path(out), tokenizer, base_model)[0]

    def save(self, path: Path | str) -> None:
        """Sharded (every rank writes its part) into a temp directory beside `path`, renamed into place."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            self.ranks.call("save_shards", tmp)
            meta = json.dumps(
                {
                    "version": self.version,
                    "trainer": "fsdp2",
                    "world_size": self.ranks.world_size,
                    "expert_parallel": self.spec.expert_parallel,
                    "config": asdict(self.spec.config),
                },
                indent=1,
            )
            write_synced(tmp / "meta.json", lambda f: f.write(meta.encode()))
            for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
                fsync_dir(d)
            replace_dir(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, path: Path | str) -> None:
        path = Path(path)
        if not (path / SHARDS_DIR).is_dir():
            raise ValueError(
                f"{path}: not an fsdp2 checkpoint (no {SHARDS_DIR}/; a train.trainer=local run writes another layout)"
            )
        meta = json.loads((path / "meta.json").read_text()) if (path / "meta.json").is_file() else {}
        saved = int(meta.get("expert_parallel", 1))
        if saved != self.spec.expert_parallel:
            raise ValueError(
                f"{path}: saved with {KEY}={saved}; this trainer has {self.spec.expert_parallel} (a checkpoint loads "
                "at its own expert_parallel)"
            )
        self.version = self.ranks.call("load_shards", path)[0]
        self._weights = None

    def close(self) -> None:
        self.ranks.close()
