"""MemGraph: vertices at fixed places of one preallocated arena, joined by data and memory edges.

Built by ``memgraph.build`` from a TaskGraph and a Plan, checked by
``memgraph.verify``, run by ``engine.run``. Every field is plain data, so it
saves to a file and loads back exactly (JSON and safetensors, see
ir/serialize.py). The engine's live buffers (arena, pinned storage, trained
weights) are held beside the data, in the attribute
``runtime`` that ``engine.run`` sets: it is not a field, so equality, repr
and files never see it. ``initial_state`` (with ``stats["step"]``) is the
state a new runtime starts from: the compiled weights, those a loaded file
saved, or those ``release()`` kept. ``print(mg)`` gives one line;
``memgraph.dump(mg)`` lists vertices.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from . import serialize
from .budget import budget_fields
from .optimizer import CompiledOptimizer, OptimizerSpec
from .plan import Plan, Recompute
from .taskgraph import ScalarRef, TaskGraph, TensorRef, Value, ValueKind, Vertex

FORMAT_VERSION = serialize.VERSION


class Kind(str, enum.Enum):
    COMPUTE = "compute"  # runs a TaskGraph vertex's op into arena views (Stream.HOST: into CPU storage)
    OFFLOAD = "offload"  # arena -> CPU storage slot
    RELOAD = "reload"  # CPU storage slot -> arena
    INPUT = "input"  # user batch tensor -> arena
    OUTPUT = "output"  # arena -> the step's returned outputs
    COPY = "copy"  # arena -> arena bytes (an updated parameter/state into its GPU home)


class Stream(str, enum.Enum):
    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    HOST = "host"  # a compute vertex run by the host's cores on pinned CPU storage (an optimizer update)
    D2D = "d2d"  # a transfer from another device's arena into this device's (TaskGraph.transfer_source)
    COMM = "comm"  # a message to or from another rank (TaskGraph SEND / RECV): one lane per rank, in tag order


class Edge(str, enum.Enum):
    DATA = "data"
    MEMORY = "memory"


@dataclass(frozen=True)
class Place:
    """Bytes [offset, offset+nbytes) of the GPU arena ("gpu") or of the pinned CPU storage ("cpu")."""

    where: str
    offset: int
    nbytes: int
    device: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass
class MVertex:
    id: int
    kind: Kind
    stream: Stream
    task_vertex: int = -1  # COMPUTE: vertex of mg.taskgraph whose op runs
    value: int = -1  # OFFLOAD/RELOAD/INPUT/OUTPUT: the TaskGraph value moved
    reads: dict[int, Place] = field(default_factory=dict)  # value id -> where it is read from
    writes: dict[int, Place] = field(default_factory=dict)  # value id -> where it is written
    workspace: int = 0  # bytes of temporary device memory while it runs
    lock: str | None = None  # a lock held while running (sum-into); no builder makes one yet, the engine refuses it
    name: str = ""  # output name for OUTPUT vertices


class LiveState(Protocol):
    """What the engine keeps between steps of one MemGraph (engine.runtime.Runtime implements it)."""

    step: int
    mixed: str | None  # why the weights are a mix of two steps (a step failed midway), else None

    def state_dict(self, mg: MemGraph) -> dict: ...

    def persistent_state(self, mg: MemGraph) -> dict: ...

    def close(self) -> None: ...


@dataclass(repr=False)
class MemGraph:
    taskgraph: TaskGraph  # the graph it was built from (recomputation already expanded)
    plan: Plan
    vertices: list[MVertex] = field(default_factory=list)
    edges: list[tuple[int, int, Edge]] = field(default_factory=list)  # (src, dst, type)
    serial: list[int] = field(default_factory=list)  # the serial order it was built from (deterministic mode)
    arena_bytes: int = 0
    cpu_bytes: int = 0
    alignment: int = 256
    homes: dict[int, Place] = field(default_factory=dict)  # persistent value -> its home between steps
    # persistent value -> the CPU tensor a new runtime starts from (at compile time; a file's; kept by release())
    initial_state: dict[int, Any] = field(default_factory=dict)
    names: dict[str, int] = field(default_factory=dict)  # state_dict key -> persistent value id
    device: str = "cpu"
    stats: dict = field(default_factory=dict)  # builder facts (edges dropped by reduction, ...)
    # runs of compute vertices, each in serial order, that the engine launches as one unit (one CUDA
    # graph on CUDA); a vertex in no segment launches alone. Decided by memgraph/segments.py.
    segments: list[list[int]] = field(default_factory=list)

    # Not a field (ClassVar): engine.run sets it on the instance; None until the first run, and after
    # release(). Setting it to None drops the live state without keeping it: the next run starts again
    # from initial_state (what release(keep=False) does, without freeing the buffers at once).
    runtime: ClassVar[LiveState | None] = None
    # Not a field either: a CompiledOptimizer (ir/optimizer.py; set by memgraph.compile around the
    # user's torch optimizer, and by load), whose hyperparameters engine.run reads before every
    # step, so LR schedulers act as in eager, and whose state_dict() exports the optimizer states.
    optimizer: ClassVar[Any] = None
    # Not a field either: on several ranks (taskgraph.ranks > 1), the torch.distributed process group its
    # messages go through (set by memgraph.compile; a loaded rank's MemGraph needs it set again).
    process_group: ClassVar[Any] = None

    def __repr__(self) -> str:
        kinds = Counter(v.kind.value for v in self.vertices)
        return (f"MemGraph({len(self.vertices)} vertices: {', '.join(f'{n} {k}' for k, n in kinds.most_common())}; "
                f"{len(self.edges)} edges; arena {self.arena_bytes} B; pinned {self.cpu_bytes} B; "
                f"device {self.device}; planner {self.plan.planner})")

    # -- structure ------------------------------------------------------------
    def add_vertex(self, kind: Kind, stream: Stream, **attrs) -> int:
        vid = len(self.vertices)
        self.vertices.append(MVertex(vid, kind, stream, **attrs))
        return vid

    def add_edge(self, src: int, dst: int, kind: Edge) -> None:
        self.edges.append((src, dst, kind))

    def predecessors(self) -> list[list[int]]:
        preds: list[set[int]] = [set() for _ in self.vertices]
        for src, dst, _ in self.edges:
            preds[dst].add(src)
        return [sorted(p) for p in preds]

    def successors(self) -> list[list[int]]:
        succs: list[set[int]] = [set() for _ in self.vertices]
        for src, dst, _ in self.edges:
            succs[src].add(dst)
        return [sorted(s) for s in succs]

    # -- user facing ------------------------------------------------------------
    def state_dict(self) -> dict:
        """Current weights (after the last engine.run, or kept by release()), keyed like the model's
        state_dict."""
        if self.runtime is not None:
            return self.runtime.state_dict(self)
        return {name: self.initial_state[vid].clone() for name, vid in self.names.items()
                if vid in self.initial_state}

    def release(self, keep: bool = True) -> None:
        """Free the engine's arena and pinned storage now, keeping what was trained: the weights,
        optimizer states and step count are first copied to host memory (into ``initial_state`` and
        ``stats["step"]``), so ``state_dict()``, ``save()`` and ``mg.optimizer`` give them, and the
        next engine.run allocates the buffers again and goes on from them, bitwise as if never
        released. If the copy fails, it raises and the runtime stays.

        A runtime whose weights are mixed (a step failed after some weights were updated in place)
        keeps nothing: the next run starts again from the last consistent state, the compiled weights
        or those of the last release() or of the loaded file, and the steps since are lost. So does
        ``keep=False`` (the same as ``mg.runtime = None``, but freeing the buffers at once), which
        skips the copy: for benchmarks and tests that start over."""
        runtime = self.runtime
        if runtime is None:
            return
        if keep and getattr(runtime, "mixed", None) is None:
            state, step = runtime.persistent_state(self), runtime.step
            # new objects, not updates in place: the old tensors may be the model's, the old dict shared
            # with copies of this MemGraph (dataclasses.replace)
            self.initial_state = state
            self.stats = {**self.stats, "step": step}
        runtime.close()
        self.runtime = None

    def summary(self) -> dict:
        kinds = Counter(v.kind.value for v in self.vertices)
        edge_kinds = Counter(e[2].value for e in self.edges)
        moved = Counter()
        for v in self.vertices:
            if v.kind in (Kind.OFFLOAD, Kind.RELOAD):
                moved[v.kind.value] += sum(p.nbytes for p in v.writes.values())
        return {
            "vertices": len(self.vertices),
            "vertices_by_kind": dict(kinds),
            "edges": len(self.edges),
            "data_edges": edge_kinds.get(Edge.DATA.value, 0),
            "memory_edges": edge_kinds.get(Edge.MEMORY.value, 0),
            "bytes_offloaded": moved.get(Kind.OFFLOAD.value, 0),
            "bytes_reloaded": moved.get(Kind.RELOAD.value, 0),
            "arena_bytes": self.arena_bytes,
            "cpu_bytes": self.cpu_bytes,
            "peak_cpu_bytes": self.stats.get("peak_cpu_bytes", self.cpu_bytes),
            "edges_removed_by_reduction": self.stats.get("edges_removed_by_reduction", 0),
            "planner": self.plan.planner,
            "predicted_time": self.plan.predicted_time,
            **budget_fields(self.plan.gpu_budget, self.stats.get("unplanned_peak")),
        }

    # -- files --------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the MemGraph to ``path`` (a zip of ``graph.json`` and ``state.safetensors``, see
        ir/serialize.py): every field, with its TaskGraph, Plan and optimizer hyperparameters, and
        the persistent tensors. After engine.run (or release()) those are the trained weights and
        optimizer states, and ``stats["step"]`` the steps taken, so a loaded copy continues training;
        before any run, the compile-time ones. The hyperparameters are ``mg.optimizer``'s current
        param groups (an LR scheduler stepped after the last run included: the next step's lr),
        checked as engine.run checks them. Raises TypeError, naming where (and which TaskGraph
        vertex), if the graph holds a value the format cannot, and ValueError for hyperparameters the
        step cannot follow (see engine.run), before anything is written."""
        mg = self
        if self.runtime is not None:  # save the trained weights and step count, not the compile-time ones
            mg = dataclasses.replace(self, initial_state=self.runtime.persistent_state(self),
                                     stats={**self.stats, "step": self.runtime.step})
        spec = self.taskgraph.optimizer
        if spec is not None and self.optimizer is not None:
            # the hyperparameters of the next step, as engine.run would take them: the spec holds those
            # of the last step run until then
            mg = dataclasses.replace(mg, taskgraph=dataclasses.replace(
                self.taskgraph, optimizer=spec.following(self.optimizer.param_groups)))
        serialize.save(mg, path, FILE_TYPES)


