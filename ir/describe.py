"""One way to name a vertex, used by every error, log line, trace slice and graph dump.

    vertex 12 (compute aten::mm.default) in module 'h.0.attn' reading [value 3 [8, 16] torch.float32]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .budget import format_bytes
from .memgraph import Kind, MemGraph
from .taskgraph import TaskGraph


@dataclass(frozen=True)
class VertexInfo:
    """What a user needs to find a MemGraph vertex: kind, op, module and the values it reads."""

    vertex: int
    kind: str
    op: str = ""
    module: str = ""
    inputs: list[tuple[int, Any, Any]] = field(default_factory=list)  # (value id, shape or None, dtype or None)
    value: int = -1  # the value an offload, reload, input or output vertex moves


def describe_vertex(mg: MemGraph, vid: int) -> VertexInfo:
    mv = mg.vertices[vid]
    tg = mg.taskgraph
    op = module = ""
    if 0 <= mv.task_vertex < len(tg.vertices):
        tv = tg.vertices[mv.task_vertex]
        op, module, read_ids = tv.op, tv.module, tv.inputs()
    else:
        read_ids = list(mv.reads) or ([mv.value] if mv.value >= 0 else [])
    inputs = []
    for val in read_ids:
        if 0 <= val < len(tg.values):
            inputs.append((val, tuple(tg.values[val].shape), tg.values[val].dtype))
        else:
            inputs.append((val, None, None))
    return VertexInfo(vid, mv.kind.value, op, module, inputs, mv.value if not op else -1)


def format_vertex(mg: MemGraph, vid: int, inputs: bool = True) -> str:
    """`vertex 12 (compute aten::mm.default) in module 'h.0' reading [...]`; `inputs=False` stops before reading."""
    return format_info(describe_vertex(mg, vid), inputs=inputs)


def format_info(info: VertexInfo, inputs: bool = True) -> str:
    text = f"vertex {info.vertex} ({info.kind}{' ' + info.op if info.op else ''})"
    if info.value >= 0:
        text += f" of value {info.value}"
    if info.module:
        text += f" in module '{info.module}'"
    if inputs and info.inputs:
        reads = ", ".join(f"value {v} {list(s) if s is not None else '?'} {d}" for v, s, d in info.inputs)
        text += f" reading [{reads}]"
    return text


def short_name(mg: MemGraph, vid: int) -> str:
    """A slice name for traces: the op for compute, else kind and value (`offload v17`)."""
    mv = mg.vertices[vid]
    if mv.kind is Kind.COMPUTE and 0 <= mv.task_vertex < len(mg.taskgraph.vertices):
        return mg.taskgraph.vertices[mv.task_vertex].op
    return f"{mv.kind.value} v{mv.value}" if mv.value >= 0 else mv.kind.value


def format_task_vertex(tg: TaskGraph, vertex: int) -> str:
    """A TaskGraph vertex for planner and builder messages: `vertex 4 (aten::mm.default, module 'h.0')`."""
    v = tg.vertices[vertex]
    return f"vertex {vertex} ({v.op}, module '{v.module}')"


def dump(mg: MemGraph, limit: int = 40) -> str:
    """A short text picture of a MemGraph: sizes, vertex and edge counts, then the first `limit`
    vertices of its serial order with their places and predecessors."""
    kinds = Counter(v.kind.value for v in mg.vertices)
    preds = mg.predecessors()
    header = (f"MemGraph on {mg.device}: {len(mg.vertices)} vertices "
              f"({', '.join(f'{n} {k}' for k, n in kinds.most_common())}), {len(mg.edges)} edges; "
              f"arena {format_bytes(mg.arena_bytes)}, pinned CPU {format_bytes(mg.cpu_bytes)}; "
              f"planner {mg.plan.planner}")
    lines = [header]
    order = mg.serial or list(range(len(mg.vertices)))
    for vid in order[:limit]:
        mv = mg.vertices[vid]
        places = ", ".join(f"v{val}@{p.where}[{p.offset}:{p.end})" for val, p in mv.writes.items())
        after = f" after {preds[vid][:6]}{'...' if len(preds[vid]) > 6 else ''}" if preds[vid] else ""
        lines.append(f"  {format_vertex(mg, vid, inputs=False)} -> {places or '-'}{after}")
    if len(order) > limit:
        lines.append(f"  ... {len(order) - limit} more (dump(mg, limit=...) shows more)")
    return "\n".join(lines)
