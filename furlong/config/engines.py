"""Rollout engines and their weights: weight sync, SGLang, the hf engine, Ray placement."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from furlong.config.base import _Node


class SyncConfig(_Node):
    """How each RL step's weights reach the rollout engine (furlong.sync; docs/weight-sync.md)."""

    transport: Literal["direct", "inprocess", "directory", "http", "broadcast", "shared"] = Field(
        "direct",
        description="direct: copy into the in-process engine; broadcast (engine=server): send every "
        "tensor over a torch.distributed group with the engine servers; shared (engine="
        "server, or colocated Ray actors): engines on the trainer's host load from its "
        "shared memory; otherwise publish full/delta updates that a relay verifies and loads",
    )
    engine: Literal["inprocess", "server"] = Field(
        "inprocess", description="server: the RL rollout engine runs in its own process with its relay beside it"
    )
    servers: int = Field(
        1,
        ge=1,
        description="engine=server: this many engine processes behind one router "
        "(furlong.engine.router: least-loaded, sticky, failover)",
    )
    engine_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="published weights' dtype; bfloat16 halves the bytes, but rollouts then "
        "differ from the fp32 trainer by ~5e-2 in logprob (TIS corrects for it)",
    )
    quantize: Literal["none", "fp8"] = Field(
        "none",
        description="fp8: the decoder layers' Linear weights reach the rollout engine as e4m3 + float32 scales "
        "(per output channel, or fp8_block tiles) and the hf engine generates from them; a checksum each "
        "step proves the engine holds the trainer's quantized tensors (docs/weight-sync.md#fp8-rollout-weights)",
    )
    fp8_block: int | None = Field(
        None,
        ge=1,
        description="quantize=fp8: one scale per fp8_block x fp8_block tile (128: the FineGrainedFP8 "
        "layout); null: one per output channel",
    )
    quantized_forward: bool = Field(
        False,
        description="quantize=fp8: the trainer computes logprobs and loss through the same fp8-rounded weights "
        "(straight-through gradient to its full-precision weights), so rollout and trainer see one policy",
    )
    full_every: int = Field(20, ge=1, description="a full snapshot every this many publishes bounds the chain")
    dir: Path | None = Field(None, description="published updates (directory/http); null: RUN_DIR/weights")
    keep: int = Field(2, ge=0, description="updates kept before the newest full snapshot when pruning")
    momentum: bool = Field(
        True,
        description="predict dense deltas from the previous one: smaller payloads, for up "
        "to 2 bytes of state per word of dense tensors at each end",
    )
    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="transport=broadcast: the torch.distributed backend (nccl needs a GPU at every rank)"
    )
    master_address: str = Field(
        "127.0.0.1",
        description="transport=broadcast: the trainer's address that the "
        "engines join its group at (loopback or a private network)",
    )
    bucket_mb: float = Field(
        256,
        gt=0,
        description="transport=broadcast: tensors go in flat buckets of at most this many MiB, one broadcast each",
    )

    @model_validator(mode="after")
    def _server_needs_files(self) -> SyncConfig:
        if self.engine == "server" and self.transport not in ("directory", "http", "broadcast", "shared"):
            raise ValueError(
                f"engine=server takes updates from files, HTTP, a broadcast or shared memory: set "
                f"transport to directory, http, broadcast or shared (got {self.transport!r})"
            )
        if self.transport == "broadcast" and self.engine != "server":
            raise ValueError("transport=broadcast sends weights to engine server processes: set engine to server")
        if self.quantize == "none" and (self.quantized_forward or self.fp8_block is not None):
            raise ValueError("train.sync.quantized_forward and train.sync.fp8_block need train.sync.quantize=fp8")
        if self.servers > 1 and self.engine != "server":
            raise ValueError(
                f"servers={self.servers} runs engine processes: set engine to server (got {self.engine!r})"
            )
        return self


