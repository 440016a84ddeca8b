"""The embedded default model: a few-million-parameter Qwen3 built offline, in seconds, and cached on disk."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from furlong.model.corpus import generate_corpus
from furlong.model.tokenizer import END_OF_TEXT, IM_END, train_bpe, wrap_for_transformers

# Bump when the recipe changes in a way the spec fields do not capture, so old caches are not reused.
FORMAT_VERSION = 2
MARKER = "furlong_tiny.json"


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 16384
    corpus_samples: int = 6000  # synthetic documents for tokenizer training
    stdlib_bytes: int = 1_500_000  # Python stdlib source mixed into the tokenizer corpus


def cache_root() -> Path:
    """$FURLONG_CACHE (as for images and tasks), else $FURLONG_CACHE_DIR, else $XDG_CACHE_HOME/furlong,
    else ~/.cache/furlong. Models need no sandbox access, so they stay in the user's cache even as root."""
    if env := os.environ.get("FURLONG_CACHE") or os.environ.get("FURLONG_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "furlong"


def spec_fingerprint(spec: TinySpec, seed: int) -> dict:
    # The stdlib corpus depends on the interpreter version, so it is part of the identity.
    return {
        "format": FORMAT_VERSION,
        "seed": seed,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        **asdict(spec),
    }


def spec_hash(spec: TinySpec, seed: int) -> str:
    blob = json.dumps(spec_fingerprint(spec, seed), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def init_tiny(out_dir: Path | str | None = None, seed: int = 0, spec: TinySpec | None = None, **overrides: int) -> Path:
    """Build (or reuse) the tiny checkpoint and return its directory.

    `overrides` replace TinySpec fields (e.g. `num_layers=2`). The default directory is
    `<cache_root>/models/tiny-<hash of spec and seed>`. An existing directory built from the same spec and
    seed is returned as is; one built from a different spec is an error rather than silently reused.
    """
    spec = replace(spec or TinySpec(), **overrides)
    out = Path(out_dir) if out_dir is not None else cache_root() / "models" / f"tiny-{spec_hash(spec, seed)}"
    return build_once(out, spec_fingerprint(spec, seed), lambda tmp: _build(tmp, spec, seed), MARKER)


def build_once(out: Path, fingerprint: dict, build: Callable[[Path], None], marker: str) -> Path:
    """`out`, built by `build(tmp)` unless it exists: the `marker` file records `fingerprint`, and an existing
    directory with another fingerprint (or none) is an error rather than silently reused."""
    if out.exists():
        return _check_existing(out, fingerprint, marker)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename into place: readers never see a half-written checkpoint.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build(tmp)
        (tmp / marker).write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.exists():
                raise
            return _check_existing(out, fingerprint, marker)  # a concurrent builder won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_existing(out: Path, fingerprint: dict, marker: str) -> Path:
    path = out / marker
    if not path.is_file():
        raise FileExistsError(
            f"{out} exists but is not a furlong model built here (no {marker}); remove it or pick another directory"
        )
    found = json.loads(path.read_text())
    if found != fingerprint:
        raise FileExistsError(f"{out} holds a model built from a different spec: {found} != {fingerprint}")
    return out


def _build(out: Path, spec: TinySpec, seed: int) -> None:
    tok = train_bpe(generate_corpus(seed, spec.corpus_samples, spec.stdlib_bytes), spec.vocab_size)
    tokenizer = wrap_for_transformers(tok)
    eos_id, pad_id = (int(tokenizer.convert_tokens_to_ids(t)) for t in (IM_END, END_OF_TEXT))  # type: ignore[arg-type]
    model = build_model(spec, seed, len(tokenizer), eos_id=eos_id, pad_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _portable_tokenizer_class(out / "tokenizer_config.json")


def _portable_tokenizer_class(config_path: Path) -> None:
    """transformers 5 writes its own class name (TokenizersBackend), which 4.x cannot resolve; the 4.x name
    PreTrainedTokenizerFast loads the same tokenizer.json in both (and is never replaced by Qwen2Tokenizer)."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_model(spec: TinySpec, seed: int, vocab_size: int, eos_id: int, pad_id: int) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 whose vocabulary is exactly the tokenizer's (so every id decodes)."""
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)  # initialisation is the only randomness
    model = Qwen3ForCausalLM(config).float().eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None)
    return model
