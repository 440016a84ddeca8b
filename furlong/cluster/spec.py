"""The cluster spec `furlong train --plan` reads: nodes, the model's shape, and each role's parallelism."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
Dtype = Literal["fp32", "bf16", "fp16", "fp8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeGroup(_Strict):
    """`count` identical nodes."""

    name: str = Field(description="label; nodes print as NAME0, NAME1, ...")
    count: int = Field(ge=1, description="how many nodes of this kind")
    gpus: int = Field(0, ge=0, description="GPUs per node (0: a CPU node, for sandboxes)")
    gpu_memory_gib: float = Field(0, ge=0, description="usable memory of one GPU, GiB")
    cpus: int = Field(ge=1, description="CPU cores per node")
    memory_gib: float = Field(ge=1, description="host memory per node, GiB")
    gpu_link_gbs: float = Field(450, gt=0, description="GPU-to-GPU bandwidth inside a node, GB/s per direction")
    network_gbs: float = Field(50, gt=0, description="network bandwidth into or out of a node, GB/s")

    @model_validator(mode="after")
    def _memory(self) -> NodeGroup:
        if self.gpus and not self.gpu_memory_gib:
            raise ValueError("gpu_memory_gib is required for a node with gpus > 0")
        return self


class Attention(_Strict):
    """gqa: separate q/k/v projections; mla: DeepSeek-style latent attention (optionally with a DSA indexer)."""

    kind: Literal["gqa", "mla"] = "gqa"
    qkv_bias: bool = Field(False, description="gqa: biases on q, k, v (Qwen2.5)")
    qk_norm: bool = Field(False, description="gqa: RMSNorm over each head's q and k (Qwen3)")
    q_lora_rank: int = Field(0, ge=0, description="mla: q latent width (0: a plain q projection)")
    kv_lora_rank: int = Field(0, ge=0, description="mla: kv latent width, what the KV cache stores")
    qk_nope_head_dim: int = Field(0, ge=0, description="mla: per-head q/k width without rotary")
    qk_rope_head_dim: int = Field(0, ge=0, description="mla: per-head q/k rotary width (shared k)")
    v_head_dim: int = Field(0, ge=0, description="mla: per-head v width")
    index_heads: int = Field(0, ge=0, description="mla with DSA: indexer heads (0: no indexer)")
    index_head_dim: int = Field(0, ge=0, description="mla with DSA: indexer head width")
    index_topk: int = Field(0, ge=0, description="mla with DSA: keys each query attends to (0: all before it)")

    @model_validator(mode="after")
    def _mla(self) -> Attention:
        if self.kind == "mla" and not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError("mla needs kv_lora_rank, qk_rope_head_dim and v_head_dim")
        return self


class Moe(_Strict):
    experts: int = Field(ge=1, description="routed experts per MoE layer")
    active: int = Field(ge=1, description="routed experts each token uses (top-k)")
    ffn: int = Field(ge=1, description="intermediate width of one expert")
    shared_ffn: int = Field(0, ge=0, description="total intermediate width of the shared experts (0: none)")
    dense_layers: int = Field(0, ge=0, description="leading layers with a dense MLP instead")

    @model_validator(mode="after")
    def _active(self) -> Moe:
        if self.active > self.experts:
            raise ValueError(f"active ({self.active}) exceeds experts ({self.experts})")
        return self


class ModelSpec(_Strict):
    """A decoder-only transformer, inline or from a Hugging Face config.json (`hf_config`)."""

    name: str = "model"
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(0, ge=0, description="gqa: key/value heads (0: as heads)")
    head_dim: int = Field(0, ge=0, description="gqa: per-head width (0: hidden / heads)")
    ffn: int = Field(ge=1, description="dense MLP intermediate width")
    vocab: int = Field(ge=1)
    tie_embeddings: bool = False
    mtp_layers: int = Field(0, ge=0, description="multi-token-prediction layers, counted apart")
    attention: Attention = Attention()
    moe: Moe | None = None

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


class Trainer(_Strict):
    gpus: int = Field(ge=1, description="GPUs the trainer ranks use")
    tp: int = Field(1, ge=1, description="tensor parallel (with sequence parallel)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    pp_layers: tuple[int, ...] = Field((), description="decoder layers per stage, first to last (empty: even split)")
    cp: int = Field(1, ge=1, description="context parallel: each rank holds seq_len / cp tokens")
    ep: int = Field(1, ge=1, description="expert parallel: each rank holds experts / ep")
    shard: Literal["none", "optimizer", "full"] = Field(
        "full", description="over data parallel: none (DDP), optimizer (ZeRO-1), full (FSDP: params, grads too)"
    )
    param_dtype: Dtype = "bf16"
    grad_dtype: Dtype = "fp32"
    master_weights: bool = Field(True, description="fp32 master copy of each parameter")
    moment_dtype: Dtype = "fp32"
    optimizer_offload: Literal["none", "cpu", "disk"] = "none"
    seq_len: int = Field(ge=1, description="tokens per sequence")
    micro_batch: int = Field(1, ge=1, description="sequences per micro-batch")
    activation_checkpointing: bool = True
    lora_rank: int = Field(0, ge=0, description="0: full fine-tuning; r: LoRA adapters, base frozen")
    lora_targets: tuple[Literal["attention", "mlp", "experts"], ...] = ("attention",)
    reserved_gib: float = Field(4, ge=0, description="per GPU, for the CUDA context, NCCL buffers and fragmentation")

    @model_validator(mode="after")
    def _stages(self) -> Trainer:
        if self.pp_layers and (len(self.pp_layers) != self.pp or min(self.pp_layers) < 1):
            raise ValueError(f"pp_layers needs pp ({self.pp}) counts of at least 1, got {list(self.pp_layers)}")
        return self


class Rollout(_Strict):
    engine: Literal["sglang", "vllm", "hf"] = Field(
        "sglang", description="hf: furlong's in-process engine (its weights in `dtype`, KV as the batch needs it)"
    )
    gpus: int = Field(ge=1)
    tp: int = Field(1, ge=1, description="tensor parallel per engine; GPUs per engine")
    ep: int = Field(1, ge=1, description="expert parallel inside an engine (1: experts split by tp)")
    dp_attention: bool = Field(False, description="attention replicated per GPU (SGLang dp-attention)")
    dtype: Dtype = "bf16"
    kv_dtype: Dtype = "bf16"
    memory_fraction: float = Field(
        0.85,
        gt=0,
        le=1,
        description="of GPU memory for weights and KV cache (vllm: train.vllm.gpu_memory_utilization; "
        "sglang: --mem-fraction-static)",
    )


class Sandboxes(_Strict):
    concurrent: int = Field(ge=0, description="sandboxes alive at once")
    cpus: float = Field(1, gt=0, description="CPU cores per sandbox")
    memory_gib: float = Field(2, gt=0, description="memory per sandbox, GiB")


class Delta(_Strict):
    """What a delta update costs (furlong/sync: changed positions and values, zstd). Defaults: the GRPO steps of
    bench/results/weight_sync.json at the recipe's lr (2e-4), 0.677 of values changed at 3.0 bits each."""

    changed_fraction: float = Field(0.677, gt=0, le=1, description="share of engine-dtype values an update changes")
    value_bits: float = Field(3.0, gt=0, description="bits per changed value after coding")
    encode_gbs: float = Field(0.71, gt=0, description="engine-dtype GB one core encodes per second")
    apply_gbs: float = Field(1.12, gt=0, description="engine-dtype GB one core applies per second")
    encoders: int = Field(1, ge=1, description="cores encoding (and applying, per relay) in parallel")


