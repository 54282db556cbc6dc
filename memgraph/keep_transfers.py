"""A plan amended to keep the copies between devices it would make again.

A planner may choose to drop a value a device received from another (a weight's cast from its
owner, say) after the forward and copy it again for the backward: its cost model prices that copy
at the bytes over the link between the devices, which is cheap. What it does not see is the wait:
the copy runs at its reader's turn and needs its source made again on the other device at that
device's turn, so each device's backward keeps waiting for the other's (two H200s at 50% of eager's
memory, gpt1.3b with the weights' casts travelling: each GPU idled 18-21 ms a step so, simulated).
``keep_transfers(tg, plan)`` is the plan without those copies made again: the first copy stays
until its last reader. It holds more bytes, so memgraph.compile builds it beside its pick and keeps
it only where the simulator runs it faster (there: 176.3 ms against 184.3).
"""

from __future__ import annotations

import dataclasses

from ..ir.plan import Plan
from ..ir.taskgraph import TaskGraph


def keep_transfers(tg: TaskGraph, plan: Plan) -> Plan | None:
    """``plan`` without its recomputations of copies from another device, or None where it has none."""
    kept = [r for r in plan.recompute if tg.transfer_source(tg.vertices[r.vertex]) is None]
    if len(kept) == len(plan.recompute):
        return None
    return dataclasses.replace(plan, recompute=kept)
