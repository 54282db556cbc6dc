"""What the engine keeps on a MemGraph between steps (``mg.runtime``), shared by backends.

A runtime owns the arena (one byte buffer per device), the CPU storage (one
byte buffer), the step counter, the loop's precomputed graph, and every
vertex decoded once: ``execute(mg, vid)`` binds a vertex to its views on its
first launch (``bind_<kind>``, below) and runs it through its kind's hook
(``run_<kind>``, in the backend; engine/dispatch.py has the one table from
Kind to hook names). Backends (engine/cpu.py, engine/cuda.py) subclass it
and add how buffers are allocated, how a vertex is launched and how each
kind runs:

    _allocate(mg)                     allocate self.arenas {device: uint8} and self.storage
    begin_step(mg, leaves, step)      per-step state (StepContext, batch leaves, outputs)
    completion_source()               optional: what the loop blocks on (default: a SimpleQueue)
    launch(item, notify)              start unit item.vertex (StaticGraph.units: a segment or one
                                      vertex) on stream instance (item.key, item.instance),
                                      calling execute_unit(mg, unit) there (CUDA may replay a graph);
                                      call notify(Completion) exactly once, from any thread, when done
    run_compute(vid, PreparedVertex)  run each kind with what bind_<kind> made of the vertex:
    run_offload / run_reload / run_copy(vid, ((dst bytes, src bytes), ...))
    run_input(vid, InputBinding)      copy batch leaf .leaf into .dst
    run_output(vid, OutputBinding)    make .src the step's output .name
    end_step() -> dict                the step's outputs; abort_step() after a failure
    close()                           stop worker threads / free buffers
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import NamedTuple

import torch

from ..ir.describe import format_vertex
from ..ir.memgraph import MemGraph, MVertex, Place
from ..ir.taskgraph import MESSAGE_OPS
from ..kernels.launch import PreparedVertex
from ..kernels.messages import PreparedMessage
from ..kernels.views import ref_view, typed_view
from .dispatch import input_place, output_place, per_vertex, transfer_pairs
from .errors import EngineError
from .loop import StaticGraph

log = logging.getLogger(__name__)


def initial_step(mg: MemGraph) -> int:
    """The optimizer's step count before the first engine.run (0 for graphs without optimizer)."""
    opt = mg.taskgraph.optimizer
    return int(getattr(opt, "initial_step", 0) or 0) if opt is not None else 0


def arena_devices(mg: MemGraph) -> list[int]:
    devs = {p.device for mv in mg.vertices for places in (mv.reads, mv.writes)
            for p in places.values() if p.where == "gpu"}
    devs |= {p.device for p in mg.homes.values() if p.where == "gpu"}
    return sorted(devs) or [0]


def workspace_capacity(mg: MemGraph, devices: list[int]) -> dict[int, int | None]:
    """Workspace bytes per device: what the GPU budget leaves beside the arena (unbounded without a budget)."""
    budget = int(getattr(mg.plan, "gpu_budget", 0) or 0)
    cap = budget - mg.arena_bytes if budget > 0 else None
    if cap is not None and cap < 0:
        log.warning("arena (%d bytes) exceeds the plan's GPU budget (%d); workspace left unbounded",
                    mg.arena_bytes, budget)
        cap = None
    return {dev: cap for dev in devices}


class InputBinding(NamedTuple):
    leaf: int  # index of the batch leaf it loads
    dst: torch.Tensor  # the value's view where it goes


class OutputBinding(NamedTuple):
    name: str  # its key in the dict engine.run returns
    src: torch.Tensor  # the value's view where it is read


def _unknown_kind(self, mg: MemGraph, mv: MVertex):
    raise EngineError(f"vertex {mv.id}: unknown kind {mv.kind!r}")