class Step(_Strict):
    """One RL step, for the time estimate: every input is printed beside the term it feeds."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: rollout, then train, then weight sync; async: the next rollout overlaps them"
    )
    prompts: int = Field(ge=1, description="prompts per step")
    group_size: int = Field(1, ge=1, description="samples per prompt")
    prompt_tokens: int = Field(ge=0, description="mean prompt tokens per sample")
    response_tokens: int = Field(ge=1, description="mean tokens the policy generates per sample, all turns")
    observation_tokens: int = Field(0, ge=0, description="mean tokens the environment adds per sample (prefilled)")
    env_seconds: float = Field(0, ge=0, description="mean seconds a sample waits on its environment, not generating")
    concurrent: int = Field(0, ge=0, description="samples in flight at once (0: the whole step's)")
    spec_accept: float = Field(1, ge=1, description="tokens a decode step yields per sample (speculative decoding)")
    logprob_passes: int = Field(0, ge=0, description="forward-only passes before training (old-policy, reference)")
    gpu_tflops: float = Field(989, gt=0, description="dense bf16 peak of one GPU, TFLOP/s (989: H100/H200)")
    gpu_hbm_tbs: float = Field(4.8, gt=0, description="memory bandwidth of one GPU, TB/s (4.8: H200)")
    mfu: float = Field(0.3, gt=0, le=1, description="share of peak FLOP/s that training, prefill and decode reach")
    mbu: float = Field(0.6, gt=0, le=1, description="share of memory bandwidth that decode reaches")


class TeacherSpec(_Strict):
    """A distillation teacher (train.distill, docs/distill.md) held on the trainer's GPUs beside the policy:
    its weights on each rank, its prefill of every sample before training."""

    kind: Literal["checkpoint", "self"] = Field(
        "checkpoint",
        description="checkpoint: a frozen copy of another model; self: the policy under another prompt "
        "(no weights of its own, one forward pass)",
    )
    model: ModelSpec | None = Field(None, description="checkpoint: its shape (or hf_config: PATH); null: the student's")
    dtype: Dtype = Field("bf16", description="checkpoint: its weights' dtype")
    shard: bool = Field(True, description="checkpoint: split like the policy (tp, pp, ep, and dp with shard: full)")
    engine: Literal["trainer", "hf", "vllm"] = Field(
        "trainer",
        description="train.distill.teacher.engine: trainer (on the trainer's GPUs); hf or vllm: an engine role of "
        "its own on `gpus` more GPUs, its weights there (a checkpoint teacher only)",
    )
    gpus: int = Field(1, ge=1, description="engine hf|vllm: the teacher engine's GPUs (its weights split over them)")

    @model_validator(mode="after")
    def _self_has_no_model(self) -> TeacherSpec:
        if self.kind == "self" and self.model is not None:
            raise ValueError("teacher.model: a self teacher is the policy itself; drop it (or kind: checkpoint)")
        if self.kind == "self" and self.engine != "trainer":
            raise ValueError(
                f"teacher.engine: {self.engine} serves a checkpoint (a frozen self teacher is kind: checkpoint); "
                "a live self teacher is the policy, on the trainer"
            )
        return self

    @property
    def on_engine(self) -> bool:
        return self.engine != "trainer"


class ClusterSpec(_Strict):
    nodes: tuple[NodeGroup, ...] = Field(min_length=1)
    model: ModelSpec
    trainer: Trainer
    rollout: Rollout
    colocate: bool = Field(False, description="rollout engines share the trainer's GPUs")
    sync: Literal["full", "delta", "lora"] = Field("full", description="what each update sends to the engines")
    delta: Delta = Delta()
    sandboxes: Sandboxes = Sandboxes(concurrent=0)
    step: Step | None = Field(None, description="one step's batch and hardware rates: the time estimate")
    teacher: TeacherSpec | None = Field(
        None, description="a distillation teacher: on the trainer's GPUs, or (teacher.engine) on an engine of its own"
    )

    @model_validator(mode="after")
    def _layers(self) -> ClusterSpec:
        split = self.trainer.pp_layers
        if split and sum(split) != self.model.layers:
            raise ValueError(f"trainer.pp_layers sums to {sum(split)} but the model has {self.model.layers} layers")
        if self.step and self.step.mode == "async" and self.colocate:
            raise ValueError("step.mode async needs the engines on their own GPUs (colocate: false)")
        return self


def hf_model(path: Path) -> dict:
    """A ModelSpec's fields from a Hugging Face config.json (Llama/Qwen2/Qwen3 and their MoE, DeepSeek/GLM-5)."""
    c = json.loads(Path(path).read_text())
    try:
        return _hf_fields(c)
    except KeyError as exc:
        raise ValueError(f"{path}: model.hf_config has no {exc.args[0]!r}, which a decoder config needs") from None


