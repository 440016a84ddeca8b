"""A controlled sandbox's network as its host holds it: the Gate (proxy and DNS) and the routing rules that
carry its phase (furlong.sandbox.runtime.netns). furlong.sandbox.runtime.bwrap makes one for every sandbox whose policies
are not all `no-network` or all `public`; furlong.sandbox.runtime.bwrap_box's set_network moves it between phases."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from furlong.sandbox.network import NO_NETWORK, PUBLIC, NetworkPolicy
from furlong.sandbox.runtime import netns
from furlong.sandbox.runtime.egress_proxy import Gate


def controlled(policies: tuple[NetworkPolicy, ...]) -> bool:
    """Whether a sandbox with these policies needs a gate: any restricted one, or several that differ."""
    return any(p.proxied for p in policies) or len(set(policies)) > 1


def first_rules(policy: NetworkPolicy) -> tuple[str, ...]:
    """The rules a controlled sandbox starts with: `policy` for every uid."""
    return netns.phase_rules(policy != PUBLIC, False, None)


@dataclass
class NetworkControl:
    gate: Gate
    verifier_uid: int | None  # None: one uid, so the agent's processes share the verifier's network
    agent: NetworkPolicy  # what the agent's processes have now
    verifier: NetworkPolicy  # and the verifier's commands (the gate's policy)
    rules: tuple[str, ...]

    async def set(self, pid: int, policy: NetworkPolicy, verifier_only: bool) -> None:
        """Moves the sandbox whose bwrap is `pid` to `policy` (see furlong.sandbox.base.NetworkSwitching):
        rules first, then the gate, so the agent loses the proxy before it admits anything new."""
        agent = self.agent if verifier_only and self.verifier_uid is not None else policy
        cut = agent != policy
        rules = netns.phase_rules(policy != PUBLIC, cut, self.verifier_uid)
        if rules != self.rules:
            await asyncio.to_thread(netns.apply, pid, netns.switch_script(self.rules, rules))
            self.rules = rules
        await self.gate.set(policy)
        self.agent, self.verifier = (NO_NETWORK if cut else policy), policy
