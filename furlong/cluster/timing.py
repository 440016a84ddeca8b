"""Seconds per RL step for `furlong train --plan`: a roofline estimate whose every input is in the spec.

Rollout: each sample is prefilled (bound by FLOPs), decoded (each decode step reads the engine GPU's weights
and its batch's KV cache, or is bound by FLOPs, whichever is slower) and waits on its environment. Train:
passes x 2 x active parameters per token, plus attention. Weight sync: the update path's seconds
(furlong.cluster.updates). Sync mode adds the three; async overlaps the next rollout with training and sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from furlong.cluster.shapes import ModelParams, kv_bytes_per_token, model_params
from furlong.cluster.spec import DTYPE_BYTES, ClusterSpec, ModelSpec, Step

GIB = 1024**3


def _step(spec: ClusterSpec) -> Step:
    """The spec's `step` section, which every time term reads (plan.py estimates only where it is set)."""
    if spec.step is None:
        raise ValueError("cluster spec: the step time needs a `step` section (the batch and hardware rates)")
    return spec.step


@dataclass(frozen=True)
class TimeTerm:
    name: str
    seconds: float
    formula: str


@dataclass(frozen=True)
class StepTime:
    terms: tuple[TimeTerm, ...]
    seconds: float
    formula: str


def attention_flops(m: ModelSpec, keys: float) -> float:
    """FLOPs of q x k and scores x v for one token attending to `keys` keys, all layers, one forward pass
    (DSA: at most index_topk keys; its indexer's own scoring is not counted)."""
    a = m.attention
    qk, v = (a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim) if a.kind == "mla" else (m.hd, m.hd)
    if a.index_topk:
        keys = min(keys, a.index_topk)
    return 2 * m.layers * m.heads * (qk + v) * keys


def kv_read_bytes(spec: ClusterSpec, ctx: float) -> float:
    """KV cache one decode step reads for one sample at context `ctx`, on one engine GPU. DSA reads every
    key's indexer entry but the latent of only index_topk keys."""
    m, r = spec.model, spec.rollout
    a, kv = m.attention, DTYPE_BYTES[r.kv_dtype]
    if a.kind == "mla" and a.index_topk:
        return m.layers * kv * (a.index_head_dim * ctx + (a.kv_lora_rank + a.qk_rope_head_dim) * min(ctx, a.index_topk))
    return kv_bytes_per_token(m, kv, r.tp, r.dp_attention) * ctx


def decode_step(spec: ClusterSpec, p: ModelParams, batch: float, ctx: float) -> tuple[float, str]:
    """Seconds of one engine decode step with `batch` samples at context `ctx`, and how it splits.

    A step processes batch x spec_accept tokens; a MoE GPU reads only the experts they route to (each token
    picks `active` of `experts`: 1 - (1 - active/experts)^tokens of them)."""
    r, m, st = spec.rollout, spec.model, _step(spec)
    tokens = batch * st.spec_accept
    touched = 1.0 if m.moe is None else 1 - (1 - m.moe.active / m.moe.experts) ** tokens
    dense = (p.total - p.experts) / (1 if r.dp_attention else r.tp)
    weights = (dense + p.experts / (r.ep if r.ep > 1 else r.tp) * touched) * DTYPE_BYTES[r.dtype]
    kv = (batch / r.tp if r.dp_attention else batch) * kv_read_bytes(spec, ctx)
    memory = (weights + kv) / (st.gpu_hbm_tbs * 1e12 * st.mbu)
    compute = tokens * (2 * p.active + attention_flops(m, ctx)) / (r.tp * st.gpu_tflops * 1e12 * st.mfu)
    bound = "memory" if memory >= compute else "compute"
    routed = f" (experts touched {touched:.0%})" if m.moe else ""
    return max(memory, compute), (
        f"{weights / GIB:,.1f} GiB weights{routed} + {kv / GIB:,.2f} GiB KV per GPU; {bound}-bound"
    )