# What a MemGraph file may name: loading builds these and nothing else.
FILE_TYPES = (MemGraph, MVertex, Place, Kind, Stream, Edge, Plan, Recompute, TaskGraph, Value, ValueKind, Vertex,
              TensorRef, ScalarRef, OptimizerSpec)


def load(path: str | Path, optimizer: Any = None) -> MemGraph:
    """Read a MemGraph written by `MemGraph.save`; it runs like the saved one (from its saved
    weights, optimizer states and step), with no runtime until the next engine.run. When it has an
    optimizer, ``mg.optimizer`` is a CompiledOptimizer over the saved hyperparameters (the saved
    optimizer's param groups when it was saved: the lr of the next step, and ``initial_lr``): an
    LR scheduler stepped on it drives the next runs, and its ``state_dict()`` exports the optimizer
    states to eager.

    ``optimizer``: a torch optimizer of the saved kind over the model's parameters (grouped as at
    compile), which takes the saved hyperparameters as ``opt.load_state_dict`` would and becomes
    what ``mg.optimizer`` follows, as compile's does. Made before, a scheduler on it (made, as torch
    asks, before the optimizer's state is loaded, since making one sets the lr) and restored with
    ``sched.load_state_dict(...)`` continues the saved schedule exactly. The optimizer's own states
    are not read: the file's are the step's.

    Loading parses JSON and safetensors only, so a file runs no code, whoever wrote it. Raises
    ValueError naming the path for a file of another format or version (pickled MemGraphs of
    version 1 included) or a corrupted one, and for an ``optimizer`` the saved step does not run."""
    mg = serialize.load(path, FILE_TYPES)
    if not isinstance(mg, MemGraph):
        raise ValueError(f"{path} holds a {type(mg).__name__}, not a MemGraph")  # noqa: TRY004 - a wrong file
    spec = mg.taskgraph.optimizer
    if optimizer is not None:
        if spec is None:
            raise ValueError(f"{path}: the MemGraph was compiled without an optimizer, and one was given")
        try:
            spec.restore(optimizer)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        mg.optimizer = CompiledOptimizer(mg, optimizer)
    elif spec is not None:
        try:
            mg.optimizer = CompiledOptimizer(mg)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a spec no compile wrote
            raise ValueError(f"{path}: corrupted MemGraph file (its optimizer: {exc})") from exc
    return mg
