"""Chrome / Perfetto trace of one step: a track per stream instance, a slice per vertex.

Open the file in https://ui.perfetto.dev or chrome://tracing: compute,
h2d and d2h lanes sit under one process per device, so overlap of
transfers and compute is visible at a glance. Times are microseconds from
the start of the step; backends measure them (CPU: time.perf_counter in the
worker; CUDA: event timestamps) so the loop adds no clock calls of its own.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..ir.describe import short_name
from ..ir.memgraph import Kind, MemGraph
from .loop import Record, StaticGraph

_LANE_ORDER = {"compute": 0, "h2d": 1, "d2h": 2}


def vertex_bytes(mg: MemGraph, vid: int) -> int:
    """Bytes a vertex moves or writes: what a user compares with link bandwidth."""
    mv = mg.vertices[vid]
    places = mv.reads if mv.kind is Kind.OUTPUT else mv.writes
    return int(sum(p.nbytes for p in places.values()))


def unit_predecessors(mg: MemGraph) -> dict[int, list[int]]:
    """Per unit (named by its first vertex, as records name it): the units it waits for, by their
    first vertices (the loop's own units, engine/loop.py StaticGraph)."""
    graph = StaticGraph(mg)
    head = graph.head
    return {head[u]: sorted(head[p] for p in preds) for u, preds in enumerate(graph.predecessors())}


def timeline_events(mg: MemGraph, records: list[Record], keys: list, origin: float,
                 instances: dict[int, int] | None = None, meta: dict | None = None,
                 launched: dict[int, float] | None = None) -> dict:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms", "metadata": {...}}.
    ``launched``: when the host launched each unit (perf_counter seconds, by first vertex), where the
    backend knows; a slice then carries it as args["launched"], in the trace's microseconds."""
    events: list[dict] = []
    tids: dict[tuple[int, int], int] = {}
    used = sorted({(r.key, r.instance) for r in records}
                  | {(k, i) for k, n in (instances or {}).items() for i in range(n)},
                  key=lambda ki: (keys[ki[0]][1], _LANE_ORDER.get(keys[ki[0]][0].value, 9), ki[0], ki[1]))
    devices = sorted({keys[k][1] for k, _ in used})
    for dev in devices:
        events.append({"ph": "M", "name": "process_name", "pid": dev, "tid": 0,
                       "args": {"name": f"{mg.device}:{dev}"}})
    for order, (k, inst) in enumerate(used):
        stream, dev = keys[k]
        tid = order + 1
        tids[(k, inst)] = tid
        events.append({"ph": "M", "name": "thread_name", "pid": dev, "tid": tid,
                       "args": {"name": f"{stream.value} {inst}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": dev, "tid": tid, "args": {"sort_index": order}})
    tg = mg.taskgraph
    after = unit_predecessors(mg)
    for r in records:
        mv = mg.vertices[r.vertex]
        stream, dev = keys[r.key]
        args = {"vertex": r.vertex, "kind": mv.kind.value, "bytes": vertex_bytes(mg, r.vertex)}
        if mv.kind is Kind.COMPUTE and 0 <= mv.task_vertex < len(tg.vertices):
            tv = tg.vertices[mv.task_vertex]
            args.update(task_vertex=mv.task_vertex, module=tv.module, phase=tv.phase)
        if mv.value >= 0:
            args["value"] = mv.value
        if launched and r.vertex in launched:
            args["launched"] = round((launched[r.vertex] - origin) * 1e6, 3)
        if after[r.vertex]:  # what it waited for: bench/trace_waits.py reads these to explain gaps
            args["after"] = after[r.vertex]
        if not r.ok:
            args["failed"] = True
        events.append({
            "ph": "X", "name": short_name(mg, r.vertex), "cat": mv.kind.value,
            "pid": dev, "tid": tids[(r.key, r.instance)],
            "ts": round((r.start - origin) * 1e6, 3), "dur": round(max(r.end - r.start, 0.0) * 1e6, 3),
            "args": args,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": dict(meta or {})}


def write_timeline(path: str | Path, mg: MemGraph, records: list[Record], keys: list, origin: float,
                instances: dict[int, int] | None = None, meta: dict | None = None,
                launched: dict[int, float] | None = None) -> Path:
    path = Path(path)
    doc = timeline_events(mg, records, keys, origin, instances, meta, launched)
    path.write_text(json.dumps(doc, default=str))
    return path
