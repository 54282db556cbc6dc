"""Plan: a planner's decisions on top of a TaskGraph, consumed by memgraph.build.

A Plan never mentions how it was found (ILP, greedy, by hand). It says:
- ``order``: the serial order of the TaskGraph's vertices fed to BuildMemGraph;
- ``recompute``: forward vertices to run again just before a later vertex;
  the copy's outputs replace the originals for every vertex from there on;
- ``offload``: values copied to CPU after production and reloaded before
  their next use (BuildMemGraph may evict more when memory runs out);
- ``home``: where each persistent input (parameter, optimizer state, frozen
  weight, constant) lives between steps: "gpu" (default) or "cpu";
- ``host_update``: optimizer update vertices run by the host's cores on the CPU homes of their
  parameters and states (ZeRO-Offload's CPU step, chosen per update): the gradient is copied to
  pinned memory and nothing of the update touches the GPU; ``resident``: CPU-homed values kept
  in the arena from their first fetch on (such a parameter, fetched once per step);
- budgets and the planner's predictions, so runs can be compared with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .taskgraph import MESSAGE_OPS, TaskGraph, TensorRef, ValueKind, map_refs

GPU = "gpu"
CPU = "cpu"


@dataclass(frozen=True)
class Recompute:
    vertex: int  # TaskGraph vertex to run again (its inputs renamed to the latest copies)
    before: int  # TaskGraph vertex before which the copy runs


@dataclass
class Plan:
    gpu_budget: int
    cpu_budget: int | None = None  # None: unbounded pinned storage
    order: list[int] | None = None  # None: program order
    recompute: list[Recompute] = field(default_factory=list)  # in the order the copies run
    offload: set[int] = field(default_factory=set)
    home: dict[int, str] = field(default_factory=dict)  # persistent value id -> GPU | CPU
    # CPU-homed value -> TaskGraph vertices after which its arena copy is dropped: the planner
    # fetches it once per run of nearby readers, and the builder frees it where each run but the
    # last ends (it is fetched again before its next reader)
    release_after: dict[int, list[int]] = field(default_factory=dict)
    host_update: set[int] = field(default_factory=set)  # TaskGraph update vertices run on the host
    # CPU-homed values whose arena copy stays from their first fetch to their last use (a parameter
    # updated on the host, which the plan would otherwise have kept in a GPU home)
    resident: set[int] = field(default_factory=set)
    planner: str = "none"
    predicted_time: float | None = None  # seconds per step
    predicted_peak: int | None = None  # bytes
    stats: dict = field(default_factory=dict)  # planner-specific facts (solve time, gap, mix)

    def home_of(self, value: int) -> str:
        return self.home.get(value, GPU)

    def expand(self, taskgraph: TaskGraph) -> tuple[TaskGraph, list[int]]:
        """Apply recomputation: return a new TaskGraph with the copies added and the serial order.

        The copy of vertex v scheduled before vertex b gets fresh output values;
        every vertex after it in the serial order (b included) reads the copy's
        outputs instead of v's. Copies of chains therefore read earlier copies.
        """
        order = list(range(len(taskgraph.vertices))) if self.order is None else list(self.order)
        if sorted(order) != list(range(len(taskgraph.vertices))):
            raise ValueError("plan order must be a permutation of the TaskGraph's vertices")
        if not self.recompute:
            return taskgraph, order
        graph = taskgraph.copy()
        pending: dict[int, list[int]] = {}
        for rc in self.recompute:
            vertex = taskgraph.vertices[rc.vertex]
            if vertex.phase != "forward" or vertex.op in MESSAGE_OPS:
                raise ValueError(f"only forward vertices can be recomputed (and no message: its peer sends or "
                                 f"receives once), not {rc.vertex} ({vertex.op})")
            pending.setdefault(rc.before, []).append(rc.vertex)
        rename: dict[int, int] = {}
        own: dict[int, int] = {}  # the copy's own outputs (refs to them are in-place targets)

        def renamed(ref: TensorRef) -> TensorRef:
            return dataclasses.replace(ref, value=rename[ref.value]) if ref.value in rename else ref

        def renamed_own(ref: TensorRef) -> TensorRef:
            return dataclasses.replace(ref, value=own[ref.value]) if ref.value in own else renamed(ref)

        new_order: list[int] = []
        for vid in order:
            for orig in pending.pop(vid, []):
                src = graph.vertices[orig]
                outs = []
                for out in src.outputs:
                    if out < 0:
                        outs.append(out)
                        continue
                    val = graph.values[out]
                    outs.append(graph.add_value(val.shape, val.stride, val.dtype, val.nbytes,
                                                ValueKind.INTERMEDIATE, name=val.name))
                for old, new in zip(src.outputs, outs):
                    if old >= 0:
                        own[old] = new
                copy_id = graph.add_vertex(src.op, map_refs(src.args, renamed_own), map_refs(src.kwargs, renamed_own),
                                           outs, module=src.module, phase="recompute", random=src.random,
                                           time=src.time, workspace=src.workspace, recompute_of=orig,
                                           copy_in=tuple((rename.get(o, o), own[n]) for o, n in src.copy_in),
                                           device=src.device)
                rename.update(own)
                own.clear()
                new_order.append(copy_id)
            if rename:
                v = graph.vertices[vid]
                v.args = map_refs(v.args, renamed)
                v.kwargs = map_refs(v.kwargs, renamed)
                v.copy_in = tuple((rename.get(o, o), n) for o, n in v.copy_in)
            new_order.append(vid)
        if pending:
            raise ValueError(f"recompute targets {sorted(pending)} are not in the order")
        for name, out in graph.outputs.items():
            graph.outputs[name] = rename.get(out, out)
        graph.bindings = {k: rename.get(v, v) for k, v in graph.bindings.items()}
        return graph, new_order
