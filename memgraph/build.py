"""BuildMemGraph: TaskGraph + Plan -> MemGraph, by simulating the plan's serial order.

The paper's algorithm (turnip-paper §6, Figures 8-9) for variable-size tensors:
two horizons walk the steps of `schedule.Schedule`. The allocation horizon
reserves arena bytes for outputs of steps ahead of execution for as long as
free bytes allow, so the runtime may run vertices out of the serial order;
the execution horizon "runs" a step: reloads its evicted inputs, emits its
MemGraph vertex, frees what nobody reads again. When bytes must be found
(the step to run now), the contiguous window whose occupants are needed the
latest is cleared: reservations of later steps are revoked first (free),
then values are offloaded (once: values are immutable, a CPU copy stays
valid) and their later uses renamed to a reload. Every writer of a byte
range waits (memory edge) for the readers of the range's previous occupants,
so every edge points forward in the serial order: acyclic and race-free.

If clearing fails because of fragmentation, the arena is flushed (everything
evicted) and the step's inputs and outputs packed from scratch, so any budget
with room for the GPU homes plus the largest single step always builds when
CPU storage is unbounded.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter

from turnip.memgraph.alloc import START, RangeAllocator, Tenancy, wait_for
from turnip.memgraph.memgraph import Edge, Kind, MemGraph, Place, Stream
from turnip.memgraph.reduce import reduce_memory_edges
from turnip.memgraph.schedule import OUT, TASK, Schedule
from turnip.memgraph.taskgraph import TaskGraph, ValueKind
from turnip.planners.plan import Plan

log = logging.getLogger(__name__)

UNBOUNDED = 1 << 60  # pinned CPU storage limit when the plan sets none


class InfeasibleBudget(ValueError):
    """The plan's GPU budget is below what the step can ever run in.

    ``minimum`` is the smallest GPU budget (bytes) that builds with this plan,
    ``vertex`` the TaskGraph vertex needing it (-1 when none is to blame),
    ``resource`` "gpu", or "cpu" when no GPU budget helps because pinned CPU
    storage (plan.cpu_budget) is too small; ``minimum`` is then the CPU bytes
    the CPU homes alone need.
    """

    def __init__(self, message: str, minimum: int, vertex: int = -1, resource: str = "gpu"):
        super().__init__(message)
        self.minimum = minimum
        self.vertex = vertex
        self.resource = resource


class _OutOfMemory(Exception):
    def __init__(self, resource: str, step: int):
        super().__init__(resource, step)
        self.resource, self.step = resource, step


class _NeedFlush(Exception):
    """No window can be cleared without touching what the current step pins."""


class _Builder:
    def __init__(self, tg: TaskGraph, order: list[int], plan: Plan, alignment: int, gpu_budget: int,
                 sched: Schedule | None = None):
        self.tg, self.plan, self.alignment = tg, plan, alignment
        self.sched = sched = sched or Schedule(tg, order, plan, alignment)
        self.size, self.uses = sched.size, sched.uses
        self.mg = MemGraph(taskgraph=tg, plan=plan, alignment=alignment, device=tg.device)
        nvals = len(tg.values)
        self.cur: list[Tenancy | None] = [None] * nvals  # arena copy of each value
        self.pre: list[Tenancy | None] = [None] * nvals  # reservation for an output not yet produced
        self.cpu: list[Tenancy | None] = [None] * nvals  # CPU copy (temporary slot or home)
        self.nidx = [0] * nvals  # index in uses[v] of v's next use
        self.entered = [False] * nvals  # batch value copied in by its INPUT vertex
        self.home_t: dict[int, Tenancy] = {}  # persistent value -> tenancy of its home
        self.data: set[tuple[int, int]] = set()
        self.memory: set[tuple[int, int]] = set()
        self.stats: Counter = Counter()
        self.now = 0
        self.alloc_step = 0  # the allocation horizon
        nsteps = len(sched.steps)
        self.pre_cost = nsteps + 1  # a reservation is cheaper to clear than any resident value
        self.free_cost = 3 * (nsteps + 2)
        capacity = (gpu_budget - sched.max_workspace) // alignment * alignment
        cpu_limit = UNBOUNDED if plan.cpu_budget is None else plan.cpu_budget // alignment * alignment
        self._place_homes(capacity, cpu_limit)

    # -- homes -------------------------------------------------------------------------
    def _place_homes(self, capacity: int, cpu_limit: int) -> None:
        sched, values = self.sched, self.tg.values
        offset = 0
        for v in range(len(values)):
            if sched.gpu_home[v]:
                home = Tenancy(v)
                home.start, home.end, home.writer, home.home = offset, offset + self.size[v], START, True
                home.place = Place("gpu", offset, self.size[v])
                offset = home.end
                self.home_t[v] = self.cur[v] = home
        if capacity < offset:
            raise _OutOfMemory("gpu", -1)
        self.gpu = RangeAllocator(offset, capacity, "gpu", fresh_time=-1, two_sided=True)
        self.cpu_alloc = RangeAllocator(0, cpu_limit, "cpu", fresh_time=UNBOUNDED, two_sided=False)
        for v in range(len(values)):
            if sched.cpu_home[v]:
                home = Tenancy(v)
                at = self.cpu_alloc.find_fit(self.size[v])
                if at is None:
                    raise _OutOfMemory("cpu-homes", -1)
                self.cpu_alloc.alloc(at, self.size[v], home)
                home.writer, home.home = START, True
                self.home_t[v] = self.cpu[v] = home
        for v, home in self.home_t.items():
            self.mg.homes[v] = home.place

    # -- the two horizons (paper Figure 8) ----------------------------------------------
    def run(self) -> MemGraph:
        steps = self.sched.steps
        n = len(steps)
        e = 0
        while e < n:
            a = self.alloc_step
            if a < n and self._reserve_ahead(a):
                self.alloc_step = a + 1
                continue
            self._execute(e)
            e += 1
            self.alloc_step = max(self.alloc_step, e)
        return self._finish()

    def _reserve_ahead(self, s: int) -> bool:
        step = self.sched.steps[s]
        if step[0] != TASK:
            return True
        for o in self.sched.outputs[step[1]]:
            if self.pre[o] is None:
                t = Tenancy(o, step=s)
                at = self.gpu.find_fit(self.size[o])
                if at is None:
                    return False
                t.pending = wait_for(self.gpu.alloc(at, self.size[o], t))
                self.gpu.set_cost(t, self.pre_cost + s)
                self.pre[o] = t
                self.stats["reservations"] += 1
        return True

    def _execute(self, s: int) -> None:
        self.now = s
        step = self.sched.steps[s]
        try:
            self._prepare(s, step)
        except _NeedFlush:
            self._flush()
            try:
                self._prepare(s, step)
            except _NeedFlush:
                raise _OutOfMemory("gpu", s) from None
        if step[0] == TASK:
            self._run_task(s, step[1])
        elif step[0] == OUT:
            self._run_output(step[1], step[2])
        else:
            self._run_writeback(step[1], step[2])

    def _prepare(self, s: int, step: tuple) -> None:
        """Make every value the step reads resident and every output reserved."""
        if step[0] == TASK:
            reads, outs = self.sched.inputs[step[1]], self.sched.outputs[step[1]]
        else:
            reads, outs = [step[2]], []
        pinned = {t for t in (self.cur[x] for x in reads) if t is not None}
        pinned.update(t for t in (self.pre[o] for o in outs) if t is not None)
        for o in outs:
            if self.pre[o] is None:
                t = Tenancy(o, step=s)
                self._place(t, pinned)
                self.gpu.set_cost(t, self.pre_cost + s)
                self.pre[o] = t
                pinned.add(t)
        for x in reads:
            pinned.add(self._resident(x, pinned))

    # -- simMalloc / simMallocForceReld / simMallocOffld --------------------------------
    def _place(self, t: Tenancy, pinned: set) -> None:
        """Find arena bytes for t now, clearing a window if nothing is free."""
        size = self.size[t.value]
        at = self.gpu.find_fit(size)
        if at is None:
            at = self.gpu.best_window(size, pinned, self.free_cost)
            if at is None:
                raise _NeedFlush
            for victim in self.gpu.occupants(at, at + size):
                if victim.writer is None:
                    self._revoke(victim)
                else:
                    self._evict(victim)
        t.pending = wait_for(self.gpu.alloc(at, size, t))

    def _revoke(self, t: Tenancy) -> None:
        self.gpu.revoke(t)
        self.pre[t.value] = None
        self.alloc_step = min(self.alloc_step, t.step)
        self.stats["revoked_reservations"] += 1

    def _evict(self, t: Tenancy) -> None:
        v = t.value
        if self.cpu[v] is None:
            self._offload(v, t)
            self.stats["offloads_evicted"] += 1
        self.gpu.free(t, self.now)
        self.cur[v] = None
        self.stats["evictions"] += 1

    def _flush(self) -> None:
        """Fragmentation fallback: clear the whole arena (homes excepted)."""
        self.stats["flushes"] += 1
        for t in self.gpu.tenancies():
            if t.writer is None:
                self._revoke(t)
            else:
                self._evict(t)

    def _offload(self, v: int, t: Tenancy) -> None:
        """Copy v from its arena tenancy t into a fresh pinned CPU slot."""
        slot = Tenancy(v)
        at = self.cpu_alloc.find_fit(self.size[v])
        if at is None:
            raise _OutOfMemory("cpu", self.now)
        history = self.cpu_alloc.alloc(at, self.size[v], slot)
        mid = self.mg.add_vertex(Kind.OFFLOAD, Stream.D2H, value=v, reads={v: t.place}, writes={v: slot.place})
        self._read(t, mid)
        self._wait(wait_for(history), mid)
        slot.writer = mid
        self.cpu[v] = slot

    def _resident(self, v: int, pinned: set) -> Tenancy:
        """v's arena tenancy, reloading it (or copying a batch input in) when needed."""
        t = self.cur[v]
        if t is not None:
            return t
        t = Tenancy(v)
        self._place(t, pinned)
        if self.tg.values[v].kind is ValueKind.BATCH and not self.entered[v]:
            self.entered[v] = True
            mid = self.mg.add_vertex(Kind.INPUT, Stream.H2D, value=v, writes={v: t.place})
            self.stats["inputs"] += 1
        else:
            slot = self.cpu[v]
            if slot is None:
                raise AssertionError(f"value {v} is needed but is neither in the arena nor in CPU storage")
            mid = self.mg.add_vertex(Kind.RELOAD, Stream.H2D, value=v, reads={v: slot.place}, writes={v: t.place})
            self._read(slot, mid)
            self.stats["reloads"] += 1
        self._wait(t.pending, mid)
        t.pending, t.writer = [], mid
        self.gpu.set_cost(t, self._next_use(v))
        self.cur[v] = t
        return t

    # -- running steps ------------------------------------------------------------------
    def _run_task(self, s: int, vid: int) -> None:
        vertex = self.tg.vertices[vid]
        ins, outs = self.sched.inputs[vid], self.sched.outputs[vid]
        mid = self.mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, task_vertex=vid,
                                 reads={x: self.cur[x].place for x in ins},
                                 writes={o: self.pre[o].place for o in outs}, workspace=vertex.workspace)
        for x in ins:
            self._read(self.cur[x], mid)
        for o in outs:
            t = self.pre[o]
            self.pre[o] = None
            self._wait(t.pending, mid)
            t.pending, t.writer = [], mid
            self.gpu.set_cost(t, self._next_use(o))
            self.cur[o] = t
        for x in ins:
            self._used(x)
        for o in outs:
            if not self.uses[o]:
                self._drop(o)
            elif o in self.sched.offload_after:
                self._offload(o, self.cur[o])
                self.stats["offloads_planned"] += 1
        for v in self.sched.release_at.get(s, ()):
            t = self.cur[v]
            if t is not None and self.cpu[v] is not None and self.nidx[v] < len(self.uses[v]):
                self.gpu.free(t, self.now)
                self.cur[v] = None

    def _run_output(self, name: str, v: int) -> None:
        t = self.cur[v]
        mid = self.mg.add_vertex(Kind.OUTPUT, Stream.D2H, value=v, name=name, reads={v: t.place})
        self._read(t, mid)
        self._used(v)

    def _run_writeback(self, src: int, dst: int) -> None:
        """Put the updated value dst where src lives between steps, once src's readers are done."""
        t = self.cur[dst]
        home = self.home_t[src]
        if self.sched.gpu_home[src]:
            mid = self.mg.add_vertex(Kind.COPY, Stream.COMPUTE, value=dst, reads={dst: t.place},
                                     writes={dst: home.place})
            self.stats["copies"] += 1
            self.cur[src] = None
        else:
            mid = self.mg.add_vertex(Kind.OFFLOAD, Stream.D2H, value=dst, reads={dst: t.place},
                                     writes={dst: home.place})
            self.stats["offloads_writeback"] += 1
            self.cpu[src] = None
        self._read(t, mid)
        self._wait(wait_for([home]), mid)
        new = Tenancy(dst)
        new.writer, new.home = mid, True
        if self.sched.gpu_home[src]:
            new.start, new.end, new.place = home.start, home.end, home.place
        else:
            self.cpu_alloc.replace(home, new)
            old = self.cpu[dst]
            if old is not None and not old.home:
                self.cpu_alloc.free(old, self.now)
            if old is None or not old.home:
                self.cpu[dst] = new  # a later reload of dst may read its home
        self.home_t[src] = new
        self._used(dst)

    # -- bookkeeping ---------------------------------------------------------------------
    def _read(self, t: Tenancy, mid: int) -> None:
        if t.writer is not None and t.writer >= 0:
            self.data.add((t.writer, mid))
        t.readers.append(mid)

    def _wait(self, preds: list[int], mid: int) -> None:
        for p in preds:
            self.memory.add((p, mid))

    def _next_use(self, v: int) -> int:
        uses, k = self.uses[v], self.nidx[v]
        return uses[k] if k < len(uses) else self.pre_cost - 1

    def _used(self, v: int) -> None:
        self.nidx[v] += 1
        if self.nidx[v] >= len(self.uses[v]):
            self._drop(v)
        elif self.cur[v] is not None and not self.cur[v].home:
            self.gpu.set_cost(self.cur[v], self.uses[v][self.nidx[v]])

    def _drop(self, v: int) -> None:
        """Nobody reads v again: its arena bytes and CPU copy are free (homes stay)."""
        t = self.cur[v]
        if t is not None and not t.home:
            self.gpu.free(t, self.now)
            self.cur[v] = None
        slot = self.cpu[v]
        if slot is not None and not slot.home:
            self.cpu_alloc.free(slot, self.now)
            self.cpu[v] = None

    def _finish(self) -> MemGraph:
        mg = self.mg
        n = len(mg.vertices)
        kept, dropped = reduce_memory_edges(n, self.data, self.memory)
        # edges sorted by (destination, source), packed into ints so the sort is cheap
        packed = [(d * n + s) * 2 for s, d in self.data]
        packed.extend((d * n + s) * 2 + 1 for s, d in kept)
        packed.sort()
        kinds = (Edge.DATA, Edge.MEMORY)
        mg.edges = [((k >> 1) % n, (k >> 1) // n, kinds[k & 1]) for k in packed]
        mg.serial = list(range(n))
        mg.arena_bytes = max(self.gpu.high, self.sched.home_bytes)
        mg.cpu_bytes = self.cpu_alloc.high
        kinds = Counter(v.kind.value for v in mg.vertices)
        mg.stats.update(self.stats)
        mg.stats.update({
            "peak_cpu_bytes": self.cpu_alloc.peak_live,
            "peak_arena_bytes": self.gpu.peak_live + self.sched.home_bytes,
            "edges_removed_by_reduction": dropped,
            "memory_edges_before_reduction": len(self.memory),
            "gpu_home_bytes": self.sched.home_bytes,
            "workspace_bytes": self.sched.max_workspace,
            "vertices_by_kind": dict(kinds),
        })
        return mg


def _attempt(tg: TaskGraph, order: list[int], plan: Plan, alignment: int, gpu_budget: int,
             sched: Schedule | None = None) -> MemGraph:
    sched = sched or Schedule(tg, order, plan, alignment)
    if gpu_budget < sched.min_gpu_budget()[0]:
        raise _OutOfMemory("gpu", -1)  # some step cannot fit: no need to simulate
    return _Builder(tg, order, plan, alignment, gpu_budget, sched).run()


def minimum_budget(tg: TaskGraph, plan: Plan, alignment: int = 256) -> tuple[int, int]:
    """(smallest GPU budget that builds with this plan, TaskGraph vertex of the expanded graph needing it).

    The lower bound (GPU homes + the largest single step + workspace) always builds when CPU storage is
    unbounded; with a CPU budget, bisect over build attempts above it."""
    graph, order = plan.expand(tg)
    return _minimum(graph, order, plan, alignment)


def _minimum(graph: TaskGraph, order: list[int], plan: Plan, alignment: int) -> tuple[int, int]:
    sched = Schedule(graph, order, plan, alignment)
    low, step = sched.min_gpu_budget()
    vertex = sched.task_vertex_of(graph, step)

    def works(budget: int) -> bool:
        try:
            _attempt(graph, order, plan, alignment, budget, sched)
            return True
        except _OutOfMemory as exc:
            if exc.resource == "cpu-homes":
                raise InfeasibleBudget(
                    f"plan.cpu_budget={plan.cpu_budget} bytes cannot hold the values the plan homes on the CPU",
                    minimum=sum(sched.size[v] for v in range(len(graph.values)) if sched.cpu_home[v]),
                    resource="cpu") from None
            return False

    if plan.cpu_budget is None or works(low):
        return low, vertex
    high = low + sum(sched.size) + alignment  # every value in its own bytes: nothing evicted
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


def _describe(graph: TaskGraph, vertex: int) -> str:
    if vertex < 0:
        return "the GPU-resident parameters and states alone"
    v = graph.vertices[vertex]
    return f"vertex {vertex} ({v.op}, module '{v.module}')"


def build(taskgraph: TaskGraph, plan: Plan, alignment: int = 256) -> MemGraph:
    """Compile the plan's serial order of the TaskGraph into a MemGraph over one arena of
    ``plan.gpu_budget - max workspace`` bytes. Raises InfeasibleBudget when no build fits."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, not {alignment}")
    graph, order = plan.expand(taskgraph)
    started = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()  # the simulation makes millions of small acyclic objects: cycle collection only costs time
    try:
        mg = _attempt(graph, order, plan, alignment, plan.gpu_budget)
    except _OutOfMemory as exc:
        minimum, vertex = _minimum(graph, order, plan, alignment)
        need = f"; it runs out of {'pinned CPU storage' if exc.resource == 'cpu' else 'GPU memory'}"
        raise InfeasibleBudget(
            f"GPU budget {plan.gpu_budget} bytes is too small for this step{need}: the smallest budget that "
            f"works is {minimum} bytes ({minimum / 2**20:.2f} MiB), needed by {_describe(graph, vertex)}",
            minimum=minimum, vertex=vertex) from None
    finally:
        if collecting:
            gc.enable()
    mg.stats["build_seconds"] = time.perf_counter() - started
    log.info("built MemGraph: %d vertices, %d edges, arena %d bytes, cpu %d bytes in %.2fs",
             len(mg.vertices), len(mg.edges), mg.arena_bytes, mg.cpu_bytes, mg.stats["build_seconds"])
    return mg
