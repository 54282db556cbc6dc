"""TaskGraph: the traced training step as ATen-op vertices over dense tensor values.

A *value* is one dense tensor (its own storage). A *vertex* is one ATen op
call in program order; its argument template refers to values through
`TensorRef` (a view of a value's storage, applied with ``as_strided`` at
launch) and to per-step host scalars through `ScalarRef` (optimizer bias
corrections and the like, computed on the host each step so the numbers
match eager PyTorch exactly). Views never become vertices or values.

The structure is plain data: it can be built by hand for synthetic graphs
(``op`` is then any string) and is what planners and BuildMemGraph consume.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils import _pytree as pytree

from .sizes import aligned


class ValueKind(str, enum.Enum):
    BATCH = "batch"  # user input, copied in each step
    PARAMETER = "parameter"  # trainable: updated by the step, bound to its output
    # requires_grad=False parameter or buffer: read-only input, except a buffer the step updates in place
    # (BatchNorm's running statistics), which is bound to its new version like an optimizer state
    FROZEN = "frozen"
    OPTIMIZER_STATE = "optimizer_state"  # updated by the step, bound to its output
    CONSTANT = "constant"  # tensor baked into the trace (e.g. a scalar tensor)
    INTERMEDIATE = "intermediate"  # produced by a vertex

    @property
    def is_input(self) -> bool:
        return self is not ValueKind.INTERMEDIATE

    @property
    def is_persistent(self) -> bool:
        """Lives across steps in a home (GPU arena or CPU storage)."""
        return self in (ValueKind.PARAMETER, ValueKind.FROZEN, ValueKind.OPTIMIZER_STATE, ValueKind.CONSTANT)


@dataclass(frozen=True)
class TensorRef:
    """A strided view of a value's storage (sizes/strides/offset in elements)."""

    value: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0


@dataclass(frozen=True)
class ScalarRef:
    """A host scalar resolved at launch from the step's scalar table (see OptimizerSpec)."""

    name: str


@dataclass
class Value:
    id: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: Any  # torch.dtype for traced graphs; anything for synthetic ones
    nbytes: int  # bytes of the value's storage
    kind: ValueKind = ValueKind.INTERMEDIATE
    producer: int = -1  # vertex id, -1 for inputs
    name: str = ""  # input name, e.g. "param:blocks.0.attn.weight" or "batch:0"
    device: int = 0  # the device whose memory holds it (its producer's; an input's home): TaskGraph.devices

    @property
    def dense_ref(self) -> TensorRef:
        return TensorRef(self.id, tuple(self.shape), tuple(self.stride), 0)


@dataclass
class Vertex:
    id: int
    op: str  # qualified ATen overload name, e.g. "aten::mm" or "aten::add.Tensor"
    args: tuple = ()  # template: constants, TensorRef, ScalarRef, nested lists/tuples
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[int, ...] = ()  # value ids, in the op's return order (-1: output unused)
    module: str = ""  # module path it came from ("" for backward/optimizer when unknown)
    phase: str = "forward"  # "forward" | "backward" | "optimizer"
    random: bool = False  # consumes the RNG: replayed with a per-vertex generator state
    time: float = 0.0  # seconds (estimated or measured)
    workspace: int = 0  # temporary bytes the op needs beyond its outputs
    recompute_of: int = -1  # for a recomputed copy: the original vertex (same RNG state, same op)
    # In-place ATen ops stay in-place (the exact eager kernel): each (old, new) pair says
    # "copy value old into new's buffer, then run the op"; refs in args to `new` are the
    # mutated views.
    copy_in: tuple[tuple[int, int], ...] = ()
    device: int = 0  # the device it runs on, reading and writing only values of that device (but a transfer)

    def refs(self) -> Iterator[TensorRef]:
        yield from iter_refs(self.args)
        yield from iter_refs(self.kwargs)

    def inputs(self) -> list[int]:
        """Value ids read, in first-use order, without duplicates (own outputs excluded)."""
        seen: dict[int, None] = {}
        for old, _ in self.copy_in:
            seen.setdefault(old, None)
        own = set(self.outputs)
        for ref in self.refs():
            if ref.value not in own:
                seen.setdefault(ref.value, None)
        return list(seen)


def iter_refs(template: Any) -> Iterator[TensorRef]:
    if isinstance(template, TensorRef):
        yield template
    elif isinstance(template, (list, tuple)):
        for item in template:
            yield from iter_refs(item)
    elif isinstance(template, dict):
        for item in template.values():
            yield from iter_refs(item)


