"""Tiny random-initialised variants of real model families, built offline from transformers' config classes.

Each family keeps what makes its architecture its own (attention type, rope scaling, norm placement, MoE
routing, tied or untied embeddings) at a toy size: two or three layers, hidden size 64, a handful of experts.
Its tokenizer is a small byte-level BPE with the family's control tokens as single ids and the family's
published chat template (furlong/model/templates/, each file naming its source), so the agent loop, the
tool-call parser and the trainer see what they would see with a real checkpoint of that family. The weights
are random: these models test plumbing (parity, weight sync, LoRA, export), never learning.

`init_family(name)` builds one into the cache as `init_tiny` does (content-addressed, atomic rename).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig, PreTrainedTokenizerFast

from furlong.model.corpus import generate_corpus
from furlong.model.families_configs import CONFIGS
from furlong.model.tiny import _portable_tokenizer_class, build_once, cache_root
from furlong.model.tokenizer import train_bpe

FORMAT_VERSION = 1
MARKER = "furlong_family.json"
TEMPLATES = Path(__file__).parent / "templates"
VOCAB = 2048  # BPE merges; the family's control tokens are added on top


@dataclass(frozen=True)
class Family:
    """One family: its config builder, template, control tokens and where LoRA goes."""

    name: str
    config: Callable[[int, dict[str, int | None]], PretrainedConfig]  # (vocab size, token ids) -> config
    template: str  # file in furlong/model/templates/
    tool_format: str | None  # furlong's parser for the template's calls; None: furlong has none yet
    special: tuple[str, ...]  # control tokens (single ids, dropped by skip_special_tokens)
    bos: str | None
    eos: tuple[str, ...]  # the first is the tokenizer's eos; all stop generation (generation_config)
    pad: str
    lora_targets: tuple[str, ...]  # the family's attention / dense projections (PEFT module names)
    keeps: str  # what the tiny variant keeps from the real config (docs/models.md's table)
    markup: tuple[str, ...] = ()  # single ids kept in decoded text (tool-call tags)


QWEN_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA3 = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|finetune_right_pad_id|>",
)
GEMMA = ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>")
HARMONY = ("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>")
HARMONY_CALL = "<|call|>"
DEEPSEEK = tuple(
    f"<｜{t}｜>"  # noqa: RUF001  # DeepSeek's control tokens are written with fullwidth bars
    for t in (
        "begin▁of▁sentence",
        "end▁of▁sentence",
        "▁pad▁",
        "User",
        "Assistant",
        "tool▁calls▁begin",
        "tool▁calls▁end",
        "tool▁call▁begin",
        "tool▁call▁end",
        "tool▁sep",
        "tool▁outputs▁begin",
        "tool▁outputs▁end",
        "tool▁output▁begin",
        "tool▁output▁end",
    )
) + ("<think>", "</think>")  # DeepSeek-V3.1's tokenizer has these as tokens too: its template writes </think>
GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3",
            CONFIGS["qwen3"],
            "qwen3.jinja",
            "hermes",
            (),
            None,
            ("<|im_end|>", "<|endoftext|>"),
            "<|endoftext|>",
            QWEN_ATTENTION,
            "GQA, q/k RMSNorm, rope theta 1e6, tied embeddings (as Qwen3-0.6B to 4B), SwiGLU",
        ),
        Family(
            "qwen3_moe",
            CONFIGS["qwen3_moe"],
            "qwen3.jinja",
            "hermes",
            (),
            None,
            ("<|im_end|>", "<|endoftext|>"),
            "<|endoftext|>",
            QWEN_ATTENTION,
            "Qwen3 attention; every layer sparse: 8 experts, top-2, normalised top-k (Qwen3-30B-A3B: 128, top-8); "
            "untied embeddings",
        ),
        Family(
            "llama3",
            CONFIGS["llama3"],
            "llama3_json.jinja",
            "llama3_json",
            LLAMA3,
            "<|begin_of_text|>",
            ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
            "<|finetune_right_pad_id|>",
            QWEN_ATTENTION,
            "GQA, rope theta 5e5 with llama3 rope scaling (factor 8, low/high freq 1/4, original 8192), untied "
            "embeddings (Llama 3.1 8B)",
        ),
        Family(
            "gemma3",
            CONFIGS["gemma3"],
            "gemma3.jinja",
            "pythonic",
            GEMMA,
            "<bos>",
            ("<end_of_turn>", "<eos>"),
            "<pad>",
            QWEN_ATTENTION,
            "sliding-window and global layers (window 16 here), local/global rope (1e4 / 1e6 with linear factor 8), "
            "q/k norm, pre- and post-norms, sqrt(hidden) embedding scale, GeGLU, tied embeddings",
        ),
        Family(
            "gpt_oss",
            CONFIGS["gpt_oss"],
            "gpt_oss.jinja",
            "harmony",
            (*HARMONY, HARMONY_CALL),
            "<|startoftext|>",
            ("<|return|>", HARMONY_CALL, "<|endoftext|>"),
            "<|endoftext|>",
            QWEN_ATTENTION,
            "alternating sliding (window 16 here) / full attention with learned sinks, attention bias, yarn rope "
            "(factor 32), 4 experts top-2 with the clamped SwiGLU, untied embeddings",
        ),
        Family(
            "deepseek_v3",
            CONFIGS["deepseek_v3"],
            "deepseek_v3.jinja",
            "deepseek_v3",
            DEEPSEEK,
            DEEPSEEK[0],
            (DEEPSEEK[1],),
            DEEPSEEK[2],
            ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
            "MLA (q and kv low-rank, decoupled rope dims), yarn rope (factor 40, mscale), first layer dense then "
            "MoE: 8 routed experts top-2 in 2 groups + 1 shared, sigmoid routing with score-correction bias, "
            "untied embeddings",
        ),
        Family(
            "glm4_moe",
            CONFIGS["glm4_moe"],
            "glm4_5.jinja",
            "glm45",
            GLM,
            None,
            ("<|endoftext|>", "<|user|>", "<|observation|>"),
            "<|endoftext|>",
            QWEN_ATTENTION,
            "GQA with attention bias and q/k norm, partial rotary (half the head), first layer dense then MoE: "
            "8 routed experts top-2 + 1 shared, sigmoid routing, untied embeddings",
            markup=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        ),
    )
}


def family(name: str) -> Family:
    """The family `name`; a ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}: expected tiny or one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def fingerprint(fam: Family, seed: int) -> dict[str, Any]:
    template = (TEMPLATES / fam.template).read_bytes()
    return {
        "format": FORMAT_VERSION,
        "family": fam.name,
        "seed": seed,
        "template_sha256": hashlib.sha256(template).hexdigest()[:16],
    }


