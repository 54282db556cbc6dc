"""The event loop: dependency counters, a ready set by priority, resources, completions.

Split in two so the bookkeeping can be tested (and simulated) without threads:

- ``Scheduler`` is pure state: ``start()`` and ``complete(v)`` return the
  vertices to launch now. Per completion it does O(successors) work plus
  O(stream keys) per launch; nothing scans all vertices (CUDA target: the
  completion path costs < 10 us per vertex).
- ``drive()`` is the loop thread: it launches through a backend, waits on a
  completion source that backends fill (CPU workers put a Completion; the
  CUDA source polls its events inside ``get()``), and turns failures and
  stalls into exceptions only after in-flight work has drained, so the engine
  stays usable.

Stopping (a unit that raises, Ctrl-C, an error of the loop itself): the loop
launches nothing more, asks the backend to cancel launched units that have not
started (``stop``: they report ``NotRun``), and drains what runs for at most
``DRAIN_S`` seconds; what is still running then is abandoned (``Scheduler.drained``
is False) and the caller decides what the step left behind (engine/run_step.py).
Ctrl-C reaches the loop only through ``Interrupts``: while a step runs, SIGINT is
recorded instead of raised wherever the main thread happens to be (a
KeyboardInterrupt raised just after ``get()`` returned a completion used to drop
that completion, and the drain then waited forever); a second one raises at once.
The loop never blocks longer than ``POLL_S`` without looking at it, since neither
``_thread.interrupt_main`` nor a SIGINT the kernel hands to a worker thread wakes a
blocked wait.

Ready vertices wait in one heap per stream key ((stream class, device)).
A vertex whose stream is busy simply stays in its heap; one refused another
resource (workspace) is parked with that resource's manager and put back when
the manager releases something, so a busy resource never stalls vertices that
do not need it. A vertex's needs are computed once per MemGraph
(``StaticGraph.needs``) and taken all-or-nothing (``Scheduler._acquire``)
before its stream instance, which the loop already saw free.
"""

from __future__ import annotations

import heapq
import inspect
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

from ..ir.describe import describe_vertex, format_info, format_vertex
from ..ir.memgraph import MemGraph, Stream
from .errors import ResourceError, StallError, VertexError
from .resources import WORKSPACE, StreamPool, WorkspacePool

log = logging.getLogger(__name__)

WAITING, READY, RUNNING, DONE = 0, 1, 2, 3
_STATE_NAMES = ("waiting on predecessors", "ready", "running", "done")

POLL_S = 0.05  # the longest the loop waits without looking for an interrupt
DRAIN_S = 10.0  # after a failure or an interrupt: how long units already running may take to finish


def vertex_device(mv) -> int:
    """The device whose streams run a vertex: where it writes on the GPU, else where it reads; a
    rank's messages all run on one lane (device 0's), in tag order."""
    if mv.stream is Stream.COMM:
        return 0
    for places in (mv.writes, mv.reads):
        for place in places.values():
            if place.where == "gpu":
                return place.device
    return 0