def map_refs(template: Any, fn) -> Any:
    """Rebuild a template with every TensorRef replaced by fn(ref)."""
    if isinstance(template, TensorRef):
        return fn(template)
    if isinstance(template, list):
        return [map_refs(t, fn) for t in template]
    if isinstance(template, tuple):
        return tuple(map_refs(t, fn) for t in template)
    if isinstance(template, dict):
        return {k: map_refs(t, fn) for k, t in template.items()}
    return template


# ops that move a value between devices when their source is on another device: op -> index of the source argument
TRANSFER_OPS = {"aten::_to_copy": 0, "aten::copy_": 1}
# a value sent to or received from another rank (trace/ranks.py): kwargs peer (the other rank) and tag (the
# message's position among the step's messages, the same on every rank); a send reads its value, a receive makes it
SEND, RECV = "turnip::send", "turnip::recv"
MESSAGE_OPS = (SEND, RECV)

_PLAIN_DICTS = (dict, OrderedDict, defaultdict)  # read as one kind of mapping; other dict subclasses keep theirs


def normalized_batch(batch: Any) -> Any:
    """The batch as the compiled step sees it: lists read as tuples (a DataLoader yields lists where an
    example was a tuple) and dicts with their keys sorted (a loader may build them in another order)."""
    if isinstance(batch, (list, tuple)) and not hasattr(batch, "_fields"):  # named tuples keep their type
        return tuple(normalized_batch(x) for x in batch)
    if type(batch) in _PLAIN_DICTS:
        return {k: normalized_batch(batch[k]) for k in sorted(batch, key=lambda k: (type(k).__name__, repr(k)))}
    return batch


def flatten_batch_structure(batch: Any) -> tuple[list, Any]:
    """A normalized batch's leaves and pytree structure (see normalized_batch): two batches a
    loader may give for one example flatten alike."""
    return pytree.tree_flatten(normalized_batch(batch))


def normalized_positions(batch: Any) -> list[int]:
    """positions[i]: the index, among ``pytree.tree_flatten(batch)``'s leaves, of the normalized
    batch's leaf i (normalizing keeps every leaf's key path, only the order changes)."""
    index = {pytree.keystr(path): j for j, (path, _) in enumerate(pytree.tree_flatten_with_path(batch)[0])}
    paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(normalized_batch(batch))[0]]
    if len(index) != len(paths) or set(index) != set(paths):
        raise ValueError(f"batch leaves {sorted(index)} do not all keep their paths {sorted(paths)} when normalized")
    return [index[path] for path in paths]


def batch_leaf_names(spec: Any) -> list[str]:
    """The path of every leaf of a batch structure, as in "['input_ids']" or "[1]"."""
    blank = pytree.tree_unflatten([0] * spec.num_leaves, spec)
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(blank)[0]]