class SGLangConfig(_Node):
    """`train.engine: sglang`: attach to a running SGLang server (url) or start one (furlong.engine.sglang_launch)."""

    url: str | None = Field(None, description="a running server's base URL; null: start one for the run")
    python: str | None = Field(None, description="interpreter that has sglang installed; null: this one")
    launch_module: str = Field("sglang.launch_server", description="run with python -m (tests: tests.sglang_standin)")
    port: int = Field(0, ge=0, description="0: a free port")
    extra_args: tuple[str, ...] = Field((), description="more launch_server flags, e.g. [--mem-fraction-static, 0.5]")
    start_timeout_s: float = Field(600.0, gt=0, description="a started server must answer within this")
    weights_via: Literal["disk", "tensor"] = Field(
        "disk",
        description="disk: each update is a checkpoint the server loads (/update_weights_from_disk); "
        "tensor: /update_weights_from_tensor (same host only)",
    )


class VLLMConfig(_Node):
    """`train.engine: vllm`: the memory vLLM may take (furlong.engine.vllm; `furlong train --plan`'s
    rollout.memory_fraction is the same fraction)."""

    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="on a GPU: the fraction of its memory vLLM takes for weights, activations and KV cache "
        "(null: vLLM's default, 0.9, which leaves a trainer on the same GPU little); the CPU build ignores it",
    )
    kv_cache_gib: int | None = Field(
        None,
        ge=1,
        description="the CPU build's KV cache, GiB (VLLM_CPU_KVCACHE_SPACE); null: that variable as set, else 1",
    )


class HFEngineConfig(_Node):
    """The in-process hf engine (furlong.engine.hf) that runs rollouts and held-out evals."""

    prefix_cache_mb: float = Field(
        256,
        ge=0,
        description="KV of finished turns kept for later turns and group members that share their "
        "prefix (LRU within this many MiB); 0 disables the prefix cache",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="where the in-process engine's model runs (RL "
        "rollouts and held-out evals; with train.device=cuda, weights are "
        "copied GPU to GPU)",
    )
    deterministic: bool = Field(
        False,
        description="each request prefilled and decoded in its own forwards, no prefix cache: a "
        "seeded request's tokens and logprobs do not depend on what else runs, so a sync "
        "run on one machine repeats bit for bit (slower; docs/training.md#reproducibility)",
    )


class RayConfig(_Node):
    """`train.cluster: ray`: the rollout engines and the RL trainer run as Ray actors (furlong.cluster;
    docs/cluster.md). Resources are Ray's logical CPUs, reserved in placement groups, one bundle per actor."""

    address: str | None = Field(
        None,
        description="null: start a local Ray cluster for the run (stopped at its "
        "end); an address (`auto`, HOST:PORT) joins a running one",
    )
    num_cpus: float | None = Field(
        None, gt=0, description="a local cluster's logical CPUs; null: what the bundles reserve"
    )
    placement: Literal["colocated", "disaggregated"] = Field(
        "colocated",
        description="colocated: one placement group packs the trainer and the engines on one node; "
        "disaggregated: a trainer group and an engine group spread over the nodes",
    )
    engines: int = Field(
        1,
        ge=1,
        description="engine actors (each an engine server with its relay) behind "
        "furlong.engine.router when more than one",
    )
    engine_cpus: float = Field(
        1.0,
        gt=0,
        description="logical CPUs each engine actor's bundle reserves (a distillation teacher's engine actor's too)",
    )
    trainer_cpus: float = Field(1.0, gt=0, description="logical CPUs the trainer actor's bundle reserves")
    trainer_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs each trainer actor's bundle reserves (train.device=cuda "
        "needs > 0); a fraction shares a GPU (colocated: 0.5 each)",
    )
    engine_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs each engine actor's bundle reserves (a distillation teacher's engine actor's too); > 0: "
        "the engine runs on CUDA",
    )
    sandbox_hosts: int = Field(
        0,
        ge=0,
        description="sandbox host actors, each running `furlong sandbox serve` on "
        "its node; > 0: the run's sandboxes go to them (the remote "
        "backend), 0: sandbox.backend as configured",
    )
    sandbox_host_cpus: float = Field(1.0, gt=0, description="logical CPUs each sandbox host's bundle reserves")
    sandbox_host_capacity: int = Field(8, ge=1, description="most sandboxes at once on each sandbox host")
    max_restarts: int = Field(
        3,
        ge=0,
        description="times Ray restarts a dead engine actor (same address; "
        "the router readmits it at the live weight version)",
    )
    start_timeout_s: float = Field(
        180.0, gt=0, description="how long placement groups and actors may take to become ready"
    )
