"""memgraph.build: TaskGraph + Plan -> MemGraph, and the smallest GPU budget a plan builds in.

The work is done by `horizons.HorizonWalk` (the paper's BuildMemGraph). Here:
expanding the plan's recomputation, the budget checks, and finding the
minimum when the plan's budget is too small: the lower bound (GPU homes +
the largest single step + workspace) always builds when pinned CPU storage
is unbounded; with a CPU budget, bisection over build attempts above it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

from ..ir.describe import format_task_vertex
from ..ir.errors import InfeasibleBudget
from ..ir.memgraph import Kind, MemGraph
from ..ir.plan import CPU, Plan
from ..ir.sizes import aligned
from ..ir.taskgraph import TaskGraph
from .horizons import HorizonWalk, OutOfMemory
from .schedule import Schedule
from .segments import find_segments

log = logging.getLogger(__name__)


def _attempt(tg: TaskGraph, order: list[int], plan: Plan, alignment: int, gpu_budget: int,
             sched: Schedule | None = None, compact: bool = False, prefetch: bool = True,
             crossing_last: bool = False) -> MemGraph:
    started = time.perf_counter()
    sched = sched or Schedule(tg, order, plan, alignment)
    scheduled = time.perf_counter() - started
    if gpu_budget < sched.plan_floor()[0]:
        raise OutOfMemory("gpu", -1)  # some step cannot fit: no need to simulate
    mg = HorizonWalk(tg, order, plan, alignment, gpu_budget, sched, compact, prefetch, crossing_last).run()
    mg.stats["seconds_schedule"] = scheduled
    return mg


def minimum_budget(tg: TaskGraph, plan: Plan, alignment: int = 256, compact: bool = False) -> tuple[int, int]:
    """(smallest GPU budget that builds with this plan, TaskGraph vertex of the expanded graph needing it).

    The lower bound (GPU homes + the largest single step + workspace) always builds when CPU storage is
    unbounded; with a CPU budget, bisect over build attempts above it."""
    graph, order = plan.expand(tg)
    return _minimum(graph, order, plan, alignment, compact)


def _minimum(graph: TaskGraph, order: list[int], plan: Plan, alignment: int,
             compact: bool = False) -> tuple[int, int]:
    sched = Schedule(graph, order, plan, alignment)
    low, step = sched.plan_floor()
    vertex = sched.task_vertex_of(graph, step)

    def works(budget: int) -> bool:
        try:
            _attempt(graph, order, plan, alignment, budget, sched, compact)
            return True
        except OutOfMemory as exc:
            if exc.resource == "cpu-homes":
                raise InfeasibleBudget(
                    f"plan.cpu_budget={plan.cpu_budget} bytes cannot hold the values the plan homes on the CPU",
                    minimum=sum(sched.size[v] for v in range(len(graph.values)) if sched.cpu_home[v]),
                    resource="cpu") from None
            return False

    if plan.cpu_budget is None or works(low):
        return low, vertex
    high = aligned(low + sum(sched.size), alignment)  # every value in its own bytes
    if not works(high):
        raise InfeasibleBudget(f"plan.cpu_budget={plan.cpu_budget} bytes is too small for this plan at any GPU "
                               f"budget (tried up to {high} bytes)", minimum=high, vertex=vertex, resource="cpu")
    lo_units, hi_units = low // alignment, -(-high // alignment)  # lo fails, hi works
    for _ in range(40):
        if hi_units - lo_units <= 1:
            break
        mid = (lo_units + hi_units) // 2
        if works(mid * alignment):
            hi_units = mid
        else:
            lo_units = mid
    return hi_units * alignment, vertex


def _planned_offload(graph: TaskGraph, plan: Plan) -> int:
    """Bytes the plan itself sends to the CPU each step (at most): offloaded values and CPU homes."""
    homes = sum(graph.values[v].nbytes for v, where in plan.home.items() if where == CPU)
    return homes + sum(graph.values[v].nbytes for v in plan.offload if 0 <= v < len(graph.values))


def _describe(graph: TaskGraph, vertex: int) -> str:
    return "the GPU-resident parameters and states alone" if vertex < 0 else format_task_vertex(graph, vertex)


def build(taskgraph: TaskGraph, plan: Plan, alignment: int = 256, compact: bool = False,
          segment_size: int | str | None = "auto") -> MemGraph:
    """Compile the plan's serial order of the TaskGraph into a MemGraph over one arena of
    ``plan.gpu_budget - max workspace`` bytes. Raises InfeasibleBudget when no build fits.

    By default bytes are reserved ahead of execution and never-used bytes are taken first, as far
    as the budget allows (most freedom for the runtime: with an unbounded budget every value gets
    bytes of its own). That walk can fragment the arena and evict what the plan keeps; where it
    does, the compact walk is tried too and the one moving fewer bytes kept. ``compact=True``
    reuses bytes first and reserves nothing ahead: the arena is then about the smallest this
    order needs (``arena_bytes`` of a compact build with an unbounded budget is the packed "keep
    everything" peak).

    ``segment_size``: the longest run of compute vertices launched as one unit (memgraph/segments.py;
    a CUDA graph on CUDA); None unbounded, 1 every vertex alone; "auto" unbounded for a graph traced
    for CUDA, 1 on the CPU (where a launch costs little and single vertices let the runtime, and the
    tests' random orders, choose the most)."""
    graph, order, sched = prepare(taskgraph, plan, alignment)
    mg = _walk(graph, order, plan, alignment, compact, segment_size, sched=sched)
    planned = _planned_offload(graph, plan)
    if not compact and mg.summary()["bytes_offloaded"] > planned:
        packed = _compact_walk(graph, order, plan, alignment, segment_size, sched)
        if packed is not None:
            log.info("allocate-ahead build offloads %d bytes beyond the plan's %d; the packed build %d",
                     mg.summary()["bytes_offloaded"] - planned, planned, packed.summary()["bytes_offloaded"] - planned)
            if packed.summary()["bytes_offloaded"] < mg.summary()["bytes_offloaded"]:
                mg = packed
    return mg


Prepared = tuple[TaskGraph, list[int], Schedule]  # the expanded graph, its serial order, the schedule walks read


def prepare(taskgraph: TaskGraph, plan: Plan, alignment: int = 256) -> Prepared:
    """The plan expanded over the TaskGraph and the Schedule every walk reads (none changes it): given
    to build_walks again, another walk of the same plan is built without expanding it again."""
    graph, order = _expanded(taskgraph, plan, alignment)
    return graph, order, Schedule(graph, order, plan, alignment)


def build_walks(taskgraph: TaskGraph, plan: Plan, alignment: int = 256, segment_size: int | str | None = "auto",
                walks: tuple[str, ...] = ("ahead", "compact"), prepared: Prepared | None = None) -> dict[str, MemGraph]:
    """The plan built by each walk named in ``walks`` (see build), by name, for a caller that compares
    them (memgraph.compile simulates them all), over one schedule (``prepared``, made here when not
    given): "ahead" (allocate-ahead); "apart" (on several devices only: allocate-ahead reusing the
    bytes of transfers between devices last, HorizonWalk's crossing_last); "compact" where that builds
    at the plan's budget. Raises InfeasibleBudget when an allocate-ahead walk cannot build.

    compile asks for "apart" only where everything is kept: there it ran gpt1.3b on four devices in
    173.8 ms against 223.0 (simulated); below the peak, on two H200s at 50%, it was simulated 1% faster
    than the compact walk and ran 5% slower (bench/results/h200x2/s9, call 3)."""
    unknown = set(walks) - {"ahead", "apart", "compact"}
    if unknown:
        raise ValueError(f"unknown builder walks {sorted(unknown)}: the walks are 'ahead', 'apart' and 'compact'")
    graph, order, sched = prepared if prepared is not None else prepare(taskgraph, plan, alignment)
    built = {}
    if "ahead" in walks:
        built["ahead"] = _walk(graph, order, plan, alignment, False, segment_size, sched=sched)
    if "apart" in walks and graph.devices > 1:
        built["apart"] = _walk(graph, order, plan, alignment, False, segment_size, sched=sched, crossing_last=True)
    packed = _compact_walk(graph, order, plan, alignment, segment_size, sched) if "compact" in walks else None
    if packed is not None:
        built["compact"] = packed
    return built


def rebuild_ahead(mg: MemGraph, prefetch: bool) -> MemGraph:
    """The allocate-ahead walk of a built MemGraph's own (expanded) graph, serial order and plan,
    with or without the reservations of reloads (horizons.HorizonWalk's prefetch), for a
    comparison on one plan (bench/prefetch_ab.py); what compile adds (optimizer, initial state,
    names) is copied over."""
    order = [mv.task_vertex for mv in (mg.vertices[v] for v in mg.serial) if mv.kind is Kind.COMPUTE]
    new = _walk(mg.taskgraph, order, mg.plan, mg.alignment, False, "auto", prefetch)
    new.initial_state, new.names, new.device = dict(mg.initial_state), dict(mg.names), mg.device
    new.stats.update((k, mg.stats[k]) for k in ("unplanned_peak", "loss_blocks") if k in mg.stats)
    return new


def _expanded(taskgraph: TaskGraph, plan: Plan, alignment: int) -> tuple[TaskGraph, list[int]]:
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, not {alignment}")
    return plan.expand(taskgraph)


def _compact_walk(graph: TaskGraph, order: list[int], plan: Plan, alignment: int,
                  segment_size: int | str | None, sched: Schedule | None = None) -> MemGraph | None:
    """The compact walk at the plan's own budget, or None where it runs out of memory there."""
    started = time.perf_counter()
    try:
        with _no_cycle_collection():
            mg = _attempt(graph, order, plan, alignment, plan.gpu_budget, sched, compact=True)
    except OutOfMemory:
        return None
    return _finished(mg, started, segment_size)


@contextlib.contextmanager
def _no_cycle_collection():
    """The simulation makes millions of small acyclic objects: cycle collection only costs time."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _walk(graph: TaskGraph, order: list[int], plan: Plan, alignment: int, compact: bool,
          segment_size: int | str | None, prefetch: bool = True, sched: Schedule | None = None,
          crossing_last: bool = False) -> MemGraph:
    started = time.perf_counter()
    with _no_cycle_collection():
        try:
            mg = _attempt(graph, order, plan, alignment, plan.gpu_budget, sched, compact=compact, prefetch=prefetch,
                          crossing_last=crossing_last)
        except OutOfMemory as exc:
            minimum, vertex = _minimum(graph, order, plan, alignment, compact)
            if minimum > plan.gpu_budget:
                need = f"; it runs out of {'pinned CPU storage' if exc.resource == 'cpu' else 'GPU memory'}"
                raise InfeasibleBudget(
                    f"GPU budget {plan.gpu_budget} bytes is too small for this step{need}: the smallest budget "
                    f"that works is {minimum} bytes ({minimum / 2**20:.2f} MiB), needed by "
                    f"{_describe(graph, vertex)}", minimum=minimum, vertex=vertex) from None
            # Under a CPU bound the builder's choices are not monotone in the budget: a smaller arena
            # that works fits this budget too, so use it.
            log.warning("GPU budget %d runs out of pinned CPU storage; building with %d instead",
                        plan.gpu_budget, minimum)
            mg = _attempt(graph, order, plan, alignment, minimum, sched, compact=compact, crossing_last=crossing_last)
            mg.stats["arena_budget_used"] = minimum
    return _finished(mg, started, segment_size)


def _finished(mg: MemGraph, started: float, segment_size: int | str | None) -> MemGraph:
    if segment_size == "auto":
        segment_size = None if mg.taskgraph.device == "cuda" else 1
    mg.segments = find_segments(mg, segment_size)
    mg.stats["build_seconds"] = time.perf_counter() - started
    log.info("built MemGraph: %d vertices, %d edges, arena %d bytes, cpu %d bytes in %.2fs",
             len(mg.vertices), len(mg.edges), mg.arena_bytes, mg.cpu_bytes, mg.stats["build_seconds"])
    return mg
