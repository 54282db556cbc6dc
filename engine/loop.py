"""The event loop: dependency counters, a ready set by priority, resources, completions.

Split in two so the bookkeeping can be tested (and simulated) without threads:

- ``Scheduler`` is pure state: ``start()`` and ``complete(v)`` return the
  vertices to launch now. Per completion it does O(successors) work plus
  O(stream keys) per launch; nothing scans all vertices (CUDA target: the
  completion path costs < 10 us per vertex).
- ``drive()`` is the loop thread: it launches through a backend, blocks on a
  thread-safe queue that backends fill from their completion callbacks
  (callbacks only enqueue), and turns failures and stalls into exceptions
  only after in-flight work has drained, so the engine stays usable.

Ready vertices wait in one heap per stream key ((stream class, device)).
A vertex whose stream is busy simply stays in its heap; one blocked on a
lock or on workspace is parked with that resource and put back when it is
released, so a busy lock never stalls vertices of other locks or none.
"""

from __future__ import annotations

import heapq
import logging
import queue
import time
from collections.abc import Callable
from typing import NamedTuple

from turnip.engine.errors import ResourceError, StallError, VertexError
from turnip.engine.resources import LockTable, StreamPool, WorkspacePool
from turnip.ir.describe import describe_vertex, format_info, format_vertex
from turnip.ir.memgraph import MemGraph, Stream

log = logging.getLogger(__name__)

WAITING, READY, RUNNING, DONE = 0, 1, 2, 3
_STATE_NAMES = ("waiting on predecessors", "ready", "running", "done")


def vertex_device(mv) -> int:
    """The device whose streams run a vertex: where it writes on the GPU, else where it reads."""
    for places in (mv.writes, mv.reads):
        for place in places.values():
            if place.where == "gpu":
                return place.device
    return 0