class StaticGraph:
    """What the loop needs from a MemGraph, in flat lists, computed once per MemGraph.

    The loop schedules *units*: each segment of ``mg.segments`` (memgraph/segments.py) is one unit,
    launched as a whole, and every other vertex is a unit of its own. ``units[u]`` lists unit u's
    vertices in the order they run; with no segments, unit u is vertex u. Edges between vertices
    of different units become edges between the units."""

    def __init__(self, mg: MemGraph):
        nv = len(mg.vertices)
        self.vertex_count = nv
        unit_of = [-1] * nv
        units: list[tuple[int, ...]] = []
        for seg in mg.segments:
            for vid in seg:
                if not 0 <= vid < nv or unit_of[vid] >= 0:
                    raise ValueError(f"segment {len(units)} names vertex {vid}, which is outside 0..{nv - 1} "
                                     f"or in another segment")
                unit_of[vid] = len(units)
            units.append(tuple(seg))
        if units:
            for vid in range(nv):
                if unit_of[vid] < 0:
                    unit_of[vid] = len(units)
                    units.append((vid,))
        else:
            units = [(vid,) for vid in range(nv)]
            unit_of = list(range(nv))
        self.units = units
        self.unit_of = unit_of
        self.head = [u[0] for u in units]  # the vertex that names a unit in records and traces
        n = len(units)
        self.n = n
        succ: list[set[int]] = [set() for _ in range(n)]
        for src, dst, _ in mg.edges:
            if not (0 <= src < nv and 0 <= dst < nv):
                raise ValueError(f"edge ({src}, {dst}) names a vertex outside 0..{nv - 1}")
            a, b = unit_of[src], unit_of[dst]
            if a != b:
                succ[a].add(b)
        self.succs: list[tuple[int, ...]] = [tuple(sorted(s)) for s in succ]
        indeg = [0] * n
        for s in self.succs:
            for dst in s:
                indeg[dst] += 1
        self.indegree = indeg
        self.roots = [u for u in range(n) if indeg[u] == 0]
        key_index: dict[tuple[Stream, int], int] = {}
        self.keys: list[tuple[Stream, int]] = []
        self.key_of: list[int] = []
        self.device: list[int] = []
        for unit in units:
            keys = {(Stream(mg.vertices[vid].stream), vertex_device(mg.vertices[vid])) for vid in unit}
            if len(keys) > 1:
                raise ValueError(f"segment of vertices {list(unit)[:5]}... mixes streams or devices: {sorted(keys)}")
            key = keys.pop()
            if key not in key_index:
                key_index[key] = len(self.keys)
                self.keys.append(key)
            self.key_of.append(key_index[key])
            self.device.append(key[1])
        # units that launch only once what they read has really been made, not merely reported at
        # enqueue (launch-ahead): copies between devices. Launched on such a report, a copy holds its
        # stream instance while the device waits for its writer, and copies ready behind it wait too:
        # on four GPUs the owners' updated weights, launched as their updates were enqueued, held every
        # device's incoming gradient buckets (simulated, gpt1.3b: 197 ms a step against 174).
        self.waits_for_run = [self.keys[k][0] is Stream.D2D for k in self.key_of]
        # units whose real end some successor waits for: the backend tells the loop (Ran) when one of
        # them, reported at enqueue, has run
        self.watched = [any(self.waits_for_run[s] for s in self.succs[u]) for u in range(n)]
        # stream keys whose units launch in one fixed order whatever the policy: the messages to and from
        # other ranks, in tag order (trace/ranks.py), which every rank shares; key index -> units in order
        tasks = mg.taskgraph.vertices
        self.sequenced: dict[int, list[int]] = {}
        for u, unit in enumerate(units):
            if self.keys[self.key_of[u]][0] is Stream.COMM:
                self.sequenced.setdefault(self.key_of[u], []).append(u)
        for members in self.sequenced.values():
            members.sort(key=lambda u: tasks[mg.vertices[units[u][0]].task_vertex].kwargs["tag"])
        # what each unit needs beside its stream: ((manager name, description), ...), mostly empty.
        # A unit's vertices run one after another, so it needs the most any one of them needs.
        self.needs: list[tuple[tuple[str, Any], ...]] = []
        for u, unit in enumerate(units):
            for vid in unit:
                if mg.vertices[vid].lock is not None:
                    raise ResourceError(f"{format_vertex(mg, vid, inputs=False)} asks for lock "
                                        f"{mg.vertices[vid].lock!r}: no builder produces locks yet, so the "
                                        f"engine has no lock resource (engine/resources.py)")
            ws = max(int(mg.vertices[vid].workspace) for vid in unit)
            self.needs.append(((WORKSPACE, (self.device[u], ws)),) if ws else ())

    def unit_ranks(self, vertex_ranks: list[int]) -> list[int]:
        """A rank per unit from a rank per vertex: its best member's."""
        if len(vertex_ranks) != self.vertex_count:
            raise ValueError(f"{len(vertex_ranks)} ranks for {self.vertex_count} vertices")
        if self.n == self.vertex_count:
            return list(vertex_ranks)
        return [min(vertex_ranks[vid] for vid in unit) for unit in self.units]

    def predecessors(self) -> list[list[int]]:
        """Only for error messages: building it is O(edges)."""
        preds: list[list[int]] = [[] for _ in range(self.n)]
        for src, s in enumerate(self.succs):
            for dst in s:
                preds[dst].append(src)
        return preds


class Launch(NamedTuple):
    vertex: int
    key: int  # index into StaticGraph.keys
    instance: int  # stream instance within the key


