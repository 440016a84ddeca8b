"""Expert parallelism for the FSDP2 trainer (`train.fsdp2.expert_parallel`): an MoE layer's experts split by
expert over the `ep` dimension of a (dp, ep) device mesh.

Routing stays replicated: the ranks of one ep group see the same tokens, so each router (and routing replay,
furlong.train.routing, whose hooks sit on the router) picks the same top-k on each. Each rank holds
num_experts/ep experts (a contiguous block) and computes only their weighted outputs for the tokens routed to
them; a forward all-reduce over ep sums the blocks' outputs into the layer's. This is the Megatron
tensor-parallel pair of collectives: the experts' output is summed over ep in the forward and passed through in
the backward (every rank's loss is the same one, not a share of a sum), and the experts' inputs (hidden states,
routing weights) pass through in the forward and have their gradients summed over ep in the backward (each rank
has only its experts' part of them). So every rank of an ep group holds the same gradients for the dense
weights, and the gradients of an expert's weights stay on its owner.

A token's route to another rank's expert becomes the index num_experts here (transformers' placeholder for a
token routed elsewhere), which its grouped_mm and batched_mm experts implementations skip under
`_is_expert_parallel`, as does the eager forward of the classes in EAGER_SPLITTABLE.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

KEY = "train.fsdp2.expert_parallel"
# transformers 5.x experts classes (fused 3-D weights) whose eager forward skips the num_experts placeholder;
# the grouped_mm and batched_mm implementations skip it in any class once its _is_expert_parallel is set.
EAGER_SPLITTABLE = ("Qwen3MoeExperts", "DeepseekV3Experts", "Glm4MoeExperts")


class _SumOut(torch.autograd.Function):
    """Forward: the sum over `group`; backward: the gradient as it is (every rank's downstream is the same)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumGradsIn(torch.autograd.Function):
    """Forward: (hidden, weights) as they are; backward: their gradients summed over `group` (each rank's cover
    its experts), in one all-reduce, so the ranks' collectives pair up whatever experts each one hit."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weights: torch.Tensor, group: dist.ProcessGroup
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.group = group
        return hidden.view_as(hidden), weights.view_as(weights)

    @staticmethod
    def backward(ctx: Any, gh: torch.Tensor, gw: torch.Tensor) -> tuple[Any, ...]:
        flat = torch.cat([gh.reshape(-1).float(), gw.reshape(-1).float()])  # an unused output's gradient: zeros
        dist.all_reduce(flat, group=ctx.group)
        return flat[: gh.numel()].view_as(gh).to(gh.dtype), flat[gh.numel() :].view_as(gw).to(gw.dtype), None


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's experts modules: an int `num_experts` beside 3-D weights whose first dimension it is."""
    out = []
    for name, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if isinstance(n, int) and any(p.dim() == 3 and p.shape[0] == n for p in own):
            out.append((name, module))
    return out


def check_split(model: nn.Module, ep: int) -> int:
    """The experts each rank holds under expert_parallel `ep`; a clear error when the model cannot be split so."""
    found = experts_modules(model)
    name = type(model).__name__
    if not found:
        raise ValueError(f"{KEY}={ep}: {name} has no fused MoE experts to split (a dense model: use 1)")
    counts = []
    for path, module in found:
        kind = type(module).__name__
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None) or "eager"
        if not hasattr(module, "_is_expert_parallel") or (impl == "eager" and kind not in EAGER_SPLITTABLE):
            raise ValueError(
                f"{KEY}={ep}: {path} is a {kind} running the {impl!r} experts implementation; furlong splits "
                f"transformers' grouped_mm and batched_mm ones, and the eager one of {', '.join(EAGER_SPLITTABLE)}"
            )
        experts = int(cast(int, module.num_experts))
        if experts % ep:
            raise ValueError(f"{KEY}={ep} must divide the number of experts ({experts} in {path})")
        counts.append(experts // ep)
    return counts[0]


def split_experts(model: nn.Module, ep: int, ep_rank: int, group: dist.ProcessGroup) -> tuple[str, ...]:
    """Keep experts [ep_rank * n, (ep_rank + 1) * n) of every experts module (n = num_experts / ep), in place,
    and route their forwards through the ep group. Returns the split parameters' names (as in `model`)."""
    n = check_split(model, ep)
    names = []
    for path, module in experts_modules(model):
        total = cast(Any, module).num_experts
        for pname, p in list(module.named_parameters(recurse=False)):
            if p.dim() >= 1 and p.shape[0] == total:
                local = p.detach()[ep_rank * n : (ep_rank + 1) * n].clone()
                setattr(module, pname, nn.Parameter(local, requires_grad=p.requires_grad))
                names.append(f"{path}.{pname}" if path else pname)
        cast(Any, module).num_experts = n
        cast(
            Any, module
        )._is_expert_parallel = True  # transformers' grouped/batched forwards: an index >= n is elsewhere
        _route_through(module, ep_rank * n, n, group)
    return tuple(names)


def _route_through(module: nn.Module, first: int, n: int, group: dist.ProcessGroup) -> None:
    """Hooks on `module`: its (hidden, top-k index, top-k weights) arguments made local, its output summed."""
    signature = inspect.signature(module.forward)
    params = list(signature.parameters)[:3]
    inputs: list[torch.Tensor] = []  # this call's (hidden, weights), for `after`

    def before(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = signature.bind(*args, **kwargs)
        hidden, index, weights = (bound.arguments[p] for p in params)
        mine = (index >= first) & (index < first + n)
        hidden, weights = _SumGradsIn.apply(hidden, weights, group)
        bound.arguments.update(zip(params, (hidden, torch.where(mine, index - first, n), weights), strict=True))
        inputs[:] = [hidden, weights]
        return bound.args, bound.kwargs

    def after(_mod: nn.Module, _args: tuple, _kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        # A rank whose experts got no token has an output without a graph: the zero term ties it to the inputs,
        # so every rank's backward reaches the all-reduce of _SumGradsIn.
        hidden, weights = inputs
        tied = out + 0.0 * (hidden.sum() + weights.sum()).to(out.dtype)
        return _SumOut.apply(tied, group)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


def gather_experts(local: torch.Tensor, group: dist.ProcessGroup, ep: int) -> torch.Tensor:
    """Every rank's block of one split parameter, in expert order (the whole parameter)."""
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def split_grad_norm(dense: Iterable[torch.Tensor], split: Iterable[torch.Tensor], group: dist.ProcessGroup) -> float:
    """The whole model's gradient norm: the dense gradients' (the same on every ep rank) with the split experts'
    (each rank's own blocks: their squares summed over ep)."""
    a, b = _norm(list(dense)), _norm(list(split))
    squares = torch.tensor([b * b], dtype=torch.float64)
    dist.all_reduce(squares, group=group)
    return math.sqrt(a * a + float(squares))


def _norm(grads: list[torch.Tensor]) -> float:
    if not grads:
        return 0.0
    norm: Any = torch.nn.utils.get_total_norm(grads)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor over dp: its sum