class Runtime:
    device_type = "cpu"

    def __init__(self, mg: MemGraph):
        self.graph = StaticGraph(mg)
        # a saved MemGraph remembers how many steps it took (Adam's bias corrections depend on it)
        self.step = int(mg.stats.get("step", initial_step(mg)))
        self.lock = threading.Lock()  # one step at a time per MemGraph
        self.devices = arena_devices(mg)
        self.workspace_capacity = workspace_capacity(mg, self.devices)
        self.arenas: dict[int, torch.Tensor] = {}
        self.storage: torch.Tensor | None = None
        self._views: dict[tuple, torch.Tensor] = {}
        n = self.graph.vertex_count
        self._bound: list = [None] * n  # per vertex: what bind_<kind> made of it, on its first launch
        # plain functions, not bound methods, which would tie the runtime to itself in a reference cycle
        self._binders = per_vertex(type(self), "bind_", mg.vertices, unknown=_unknown_kind)
        self._runners = per_vertex(type(self), "run_", mg.vertices, unknown=_unknown_kind)
        self.leaf_of = {vid: i for i, vid in enumerate(mg.taskgraph.batch_inputs)}  # batch value -> leaf
        self._output_names = {vid: name for name, vid in mg.taskgraph.outputs.items()}
        self.fuzz_seed: int | None = None  # set per step by engine.run for random orderings
        self.timing = False  # set per step by engine.run when a trace is wanted
        # traced steps of a backend whose records are device times: when the host launched each unit
        self.launched: dict[int, float] = {}
        self.transfer_depth = 0  # set per step by engine.run: copies reported at enqueue (CUDA)
        self.completion = "events"  # set per step by engine.run: how CUDA lanes report (engine/completions.py)
        self.stream_sizes: list[int] = []  # set per step by engine.run: stream instances per StaticGraph key
        self._ranks: dict[str, list[int]] = {}
        self.last_records: list = []  # Record of the last step (for traces and tests)
        self.last_launch_order: list[int] = []
        self.last_loop_time = None  # loop.LoopTime of the last step: where the loop thread's time went
        # vertices that overwrite a home (updates in place, write-backs): once one has run, a failed
        # step leaves some weights at step N and others at step N-1
        home_places = set(mg.homes.values())
        self.home_writers = frozenset(mv.id for mv in mg.vertices if any(p in home_places for p in mv.writes.values()))
        self.mixed: str | None = None  # why the weights are a mix of two steps, after such a failure
        self.unsettled: str | None = None  # set by engine.run: a stopped step left units running
        self.interrupts = None  # set per step by engine.run (loop.Interrupts), for a backend's own waits
        self._allocate(mg)
        self._write_initial_state(mg)

    # -- buffers ----------------------------------------------------------------------
    def _allocate(self, mg: MemGraph) -> None:
        raise NotImplementedError

    def buffer(self, place: Place) -> torch.Tensor:
        if place.where == "gpu":
            try:
                return self.arenas[place.device]
            except KeyError:
                raise EngineError(f"no arena on device {place.device}") from None
        if place.where == "cpu":
            return self.storage
        raise EngineError(f"unknown place {place.where!r} (expected 'gpu' or 'cpu')")

    def view(self, mg: MemGraph, place: Place, value: int) -> torch.Tensor:
        """The dense tensor of ``value`` stored at ``place`` (cached: the arena never moves)."""
        key = (place.where, place.device, place.offset, value)
        t = self._views.get(key)
        if t is None:
            val = mg.taskgraph.values[value]
            buf = self.buffer(place)
            if place.offset < 0 or place.offset + val.nbytes > buf.numel():
                raise EngineError(f"value {value} ({val.nbytes} bytes) at {place.where} offset {place.offset} "
                                  f"lies outside its buffer of {buf.numel()} bytes")
            t = typed_view(buf, place.offset, val)
            if val.nbytes and t.data_ptr() != buf.data_ptr() + place.offset:
                # cheap, once per place: a view at the wrong address would corrupt other values silently
                raise EngineError(f"typed_view of value {value} starts at byte {t.data_ptr() - buf.data_ptr()} "
                                  f"of its buffer, expected {place.offset}")
            self._views[key] = t
        return t

    def bytes_of(self, place: Place, nbytes: int) -> torch.Tensor:
        buf = self.buffer(place)
        if nbytes > place.nbytes or place.offset < 0 or place.offset + nbytes > buf.numel():
            raise EngineError(f"{nbytes} bytes at {place.where} offset {place.offset} do not fit the place "
                              f"({place.nbytes} bytes) or its buffer ({buf.numel()} bytes)")
        return buf[place.offset:place.offset + nbytes]

    def output_name(self, mv) -> str:
        """The key an OUTPUT vertex's value gets in the dict engine.run returns."""
        return mv.name or self._output_names.get(mv.value) or f"value:{mv.value}"

    # -- vertices: bound once, run through their kind's hook -------------------------------
    def execute(self, mg: MemGraph, vid: int) -> None:
        """Run vertex ``vid`` with its kind's run_ hook, binding it on its first launch.

        A binding is cached only once made, so a vertex that fails to bind (a place outside its
        buffer) fails again at its next launch instead of running with a half-made binding.
        """
        binding = self._bound[vid]
        if binding is None:
            binding = self._bound[vid] = self._binders[vid](self, mg, mg.vertices[vid])
        self._runners[vid](self, vid, binding)

    def execute_unit(self, mg: MemGraph, unit: int) -> None:
        """Run the loop's unit ``unit`` (a segment's vertices in order, or one vertex). A failure
        carries the vertex that failed as ``failed_vertex``, for the loop's error message."""
        for vid in self.graph.units[unit]:
            try:
                self.execute(mg, vid)
            except Exception as exc:
                exc.failed_vertex = vid
                raise

    def bind_compute(self, mg: MemGraph, mv: MVertex) -> PreparedVertex:
        """The compute vertex bound to its arena views (places never move)."""
        tv = mg.taskgraph.vertices[mv.task_vertex]
        reads = mv.reads

        def resolve(ref):
            place = reads.get(ref.value)
            if place is None:
                raise EngineError(f"vertex {mv.id} reads value {ref.value}, which its MemGraph vertex "
                                  f"does not place")
            return ref_view(self.view(mg, place, ref.value), ref)

        outs = [self.view(mg, mv.writes[o], o) if o >= 0 and o in mv.writes else None for o in tv.outputs]
        if tv.op in MESSAGE_OPS:
            return PreparedMessage(tv, resolve, outs, self.process_group(mg))
        return PreparedVertex(tv, resolve, outs)

    def process_group(self, mg: MemGraph):
        """The process group a rank's MemGraph sends its messages through: the one it was compiled in."""
        group = mg.process_group
        if group is None:
            raise EngineError(f"this MemGraph is rank {mg.taskgraph.rank} of {mg.taskgraph.ranks}: it runs in "
                              f"the process group it was compiled in (a loaded one: set mg.process_group)")
        return group

    def bind_transfer(self, mg: MemGraph, mv: MVertex) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """((destination bytes, source bytes), ...): offload, reload and copy all move a value's bytes."""
        values = mg.taskgraph.values
        pairs = []
        for v, src, dst in transfer_pairs(mg, mv):
            n = values[v].nbytes
            pairs.append((self.bytes_of(dst, n), self.bytes_of(src, n)))
        return tuple(pairs)

    bind_offload = bind_reload = bind_copy = bind_transfer

    def bind_input(self, mg: MemGraph, mv: MVertex) -> InputBinding:
        idx = self.leaf_of.get(mv.value)
        if idx is None:
            raise EngineError(f"{format_vertex(mg, mv.id, inputs=False)}: value {mv.value} is not a batch input")
        return InputBinding(idx, self.view(mg, input_place(mg, mv), mv.value))

    def bind_output(self, mg: MemGraph, mv: MVertex) -> OutputBinding:
        src = self.view(mg, output_place(mg, mv), mv.value)
        return OutputBinding(self.output_name(mv), src)

    # -- persistent state -------------------------------------------------------------
    @torch.no_grad()
    def _write_initial_state(self, mg: MemGraph) -> None:
        """Every persistent value into its home from ``mg.initial_state``: the compiled weights, a loaded
        file's, or those the last ``mg.release()`` kept (with ``mg.stats["step"]``, read above)."""
        for vid, home in mg.homes.items():
            if vid not in mg.initial_state:
                raise EngineError(f"persistent value {vid} ({mg.taskgraph.values[vid].name}) has a home "
                                  f"but no initial state")
            src = mg.initial_state[vid]
            val = mg.taskgraph.values[vid]
            if tuple(src.shape) != tuple(val.shape) or src.dtype != val.dtype:
                raise EngineError(f"initial state of value {vid} ({val.name}) is {tuple(src.shape)} {src.dtype}, "
                                  f"expected {tuple(val.shape)} {val.dtype}")
            self.view(mg, home, vid).copy_(src)

    @torch.no_grad()
    def read_home(self, mg: MemGraph, vid: int) -> torch.Tensor:
        """A fresh CPU tensor with the current contents of a persistent value."""
        home = mg.homes.get(vid)
        if home is None:
            return mg.initial_state[vid].detach().clone()
        return self.view(mg, home, vid).detach().to("cpu", copy=True)

    def check_consistent(self) -> None:
        if self.mixed is not None:
            raise EngineError(self.mixed)

    def state_dict(self, mg: MemGraph) -> dict:
        self.check_consistent()
        return {name: self.read_home(mg, vid) for name, vid in mg.names.items()
                if vid in mg.homes or vid in mg.initial_state}

    def persistent_state(self, mg: MemGraph) -> dict:
        """{persistent value: a CPU tensor of its current contents}, fresh copies of the homes (what
        ``mg.save()`` writes and ``mg.release()`` keeps); refuses mixed weights."""
        self.check_consistent()
        state = {vid: t for vid, t in mg.initial_state.items() if vid not in mg.homes}
        state.update({vid: self.read_home(mg, vid) for vid in mg.homes})
        return state

    # -- the loop's cached inputs -------------------------------------------------------
    def ranks(self, mg: MemGraph, policy) -> list[int]:
        key = getattr(policy, "cache_key", None)
        if key is None:
            return policy.ranks(mg)
        if key not in self._ranks:
            self._ranks[key] = policy.ranks(mg)
        return self._ranks[key]

    def device_records(self, records: list, origin: float) -> list:
        """Records with the times the work really ran (backends that run asynchronously override)."""
        return records

    # -- backend hooks ------------------------------------------------------------------
    def completion_source(self):
        """Where the loop waits: an object with put(Completion) and a blocking get().

        By default a fresh thread-safe queue per step (the notify callable launch()
        gets is its put). A backend that polls instead (CUDA events) exposes its own
        as ``self.completions``.
        """
        source = getattr(self, "completions", None)
        return source if source is not None else queue.SimpleQueue()

    def begin_step(self, mg: MemGraph, leaves: list, step: int) -> None:
        raise NotImplementedError

    def launch(self, item, notify) -> None:
        raise NotImplementedError

    def end_step(self) -> dict:
        raise NotImplementedError

    def abort_step(self) -> None:
        pass

    def cancel_step(self) -> list[int] | None:
        """Start no other unit of the step; return the units that began (ran, or run now). None: the
        backend cannot tell, and every unit launched counts as begun."""
        return None

    def quiesce(self, timeout: float | None) -> bool:
        """Wait until no unit of the last step runs, at most ``timeout`` seconds; True if none does."""
        return True

    def close(self) -> None:
        """Drop every reference to the arena and storage so their memory is freed now."""
        self._bound = [None] * len(self._bound)
        self._views.clear()
        self.arenas.clear()
        self.storage = None