class Scheduler:
    """Dependency counters, ready heaps and resources for one step. Not thread-safe: the loop owns it."""

    def __init__(self, graph: StaticGraph, ranks: list[int], strict: bool,
                 streams: StreamPool, workspace: WorkspacePool):
        """``ranks``: one per MemGraph vertex (a policy's); the scheduler ranks each unit by its best."""
        self.g = graph
        self.rank = ranks = graph.unit_ranks(ranks)
        for members in graph.sequenced.values():  # ready in their fixed order, whatever the policy's ranks
            for position, u in enumerate(members):
                ranks[u] = position - len(members)
        self.strict = strict
        self.streams = streams
        self.workspace = workspace
        # the managers StaticGraph.needs names; streams are apart: the ready heaps are per stream key
        self.resources = {WORKSPACE: workspace}
        for vid, needs in enumerate(graph.needs):
            for name, description in needs:
                reason = self.resources[name].never_fits(description)
                if reason is not None:
                    raise ResourceError(f"vertex {vid} {reason}")
        self.pending = list(graph.indegree)
        self.state = bytearray(graph.n)
        self.stream_of: list[tuple[int, int] | None] = [None] * graph.n  # stream handle (key, instance) held
        self.instance = [-1] * graph.n  # stream instance within its key, for records
        self.held: list[list | None] = [None] * graph.n  # handles of the other resources held, as in needs
        self.nkeys = len(graph.keys)
        self.ready: list[list[tuple[int, int]]] = [[] for _ in range(self.nkeys)]
        self.waiters: dict[str, list[tuple[int, int]]] = {name: [] for name in self.resources}
        # launch order per key: the vertices of that key sorted by rank (all keys when strict, else the
        # graph's sequenced ones); _next[k] is the one allowed next
        self.sequenced = [strict or k in graph.sequenced for k in range(self.nkeys)]
        per_key: list[list[int]] = [graph.sequenced.get(k, []) for k in range(self.nkeys)]
        if strict:
            per_key = [[] for _ in range(self.nkeys)]
            for vid in sorted(range(graph.n), key=ranks.__getitem__):
                per_key[graph.key_of[vid]].append(vid)
        self._sequence = per_key
        self._next = [0] * self.nkeys
        self.in_flight = 0
        self.done = 0
        # units reported at enqueue, not yet seen to run, whose successors waiting for that (StaticGraph.
        # waits_for_run) ran() releases
        self.unran = bytearray(graph.n)
        self.awaiting_run = 0
        self.halted = False
        self.drained = True  # False when drive() returned or raised with units still in flight
        self.launch_order: list[int] = []  # vertex ids in launch order (tests, traces); a unit's in its order

    # -- public ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.done == self.g.n

    def start(self) -> list[Launch]:
        for vid in self.g.roots:
            self._make_ready(vid)
        return self._dispatch()

    def complete(self, vid: int, ran: bool = True) -> list[Launch]:
        """Unit ``vid`` finished (or failed): free its resources, release its successors. ``ran``
        False: it was reported at enqueue and may still run on the device; its successors that wait
        for its real end (StaticGraph.waits_for_run) are released by ``ran(vid)`` instead."""
        if self.state[vid] != RUNNING:
            raise RuntimeError(f"completion for vertex {vid}, which is {_STATE_NAMES[self.state[vid]]}")
        g = self.g
        self.state[vid] = DONE
        self.in_flight -= 1
        self.done += 1
        self.streams.release(self.stream_of[vid])
        held = self.held[vid]
        if held is not None:
            self._release(vid, held)
        early = not ran and g.watched[vid]
        if early:
            self.unran[vid] = 1
            self.awaiting_run += 1
        return self._release_successors(vid, False if early else None)

    def ran(self, vid: int) -> list[Launch]:
        """Unit ``vid``, reported at enqueue, has really run: release its successors that waited for
        that. A unit ``complete`` did not hold any successor for is ignored."""
        if not self.unran[vid]:
            return []
        self.unran[vid] = 0
        self.awaiting_run -= 1
        return self._release_successors(vid, True)

    def _release_successors(self, vid: int, waiting: bool | None) -> list[Launch]:
        """Count unit ``vid`` done for its successors (None: all of them; False: those that do not wait
        for its run; True: only those), then launch what that made ready."""
        waits, pending = self.g.waits_for_run, self.pending
        for s in self.g.succs[vid]:
            if waiting is not None and waits[s] != waiting:
                continue
            pending[s] -= 1
            if pending[s] == 0:
                self._make_ready(s)
        if self.halted:
            return []
        return self._dispatch()

    def halt(self) -> None:
        """Stop launching (a vertex failed); completions are still accepted so in-flight work drains."""
        self.halted = True

    def stuck(self) -> list[int]:
        """Units that never launched, by their first vertex."""
        return [self.g.head[u] for u in range(self.g.n) if self.state[u] in (WAITING, READY)]

    def explain_stuck(self, mg: MemGraph, limit: int = 10) -> str:
        """Why vertices cannot run: unfinished predecessors, or their turn in deterministic mode."""
        g = self.g
        stuck = [u for u in range(g.n) if self.state[u] in (WAITING, READY)]
        preds = g.predecessors()
        lines = []
        for u in stuck[:limit]:
            vid = g.head[u]
            mv = mg.vertices[vid]
            what = format_vertex(mg, vid) + (f" (segment of {len(g.units[u])} vertices)" if len(g.units[u]) > 1 else "")
            if self.state[u] == WAITING:
                waiting = [g.head[p] for p in preds[u] if self.state[p] != DONE]
                lines.append(f"  {what}: waits for {waiting}")
            elif self.sequenced[g.key_of[u]]:
                k = g.key_of[u]
                head = g.head[self._sequence[k][self._next[k]]]
                order = "deterministic order" if self.strict else "the messages' fixed order"
                lines.append(f"  {what}: ready, but {order} on {mv.stream.value} launches vertex {head} first")
            else:
                lines.append(f"  {what}: ready but never got its resources")
        more = f"\n  ... and {len(stuck) - limit} more" if len(stuck) > limit else ""
        return "\n".join(lines) + more

    # -- internals --------------------------------------------------------------------
    def _make_ready(self, vid: int) -> None:
        self.state[vid] = READY
        heapq.heappush(self.ready[self.g.key_of[vid]], (self.rank[vid], vid))

    def _acquire(self, item: tuple[int, int]) -> bool:
        """Every resource vertex ``item[1]`` needs beside its stream, all or none (True if all).

        On a refusal, what was taken is given back and the vertex is parked with the manager that
        refused, until that manager releases something. Its stream is not taken here: the loop only
        pops a vertex whose stream key has a free instance, and takes it once this returns True.
        """
        vid = item[1]
        resources = self.resources
        needs = self.g.needs[vid]
        held = []
        for name, description in needs:
            handle = resources[name].try_acquire(description)
            if handle is None:
                for (taken, _), h in zip(needs, held):
                    resources[taken].release(h)
                heapq.heappush(self.waiters[name], item)
                return False
            held.append(handle)
        self.held[vid] = held
        return True

    def _release(self, vid: int, held: list) -> None:
        """Give back vertex ``vid``'s resources beside its stream; wake the vertices parked on them."""
        self.held[vid] = None
        resources, waiters = self.resources, self.waiters
        for (name, _), handle in zip(self.g.needs[vid], held):
            resources[name].release(handle)
            parked = waiters[name]
            if parked:  # rare: wake all; those that still do not fit park again
                waiters[name] = []
                for item in parked:
                    heapq.heappush(self.ready[self.g.key_of[item[1]]], item)

    def _dispatch(self) -> list[Launch]:
        """Launch every ready vertex whose resources are free, best rank first across keys."""
        launches: list[Launch] = []
        ready = self.ready
        free = self.streams.free
        needs = self.g.needs
        keys = range(self.nkeys)
        sequenced = self.sequenced
        while True:
            best = -1
            best_rank = 0
            for k in keys:
                heap = ready[k]
                if not heap or not free[k]:
                    continue
                rank, vid = heap[0]
                if sequenced[k] and vid != self._sequence[k][self._next[k]]:
                    continue  # its turn has not come: an earlier vertex of this stream class is not ready
                if best < 0 or rank < best_rank:
                    best, best_rank = k, rank
            if best < 0:
                return launches
            item = heapq.heappop(ready[best])
            vid = item[1]
            if needs[vid] and not self._acquire(item):
                continue  # parked until the resource that refused releases something
            handle = free[best].pop()  # streams.try_acquire(best), inlined: cannot refuse, free[best] is not empty
            self.stream_of[vid] = handle
            inst = handle[1]
            self.instance[vid] = inst
            self.state[vid] = RUNNING
            self.in_flight += 1
            if sequenced[best]:
                self._next[best] += 1
            self.launch_order.extend(self.g.units[vid])
            launches.append(Launch(vid, best, inst))


