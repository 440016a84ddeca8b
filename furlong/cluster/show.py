"""Prints a Plan as rich tables: placement, memory per trainer rank and engine GPU, bytes per weight update."""

from __future__ import annotations

from typing import cast

from rich.console import Console, JustifyMethod
from rich.table import Table

from furlong.cluster.plan import GIB, Memory, Plan
from furlong.cluster.shapes import mtp_params
from furlong.cluster.timing import StepTime


def _memory_table(mem: Memory) -> Table:
    table = Table(title=f"memory per {mem.role}", title_justify="left")
    for col, justify in (("part", "left"), ("GiB", "right"), ("formula", "left")):
        table.add_column(col, justify=cast(JustifyMethod, justify), overflow="fold")
    for t in mem.terms:
        table.add_row(t.name, f"{t.bytes / GIB:,.2f}", t.formula)
    verdict = "fits" if mem.fits else "DOES NOT FIT"
    table.add_row("total", f"{mem.total / GIB:,.2f}", f"of {mem.capacity / GIB:,.2f} GiB: {verdict}")
    return table


def _step_table(step: StepTime) -> Table:
    table = Table(title="time per step", title_justify="left")
    for col, justify in (("term", "left"), ("seconds", "right"), ("formula", "left")):
        table.add_column(col, justify=cast(JustifyMethod, justify), overflow="fold")
    for t in step.terms:
        table.add_row(t.name, f"{t.seconds:,.1f}", t.formula)
    table.add_row("step", f"{step.seconds:,.1f}", f"{step.seconds / 60:,.2f} min; {step.formula}")
    return table


def print_plan(plan: Plan, console: Console) -> None:
    s, p, m = plan.spec, plan.params, plan.spec.model
    kind = f"MoE, {m.moe.experts} experts, {m.moe.active} active" if m.moe else "dense"
    mtp = f", +{mtp_params(m) / 1e9:.2f}B in {m.mtp_layers} MTP layer(s)" if m.mtp_layers else ""
    console.print(
        f"[bold]{m.name}[/bold]: {kind}, {m.layers} layers, hidden {m.hidden}, {m.attention.kind} "
        f"attention; {p.total:,} parameters ({p.total / 1e9:.2f}B), {p.active / 1e9:.2f}B active per "
        f"token{mtp}"
    )
    placement = Table(title="placement", title_justify="left")
    for col in ("role", "devices (node:gpus)", "detail"):
        placement.add_column(col, overflow="fold")
    for a in plan.placement:
        placement.add_row(a.role, a.devices, a.detail)
    console.print(placement)
    console.print(_memory_table(plan.trainer))
    console.print(_memory_table(plan.engine))
    if plan.teacher is not None:
        console.print(_memory_table(plan.teacher))
    updates = Table(title=f"each weight update ({s.sync})", title_justify="left")
    for col, justify in (("what", "left"), ("GiB", "right"), ("link", "left"), ("seconds", "right")):
        updates.add_column(col, justify=cast(JustifyMethod, justify), overflow="fold")
    for u in plan.updates:
        updates.add_row(u.what, f"{u.bytes / GIB:,.2f}", u.link, f"{u.seconds:.2f}" if u.seconds else "")
    console.print(updates)
    if len(plan.paths) > 1:
        console.print(
            "per update: "
            + "; ".join(f"{x.kind} {x.sent / GIB:,.2f} GiB to each relay, {x.seconds:,.1f} s" for x in plan.paths),
            soft_wrap=True,
        )
    if plan.step:
        console.print(_step_table(plan.step))
    for line in plan.problems:
        console.print(f"[red]{line}[/red]", soft_wrap=True)
    console.print("nothing started (dry run)")
