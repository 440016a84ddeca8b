"""Parameter and activation counts of a ModelSpec, linear by linear as Hugging Face lays the weights out."""

from __future__ import annotations

from dataclasses import dataclass

from furlong.cluster.spec import ModelSpec


@dataclass(frozen=True)
class Linear:
    name: str
    inp: int
    out: int
    copies: int = 1  # routed experts: one per expert
    bias: bool = False

    @property
    def params(self) -> int:
        return self.copies * (self.inp * self.out + (self.out if self.bias else 0))


def attention_linears(m: ModelSpec) -> list[Linear]:
    a, h = m.attention, m.hidden
    if a.kind == "gqa":
        q, kv = m.heads * m.hd, m.kv * m.hd
        return [
            Linear("q", h, q, bias=a.qkv_bias),
            Linear("k", h, kv, bias=a.qkv_bias),
            Linear("v", h, kv, bias=a.qkv_bias),
            Linear("o", q, h),
        ]
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    qs = (
        [Linear("q_a", h, a.q_lora_rank), Linear("q_b", a.q_lora_rank, m.heads * qk)]
        if a.q_lora_rank
        else [Linear("q", h, m.heads * qk)]
    )
    out = [
        *qs,
        Linear("kv_a", h, a.kv_lora_rank + a.qk_rope_head_dim),
        Linear("kv_b", a.kv_lora_rank, m.heads * (a.qk_nope_head_dim + a.v_head_dim)),
        Linear("o", m.heads * a.v_head_dim, h),
    ]
    if a.index_heads:  # DSA's lightning indexer reads the q latent
        out += [
            Linear("index_q", a.q_lora_rank or h, a.index_heads * a.index_head_dim),
            Linear("index_k", h, a.index_head_dim),
            Linear("index_w", h, a.index_heads),
        ]
    return out


def attention_norms(m: ModelSpec) -> int:
    a = m.attention
    if a.kind == "gqa":
        return 2 * m.hd if a.qk_norm else 0
    return a.q_lora_rank + a.kv_lora_rank + (2 * a.index_head_dim if a.index_heads else 0)  # indexer: LayerNorm


def mlp_linears(m: ModelSpec, moe_layer: bool) -> list[Linear]:
    """Dense: gate, up, down. MoE: the router, routed experts (copies), shared experts."""
    h = m.hidden
    if not moe_layer:
        return [Linear("gate", h, m.ffn), Linear("up", h, m.ffn), Linear("down", m.ffn, h)]
    e = m.moe
    assert e is not None, "an MoE layer implies the model's moe section"
    out = [
        Linear("router", h, e.experts),
        Linear("expert_gate", h, e.ffn, e.experts),
        Linear("expert_up", h, e.ffn, e.experts),
        Linear("expert_down", e.ffn, h, e.experts),
    ]
    if e.shared_ffn:
        out += [
            Linear("shared_gate", h, e.shared_ffn),
            Linear("shared_up", h, e.shared_ffn),
            Linear("shared_down", e.shared_ffn, h),
        ]
    return out


def is_moe(m: ModelSpec, layer: int) -> bool:
    return m.moe is not None and layer >= m.moe.dense_layers


@dataclass(frozen=True)
class LayerParams:
    dense: int  # everything TP shards or replicates: attention, norms, router, shared experts, dense MLP
    experts: int  # routed experts: EP shards them
    active_experts: int  # of `experts`, what one token uses


def layer_params(m: ModelSpec, layer: int) -> LayerParams:
    moe = is_moe(m, layer)
    linears = attention_linears(m) + mlp_linears(m, moe)
    experts = sum(lin.params for lin in linears if lin.copies > 1)
    dense = sum(lin.params for lin in linears if lin.copies == 1) + attention_norms(m) + 2 * m.hidden
    return LayerParams(dense, experts, experts // m.moe.experts * m.moe.active if moe and m.moe else 0)


@dataclass(frozen=True)
class ModelParams:
    total: int
    active: int
    experts: int
    embedding: int  # input embedding
    head: int  # final norm + lm_head (0 for the head when tied)
    layers: tuple[LayerParams, ...]


def model_params(m: ModelSpec) -> ModelParams:
    """Parameters as `sum(p.numel() for p in model.parameters())` counts them, MTP layers excluded."""
    layers = tuple(layer_params(m, i) for i in range(m.layers))
    embedding, head = m.vocab * m.hidden, m.hidden + (0 if m.tie_embeddings else m.vocab * m.hidden)
    experts = sum(lp.experts for lp in layers)
    total = embedding + head + sum(lp.dense + lp.experts for lp in layers)
    return ModelParams(
        total, total - experts + sum(lp.active_experts for lp in layers), experts, embedding, head, layers
    )


def mtp_params(m: ModelSpec) -> int:
    """One MTP layer (DeepSeek/GLM): a decoder layer plus two norms and a 2h -> h projection; embedding and head
    are shared with the main model."""
    if not m.mtp_layers:
        return 0
    lp = layer_params(m, m.layers - 1)
    return m.mtp_layers * (lp.dense + lp.experts + 3 * m.hidden + 2 * m.hidden * m.hidden)


def activation_elements(m: ModelSpec, layer: int) -> int:
    """Values one token saves for backward in one layer (flash attention: no seq x seq scores; no dropout).

    Attention: its norm's input and output, q, k, v, the attention output (o's input), and for mla the two
    latents. MLP: its norm's input and output, and per MLP applied (each active expert, the shared experts,
    or the dense MLP) its input, gate, up and gate*up."""
    a, h = m.attention, m.hidden
    if a.kind == "gqa":
        attn = 2 * h + 2 * m.heads * m.hd + 2 * m.kv * m.hd + m.heads * m.hd
    else:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        attn = (
            2 * h + a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim + 2 * m.heads * qk + 2 * m.heads * a.v_head_dim
        )
    if not is_moe(m, layer):
        return attn + 2 * h + 3 * m.ffn
    e = m.moe
    assert e is not None, "an MoE layer implies the model's moe section"
    shared = 3 * e.shared_ffn if e.shared_ffn else 0
    return attn + 2 * h + e.active * (h + 3 * e.ffn) + shared


def kv_bytes_per_token(m: ModelSpec, kv_bytes: int, tp: int, dp_attention: bool) -> float:
    """KV cache one token costs one engine GPU: gqa shards kv heads over tp (each GPU keeps at least one);
    mla caches the kv latent and rotary key (plus the indexer's key), which every attention rank keeps."""
    a = m.attention
    if a.kind == "mla":
        per_layer = a.kv_lora_rank + a.qk_rope_head_dim + a.index_head_dim
        return m.layers * per_layer * kv_bytes
    shards = 1 if dp_attention else min(tp, m.kv)
    return m.layers * 2 * m.kv * m.hd * kv_bytes / shards


def lora_params(m: ModelSpec, rank: int, targets: tuple[str, ...]) -> int:
    """r x (in + out) per targeted linear; `mlp` is the dense MLP and shared experts, `experts` the routed."""
    total = 0
    for i in range(m.layers):
        groups = {"attention": attention_linears(m), "mlp": [], "experts": []}
        for lin in mlp_linears(m, is_moe(m, i)):
            if lin.name != "router":
                groups["experts" if lin.copies > 1 else "mlp"].append(lin)
        total += sum(rank * (lin.inp + lin.out) * lin.copies for t in targets for lin in groups[t])
    return total