class Completion(NamedTuple):
    """What a backend reports for a vertex. Times are time.perf_counter() seconds (0 if unknown)."""

    vertex: int
    error: BaseException | None
    start: float
    end: float
    ran: bool = True  # False: reported at enqueue (launch-ahead); a Ran follows where StaticGraph.watched


class Ran(NamedTuple):
    """A unit reported at enqueue has really run (backends send it for StaticGraph.watched units)."""

    vertex: int


@dataclass
class LoopTime:
    """Where the loop thread's time went in one step: ``waiting_s`` blocked for a report with
    nothing to launch (CUDA's event source spins polling there), the rest (``busy_s``) launching
    units and keeping the books. ``busy_per_launch_s`` is the host cost per launch that the timing
    simulator charges as ``host_per_vertex`` (15 us, measured on an H100 with tiny kernels), here
    measured on a real step without a timeline's overhead."""

    launches: int = 0
    waiting_s: float = 0.0
    wall_s: float = 0.0

    @property
    def busy_s(self) -> float:
        return self.wall_s - self.waiting_s

    @property
    def busy_per_launch_s(self) -> float:
        return self.busy_s / max(1, self.launches)


class Record(NamedTuple):
    vertex: int
    key: int
    instance: int
    start: float
    end: float
    ok: bool


