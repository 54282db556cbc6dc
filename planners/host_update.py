"""Which optimizer updates the host's cores run (Plan.host_update): ZeRO-Offload's CPU step, per update.

A fused Adam/AdamW update (one multi-tensor vertex per block, trace/optimizer_update.py) whose parameters
and states are all homed on the CPU can run on the host: its gradient goes to pinned memory (4 bytes
a parameter, device to host) and nothing else moves, where the GPU update fetches the parameter and
both states and writes all three back (12 bytes each way). The price is the host's time
(planners.costs: host_update_rate) on a lane of its own, overlapping the backward.

The planner does not price that choice yet (its model streams states through the GPU), so this
module derives candidate plans from its plans and memgraph.compile's simulator, which models the
host lane, picks among them:

- ``"homed"``: the updates whose parameters and states the plan already homes on the CPU;
- a share of the parameters (HOST_SHARES): the updates that run first, their parameters and
  states homed on the CPU (1.0: every fused update).

``host_update_candidates(tg, plans, mode)``: mode "auto" adds every variant of each plan (where it
differs from the plan), "all" replaces each plan by its share-1.0 variant, "off" leaves the plans
alone.

Measured on the H100 machine it loses to streaming the states (bench/results/2026-11-24_h100_near-whole-plan-host-updates.md): the
CPU step shares the host's memory bandwidth with the link's copies, and the simulator, which does
not model that sharing beyond the rate measured beside copies, is 28-63% optimistic about it.
memgraph.compile therefore defaults to "off".
"""

from __future__ import annotations

import dataclasses

from ..ir.optimizer import update_elements
from ..ir.plan import CPU, Plan
from ..ir.taskgraph import TaskGraph

HOST_UPDATE_MODES = ("auto", "off", "all")
HOST_SHARES = (0.25, 0.5, 0.75, 1.0)  # "auto": shares of the parameters updated on the host, each a candidate
FUSED_UPDATES = frozenset({"aten::_fused_adamw_", "aten::_fused_adam_"})  # the CPU has both kernels


def check_mode(mode) -> None:
    if mode not in HOST_UPDATE_MODES:
        raise ValueError(f"host_update must be one of {', '.join(map(repr, HOST_UPDATE_MODES))}, got {mode!r}")


def fused_updates(tg: TaskGraph) -> dict[int, list[int]]:
    """TaskGraph vertex -> the persistent values (parameters, states) it overwrites, for every fused
    Adam/AdamW update that only overwrites persistent values (what a host update needs)."""
    out = {}
    for vertex in tg.vertices:
        if vertex.op not in FUSED_UPDATES or vertex.phase != "optimizer" or not vertex.copy_in:
            continue
        targets = [old for old, _new in vertex.copy_in]
        if all(tg.values[old].kind.is_persistent for old in targets):
            out[vertex.id] = targets
    return out


def with_host_updates(tg: TaskGraph, plan: Plan, scope: str | float) -> Plan | None:
    """The plan with some updates run on the host; None when that changes nothing.

    scope "homed": the updates whose parameters and states the plan homes on the CPU already. A
    fraction in (0, 1]: the updates that run first in the plan's order (the last blocks' updates,
    whose gradients come first in the backward, so the host's work overlaps the rest of it) until
    that share of the parameters is covered, their parameters and states homed on the CPU. A
    parameter the plan kept in a GPU home becomes ``resident``: fetched once, at its first use,
    and kept, as the plan counted it."""
    updates = fused_updates(tg)
    if scope == "homed":
        chosen = {vid for vid, targets in updates.items() if all(plan.home_of(v) == CPU for v in targets)}
    elif isinstance(scope, float) and 0 < scope <= 1:
        position = {vid: k for k, vid in enumerate(plan.order)} if plan.order is not None else {}
        ranked = sorted(updates, key=lambda vid: position.get(vid, vid))
        sizes = {vid: update_elements(tg.vertices[vid]) for vid in ranked}
        total, covered, chosen = sum(sizes.values()), 0, set()
        for vid in ranked:
            if covered >= scope * total:
                break
            chosen.add(vid)
            covered += sizes[vid]
    else:
        raise ValueError(f"scope must be 'homed' or a fraction in (0, 1], not {scope!r}")
    if not chosen or chosen <= plan.host_update:
        return None
    targets = [v for vid in chosen for v in updates[vid]]
    params = {v for vid in chosen for v in updates[vid][0::3]}  # (param, exp_avg, exp_avg_sq) per parameter
    resident = plan.resident | {v for v in params if plan.home_of(v) != CPU}
    home = {**plan.home, **{v: CPU for v in targets}}
    label = scope if scope == "homed" else f"{scope:g}"
    stats = {**plan.stats, "host_update": label, "host_updates": len(chosen | plan.host_update)}
    return dataclasses.replace(plan, home=home, host_update=plan.host_update | chosen, resident=resident,
                               stats=stats, planner=f"{plan.planner}+host-{label}")


def host_update_candidates(tg: TaskGraph, plans: list[Plan], mode: str) -> list[Plan]:
    """The plans to build and simulate under ``mode`` (see the module docstring)."""
    check_mode(mode)
    if mode == "off":
        return plans
    if mode == "all":
        return [with_host_updates(tg, plan, 1.0) or plan for plan in plans]
    extra = []
    for plan in plans:
        for scope in ("homed", *HOST_SHARES):
            variant = with_host_updates(tg, plan, scope)
            if variant is not None and all(variant.home != p.home or variant.host_update != p.host_update
                                           for p in extra):
                extra.append(variant)
    return plans + extra
