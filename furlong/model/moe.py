"""MoE routing: record the experts a forward chose, replay them in another forward, and the routers' own losses.

Routing replay ("R3": Miles, verl) makes the trainer's forward use the experts the rollout engine chose for
each token. Without it, engine and trainer numerics (bf16 against fp32, another kernel) can pick a different
top-k for a token near a tie, and that token's expert outputs, and every later token that attends to it, differ
by far more than rounding: the importance ratio then measures routing noise, not the policy.

Every MoE family furlong builds (furlong.model.families) has, in transformers 5.x, a router module returning
`(router_logits, top_k_weights, top_k_indices)` over the layer's tokens flattened to [tokens, ...], which the
layer hands to its experts. `RouteHooks` puts a forward hook on each router: recording keeps the indices;
replay returns the recorded indices instead, with weights computed from *this* forward's router logits over
those experts (the family's own scoring function, `_WEIGHTS`), so the router still gets gradients.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

UNKNOWN = -1  # a route entry no forward recorded (a prefix-cached token, a pad, the last sampled token)


def _softmax_topk(router: Any, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE: softmax over every expert, the chosen ones' probabilities, renormalised if norm_topk_prob."""
    weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, idx)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _softmax_of_chosen(router: Any, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """GPT-OSS: softmax over the chosen experts' logits alone."""
    return torch.softmax(logits.gather(1, idx), dim=1, dtype=logits.dtype)


def _sigmoid(router: Any, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3, GLM-4.5: sigmoid scores of the chosen experts (the score-correction bias and the group limit
    only choose; they never weigh), renormalised, times the routed scaling factor."""
    weights = logits.sigmoid().gather(1, idx)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# Router class name -> its top-k weights from (router, its logits, chosen indices), as the class computes them.
_WEIGHTS: dict[str, Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_topk,
    "GptOssTopKRouter": _softmax_of_chosen,
    "DeepseekV3TopkRouter": _sigmoid,
    "Glm4MoeTopkRouter": _sigmoid,
}
ROUTED_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe")  # the furlong families _WEIGHTS covers


def replay_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The top-k weights `router` gives experts `idx` ([tokens, top_k]) from its `logits`, as its own forward does."""
    return _WEIGHTS[type(router).__name__](router, logits, idx)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order ([] for a dense model or an architecture furlong has no
    replay for)."""
    return [m for m in model.modules() if type(m).__name__ in _WEIGHTS]


def is_moe(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    experts = [getattr(config, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts")]
    return any(isinstance(n, int) and n > 1 for n in experts) or bool(moe_routers(model))


@dataclass(frozen=True)
class RouteShape:
    """What a model's routes look like: per token, `layers` rows of `top_k` expert indices in [0, experts)."""

    layers: int
    top_k: int
    experts: int


def route_shape(model: nn.Module) -> RouteShape:
    routers = moe_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE router furlong can record or replay")
    return route_shape_of(routers)


def route_shape_of(routers: list[nn.Module]) -> RouteShape:
    first: Any = routers[0]  # every router of a model has the same top_k and experts
    return RouteShape(len(routers), int(first.top_k), int(first.num_experts))


@dataclass
class _Matches:
    """Top-k agreement between this forward's own routers and the forced routes, on tokens with a route."""

    differ: list[torch.Tensor]  # per router call: [tokens] bool, True where the own top-k set differs
    known: list[torch.Tensor]  # per router call: [tokens] bool, True where a route was forced


class RouteHooks:
    """Forward hooks on a model's routers, removed on close (a context manager). Recording: `take()` returns
    the indices every router chose since the last take, [tokens, layers, top_k] int16 (one forward's tokens in
    its flattened batch order, several forwards concatenated). Replay: `forcing(routes)` for the next forward."""

    def __init__(self, model: nn.Module, record: bool = False, keep_logits: bool = False) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router furlong can record or replay")
        self.record = record
        self.keep_logits = keep_logits  # inside forcing(): the load-balancing loss reads them (with their graph)
        self.logits: list[torch.Tensor] = []
        self._chosen: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._forced: torch.Tensor | None = None
        self._apply = True
        self._inside = False  # in forcing(): other forwards of the model (a teacher's scoring) keep no logits
        self.matches = _Matches([], [])
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> RouteHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            logits, weights, chosen = output
            if self.record:
                self._chosen[layer].append(chosen.detach().to(torch.int16))
            if self.keep_logits and self._inside:
                self.logits.append(logits)
            if self._forced is None:
                return None
            return self._replace(module, layer, logits, weights, chosen)

        return hook

    def _replace(
        self, module: nn.Module, layer: int, logits: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor
    ) -> tuple:
        assert self._forced is not None
        if self._forced.shape[0] != chosen.shape[0] or self._forced.shape[2] != chosen.shape[1]:
            raise ValueError(
                f"routing replay: the routes hold {tuple(self._forced.shape)} (tokens, layers, top_k) but router "
                f"{layer} routes {tuple(chosen.shape)} (tokens, top_k)"
            )
        forced = self._forced[:, layer].to(device=chosen.device, dtype=torch.long)
        known = (forced >= 0).all(dim=-1)
        with torch.no_grad():
            same = (forced.sort(dim=-1).values == chosen.sort(dim=-1).values).all(dim=-1)
            self.matches.differ.append((~same & known).cpu())
            self.matches.known.append(known.cpu())
        if not self._apply:
            return logits, weights, chosen
        idx = torch.where(known[:, None], forced, chosen)
        return logits, replay_weights(module, logits, idx), idx

    @contextmanager
    def forcing(self, routes: torch.Tensor | None, apply: bool = True) -> Iterator[None]:
        """Forwards inside use `routes` ([tokens, layers, top_k] in the forward's flattened order; UNKNOWN
        rows keep the router's own choice) and count where the routers' own choice differed (`mismatch`).
        `apply` False: only count. None: the routers choose, as without hooks."""
        self._forced, self._apply, self._inside = routes, apply, True
        try:
            yield
        finally:
            self._forced, self._apply, self._inside = None, True, False

    def take(self) -> torch.Tensor:
        """[tokens, layers, top_k] int16 of what the routers chose since the last take (CPU)."""
        if not self._chosen[0]:
            return torch.empty(0, len(self.routers), route_shape_of(self.routers).top_k, dtype=torch.int16)
        out = torch.stack([torch.cat(calls) for calls in self._chosen], dim=1).cpu()
        self._chosen = [[] for _ in self.routers]
        return out

    def mismatch(self) -> tuple[int, int, int]:
        """(token-layer pairs whose own top-k differed from the forced one, tokens with any such layer, tokens
        compared) since the last call; resets."""
        m, self.matches = self.matches, _Matches([], [])
        if not m.known:
            return 0, 0, 0
        n = len(self.routers)
        differ = [torch.stack(m.differ[i : i + n], dim=1) for i in range(0, len(m.differ), n)]
        known = [torch.stack(m.known[i : i + n], dim=1) for i in range(0, len(m.known), n)]
        pairs = sum(int(d.sum()) for d in differ)
        tokens = sum(int(d.any(dim=1).sum()) for d in differ)
        return pairs, tokens, sum(int(k.all(dim=1).sum()) for k in known)


def expert_load(routes: list[torch.Tensor], experts: int) -> dict[str, float]:
    """Expert utilisation from recorded routes ([tokens, layers, top_k] each, UNKNOWN rows skipped): per MoE
    layer, the busiest expert's share over the mean share (1 = perfectly even, `experts` = one expert takes
    every token) and the entropy of the expert counts over log(experts) (1 = even); both averaged over layers."""
    known = [r[(r >= 0).all(dim=-1).all(dim=-1)] for r in routes if r.numel()]
    rows = torch.cat(known) if known else torch.empty(0)
    if not rows.numel():
        return {}
    counts = torch.stack(
        [torch.bincount(rows[:, layer].reshape(-1).long(), minlength=experts) for layer in range(rows.shape[1])]
    ).double()
    share = counts / counts.sum(dim=1, keepdim=True)
    entropy = -(share * share.clamp(min=1e-30).log()).sum(dim=1) / math.log(experts)
    return {
        "moe_load_max_ratio": float((share.max(dim=1).values * experts).mean()),
        "moe_load_entropy": float(entropy.mean()),
    }


def load_balancing_loss(
    routers: list[nn.Module], logits: list[torch.Tensor], attention_mask: torch.Tensor | None
) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss transformers' MoE models add with output_router_logits (the
    model's own `load_balancing_loss_func`, unscaled: the caller weighs it), over `routers`' logits of one
    forward (every router's, in layer order)."""
    module = sys.modules[type(routers[0]).__module__]
    func = getattr(module, "load_balancing_loss_func", None)
    if func is None:
        raise ValueError(
            f"{type(routers[0]).__name__}: transformers has no load-balancing loss for this router (sigmoid "
            "routers balance with their score-correction bias); set train.moe.aux_loss_coef to 0"
        )
    shape = route_shape_of(routers)
    return func(tuple(logits), shape.experts, shape.top_k, attention_mask)


def merge_routes(old: torch.Tensor | None, new: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """An episode's routes after another generation: `new` (a Generation's, over the episode's first
    len(new) tokens) where it recorded a route, `old` elsewhere, padded with UNKNOWN to `length` tokens."""
    if new is None and old is None:
        return None
    template = new if new is not None else old
    assert template is not None
    out = torch.full((length, *template.shape[1:]), UNKNOWN, dtype=torch.int16)
    for part in (old, new):
        if part is not None:
            part = part[:length]
            known = (part >= 0).all(dim=-1).all(dim=-1)
            out[: len(part)][known] = part[known]
    return out
