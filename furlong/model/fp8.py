"""FP8 (e4m3) rollout weights: the quantizer, the engine's FP8 linear and the trainer's fake-quantized one.

Only the 2-D Linear weights of the decoder layers are quantized (attention and MLP projections); embeddings,
norms, lm_head and MoE router gates keep their dtype, as the FP8 checkpoints engines load do. A weight W of
shape (out, in) becomes `weight` (torch.float8_e4m3fn) and a float32 scale, with W ~= weight * scale:

* per output channel (block=None): `weight_scale` of shape (out, 1), the compressed-tensors / vLLM "fp8"
  channel layout;
* 128x128 blocks (block=128): `weight_scale_inv` of shape (ceil(out/128), ceil(in/128)), the layout of
  transformers' FineGrainedFP8 (`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`)
  and DeepSeek-V3 checkpoints (despite the name it multiplies, as theirs does); save_fp8 writes one that
  transformers loads.

scale = amax / 448 (448: e4m3's largest finite value), so every scaled value is in range and the cast only
rounds. An all-zero row or block gets scale 1 (its values are exactly 0 either way).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import nn

if TYPE_CHECKING:  # transformers takes seconds to import; furlong.sync (which imports this) does without it
    from transformers import PreTrainedModel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
# MoE router gates pick experts: a rounding there changes routes, so they stay in full precision (as vLLM's do)
_UNQUANTIZED_LEAVES = frozenset({"gate", "router", "lm_head", "score"})


@dataclass(frozen=True)
class Fp8Spec:
    """Which weights are quantized (their names, e.g. `model.layers.0.self_attn.q_proj.weight`) and how:
    `block` None: one scale per output channel; an int: one per block x block tile."""

    weights: frozenset[str]
    block: int | None = None

    def scale_name(self, weight_name: str) -> str:
        return weight_name + ("_scale" if self.block is None else "_scale_inv")

    def tensor_names(self) -> list[str]:
        """Every tensor of the quantized weights: each e4m3 weight and its scale."""
        return sorted([*self.weights, *map(self.scale_name, self.weights)])

    def quantization_config(self) -> dict:
        """The `quantization_config` of an HF config.json for a checkpoint in this layout (block scales only:
        transformers' FineGrainedFP8 reads no per-channel scales)."""
        if self.block is None:
            raise ValueError("an HF fp8 checkpoint needs block scales (train.sync.fp8_block, e.g. 128)")
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [self.block, self.block]}


def fp8_targets(model: nn.Module, block: int | None = None) -> Fp8Spec:
    """The spec quantizing `model`'s decoder-layer nn.Linear weights (see the module doc)."""
    names = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear | Fp8Linear) and ".layers." in f".{name}" and leaf not in _UNQUANTIZED_LEAVES:
            names.append(f"{name}.weight")
    if not names:
        raise ValueError(f"{type(model).__name__} has no decoder-layer Linear weights to quantize to fp8")
    if block is not None and block < 1:
        raise ValueError(f"fp8 block size must be >= 1, got {block}")
    return Fp8Spec(frozenset(names), block)


def _blocked_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = torch.zeros(rows * block, cols * block, dtype=w.dtype, device=w.device)
    padded[:out, :inp] = w.abs()
    return padded.reshape(rows, block, cols, block).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, shape: torch.Size, block: int | None) -> torch.Tensor:
    """The scale broadcast to every element of a weight of `shape`."""
    if block is None:
        return scale
    out, inp = shape
    return scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :inp]


def quantize(w: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) of a 2-D weight; dequantize(*quantize(w)) ~= w within e4m3's rounding."""
    if w.dim() != 2:
        raise ValueError(f"fp8 quantizes 2-D Linear weights, got shape {tuple(w.shape)}")
    w = w.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if block is None else _blocked_amax(w, block)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, w.shape, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The float32 weight an engine computes with."""
    return q.float() * _expand(scale, q.shape, block)


def quantize_state(state: Mapping[str, torch.Tensor], spec: Fp8Spec) -> dict[str, torch.Tensor]:
    """`state` with each of spec's weights replaced by its e4m3 tensor and scale (other tensors as given)."""
    missing = sorted(spec.weights - state.keys())
    if missing:
        raise ValueError(f"fp8: weights {missing[:3]} (of {len(missing)}) are not in the state dict")
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name in spec.weights:
            out[name], out[spec.scale_name(name)] = quantize(t, spec.block)
        else:
            out[name] = t
    return out