class StaticGraph:
    """What the loop needs from a MemGraph, in flat lists, computed once per MemGraph."""

    def __init__(self, mg: MemGraph):
        n = len(mg.vertices)
        self.n = n
        succ: list[set[int]] = [set() for _ in range(n)]
        for src, dst, _ in mg.edges:
            if not (0 <= src < n and 0 <= dst < n):
                raise ValueError(f"edge ({src}, {dst}) names a vertex outside 0..{n - 1}")
            succ[src].add(dst)
        self.succs: list[tuple[int, ...]] = [tuple(sorted(s)) for s in succ]
        indeg = [0] * n
        for s in self.succs:
            for dst in s:
                indeg[dst] += 1
        self.indegree = indeg
        self.roots = [v for v in range(n) if indeg[v] == 0]
        key_index: dict[tuple[Stream, int], int] = {}
        self.keys: list[tuple[Stream, int]] = []
        self.key_of: list[int] = []
        self.device: list[int] = []
        for mv in mg.vertices:
            key = (Stream(mv.stream), vertex_device(mv))
            if key not in key_index:
                key_index[key] = len(self.keys)
                self.keys.append(key)
            self.key_of.append(key_index[key])
            self.device.append(key[1])
        self.workspace: list[int] = [int(mv.workspace) for mv in mg.vertices]
        self.lock: list[str | None] = [mv.lock for mv in mg.vertices]

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
                 streams: StreamPool, workspace: WorkspacePool, locks: LockTable | None = None):
        if len(ranks) != graph.n:
            raise ValueError(f"{len(ranks)} ranks for {graph.n} vertices")
        self.g = graph
        self.rank = ranks
        self.strict = strict
        self.streams = streams
        self.workspace = workspace
        self.locks = locks or LockTable()
        for vid, ws in enumerate(graph.workspace):
            if ws and not workspace.fits_ever(graph.device[vid], ws):
                raise ResourceError(f"vertex {vid} needs {ws} workspace bytes, more than the "
                                    f"{workspace.capacity.get(graph.device[vid])} available on device "
                                    f"{graph.device[vid]}")
        self.pending = list(graph.indegree)
        self.state = bytearray(graph.n)
        self.instance = [-1] * graph.n
        self.nkeys = len(graph.keys)
        self.ready: list[list[tuple[int, int]]] = [[] for _ in range(self.nkeys)]
        self.lock_waiters: dict[str, list[tuple[int, int]]] = {}
        self.ws_waiters: dict[int, list[tuple[int, int]]] = {}
        if strict:
            # launch order per key: the vertices of that key sorted by rank; _next[k] is the one allowed next
            per_key: list[list[int]] = [[] for _ in range(self.nkeys)]
            for vid in sorted(range(graph.n), key=ranks.__getitem__):
                per_key[graph.key_of[vid]].append(vid)
            self._sequence = per_key
            self._next = [0] * self.nkeys
        self.in_flight = 0
        self.done = 0
        self.halted = False
        self.launch_order: list[int] = []  # vertex ids in launch order (tests, traces)

    # -- public ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.done == self.g.n

    def start(self) -> list[Launch]:
        for vid in self.g.roots:
            self._make_ready(vid)
        return self._dispatch()

    def complete(self, vid: int) -> list[Launch]:
        """Vertex ``vid`` finished (or failed): free its resources, release its successors."""
        if self.state[vid] != RUNNING:
            raise RuntimeError(f"completion for vertex {vid}, which is {_STATE_NAMES[self.state[vid]]}")
        g = self.g
        self.state[vid] = DONE
        self.in_flight -= 1
        self.done += 1
        self.streams.release(g.key_of[vid], self.instance[vid])
        lock = g.lock[vid]
        if lock is not None:
            self.locks.release(lock)
            waiters = self.lock_waiters.get(lock)
            if waiters:
                # wake all: the best waiter may sit behind a busy stream while another could take the lock
                # now; those that lose the lock again park again (waiters per lock are few: sum-into fan-in)
                self.lock_waiters[lock] = []
                for item in waiters:
                    self._unpark(item)
        ws = g.workspace[vid]
        if ws:
            dev = g.device[vid]
            self.workspace.release(dev, ws)
            waiters = self.ws_waiters.get(dev)
            if waiters:  # rare: wake all, those that still do not fit park again
                self.ws_waiters[dev] = []
                for item in waiters:
                    self._unpark(item)
        pending = self.pending
        for s in g.succs[vid]:
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
        return [vid for vid in range(self.g.n) if self.state[vid] in (WAITING, READY)]

    def explain_stuck(self, mg: MemGraph, limit: int = 10) -> str:
        """Why vertices cannot run: unfinished predecessors, or their turn in deterministic mode."""
        stuck = self.stuck()
        preds = self.g.predecessors()
        lines = []
        for vid in stuck[:limit]:
            mv = mg.vertices[vid]
            what = format_vertex(mg, vid)
            if self.state[vid] == WAITING:
                waiting = [p for p in preds[vid] if self.state[p] != DONE]
                lines.append(f"  {what}: waits for {waiting}")
            elif self.strict:
                k = self.g.key_of[vid]
                head = self._sequence[k][self._next[k]]
                lines.append(f"  {what}: ready, but deterministic order on {mv.stream.value} launches "
                             f"vertex {head} first")
            else:
                lines.append(f"  {what}: ready but never got its resources")
        more = f"\n  ... and {len(stuck) - limit} more" if len(stuck) > limit else ""
        return "\n".join(lines) + more

    # -- internals --------------------------------------------------------------------
    def _make_ready(self, vid: int) -> None:
        self.state[vid] = READY
        heapq.heappush(self.ready[self.g.key_of[vid]], (self.rank[vid], vid))

    def _unpark(self, item: tuple[int, int]) -> None:
        heapq.heappush(self.ready[self.g.key_of[item[1]]], item)

    def _dispatch(self) -> list[Launch]:
        """Launch every ready vertex whose resources are free, best rank first across keys."""
        launches: list[Launch] = []
        g = self.g
        ready = self.ready
        streams = self.streams
        free = streams.free
        keys = range(self.nkeys)
        strict = self.strict
        while True:
            best = -1
            best_rank = 0
            for k in keys:
                heap = ready[k]
                if not heap or not free[k]:
                    continue
                rank, vid = heap[0]
                if strict and vid != self._sequence[k][self._next[k]]:
                    continue  # its turn has not come: an earlier vertex of this stream class is not ready
                if best < 0 or rank < best_rank:
                    best, best_rank = k, rank
            if best < 0:
                return launches
            item = heapq.heappop(ready[best])
            vid = item[1]
            lock = g.lock[vid]
            if lock is not None and not self.locks.acquire(lock):
                heapq.heappush(self.lock_waiters.setdefault(lock, []), item)
                continue
            ws = g.workspace[vid]
            if ws and not self.workspace.acquire(g.device[vid], ws):
                if lock is not None:
                    self.locks.release(lock)
                heapq.heappush(self.ws_waiters.setdefault(g.device[vid], []), item)
                continue
            inst = free[best].pop()
            self.instance[vid] = inst
            self.state[vid] = RUNNING
            self.in_flight += 1
            if strict:
                self._next[best] += 1
            self.launch_order.append(vid)
            launches.append(Launch(vid, best, inst))


