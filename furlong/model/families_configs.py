"""The transformers configs of the tiny family variants (furlong.model.families): the real family's settings
that shape the computation, at a toy size. Every size below is the tiny one; a comment names the real value
where the tiny one differs in kind (a window short enough that test episodes cross it, fewer experts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import (
    DeepseekV3Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    PretrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

Ids = dict[str, int | None]  # bos, eos, pad
# Shared toy sizes: 4 query heads of 32 over 2 KV heads (GQA in every family that has it). vLLM's CPU attention
# has kernels for head sizes 32, 64, ... but not 16.
SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
}
WINDOW = 16  # sliding window: real ones are 128 (GPT-OSS) to 4096 (Gemma 3); episodes here are longer than 16


def _tokens(vocab: int, ids: Ids) -> dict[str, Any]:
    return {"vocab_size": vocab, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}


def qwen3(vocab: int, ids: Ids) -> PretrainedConfig:
    return Qwen3Config(
        **SMALL,
        **_tokens(vocab, ids),
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    )


def qwen3_moe(vocab: int, ids: Ids) -> PretrainedConfig:
    return Qwen3MoeConfig(
        **SMALL,
        **_tokens(vocab, ids),
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    )


def llama3(vocab: int, ids: Ids) -> PretrainedConfig:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # Llama 3.1's
    return LlamaConfig(
        **SMALL,
        **_tokens(vocab, ids),
        num_hidden_layers=2,
        rope_parameters=rope,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        hidden_act="silu",
    )


def gemma3(vocab: int, ids: Ids) -> PretrainedConfig:
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }  # Gemma 3 4B and up
    return Gemma3TextConfig(
        **SMALL,
        **_tokens(vocab, ids),
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        rope_parameters=rope,
        query_pre_attn_scalar=32,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
    )


def gpt_oss(vocab: int, ids: Ids) -> PretrainedConfig:
    rope = {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    }
    sizes = {k: v for k, v in SMALL.items() if k != "intermediate_size"}
    return GptOssConfig(
        **sizes,
        **_tokens(vocab, ids),
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        rope_parameters=rope,
        max_position_embeddings=131072,
        attention_bias=True,
        tie_word_embeddings=False,
    )


def deepseek_v3(vocab: int, ids: Ids) -> PretrainedConfig:
    rope = {
        "rope_type": "yarn",
        "factor": 40.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000.0,
    }
    return DeepseekV3Config(
        **_tokens(vocab, ids),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=24,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters=rope,
        max_position_embeddings=163840,
        tie_word_embeddings=False,
    )


def glm4_moe(vocab: int, ids: Ids) -> PretrainedConfig:
    return Glm4MoeConfig(
        **SMALL,
        **_tokens(vocab, ids),
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )


CONFIGS: dict[str, Callable[[int, Ids], PretrainedConfig]] = {
    f.__name__: f for f in (qwen3, qwen3_moe, llama3, gemma3, gpt_oss, deepseek_v3, glm4_moe)
}