def _hf_fields(c: dict) -> dict:
    spec: dict = {
        "name": c.get("_name_or_path") or c.get("model_type", "model"),
        "layers": c["num_hidden_layers"],
        "hidden": c["hidden_size"],
        "heads": c["num_attention_heads"],
        "vocab": c["vocab_size"],
        "kv_heads": c.get("num_key_value_heads") or 0,
        "ffn": c["intermediate_size"],
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "mtp_layers": c.get("num_nextn_predict_layers", 0),
    }
    mt = c.get("model_type", "")
    if "kv_lora_rank" in c:
        spec["attention"] = {
            "kind": "mla",
            "q_lora_rank": c.get("q_lora_rank") or 0,
            "kv_lora_rank": c["kv_lora_rank"],
            "qk_nope_head_dim": c["qk_nope_head_dim"],
            "qk_rope_head_dim": c["qk_rope_head_dim"],
            "v_head_dim": c["v_head_dim"],
            "index_heads": c.get("index_n_heads", 0),
            "index_head_dim": c.get("index_head_dim", 0),
            "index_topk": c.get("index_topk", 0) if c.get("index_n_heads") else 0,
        }
    else:
        spec["head_dim"] = c.get("head_dim") or 0
        spec["attention"] = {
            "qkv_bias": bool(c.get("attention_bias", mt == "qwen2")),  # Qwen2's are implicit
            "qk_norm": mt.startswith("qwen3"),
        }
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
    if experts:
        shared = c.get("shared_expert_intermediate_size") or c.get("n_shared_experts", 0) * c["moe_intermediate_size"]
        spec["moe"] = {
            "experts": experts,
            "active": c["num_experts_per_tok"],
            "ffn": c["moe_intermediate_size"],
            "shared_ffn": shared,
            "dense_layers": c.get("first_k_dense_replace", 0),
        }
    return spec


def _with_hf_config(model, path: Path):
    """A model section with `hf_config: PATH` (relative to the spec) read into its fields, keys beside it winning."""
    if not isinstance(model, dict) or "hf_config" not in model:
        return model
    rest = dict(model)
    source = Path(rest.pop("hf_config"))
    source = source if source.is_absolute() else Path(path).parent / source
    if source.is_dir():
        source = source / "config.json"
    return {**hf_model(source), **rest}


def load_spec(path: Path) -> ClusterSpec:
    """The spec at `path`; a bad one is a ValueError naming each wrong field and what it expected."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with nodes, model, trainer, rollout")
    raw["model"] = _with_hf_config(raw.get("model"), path)
    if isinstance(raw.get("teacher"), dict):
        raw["teacher"] = {**raw["teacher"], "model": _with_hf_config(raw["teacher"].get("model"), path)}
        if raw["teacher"]["model"] is None:
            del raw["teacher"]["model"]
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors()]
        raise ValueError(f"{path}: " + "; ".join(lines)) from None
