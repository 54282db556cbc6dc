"""Which optimizer updates the host's cores run (Plan.host_update): ZeRO-Offload's CPU step, per update.

A fused Adam/AdamW update (one multi-tensor vertex per block, memgraph/optim.py) whose parameters
and states are all homed on the CPU can run on the host: its gradient goes to pinned memory (4 bytes
a parameter, device to host) and nothing else moves, where the GPU update fetches the parameter and
both states and writes all three back (12 bytes each way). The price is the host's time
(planners.costs: host_update_rate) on a lane of its own, overlapping the backward.

The planner does not price that choice yet (its model streams states through the GPU), so this
module derives candidate plans from its plans and memgraph.compile's simulator, which models the
host lane, picks among them:

- ``"homed"``: the updates whose parameters and states the plan already homes on the CPU;
- ``"all"``: every fused update, its parameters and states homed on the CPU.

``host_update_candidates(tg, plans, mode)``: mode "auto" adds both variants of each plan (where they
differ from it), "all" replaces each plan by its "all" variant, "off" leaves the plans alone.
"""

from __future__ import annotations

import dataclasses

from turnip.ir.plan import CPU, Plan
from turnip.ir.taskgraph import TaskGraph

HOST_UPDATE_MODES = ("auto", "off", "all")
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


def with_host_updates(tg: TaskGraph, plan: Plan, scope: str) -> Plan | None:
    """The plan with the updates of ``scope`` ("homed" or "all") run on the host; None when that
    changes nothing."""
    updates = fused_updates(tg)
    if scope == "homed":
        chosen = {vid for vid, targets in updates.items() if all(plan.home_of(v) == CPU for v in targets)}
        home = plan.home
    elif scope == "all":
        chosen = set(updates)
        home = {**plan.home, **{v: CPU for vid in chosen for v in updates[vid]}}
    else:
        raise ValueError(f"scope must be 'homed' or 'all', not {scope!r}")
    if not chosen or chosen <= plan.host_update:
        return None
    stats = {**plan.stats, "host_update": scope, "host_updates": len(chosen | plan.host_update)}
    return dataclasses.replace(plan, home=home, host_update=plan.host_update | chosen, stats=stats,
                               planner=f"{plan.planner}+host-{scope}")


def host_update_candidates(tg: TaskGraph, plans: list[Plan], mode: str) -> list[Plan]:
    """The plans to build and simulate under ``mode`` (see the module docstring)."""
    check_mode(mode)
    if mode == "off":
        return plans
    if mode == "all":
        return [with_host_updates(tg, plan, "all") or plan for plan in plans]
    extra = []
    for plan in plans:
        for scope in ("homed", "all"):
            variant = with_host_updates(tg, plan, scope)
            if variant is not None and all(variant.home != p.home or variant.host_update != p.host_update
                                           for p in extra):
                extra.append(variant)
    return plans + extra