def save_fp8(model: PreTrainedModel, spec: Fp8Spec, out: Path) -> Path:
    """`model` (plain Linears) saved as an HF checkpoint of its fp8 weights: the e4m3 tensors and scales in
    model.safetensors and spec's quantization_config in config.json, which transformers loads (dequantized
    on a CPU, as FP8 on a GPU that has it)."""
    config = spec.quantization_config()
    model.save_pretrained(out)  # config.json, generation_config.json; its weights are replaced below
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    state = quantize_state(model.state_dict(), spec)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # stored once, as the embedding
    save_file({k: v.detach().contiguous() for k, v in state.items()}, out / "model.safetensors", {"format": "pt"})
    meta = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**meta, "quantization_config": config}, indent=2) + "\n")
    return out


def is_quantized(name: str, t: torch.Tensor) -> bool:
    """Whether a tensor is part of an fp8 weight (the e4m3 tensor or its scale): it keeps its dtype on the
    way to the engine, since the weight is exact only against its own scale."""
    return t.dtype == FP8 or name.endswith(SCALE_SUFFIXES)


class Fp8Linear(nn.Module):
    """The engine's Linear over an e4m3 weight and its scale, dequantized in each forward (a CPU has no FP8
    matmul). Its state dict holds `weight` and `weight_scale` (or `weight_scale_inv`), so published updates
    load into it by name."""

    weight: torch.Tensor

    def __init__(self, linear: nn.Linear, block: int | None) -> None:
        super().__init__()
        self.block = block
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize(linear.weight, block)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale" if block is None else "weight_scale_inv", scale)
        self.bias = linear.bias

    @property
    def scale(self) -> torch.Tensor:
        return self.get_buffer("weight_scale" if self.block is None else "weight_scale_inv")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize(self.weight, self.scale, self.block).to(x.dtype)
        return nn.functional.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class _FakeQuant(torch.autograd.Function):
    """quantize-dequantize forward, identity backward (straight-through): the loss sees the engine's
    weights, the gradient reaches the full-precision master weight."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, block: int | None) -> torch.Tensor:
        return dequantize(*quantize(w, block), block).to(w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FakeQuantLinear(nn.Linear):
    """The trainer's Linear computing with the fp8-rounded weight (see _FakeQuant); its parameters and state
    dict are nn.Linear's, so checkpoints and published weights are unchanged."""

    fp8_block: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, _FakeQuant.apply(self.weight, self.fp8_block), self.bias)


def _module_of(model: nn.Module, weight_name: str) -> tuple[nn.Module, str, nn.Module]:
    path = weight_name.removesuffix(".weight")
    parent_name, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return parent, leaf, getattr(parent, leaf)


def to_fp8_engine(model: nn.Module, spec: Fp8Spec) -> nn.Module:
    """`model` (in place) with each of spec's Linears replaced by an Fp8Linear quantized from its weight."""
    for name in sorted(spec.weights):
        parent, leaf, linear = _module_of(model, name)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"fp8 engine weights replace nn.Linear modules; {name} is {type(linear).__name__}")
        setattr(parent, leaf, Fp8Linear(linear, spec.block))
    return model


def fake_quantize(model: nn.Module, spec: Fp8Spec) -> nn.Module:
    """`model` (in place) with spec's Linears computing through their fp8-rounded weights (FakeQuantLinear;
    the same parameters, so the optimizer and the state dict see no change)."""
    for name in spec.weights:
        _, _, linear = _module_of(model, name)
        if type(linear) is not nn.Linear:
            raise TypeError(f"fp8 fake quantization wraps plain nn.Linear modules; {name} is {type(linear).__name__}")
        linear.__class__ = FakeQuantLinear
        linear.fp8_block = spec.block  # type: ignore[assignment]
    return model