def init_family(name: str, out_dir: Path | str | None = None, seed: int = 0) -> Path:
    """Build (or reuse) family `name`'s tiny checkpoint; returns its directory (default: the model cache)."""
    fam = family(name)
    stamp = fingerprint(fam, seed)
    digest = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(out_dir) if out_dir is not None else cache_root() / "models" / f"{name}-{digest}"
    return build_once(out, stamp, lambda tmp: _build(tmp, fam, seed), MARKER)


@functools.cache
def _bpe(seed: int) -> str:
    """One small BPE per process, shared by every family (as JSON: each family adds its own tokens)."""
    return train_bpe(generate_corpus(seed, 1500, 200_000), VOCAB).to_str()


def family_tokenizer(fam: Family, seed: int = 0) -> PreTrainedTokenizerFast:
    tok = Tokenizer.from_str(_bpe(seed))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in fam.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.markup])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos,
        eos_token=fam.eos[0],
        pad_token=fam.pad,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = (TEMPLATES / fam.template).read_text()
    return fast


def _build(out: Path, fam: Family, seed: int) -> None:
    tokenizer = family_tokenizer(fam, seed)
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in (*fam.eos, fam.pad, *([fam.bos] if fam.bos else []))}  # type: ignore[arg-type]
    eos, pad = [ids[t] for t in fam.eos], ids[fam.pad]
    bos = ids[fam.bos] if fam.bos else None
    config = fam.config(len(tokenizer), {"bos": bos, "eos": eos[0], "pad": pad})
    torch.manual_seed(seed)  # initialisation is the only randomness
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=bos)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out / "tokenizer_config.json")