def _in_flight(spec: ClusterSpec, kv_tokens_per_gpu: float, problems: list[str]) -> int:
    """Samples in flight at once: `concurrent` (or the whole step's; sync mode never more than those), as many as
    the engines' KV cache holds."""
    st, r = _step(spec), spec.rollout
    samples = st.prompts * st.group_size
    want = st.concurrent or samples
    if st.mode == "sync":
        want = min(want, samples)
    final = st.prompt_tokens + st.observation_tokens + st.response_tokens
    per_engine = kv_tokens_per_gpu * (r.tp if r.dp_attention else 1)
    room = int(r.gpus // r.tp * per_engine // final)
    if want > room:
        problems.append(
            f"does not fit: KV cache: {want} samples of {final:,} tokens in flight but the engines "
            f"hold {room}; the step time assumes {max(room, 1)}"
        )
        return max(room, 1)
    return want


def _rollout(spec: ClusterSpec, p: ModelParams, in_flight: int) -> list[TimeTerm]:
    """Per-sample prefill, decode and environment terms, then the rollout's seconds for the step."""
    st, r, m = _step(spec), spec.rollout, spec.model
    samples, engines = st.prompts * st.group_size, r.gpus // r.tp
    prefilled = st.prompt_tokens + st.observation_tokens
    ctx = st.prompt_tokens + (st.observation_tokens + st.response_tokens) / 2  # mean context while decoding
    prefill = prefilled * (2 * p.active + attention_flops(m, ctx)) / (r.tp * st.gpu_tflops * 1e12 * st.mfu)
    per_engine = in_flight / engines
    batch = per_engine
    for _ in range(60):  # samples waiting on prefill or tools do not decode: the batch is their decoding share
        step, detail = decode_step(spec, p, batch, ctx)
        decode = st.response_tokens / st.spec_accept * step
        batch = per_engine * decode / (decode + prefill + st.env_seconds)
    step, detail = decode_step(spec, p, batch, ctx)
    decode = st.response_tokens / st.spec_accept * step
    latency = prefill + decode + st.env_seconds
    if st.mode == "sync":
        waves = math.ceil(samples / in_flight)
        rollout = TimeTerm(
            "rollout",
            waves * latency,
            f"{waves} wave(s) of {in_flight} samples x latency {latency:,.1f} s (prefill + decode + environment)",
        )
    else:
        rollout = TimeTerm(
            "rollout",
            samples * latency / in_flight,
            f"{samples} samples x latency {latency:,.1f} s / {in_flight} in flight (steady state)",
        )
    return [
        TimeTerm(
            "prefill, per sample",
            prefill,
            f"{prefilled:,} tokens x (2 x active + attention) FLOPs / "
            f"(tp{r.tp} x {st.gpu_tflops:g} TFLOP/s x mfu {st.mfu:g})",
        ),
        TimeTerm(
            "decode, per sample",
            decode,
            f"{st.response_tokens:,} tokens / accept {st.spec_accept:g} x {step * 1e3:,.1f} ms a step; "
            f"batch {batch:,.1f} of {per_engine:,.1f} in flight per engine, mean context {ctx:,.0f}: "
            f"{detail} at {st.gpu_hbm_tbs:g} TB/s x mbu {st.mbu:g}",
        ),
        TimeTerm("environment, per sample", st.env_seconds, "step.env_seconds (tools, sandbox)"),
        rollout,
    ]


def _train(spec: ClusterSpec, p: ModelParams) -> TimeTerm:
    """Forward 1 + backward 2 (1 with LoRA: no weight gradients of the base) + 1 recompute with activation
    checkpointing + logprob passes, each 2 x active params + attention FLOPs per token."""
    st, t, m = _step(spec), spec.trainer, spec.model
    per_sample = st.prompt_tokens + st.observation_tokens + st.response_tokens
    tokens = st.prompts * st.group_size * per_sample
    passes = (2 if t.lora_rank else 3) + (1 if t.activation_checkpointing else 0) + st.logprob_passes
    flops = passes * tokens * (2 * p.active + attention_flops(m, per_sample / 2))
    return TimeTerm(
        "train",
        flops / (t.gpus * st.gpu_tflops * 1e12 * st.mfu),
        f"{passes} passes x {tokens:,} tokens x (2 x {p.active / 1e9:.1f}B active + attention) / "
        f"({t.gpus} GPUs x {st.gpu_tflops:g} TFLOP/s x mfu {st.mfu:g})",
    )


def _teacher(spec: ClusterSpec, p: ModelParams) -> TimeTerm | None:
    """A distillation teacher's prefill of every sample, forward only, on the trainer's GPUs (or its own engine's,
    teacher.engine): the checkpoint's active parameters, or the policy's own (a self teacher)."""
    teacher = spec.teacher
    if teacher is None:
        return None
    st, m = _step(spec), teacher.model or spec.model
    active = p.active if teacher.model is None else model_params(m).active
    per_sample = st.prompt_tokens + st.observation_tokens + st.response_tokens
    tokens = st.prompts * st.group_size * per_sample
    flops = tokens * (2 * active + attention_flops(m, per_sample / 2))
    gpus, where = (teacher.gpus, "teacher engine GPUs") if teacher.on_engine else (spec.trainer.gpus, "GPUs")
    return TimeTerm(
        "teacher prefill",
        flops / (gpus * st.gpu_tflops * 1e12 * st.mfu),
        f"1 forward x {tokens:,} tokens x (2 x {active / 1e9:.1f}B active + attention) / "
        f"({gpus} {where} x {st.gpu_tflops:g} TFLOP/s x mfu {st.mfu:g})",
    )


def step_time(
    spec: ClusterSpec, p: ModelParams, kv_tokens_per_gpu: float, sync_seconds: float, problems: list[str]
) -> StepTime:
    """The step's terms and total; a KV cache too small for the samples in flight is added to `problems`."""
    in_flight = _in_flight(spec, kv_tokens_per_gpu, problems)
    terms = _rollout(spec, p, in_flight)
    rollout, train, teacher = terms[-1].seconds, _train(spec, p), _teacher(spec, p)
    sync = TimeTerm("weight sync", sync_seconds, f"sync: {spec.sync}, end to end (the update tables)")
    trained = train.seconds + (teacher.seconds if teacher else 0.0)  # the teacher scores, then the trainer trains
    name = "teacher + train" if teacher else "train"
    if _step(spec).mode == "sync":
        total, formula = rollout + trained + sync_seconds, f"sync: rollout + {name} + weight sync"
    else:
        total = max(rollout, trained + sync_seconds)
        formula = f"async: max(rollout, {name} + weight sync): the next rollout runs meanwhile"
    return StepTime((*terms, *([teacher] if teacher else []), train, sync), total, formula)
