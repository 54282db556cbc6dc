"""The simulation behind BuildMemGraph (turnip-paper §6, Figures 8-9) for variable-size tensors.

Two horizons walk the steps of `schedule.Schedule`. The allocation horizon
reserves arena bytes for outputs of steps ahead of execution for as long as
free bytes allow, so the runtime may run vertices out of the serial order,
and (allocate-ahead walks) for the reloads those steps read, so a reload may
start as soon as its bytes are free rather than when the step before its
reader frees some: on the H100 export of gpt1.3b at 50% of eager's peak that
took the simulated step of the ILP's plan from 268 to 217 ms;
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

import itertools
import time
from collections import Counter

from ..ir.memgraph import Edge, Kind, MemGraph, Place, Stream
from ..ir.plan import Plan
from ..ir.sizes import arena_capacity
from ..ir.taskgraph import MESSAGE_OPS, TaskGraph, ValueKind
from .alloc import START, RangeAllocator, Tenancy, wait_for
from .implied_edges import reduce_memory_edges
from .packing import live_peak, pack, stays
from .schedule import OUT, TASK, WB, Schedule

UNBOUNDED = 1 << 60  # pinned CPU storage limit when the plan sets none
# Bytes freed by an offload count as freed this many steps later when the allocator picks the bytes
# freed earliest: the copy may still be queued on the link, and a writer of those bytes waits for it,
# so bytes a finished reader freed are taken first
OFFLOAD_SETTLE_STEPS = 128
# (prefetch, settle) steps tried in turn when packing a compact build's stays (packing.stays): room
# for reloads to start early and for offloads to finish before their bytes are taken, as fits
PACKING_SLACK = ((16, OFFLOAD_SETTLE_STEPS), (16, 0), (4, 0), (0, 0))


class OutOfMemory(Exception):
    """This budget does not work (resource: "gpu", "cpu", or "cpu-homes")."""
    def __init__(self, resource: str, step: int):
        super().__init__(resource, step)
        self.resource, self.step = resource, step


class NeedFlush(Exception):
    """No window can be cleared without touching what the current step pins."""


class HorizonWalk:
    def __init__(self, tg: TaskGraph, order: list[int], plan: Plan, alignment: int, gpu_budget: int,
                 sched: Schedule | None = None, compact: bool = False, prefetch: bool = True,
                 crossing_last: bool = False):
        self.tg, self.plan, self.alignment, self.compact = tg, plan, alignment, compact
        # allocate-ahead walks also reserve the bytes of reloads (see _reserve_ahead); compact walks
        # get their prefetch room from packing.stays instead
        self.prefetch = prefetch and not compact
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
        self.home_src: dict[int, int] = {}  # value occupying a GPU home now -> the persistent value it belongs to
        self.data: set[tuple[int, int]] = set()
        self.memory: set[tuple[int, int]] = set()
        self.stats: Counter = Counter()
        self.now = 0
        self.cpu_short = False  # an offload found no room in pinned CPU storage
        self.alloc_step = 0  # the allocation horizon
        nsteps = len(sched.steps)
        self.pre_cost = nsteps + 1  # a reservation is cheaper to clear than any resident value
        self.free_cost = 3 * (nsteps + 2)
        # crossing_last: the bytes of a value a transfer between devices sends or receives count as freed
        # a whole step late, so any bytes freed by this device's own work are taken first. Their last
        # reader waits for another device; a writer of the same bytes would too, and through it this
        # device's work that follows: on four devices at eager's memory every device waited ~50 ms a
        # step so (gpt1.3b, simulated 223 ms against 174 with room for everything)
        self.crossing_settle = nsteps + 1 if crossing_last else 0
        self.crossing: set[int] = set()  # values a transfer between devices reads or writes
        if crossing_last:
            self.stats["crossing_last"] = 1
            for vertex in tg.vertices:
                source = tg.transfer_source(vertex)
                if source is not None:
                    self.crossing.add(source)
                    self.crossing.update(o for o in vertex.outputs if o >= 0)
        capacity = arena_capacity(gpu_budget, sched.max_workspace, alignment)
        cpu_limit = UNBOUNDED if plan.cpu_budget is None else plan.cpu_budget // alignment * alignment
        self._place_homes(capacity, cpu_limit)

    # -- homes -------------------------------------------------------------------------
    def _place_homes(self, capacity: int, cpu_limit: int) -> None:
        sched, values = self.sched, self.tg.values
        devices = range(self.tg.devices)
        top = [0 for _ in devices]  # each device's arena from 0: its GPU homes, then the resident slots
        for v in range(len(values)):
            if sched.gpu_home[v]:
                home = Tenancy(v)
                d = sched.device[v]
                home.start, home.end, home.writer, home.home = top[d], top[d] + self.size[v], START, True
                home.place = Place("gpu", top[d], self.size[v], d)
                top[d] = home.end
                self.home_t[v] = self.cur[v] = home
                self.home_src[v] = v
        # a resident CPU-homed value (plan.resident) gets arena bytes of its own beside the GPU homes:
        # fetched there once, at its first use, and never evicted (it would fragment the arena else)
        self.slot: dict[int, Tenancy] = {}
        for v in sorted(self.plan.resident):
            if 0 <= v < len(values) and sched.cpu_home[v]:
                slot = Tenancy(v)
                d = sched.device[v]
                slot.start, slot.end, slot.home = top[d], top[d] + self.size[v], True
                slot.place = Place("gpu", top[d], self.size[v], d)
                top[d] = slot.end
                self.slot[v] = slot
        if capacity < max(top):
            raise OutOfMemory("gpu", -1)
        # one allocator per device; fresh bytes first (fewest dependencies), or, compact, reuse first (smallest arena)
        self.gpus = [RangeAllocator(top[d], capacity, "gpu", fresh_time=UNBOUNDED if self.compact else -1,
                                    two_sided=True, device=d) for d in devices]
        # value -> [(first step of a stay, arena offset)] planned offline (compact builds)
        self.packed: dict[int, list[tuple[int, int]]] = {}
        if self.compact:
            started = time.perf_counter()
            for k, (prefetch, settle) in enumerate(PACKING_SLACK):
                every = stays(self.tg, self.sched, prefetch, settle)
                on = [[stay for stay in every if sched.device[stay.values[0]] == d] for d in devices]
                if k + 1 < len(PACKING_SLACK) and any(top[d] + live_peak(on[d]) > capacity for d in devices):
                    continue  # cannot fit: stays that meet in time take more than the arena (the last is packed for its stats)
                packed, ends = {}, []
                for d in devices:
                    on_d, high = pack(on[d])
                    packed.update({v: [(s, top[d] + at) for s, at in spots] for v, spots in on_d.items()})
                    ends.append(top[d] + high)
                self.stats["packed_arena_bytes"] = int(max(ends))
                if max(ends) <= capacity:
                    self.packed = packed
                    self.stats["packed_prefetch_steps"] = prefetch
                    self.stats["packed_settle_steps"] = settle
                    break
            self.stats["seconds_pack"] = time.perf_counter() - started
        self.cpu_alloc = RangeAllocator(0, cpu_limit, "cpu", fresh_time=UNBOUNDED, two_sided=False)
        for v in range(len(values)):
            if sched.cpu_home[v]:
                home = Tenancy(v)
                at = self.cpu_alloc.find_fit(self.size[v])
                if at is None:
                    raise OutOfMemory("cpu-homes", -1)
                self.cpu_alloc.alloc(at, self.size[v], home)
                home.writer, home.home = START, True
                self.home_t[v] = self.cpu[v] = home
        for v, home in self.home_t.items():
            self.mg.homes[v] = home.place

    # -- the two horizons (paper Figure 8) ----------------------------------------------
    def run(self) -> MemGraph:
        started = time.perf_counter()
        steps = self.sched.steps
        n = len(steps)
        e = 0
        while e < n:
            a = self.alloc_step
            if a < n and (a == e or not self.compact) and self._reserve_ahead(a):
                self.alloc_step = a + 1
                continue
            self._execute(e)
            e += 1
            self.alloc_step = max(self.alloc_step, e)
        self.stats["seconds_simulate"] = time.perf_counter() - started
        for gpu in self.gpus:
            gpu.close()
        self.cpu_alloc.close()
        return self._finish()

    def _reserve_ahead(self, s: int) -> bool:
        step = self.sched.steps[s]
        if step[0] != TASK:
            return True
        for o in self.sched.outputs[step[1]]:
            if self.pre[o] is None and not self._reserve(o, s, "reservations"):
                return False
        if self.prefetch and step[1] not in self.sched.host:
            # a prefetch: the reload may start once these bytes are free, not when the step
            # before its reader frees some
            for x in self.sched.inputs[step[1]]:
                if self._reloads_at(x) and not self._reserve(x, s, "reload_reservations"):
                    return False
        return True

    def _reserve(self, v: int, s: int, counter: str) -> bool:
        """Reserve free arena bytes for v, written at step s; False if none are free."""
        at = self._fit(v)
        if at is None:
            return False
        t = Tenancy(v, step=s)
        t.pending = wait_for(self._gpu(v).alloc(at, self.size[v], t))
        self._gpu(v).set_cost(t, self.pre_cost + s)
        self.pre[v] = t
        self.stats[counter] += 1
        return True

    def _reloads_at(self, x: int) -> bool:
        """x is read from a CPU copy (reloaded) unless something brings it in earlier, and has no
        bytes reserved for that yet."""
        return (self.cur[x] is None and self.pre[x] is None and self.cpu[x] is not None
                and x not in self.slot)

    def _execute(self, s: int) -> None:
        self.now = s
        step = self.sched.steps[s]
        try:
            self._prepare(s, step)
        except NeedFlush:
            self._flush()
            try:
                self._prepare(s, step)
            except NeedFlush:
                raise OutOfMemory("cpu" if self.cpu_short else "gpu", s) from None
        if step[0] == TASK:
            self._run_task(s, step[1])
        elif step[0] == OUT:
            self._run_output(step[1], step[2])
        else:
            self._run_writeback(step[1], step[2])

    def _prepare(self, s: int, step: tuple) -> None:
        """Make every value the step reads resident and every output reserved."""
        if step[0] == TASK and step[1] in self.sched.host:
            return  # the host reads pinned CPU copies (_run_host_task makes the missing ones)
        if step[0] == WB and self._in_cpu_home(step[1], step[2]):
            return  # updated on the host in its CPU home: nothing to write back
        if step[0] == TASK:
            reads, outs = self.sched.inputs[step[1]], self.sched.outputs[step[1]]
        else:
            reads, outs = [step[2]], []
        cur, pre = self.cur, self.pre
        if all(cur[x] is not None for x in reads) and all(pre[o] is not None for o in outs):
            return  # the common case: everything is in place already
        pinned = {t for t in (self.cur[x] for x in reads) if t is not None}
        pinned.update(t for t in (self.pre[x] for x in reads) if t is not None)  # prefetch reservations
        pinned.update(t for t in (self.pre[o] for o in outs) if t is not None)
        for o in outs:
            if self.pre[o] is None:
                t = Tenancy(o, step=s)
                self._place(t, pinned)
                self._gpu(o).set_cost(t, self.pre_cost + s)
                self.pre[o] = t
                pinned.add(t)
        for x in reads:
            pinned.add(self._resident(x, pinned))

    # -- simMalloc / simMallocForceReld / simMallocOffld --------------------------------
    def _place(self, t: Tenancy, pinned: set) -> None:
        """Find arena bytes for t now, clearing a window if nothing is free."""
        size = self.size[t.value]
        gpu = self._gpu(t.value)
        at = self._fit(t.value)
        stuck: set[Tenancy] = set()  # victims pinned CPU storage has no room for
        while at is None:
            at = gpu.best_window(size, pinned | stuck if stuck else pinned, self.free_cost)
            if at is None:
                raise NeedFlush
            for victim in gpu.occupants(at, at + size):
                if victim.writer is None:
                    self._revoke(victim)
                elif not self._evict(victim):
                    stuck.add(victim)
            if stuck and gpu.occupants(at, at + size):
                at = gpu.find_fit(size)  # what was evicted may have made room elsewhere
        t.pending = wait_for(gpu.alloc(at, size, t))

    def _fit(self, v: int) -> int | None:
        """Where v goes: its packed offset when those bytes are free (compact builds), else the
        allocator's choice."""
        spots = self.packed.get(v)
        if spots is not None:
            at = spots[0][1]
            for first, offset in spots:  # the stay that has begun by now (a reload's, after a release)
                if first <= self.now:
                    at = offset
            if self._gpu(v).fits_at(at, self.size[v]):
                self.stats["packed_placements"] += 1
                return at
        return self._gpu(v).find_fit(self.size[v])

    def _gpu(self, v: int) -> RangeAllocator:
        """The allocator of the device value v lives on."""
        return self.gpus[self.sched.device[v]]

    def _revoke(self, t: Tenancy) -> None:
        self._gpu(t.value).revoke(t)
        self.pre[t.value] = None
        self.alloc_step = min(self.alloc_step, t.step)
        self.stats["revoked_reservations"] += 1

    def _evict(self, t: Tenancy) -> bool:
        """Free t's bytes, offloading its value first unless a CPU copy exists; False if
        pinned CPU storage has no room for the copy (t stays)."""
        v = t.value
        if self.cpu[v] is None:
            if not self._offload(v, t):
                return False
            self.stats["offloads_evicted"] += 1
        self._gpu(v).free(t, self.now + OFFLOAD_SETTLE_STEPS)
        self.cur[v] = None
        self.stats["evictions"] += 1
        return True

    def _flush(self) -> None:
        """Fragmentation fallback: clear the whole arena (homes excepted; values pinned CPU storage
        has no room for stay)."""
        self.stats["flushes"] += 1
        for t in [t for gpu in self.gpus for t in gpu.tenancies()]:
            if t.writer is None:
                self._revoke(t)
            else:
                self._evict(t)

    def _offload(self, v: int, t: Tenancy) -> bool:
        """Copy v from its arena tenancy t into a fresh pinned CPU slot; False if none is free."""
        at = self.cpu_alloc.find_fit(self.size[v])
        if at is None:
            at = self._reclaim_cpu(self.size[v])
        if at is None:
            self.cpu_short = True
            return False
        slot = Tenancy(v)
        history = self.cpu_alloc.alloc(at, self.size[v], slot)
        slot.saved = None
        mid = self.mg.add_vertex(Kind.OFFLOAD, Stream.D2H, value=v, reads={v: t.place}, writes={v: slot.place})
        self._read(t, mid)
        self._wait(wait_for(history), mid)
        slot.writer = mid
        self.cpu[v] = slot
        return True

    def _reclaim_cpu(self, size: int) -> int | None:
        """Pinned storage is full: drop CPU copies of values that are in the arena too (a later
        eviction offloads them again), largest first, until ``size`` bytes fit."""
        copies = [self.cpu[t.value] for gpu in self.gpus for t in gpu.tenancies() if t.writer is not None]
        copies = sorted((c for c in copies if c is not None and not c.home), key=lambda c: c.start - c.end)
        for slot in copies:
            self.cpu_alloc.free(slot, self.now)
            self.cpu[slot.value] = None
            self.stats["cpu_copies_reclaimed"] += 1
            at = self.cpu_alloc.find_fit(size)
            if at is not None:
                return at
        return None

    def _resident(self, v: int, pinned: set) -> Tenancy:
        """v's arena tenancy, reloading it (or copying a batch input in) when needed."""
        t = self.cur[v]
        if t is not None:
            return t
        t = self.slot.get(v) or self.pre[v]
        if t is None:
            t = Tenancy(v)
            self._place(t, pinned)
        self.pre[v] = None
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
        t.pending, t.writer, t.saved = [], mid, None  # written: no longer revocable
        if not t.home:
            self._gpu(v).set_cost(t, self._next_use(v))
        self.cur[v] = t
        return t

    # -- running steps ------------------------------------------------------------------
    def _run_task(self, s: int, vid: int) -> None:
        if vid in self.sched.host:
            self._run_host_task(s, vid)
            return
        vertex = self.tg.vertices[vid]
        ins, outs = self.sched.inputs[vid], self.sched.outputs[vid]
        in_place = self.sched.in_place.get(vid, ())
        writes = {o: self.pre[o].place for o in outs}
        writes.update((new, self.cur[old].place) for old, new in in_place)
        stream = Stream.COMM if vertex.op in MESSAGE_OPS else \
            Stream.D2D if self.tg.transfer_source(vertex) is not None else Stream.COMPUTE
        mid = self.mg.add_vertex(Kind.COMPUTE, stream, task_vertex=vid,
                                 reads={x: self.cur[x].place for x in ins}, writes=writes, workspace=vertex.workspace)
        for x in ins:
            self._read(self.cur[x], mid)
        for o in outs:
            t = self.pre[o]
            self.pre[o] = None
            self._wait(t.pending, mid)
            t.pending, t.writer, t.saved = [], mid, None  # written: no longer revocable
            self._gpu(o).set_cost(t, self._next_use(o))
            self.cur[o] = t
        for old, new in in_place:
            self._take_over(old, new, mid)
        for x in ins:
            self._used(x)
        for o in itertools.chain(outs, (new for _, new in in_place)):
            if not self.uses[o]:
                self._drop(o)
            elif o in self.sched.offload_after and self._offload(o, self.cur[o]):
                self.stats["offloads_planned"] += 1  # (without room in pinned storage it just stays)
        for v in self.sched.release_at.get(s, ()):
            t = self.cur[v]
            if t is not None and not t.home and self.cpu[v] is not None and self.nidx[v] < len(self.uses[v]):
                self._gpu(v).free(t, self.now + OFFLOAD_SETTLE_STEPS)
                self.cur[v] = None

    def _run_host_task(self, s: int, vid: int) -> None:
        """An update the host's cores run (plan.host_update): it reads a pinned CPU copy of every input
        (a gradient is copied there now, unless an eviction did already) and writes each new version
        over its old one in the CPU home, after every reader of the old bytes (the reloads of this
        step). Schedule checked that every result is such an in-place home update."""
        ins, pairs = self.sched.inputs[vid], self.sched.in_place[vid]
        for x in ins:
            if self.cpu[x] is None:
                t = self.cur[x]
                if t is None:
                    raise AssertionError(f"value {x} is needed on the host but is neither in the arena nor in "
                                         f"CPU storage")
                if not self._offload(x, t):
                    raise OutOfMemory("cpu", s)
                self.stats["offloads_for_host"] += 1
        mid = self.mg.add_vertex(Kind.COMPUTE, Stream.HOST, task_vertex=vid,
                                 reads={x: self.cpu[x].place for x in ins},
                                 writes={new: self.cpu[old].place for old, new in pairs})
        for x in ins:
            self._read(self.cpu[x], mid)
        for old, new in pairs:
            t_old = self.cpu[old]
            self._wait([r for r in t_old.readers if r != mid], mid)
            t_new = Tenancy(new)
            t_new.writer, t_new.home = mid, True
            self.cpu_alloc.replace(t_old, t_new)
            self.home_t[old] = t_new  # old is the persistent value itself, in its CPU home (Schedule checked)
            self.cpu[old] = None
            self.cpu[new] = t_new
        self.stats["host_updates"] += 1
        for x in ins:
            self._used(x)

    def _in_cpu_home(self, src: int, dst: int) -> bool:
        """The update dst of persistent value src was made on the host, in src's CPU home."""
        return self.cpu[dst] is not None and self.cpu[dst] is self.home_t[src]

    def _take_over(self, old: int, new: int, mid: int) -> None:
        """The in-place vertex mid writes new into old's bytes, after every other reader of old."""
        t_old = self.cur[old]
        self._wait([r for r in t_old.readers if r != mid], mid)
        t_new = Tenancy(new)
        t_new.writer = mid
        if t_old.home:  # a GPU home: the new version is the home's occupant from now on
            t_new.start, t_new.end, t_new.place, t_new.home = t_old.start, t_old.end, t_old.place, True
            src = self.home_src.pop(old)
            self.home_src[new] = src
            self.home_t[src] = t_new
        else:
            self._gpu(old).replace(t_old, t_new)
        self.cur[old] = None  # old's bytes are new's now: nothing may free them on old's behalf
        self._gpu(new).set_cost(t_new, self._next_use(new))
        self.cur[new] = t_new
        self.stats["in_place"] += 1

    def _run_output(self, name: str, v: int) -> None:
        t = self.cur[v]
        mid = self.mg.add_vertex(Kind.OUTPUT, Stream.D2H, value=v, name=name, reads={v: t.place})
        self._read(t, mid)
        self._used(v)

    def _run_writeback(self, src: int, dst: int) -> None:
        """Put the updated value dst where src lives between steps, once src's readers are done."""
        t = self.cur[dst]
        home = self.home_t[src]
        if t is home or self._in_cpu_home(src, dst):  # updated in place in its home: already where it belongs
            self._used(dst)
            return
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
            self._gpu(v).set_cost(self.cur[v], self.uses[v][self.nidx[v]])

    def _drop(self, v: int) -> None:
        """Nobody reads v again: its arena bytes and CPU copy are free (homes stay)."""
        t = self.cur[v]
        if t is not None and not t.home:
            self._gpu(v).free(t, self.now + (self.crossing_settle if v in self.crossing else 0))
            self.cur[v] = None
        slot = self.cpu[v]
        if slot is not None and not slot.home:
            self.cpu_alloc.free(slot, self.now)
            self.cpu[v] = None

    def _finish(self) -> MemGraph:
        mg = self.mg
        n = len(mg.vertices)
        started = time.perf_counter()
        kept, dropped = reduce_memory_edges(n, self.data, self.memory)
        self.stats["seconds_reduce"] = time.perf_counter() - started
        # edges sorted by (destination, source), packed into ints so the sort is cheap
        packed = [(d * n + s) * 2 for s, d in self.data]
        packed.extend((d * n + s) * 2 + 1 for s, d in kept)
        packed.sort()
        kinds = (Edge.DATA, Edge.MEMORY)
        mg.edges = [((k >> 1) % n, (k >> 1) // n, kinds[k & 1]) for k in packed]
        mg.serial = list(range(n))
        # every device's arena has the bytes of the fullest
        mg.arena_bytes = max(max(gpu.high, home) for gpu, home in zip(self.gpus, self.sched.home_bytes_on))
        mg.cpu_bytes = self.cpu_alloc.high
        mg.stats.update(self.stats)
        mg.stats.update({
            "peak_cpu_bytes": self.cpu_alloc.peak_live,
            "peak_arena_bytes": max(gpu.peak_live + home for gpu, home in zip(self.gpus, self.sched.home_bytes_on)),
            "edges_removed_by_reduction": dropped,
            "memory_edges_before_reduction": len(self.memory),
            "gpu_home_bytes": self.sched.home_bytes,
            "workspace_bytes": self.sched.max_workspace,
        })
        return mg