@dataclass
class TaskGraph:
    values: list[Value] = field(default_factory=list)
    vertices: list[Vertex] = field(default_factory=list)  # ids == positions == a valid program order
    outputs: dict[str, int] = field(default_factory=dict)  # "loss" -> value id, and other step outputs
    bindings: dict[int, int] = field(default_factory=dict)  # persistent input value id -> updated value id
    optimizer: Any = None  # OptimizerSpec for traced graphs (scalar table per step)
    device: str = "cpu"  # device type the graph was traced for
    batch_inputs: list[int] = field(default_factory=list)  # BATCH value ids, in the normalized batch's leaf order
    batch_spec: Any = None  # torch.utils._pytree TreeSpec of the normalized example batch (None for synthetic graphs)
    # leaves of the normalized example batch that are not tensors (a float, a str): compile-time constants,
    # by leaf index; a batch must hold equal ones
    batch_constants: dict[int, Any] = field(default_factory=dict)
    # micro-batches a step accumulates gradients over (compile's accumulation_steps): a batch is then a list of
    # this many batches, each like the example (batch_spec, batch_constants), and batch_inputs holds the first
    # micro-batch's inputs, then the second's, ...
    accumulation_steps: int = 1
    # devices one step runs on (compile's devices=, trace/data_parallel.py): a copy of the forward and backward
    # per device, each on its micro-batch (batch_inputs: device 0's, then device 1's, ...), gradients summed
    # into each parameter's owner, the update there, updated weights copied to the others
    devices: int = 1
    # ranks (processes, trace/ranks.py) the step runs on, and which of them this graph is: its devices are this
    # rank's; values it sends to or receives from other ranks go through SEND and RECV vertices
    rank: int = 0
    ranks: int = 1
    initial_state: dict[int, Any] = field(default_factory=dict)  # persistent value -> its tensor at trace time
    state_names: dict[str, int] = field(default_factory=dict)  # model state_dict key -> persistent value id
    # bytes the engine's streams keep besides arena and op workspace (cuBLAS/cuDNN workspaces of a new
    # stream), measured by the cost model on the device; 0 on the CPU
    runtime_reserve: int = 0

    # -- construction -------------------------------------------------------
    def add_value(self, shape, stride, dtype, nbytes, kind=ValueKind.INTERMEDIATE, producer=-1, name="",
                  device: int = 0) -> int:
        vid = len(self.values)
        self.values.append(Value(vid, tuple(shape), tuple(stride), dtype, int(nbytes), kind, producer, name, device))
        return vid

    def add_vertex(self, op: str, args=(), kwargs=None, outputs=(), **attrs) -> int:
        vid = len(self.vertices)
        self.vertices.append(Vertex(vid, op, args, kwargs or {}, tuple(outputs), **attrs))
        self._own_outputs(self.vertices[vid])
        return vid

    def add_copy(self, vertex: Vertex, **changes) -> int:
        """Append ``vertex`` (of a graph over the same values, being rewritten into this one) under
        the next id, with ``changes`` replacing any of its other fields."""
        vid = len(self.vertices)
        self.vertices.append(dataclasses.replace(vertex, id=vid, **changes))
        self._own_outputs(self.vertices[vid])
        return vid

    def _own_outputs(self, vertex: Vertex) -> None:
        """A vertex's results are its own, on its device."""
        for out in vertex.outputs:
            if out >= 0:
                self.values[out].producer = vertex.id
                self.values[out].device = vertex.device

    # -- queries ------------------------------------------------------------
    def transfer_source(self, vertex: Vertex) -> int | None:
        """The value a device-to-device transfer vertex copies from another device (a plain copy,
        ``_to_copy`` into a new value or ``copy_`` over a replica), else None."""
        if self.devices == 1 or vertex.op not in TRANSFER_OPS:
            return None
        source = vertex.args[TRANSFER_OPS[vertex.op]].value
        return source if self.values[source].device != vertex.device else None

    def inputs_of_kind(self, *kinds: ValueKind) -> list[int]:
        return [v.id for v in self.values if v.kind in kinds]

    def unused_persistent(self) -> set[int]:
        """Persistent values the step neither reads, updates nor returns (a frozen weight kept in a
        narrower dtype instead, trace/half_width.py): they need no place, their state is their
        initial state."""
        used = {x for vertex in self.vertices for x in vertex.inputs()}
        used |= set(self.bindings) | set(self.outputs.values())
        return {v.id for v in self.values if v.kind.is_persistent and v.id not in used}

    def consumers(self) -> list[list[int]]:
        """consumers()[value] = vertex ids reading it, in program order."""
        users: list[list[int]] = [[] for _ in self.values]
        for vertex in self.vertices:
            for vid in vertex.inputs():
                users[vid].append(vertex.id)
        return users

    def validate(self) -> None:
        """Raise ValueError if the structure breaks the contract (program order, producers, refs)."""
        for vertex in self.vertices:
            for vid in vertex.inputs():
                val = self.values[vid]
                if val.kind is ValueKind.INTERMEDIATE and val.producer >= vertex.id:
                    raise ValueError(f"vertex {vertex.id} ({vertex.op}) reads value {vid} before it is produced")
            for out in vertex.outputs:
                if out >= 0 and self.values[out].producer != vertex.id:
                    raise ValueError(f"value {out} names producer {self.values[out].producer}, not {vertex.id}")
        for src in self.bindings:
            if not self.values[src].kind.is_persistent:
                raise ValueError(f"binding from non-persistent value {src}")

    def summary(self) -> dict:
        """Vertex counts by op and the byte totals a user asks about first."""
        by_kind = Counter()
        for v in self.values:
            by_kind[v.kind.value] += v.nbytes
        consumers = self.consumers()
        saved = 0  # forward activations read by the backward pass
        for v in self.values:
            if (v.kind is ValueKind.INTERMEDIATE and v.producer >= 0 and self.vertices[v.producer].phase == "forward"
                    and any(self.vertices[c].phase == "backward" for c in consumers[v.id])):
                saved += v.nbytes
        return {
            "vertices": len(self.vertices),
            "values": len(self.values),
            "ops": dict(Counter(v.op for v in self.vertices).most_common()),
            "vertices_by_phase": dict(Counter(v.phase for v in self.vertices)),
            "bytes_total": sum(v.nbytes for v in self.values),
            "bytes_by_kind": dict(by_kind),
            "bytes_parameters": by_kind[ValueKind.PARAMETER.value] + by_kind[ValueKind.FROZEN.value],
            "bytes_optimizer_states": by_kind[ValueKind.OPTIMIZER_STATE.value],
            "bytes_saved_for_backward": saved,
        }

    def live_peak(self, order: list[int] | None = None, alignment: int = 1) -> int:
        """Peak bytes with everything on the GPU: persistent inputs always, batch and
        intermediates from production (or step start) to their last reader.
        This is the "unplanned peak" that fractional budgets refer to."""
        order = list(range(len(self.vertices))) if order is None else order

        def size(vid: int) -> int:
            return aligned(self.values[vid].nbytes, alignment)

        last_use = {}
        for pos, vid in enumerate(order):
            for val in self.vertices[vid].inputs():
                last_use[val] = pos
        keep = set(self.outputs.values()) | set(self.bindings.values())
        live = sum(size(v.id) for v in self.values if v.kind.is_input)
        peak = live
        frees: dict[int, int] = {}
        for val, pos in last_use.items():
            # a bound input's home is taken over by its update, so it is free after its last reader
            if val not in keep and (self.values[val].kind in (ValueKind.INTERMEDIATE, ValueKind.BATCH)
                                    or val in self.bindings):
                frees[pos] = frees.get(pos, 0) + size(val)
        for pos, vid in enumerate(order):
            vertex = self.vertices[vid]
            live += sum(size(o) for o in vertex.outputs if o >= 0)
            peak = max(peak, live + vertex.workspace)
            live -= frees.get(pos, 0)
            # outputs nobody reads die at once
            live -= sum(size(o) for o in vertex.outputs if o >= 0 and o not in last_use and o not in keep)
        return peak

    def has_costs(self) -> bool:
        """Every vertex carries a time (a cost model annotated the graph, or its maker set them)."""
        return all(v.time > 0 for v in self.vertices)

    def largest_workspace(self) -> int:
        """The largest op workspace (temporaries one op allocates beside its outputs)."""
        return max((v.workspace for v in self.vertices), default=0)

    def step_workspace(self) -> int:
        """GPU bytes a step needs beside its arena at worst: the largest op workspace plus the
        runtime's reserve. Budgets are checked against arena + this."""
        return self.largest_workspace() + self.runtime_reserve

    def copy(self) -> TaskGraph:
        vertices = [_shallow_copy(v) for v in self.vertices]
        for v in vertices:
            v.kwargs = dict(v.kwargs)
        return dataclasses.replace(
            self,
            values=[_shallow_copy(v) for v in self.values],
            vertices=vertices,
            outputs=dict(self.outputs),
            bindings=dict(self.bindings),
            batch_inputs=list(self.batch_inputs),
            batch_constants=dict(self.batch_constants),
            initial_state=dict(self.initial_state),
            state_names=dict(self.state_names),
        )


