"""A task's network per phase, resolved from task.toml as Harbor 0.25 resolves it
(`harbor.trial.network_policy.resolve_trial_network_plan`, for tests run in the agent's sandbox):

- the baseline is [environment] `network_mode` (with `allowed_hosts` for 'allowlist'), else the legacy
  `allow_internet` (true: public, false: no-network), else `public`;
- each phase is its table's explicit `network_mode` ([agent], [verifier]; a step's own table first, for
  multi-step tasks), else the baseline.
A task that names no mode at all (no network_mode anywhere, no allow_internet) is the exception: where Harbor
gives it `public`, its phases stay None here and furlong's default applies (`sandbox.network.agent` and
`.verifier`; offline unless configured otherwise: docs/tasks.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from furlong.sandbox.network import HostError, NetworkPolicy, normalize_hosts
from furlong.tasks.model import Task, TaskError, TaskNetwork


@dataclass(frozen=True)
class TableNetwork:
    """One table's network keys as task.toml wrote them (`where` names the table in errors)."""

    where: str  # "environment", "agent", "verifier", "steps.build.agent"...
    mode: str | None = None
    hosts: Sequence[str] | None = None


def explicit(table: TableNetwork, task: str) -> NetworkPolicy | None:
    """The policy a table names, None where it names no mode; a TaskError names the field Harbor would
    refuse (`allowed_hosts` without 'allowlist', a URL or port among them...)."""
    if table.mode is None:
        if table.hosts is not None:
            raise TaskError(
                task, "task.toml", f"field '{table.where}.allowed_hosts': only valid with network_mode = 'allowlist'"
            )
        return None
    if table.mode != "allowlist" and table.hosts:
        raise TaskError(
            task,
            "task.toml",
            f"field '{table.where}.allowed_hosts': only valid with network_mode = 'allowlist', not {table.mode!r}",
        )
    try:
        hosts = normalize_hosts(list(table.hosts or ()))
    except HostError as exc:
        raise TaskError(task, "task.toml", f"field '{table.where}.allowed_hosts': {exc}") from None
    return NetworkPolicy(table.mode, hosts)  # type: ignore[arg-type]


def baseline(environment: TableNetwork, legacy: bool | None, task: str) -> NetworkPolicy | None:
    """[environment]'s policy: its mode, else the legacy allow_internet (None: neither is given)."""
    named = explicit(environment, task)
    if named is not None or legacy is None:
        return named
    return NetworkPolicy("public" if legacy else "no-network")


def resolve(
    environment: TableNetwork,
    legacy: bool | None,
    agent: TableNetwork,
    verifier: TableNetwork,
    task: str,
    step_agent: TableNetwork | None = None,
    step_verifier: TableNetwork | None = None,
) -> TaskNetwork:
    """Each phase's policy (a step's tables, where given, before the task's); both None where no table
    names a mode (nor allow_internet), for furlong's default to fill."""
    base = baseline(environment, legacy, task)
    phases = []
    for step_table, table in ((step_agent, agent), (step_verifier, verifier)):
        found = explicit(step_table, task) if step_table is not None else None
        phases.append(found or explicit(table, task))
    if base is None and phases == [None, None]:
        return TaskNetwork()
    base = base or NetworkPolicy("public")  # Harbor's default, for a task that names a phase's mode alone
    return TaskNetwork(agent=phases[0] or base, verifier=phases[1] or base)


def with_default(entries: list[Any], default: TaskNetwork) -> list[Any]:
    """Every loaded task's phases that task.toml leaves unnamed get `default`'s (a multi-step task's steps
    too); broken entries, and phases a task names, stay as they are."""
    return [_defaulted(e, default) if isinstance(e, Task) else e for e in entries]


def _filled(network: TaskNetwork, default: TaskNetwork) -> TaskNetwork:
    return TaskNetwork(agent=network.agent or default.agent, verifier=network.verifier or default.verifier)


def _defaulted(task: Task, default: TaskNetwork) -> Task:
    steps = tuple(dataclasses.replace(s, network=_filled(s.network, default)) for s in task.steps)
    return dataclasses.replace(task, network=_filled(task.network, default), steps=steps)