class NotRun(Exception):  # a report, not a failure
    """The error of a Completion for a unit that never started: the step was stopping (a backend
    cancelled it, or the loop stopped before handing it over). Not a failure of the unit."""


class StepToken:
    """One step's units on a backend's worker threads: which started, which run, and a switch that
    keeps the rest from starting.

    A worker calls ``begin(unit)`` right before running a unit and skips it (reporting NotRun) if
    that returns False, then ``end()`` once it ran. After ``cancel()``, no unit of the step starts,
    so the units it returns are all that ever ran, or run, of the step."""

    __slots__ = ("_idle", "cancelled", "running", "started")

    def __init__(self):
        self._idle = threading.Condition(threading.Lock())
        self.cancelled = False
        self.started: list[int] = []
        self.running = 0

    def begin(self, unit: int) -> bool:
        with self._idle:
            if self.cancelled:
                return False
            self.started.append(unit)
            self.running += 1
            return True

    def end(self) -> None:
        with self._idle:
            self.running -= 1
            if self.running == 0:
                self._idle.notify_all()

    def cancel(self) -> list[int]:
        """Start nothing more; return the units that started (ran, or run now)."""
        with self._idle:
            self.cancelled = True
            return list(self.started)

    def wait_idle(self, timeout: float | None) -> bool:
        """Wait until no unit of the step runs, at most ``timeout`` seconds (None: no limit), looking
        up every POLL_S so a Ctrl-C is seen; True if none runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self.running:
                left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._idle.wait(left)
            return True


class Interrupts:
    """Ctrl-C (SIGINT) held off while a step runs, so the loop stops where its books are whole.

    ``with Interrupts() as interrupts:`` on the main thread replaces SIGINT's Python handler for
    the block. Each signal calls the handler that was there (Python's default raises
    KeyboardInterrupt): what it raises the first time is kept in ``pending`` and not raised, and
    the loop, which looks at ``pending`` at least every POLL_S, stops launching and drains (or, once
    an update of a weight has begun, runs the step to its end: see drive's ``finish``); what it
    raises a second time is raised at once, wherever the main thread is (``hard``): control comes
    back without waiting for the drain. Later signals in the block are ignored (control is on its
    way back). A handler that returns without raising keeps meaning "ignore it". On leaving the
    block the handler is put back, and a pending interrupt that nothing raised yet is raised then
    (after a step that completed: it counts).

    On another thread (no signal reaches it) or under SIG_IGN / SIG_DFL the block changes nothing.
    """

    def __init__(self):
        self.pending: BaseException | None = None
        self.hard = False
        self.stop_by: float | None = None  # see drain_deadline
        self._previous: Any = None
        self._installed = False

    def drain_deadline(self) -> float:
        """When a stopping step stops waiting for its work (time.monotonic): DRAIN_S after the first
        ask, so every wait of one stop (the loop's drain, the backend's) shares one bound."""
        if self.stop_by is None:
            self.stop_by = time.monotonic() + DRAIN_S
        return self.stop_by

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            try:
                previous = signal.getsignal(signal.SIGINT)
                if callable(previous):
                    signal.signal(signal.SIGINT, self._handle)
                    self._previous, self._installed = previous, True
            except ValueError:  # not the main interpreter
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.hard:
            return
        try:
            self._previous(signum, frame)
        except BaseException as exc:
            if self.pending is None:
                self.pending = exc
                return
            self.hard = True
            exc.add_note("a second interrupt while the step was stopping: engine.run returned without waiting "
                         "for the work still running")
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGINT) == self._handle:
                signal.signal(signal.SIGINT, self._previous)
        pending = self.pending
        if pending is not None and exc is not pending and not self.hard:
            raise pending


_TAKES_TIMEOUT: dict[type, bool] = {}


def _timed_get(completions) -> Callable[[float], Completion | None]:
    """``wait(seconds)``: the next completion, or None after ``seconds`` without one. A source whose
    get() takes no timeout (tests' fakes, which never block) is simply asked."""
    get = completions.get
    kind = type(completions)
    takes = _TAKES_TIMEOUT.get(kind)
    if takes is None:
        try:
            takes = "timeout" in inspect.signature(get).parameters
        except (TypeError, ValueError):
            takes = False
        _TAKES_TIMEOUT[kind] = takes
    if not takes:
        return lambda seconds: get()

    def wait(seconds: float) -> Completion | None:
        try:
            return get(timeout=seconds)
        except queue.Empty:
            return None

    return wait


def drive(mg: MemGraph, scheduler: Scheduler, launch: Callable[[Launch], None],
          completions: queue.SimpleQueue[Completion], records: list[Record] | None = None, *,
          interrupts: Interrupts | None = None, stop: Callable[[], object] | None = None,
          finish: Callable[[], bool] | None = None, spent: LoopTime | None = None) -> list[Record]:
    """Run the step to the end on the calling thread; return what ran where and when.

    The loop works on units (StaticGraph); ``launch`` gets a unit, the records name each unit by
    its first vertex. ``launch`` starts a unit asynchronously (it may also raise: that counts as
    the vertex failing). Backends put a Completion on ``completions`` for every
    launched vertex, exactly once, from any thread. ``records`` (appended to,
    also when the step fails) lets a caller trace a failed step; ``spent`` (filled in, also when the
    step fails) says where the loop thread's time went.

    The step stops early when a unit raises (an Exception: VertexError once drained; a
    KeyboardInterrupt or other BaseException: raised as it is) or when ``interrupts.pending`` is
    set (raised once drained), unless ``finish()`` says, when the first Ctrl-C is seen, that stopping
    would leave the weights mixing two steps (an update of a weight has begun): the step then runs to
    its end, nothing lost, and the interrupt is the caller's to raise once it has counted (a second
    Ctrl-C still stops it at once). Stopping: nothing more is launched, ``stop()`` (the backend's
    cancel_step) keeps launched units that have not started from starting, and the units in
    flight are waited for, at most DRAIN_S seconds; after that they are abandoned
    (``scheduler.drained`` False, a note on the exception). An exception of the loop itself (its
    books, the completion source, a second Ctrl-C) is raised at once, undrained.
    """
    records = [] if records is None else records
    spent = LoopTime() if spent is None else spent
    clock = time.perf_counter
    began = clock()
    failure: tuple[int, BaseException] | None = None
    interrupt: BaseException | None = None
    finishing = False  # Ctrl-C came after an update began: the step runs to its end
    deadline: float | None = None  # set once the loop stops launching
    get = _timed_get(completions)

    def wait(seconds: float) -> Completion | None:
        asked = clock()
        done = get(seconds)
        spent.waiting_s += clock() - asked
        return done

    def halt() -> None:
        nonlocal deadline
        if deadline is None:
            scheduler.halt()
            deadline = interrupts.drain_deadline() if interrupts is not None else time.monotonic() + DRAIN_S
            if stop is not None:
                stop()

    def take_interrupt() -> None:
        """The first Ctrl-C: stop, or finish a step whose updates began."""
        nonlocal interrupt, finishing
        if interrupt is None and interrupts is not None and interrupts.pending is not None:
            interrupt = interrupts.pending
            if finish is not None and finish():
                finishing = True
                log.warning("Ctrl-C: this step's updates have begun, so it runs to its end (%d of %d units "
                            "done) and counts; Ctrl-C again to stop at once, which leaves the weights mixing "
                            "two steps", scheduler.done, scheduler.g.n)
            else:
                halt()

    def launch_all(batch: list[Launch]) -> None:
        for item in batch:
            take_interrupt()
            if deadline is not None:  # stopped within this batch: the backend never gets the rest
                now = time.perf_counter()
                completions.put(Completion(item.vertex, NotRun("the step was stopping"), now, now))
                continue
            spent.launches += 1
            try:
                launch(item)
            except BaseException as exc:  # reported as that vertex's failure (a second Ctrl-C: raised)
                if interrupts is not None and interrupts.hard:
                    raise
                now = time.perf_counter()
                completions.put(Completion(item.vertex, exc, now, now))

    n = scheduler.g.n
    key_of = scheduler.g.key_of
    head = scheduler.g.head
    instance_of = scheduler.instance
    try:
        launch_all(scheduler.start())
        while scheduler.done < n:
            take_interrupt()
            if scheduler.in_flight == 0 and (failure is not None or (interrupt is not None and not finishing)):
                break
            if scheduler.in_flight == 0 and not scheduler.awaiting_run:  # (awaiting: reported units still run)
                stuck = scheduler.stuck()
                raise StallError(f"stall: {len(stuck)} of {scheduler.g.n} vertices can never run "
                                 f"(nothing ready, nothing in flight)\n{scheduler.explain_stuck(mg)}", stuck)
            if deadline is None:
                done = wait(POLL_S)
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    break  # abandoned: the units still in flight are the caller's to account for
                done = wait(min(left, POLL_S))
            if done is None:
                continue
            if type(done) is Ran:
                launch_all(scheduler.ran(done.vertex))
                continue
            vid = done.vertex  # a unit
            error = done.error
            records.append(Record(head[vid], key_of[vid], instance_of[vid], done.start, done.end, error is None))
            if error is not None and not isinstance(error, NotRun):
                if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit raised by the unit
                    if interrupt is None or finishing:
                        interrupt, finishing = error, False
                        halt()
                elif failure is None:
                    # a unit of several vertices says which one failed (Runtime.execute_unit)
                    failure = (getattr(error, "failed_vertex", head[vid]), error)
                    finishing = False
                    halt()
                else:
                    log.warning("vertex %d also failed while draining: %r", vid, error)
            launch_all(scheduler.complete(vid, done.ran))
    except BaseException:
        scheduler.halt()
        scheduler.drained = scheduler.in_flight == 0
        raise
    finally:
        spent.wall_s = clock() - began
    scheduler.drained = scheduler.in_flight == 0
    note = None
    if not scheduler.drained:
        running = [head[u] for u in range(n) if scheduler.state[u] == RUNNING]
        note = (f"{len(running)} units launched before the step stopped were still running after {DRAIN_S:g} s "
                f"({format_vertex(mg, running[0], inputs=False)}, ...): engine.run did not wait for them")
    if finishing and failure is None and scheduler.done == n:
        return records  # the step ran to its end: the caller counts it, then raises the interrupt
    if interrupt is not None:
        if failure is not None:
            interrupt.add_note(f"{format_vertex(mg, failure[0], inputs=False)} had failed: "
                               f"{type(failure[1]).__name__}: {failure[1]}")
        if note:
            interrupt.add_note(note)
        raise interrupt
    if failure is not None:
        vid, exc = failure
        info = describe_vertex(mg, vid)
        err = VertexError(f"{format_info(info)} failed: {type(exc).__name__}: {exc}",
                          vid, info.kind, info.op, info.module, info.inputs)
        if note:
            err.add_note(note)
        raise err from exc
    return records
