"""Make again, rather than fetch back, what the built step offloads: a plan amendment.

The planner prices memory with a model; the builder (memgraph/horizons.py) packs the real arena
and, where the plan's values do not fit, evicts some: it offloads the value and reloads it before
its next reader. For most values that is the only way back. A value made by one cheap forward op
from weights that stay on the GPU has a faster one: run the op again. The bf16 copy of a tied
embedding that autocast makes for the LM head is such a value; on the H100 export of gpt1.3b at 50%
of eager's peak the builder evicted it (196.5 MiB) right after the head, and the backward waited
3.8 ms for it to come back while its offload held up the recompute before it; run again, the
cast takes 0.2 ms and the step simulates at 196.9 ms instead of 201.4.

The planner may offload such a value itself, its model pricing the copy as hidden under compute,
where the built step shows it is not: those count too. ``recompute_evicted(tg, plan, mg, costs)``
returns a copy of the plan that recomputes each such value (and no longer offloads it) just before
its first reader after the eviction (a ``Recompute`` the builder expands like
the planner's own), or None when nothing the built MemGraph offloads qualifies. Whether the amended plan is
faster is the simulator's call (memgraph.compile builds and simulates both).
"""

from __future__ import annotations

import dataclasses
import logging

from ..ir.memgraph import Edge, Kind, MemGraph
from ..ir.plan import GPU, Plan, Recompute
from ..ir.taskgraph import TaskGraph, ValueKind

log = logging.getLogger(__name__)


def recompute_evicted(tg: TaskGraph, plan: Plan, mg: MemGraph, costs) -> Plan | None:
    """The amended plan (see the module docstring), or None. ``tg`` and ``plan`` are what ``mg`` was
    built from; ``costs`` prices the op against the reload (``transfer_time``)."""
    homes = set(mg.homes.values())
    order = list(range(len(tg.vertices))) if plan.order is None else list(plan.order)
    position = {vid: k for k, vid in enumerate(order)}
    updated_at = in_place_writers(tg, position)
    serial_rank = {vid: k for k, vid in enumerate(mg.serial)}
    first_reload: dict[int, int] = {}
    for mv in mg.vertices:
        if mv.kind is Kind.RELOAD and 0 <= mv.value < len(tg.values):
            best = first_reload.get(mv.value)
            if best is None or serial_rank[mv.id] < serial_rank[best]:
                first_reload[mv.value] = mv.id
    # offloaded by the builder or by the plan itself (whose model may have priced the copy as hidden)
    evicted = {mv.value for mv in mg.vertices
               if mv.kind is Kind.OFFLOAD and 0 <= mv.value < len(tg.values)
               and not any(p in homes for p in mv.writes.values())}
    readers_of = _data_successors(mg)
    added: list[Recompute] = []
    for value in sorted(evicted):
        producer = _cheap_producer(tg, plan, value, costs)
        if producer is None or value not in first_reload:
            continue
        before = _first_original_at_or_after(mg, readers_of[first_reload[value]], serial_rank, len(tg.vertices))
        if before is None:
            continue
        # the copy reads the weights' versions of the step's start: none may be updated in place before it
        if any(updated_at.get(x, len(order)) <= position[before] for x in tg.vertices[producer].inputs()):
            continue
        added.append(Recompute(producer, before))
    if not added:
        return None
    recompute = list(plan.recompute)
    for rc in added:
        # the copy reads only weights, so it may run first among the copies before the same vertex
        at = next((k for k, other in enumerate(recompute) if other.before == rc.before), len(recompute))
        recompute.insert(at, rc)
    log.info("recomputing %d evicted values instead of reloading them: %s", len(added),
             ", ".join(f"{tg.vertices[rc.vertex].op} ({tg.vertices[rc.vertex].module or 'top'})" for rc in added))
    made_again = {tg.vertices[rc.vertex].outputs[0] for rc in added}  # each producer's one output
    return dataclasses.replace(plan, recompute=recompute, offload=set(plan.offload) - made_again,
                               stats={**plan.stats, "recomputed_instead_of_reloaded": len(added)})


def made_from_gpu_weights(tg: TaskGraph, plan: Plan, value: int) -> int | None:
    """The forward vertex that makes ``value``, its one output, from weights the plan homes on the GPU
    alone (a weight's bf16 cast), so it can run again anywhere later; else None."""
    val = tg.values[value]
    if val.kind is not ValueKind.INTERMEDIATE or val.producer < 0:
        return None
    vertex = tg.vertices[val.producer]
    if vertex.phase != "forward" or vertex.random or vertex.copy_in or [o for o in vertex.outputs if o >= 0] != [value]:
        return None
    inputs = vertex.inputs()
    if not inputs or any(not tg.values[x].kind.is_persistent or plan.home_of(x) != GPU for x in inputs):
        return None
    return vertex.id


def _cheap_producer(tg: TaskGraph, plan: Plan, value: int, costs) -> int | None:
    """made_from_gpu_weights' vertex, if running it costs less than fetching ``value`` back; else None."""
    producer = made_from_gpu_weights(tg, plan, value)
    if producer is None or tg.vertices[producer].time >= costs.transfer_time(tg.values[value].nbytes, "h2d"):
        return None
    return producer


def in_place_writers(tg: TaskGraph, position: dict[int, int]) -> dict[int, int]:
    """Per value written in place (an optimizer update's parameter): the plan-order position of its
    first writer."""
    first: dict[int, int] = {}
    for vertex in tg.vertices:
        for old, _ in vertex.copy_in:
            first[old] = min(first.get(old, len(position)), position[vertex.id])
    return first


def _data_successors(mg: MemGraph) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for src, dst, kind in mg.edges:
        if kind is Edge.DATA:
            out.setdefault(src, []).append(dst)
    return out


def _first_original_at_or_after(mg: MemGraph, readers: list[int], serial_rank: dict[int, int],
                                originals: int) -> int | None:
    """The TaskGraph vertex a Recompute names as ``before`` for the earliest of ``readers`` (MemGraph
    compute vertices): the reader itself when it is an original vertex, else the original vertex the
    recomputed copies it belongs to run before (the next original vertex in the serial order)."""
    compute = [r for r in readers if mg.vertices[r].kind is Kind.COMPUTE]
    if not compute:
        return None
    first = min(compute, key=serial_rank.__getitem__)
    for vid in mg.serial[serial_rank[first]:]:
        mv = mg.vertices[vid]
        if mv.kind is Kind.COMPUTE and 0 <= mv.task_vertex < originals:
            return mv.task_vertex
    return None