def _shallow_copy(item):
    """A new Value or Vertex with the same fields (shared, not copied). dataclasses.replace and copy.copy
    take 6-7 us each, this 1 us: a plan's expansion copies the whole graph once per build (1.8 of 39 s
    replanning gpt1.3b on two devices went to those copies)."""
    new = object.__new__(type(item))
    new.__dict__.update(item.__dict__)
    return new


def drop_unproduced(tg: TaskGraph, keep: frozenset[int] | set[int] = frozenset()) -> TaskGraph:
    """``tg`` with its values renumbered, leaving out intermediates nothing produces any more (a
    rewrite's replaced results; ``keep`` names any to keep), so the planner never sees a value
    without a producer."""
    produced = {o for vertex in tg.vertices for o in vertex.outputs if o >= 0}
    live = [val for val in tg.values if val.kind is not ValueKind.INTERMEDIATE or val.id in produced or val.id in keep]
    new_id = {val.id: i for i, val in enumerate(live)}

    def ref(r: TensorRef) -> TensorRef:
        return dataclasses.replace(r, value=new_id[r.value])

    values = [dataclasses.replace(val, id=new_id[val.id]) for val in live]
    vertices = [dataclasses.replace(vx, args=map_refs(vx.args, ref), kwargs=map_refs(vx.kwargs, ref),
                                    outputs=tuple(new_id[o] if o >= 0 else o for o in vx.outputs),
                                    copy_in=tuple((new_id[a], new_id[b]) for a, b in vx.copy_in))
                for vx in tg.vertices]
    return dataclasses.replace(
        tg, values=values, vertices=vertices, outputs={k: new_id[x] for k, x in tg.outputs.items()},
        bindings={new_id[a]: new_id[b] for a, b in tg.bindings.items()},
        batch_inputs=[new_id[x] for x in tg.batch_inputs],
        initial_state={new_id[x]: t for x, t in tg.initial_state.items()},
        state_names={name: new_id[x] for name, x in tg.state_names.items()})
