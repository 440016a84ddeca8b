"""How big each agent-writable tmpfs of a sandbox may be, so that nothing the agent writes can take the memory
the init and the verifier need.

tmpfs pages count toward the sandbox's memory cgroup and no OOM kill frees them, so the agent's files are
memory the verifier's checker can never get back. The writable layer, /dev/shm, /logs/agent and
/logs/artifacts (the verifier's mounts, furlong.sandbox.runtime.bwrap) are sized together: their sum fits inside
`memory_mb` less the init's headroom and a reserve for the verifier (docs/sandboxes.md, "Limits").
"""

from __future__ import annotations

from dataclasses import dataclass

from furlong.sandbox.base import Limits

INIT_HEADROOM_MB = 64  # memory the agent's files can never take from the init (and bwrap, the launcher)
# Memory the agent's files can never take from the verifier: its test script, a pytest run with its plugins
# and the checker under test (the audit's fail-open fixture needs 256 MiB beside the interpreter, which the
# init's headroom covers). A quarter of memory_mb when that is less, so a small sandbox keeps room for files.
VERIFIER_RESERVE_MB = 256
SHM_MB = 64  # /dev/shm, as Docker sizes it; an eighth of the budget when that is less
LOGS_MB = 256  # /logs/agent and /logs/artifacts, each: a sixteenth of the budget when that is less
MIN_MB = 16  # no mount smaller (a tmpfs size of 0 would mean unlimited): below 256 MiB of memory it wins


@dataclass(frozen=True)
class AgentCaps:
    """The size of each agent-writable tmpfs, in MiB. `layer` is `disk_mb` where that is smaller."""

    layer: int
    shm: int
    agent_logs: int
    artifacts: int

    @property
    def total(self) -> int:
        return self.layer + self.shm + self.agent_logs + self.artifacts


def verifier_reserve_mb(memory_mb: int) -> int:
    return min(VERIFIER_RESERVE_MB, memory_mb // 4)


def budget_mb(memory_mb: int) -> int:
    """What the agent's files may take in all: memory_mb less the init's headroom and the verifier's reserve."""
    return memory_mb - INIT_HEADROOM_MB - verifier_reserve_mb(memory_mb)


def agent_caps(limits: Limits) -> AgentCaps:
    """Every agent-writable tmpfs's cap; their sum is at most budget_mb(memory_mb) from 256 MiB of memory up.
    The same in a sandbox without the verifier's mounts (one uid), so a task sees the same disk either way."""
    budget = budget_mb(limits.memory_mb)
    shm = max(MIN_MB, min(SHM_MB, budget // 8))
    logs = max(MIN_MB, min(LOGS_MB, budget // 16))
    layer = max(MIN_MB, min(limits.disk_mb, budget - shm - 2 * logs))
    return AgentCaps(layer=layer, shm=shm, agent_logs=logs, artifacts=logs)
