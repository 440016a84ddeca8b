"""The trainer's side of MoE routing (train.moe; furlong.model.moe has the mechanism): routing replay in its
forwards, the router load-balancing loss, and the step's routing metrics.

With replay on, every forward of the policy over episodes that carry engine routes (Episode.routes) uses the
experts the engine chose for each token; the gate weights still come from the trainer's router logits over
those experts, so the router trains. Tokens without a route (a prefix-cached prompt token, the last sampled
one, an episode from an engine that records none) keep the trainer's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from furlong.agent.episode import Episode
from furlong.model.moe import RouteHooks, expert_load, load_balancing_loss, moe_routers, route_shape

REPLAY_MODES = ("auto", "on", "off")
METRICS = ("moe_route_mismatch", "moe_token_mismatch", "moe_load_max_ratio", "moe_load_entropy", "moe_aux_loss")


class Routing:
    """Routing replay (`mode` auto | on | off: auto replays on an MoE model, on refuses a dense one) and the
    load-balancing loss (weight `aux_coef`) on `model`'s forwards inside `forward()`."""

    def __init__(self, model: nn.Module, mode: str, aux_coef: float) -> None:
        if mode not in REPLAY_MODES:
            raise ValueError(f"train.moe.routing_replay: expected one of {REPLAY_MODES}, got {mode!r}")
        routers = moe_routers(model)
        name = type(model).__name__
        if mode == "on" and not routers:
            raise ValueError(
                f"train.moe.routing_replay=on, but {name} has no MoE router furlong can replay (qwen3_moe, gpt_oss, "
                "deepseek_v3 and glm4_moe have); use auto or off"
            )
        if aux_coef > 0 and not routers:
            raise ValueError(f"train.moe.aux_loss_coef={aux_coef}, but {name} has no MoE router")
        self.replay = mode != "off" and bool(routers)
        self.aux_coef = aux_coef
        self.hooks = RouteHooks(model, keep_logits=aux_coef > 0) if routers else None
        self.experts = route_shape(model).experts if routers else 0
        self._aux: list[float] = []

    @property
    def active(self) -> bool:
        return self.hooks is not None

    @contextmanager
    def forward(self, routes: torch.Tensor | None) -> Iterator[None]:
        """One forward of the policy over a [B, T] batch whose routes are `routes` ([B, T, layers, top_k], or
        None): replayed when replay is on, else only compared with the trainer's own choice."""
        if self.hooks is None:
            yield
            return
        self.hooks.logits.clear()
        flat = None if routes is None else routes.reshape(-1, *routes.shape[2:])
        with self.hooks.forcing(flat, apply=self.replay):
            yield

    def aux_loss(self, attention_mask: torch.Tensor, share: float) -> torch.Tensor | None:
        """aux_coef times the load-balancing loss of the last forward (with grad), times `share` (its micro-batch's
        part of the minibatch's loss tokens: accumulated gradients then weigh it once per minibatch); None at 0."""
        if self.hooks is None or self.aux_coef <= 0 or not self.hooks.logits:
            return None
        aux = load_balancing_loss(self.hooks.routers, self.hooks.logits, attention_mask)
        self.hooks.logits.clear()
        self._aux.append(float(aux.detach()))
        return self.aux_coef * share * aux

    def metrics(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """The step's routing metrics (docs/models.md): the fraction of (token, MoE layer) pairs and of tokens
        whose trainer top-k differed from the engine's before any replay, expert load from the episodes' routes,
        and the mean unweighted load-balancing loss; then starts counting anew."""
        if self.hooks is None:
            return {}
        pairs, tokens, compared = self.hooks.mismatch()
        layers = len(self.hooks.routers)
        out = {
            "moe_route_mismatch": pairs / (compared * layers) if compared else 0.0,
            "moe_token_mismatch": tokens / compared if compared else 0.0,
            "moe_aux_loss": sum(self._aux) / len(self._aux) if self._aux else 0.0,
            **dict.fromkeys(("moe_load_max_ratio", "moe_load_entropy"), 0.0),
        }
        out.update(expert_load([e.routes for e in episodes if e.routes is not None], self.experts))
        self._aux = []
        return out