class Completion(NamedTuple):
    """What a backend reports for a vertex. Times are time.perf_counter() seconds (0 if unknown)."""

    vertex: int
    error: BaseException | None
    start: float
    end: float


class Record(NamedTuple):
    vertex: int
    key: int
    instance: int
    start: float
    end: float
    ok: bool


def drive(mg: MemGraph, scheduler: Scheduler, launch: Callable[[Launch], None],
          completions: queue.SimpleQueue[Completion], records: list[Record] | None = None) -> list[Record]:
    """Run the step to the end on the calling thread; return what ran where and when.

    ``launch`` starts a vertex asynchronously (it may also raise: that counts as
    the vertex failing). Backends put a Completion on ``completions`` for every
    launched vertex, exactly once, from any thread. ``records`` (appended to,
    also when the step fails) lets a caller trace a failed step.
    """
    records = [] if records is None else records
    failure: tuple[int, BaseException] | None = None
    interrupt: BaseException | None = None

    def launch_all(batch: list[Launch]) -> None:
        for item in batch:
            try:
                launch(item)
            except Exception as exc:  # noqa: BLE001 - reported as that vertex's failure
                now = time.perf_counter()
                completions.put(Completion(item.vertex, exc, now, now))

    launch_all(scheduler.start())
    n = scheduler.g.n
    key_of = scheduler.g.key_of
    instance_of = scheduler.instance
    while scheduler.done < n:
        if scheduler.in_flight == 0:
            if failure is not None or interrupt is not None:
                break
            stuck = scheduler.stuck()
            raise StallError(f"stall: {len(stuck)} of {scheduler.g.n} vertices can never run "
                             f"(nothing ready, nothing in flight)\n{scheduler.explain_stuck(mg)}", stuck)
        try:
            done = completions.get()
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt: stop launching, drain, re-raise
            if interrupt is None:
                interrupt = exc
                scheduler.halt()
            continue
        vid = done.vertex
        records.append(Record(vid, key_of[vid], instance_of[vid], done.start, done.end, done.error is None))
        if done.error is not None:
            if failure is None:
                failure = (vid, done.error)
                scheduler.halt()
            else:
                log.warning("vertex %d also failed while draining: %r", vid, done.error)
        launch_all(scheduler.complete(vid))
    if interrupt is not None:
        raise interrupt
    if failure is not None:
        vid, exc = failure
        info = describe_vertex(mg, vid)
        raise VertexError(f"{format_info(info)} failed: {type(exc).__name__}: {exc}",
                          vid, info.kind, info.op, info.module, info.inputs) from exc
    return records
