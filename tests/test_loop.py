"""The event loop's bookkeeping, with fake backends that complete vertices in a chosen order (no threads)."""

from __future__ import annotations

import random
import time

import pytest
from turnip.engine import DeterministicPolicy, RandomPolicy, SerialPolicy, StallError, VertexError
from turnip.engine.errors import ResourceError
from turnip.engine.loop import Completion, Scheduler, StaticGraph, drive
from turnip.engine.policy import make_policy, serial_positions
from turnip.engine.resources import StreamPool, WorkspacePool, stream_counts
from turnip.ir.memgraph import Edge, Kind, MemGraph, Stream
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph

STREAMS = (Stream.COMPUTE, Stream.H2D, Stream.D2H)


def random_memgraph(n: int, seed: int, p_edge: float = 0.08, p_ws: float = 0.3,
                    shuffle_serial: bool = False) -> MemGraph:
    """A random DAG over n vertices (edges only from lower to higher ids), random streams/workspace."""
    rng = random.Random(seed)
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(n):
        ws = rng.choice([10, 40, 70]) if rng.random() < p_ws else 0
        mg.add_vertex(Kind.COMPUTE, rng.choice(STREAMS), workspace=ws)
    for dst in range(n):
        for src in range(max(0, dst - 12), dst):
            if rng.random() < p_edge:
                mg.add_edge(src, dst, Edge.DATA)
    mg.serial = list(range(n))
    if shuffle_serial:  # another topological order: sort by (random level-respecting key)
        depth = [0] * n
        for src, dst, _ in sorted(mg.edges, key=lambda e: e[1]):
            depth[dst] = max(depth[dst], depth[src] + 1)
        mg.serial = sorted(range(n), key=lambda v: (depth[v], rng.random()))
    return mg


def make_scheduler(mg, policy, counts=None, ws_cap=100):
    graph = StaticGraph(mg)
    counts = counts or {Stream.COMPUTE: 2, Stream.H2D: 1, Stream.D2H: 1}
    pool = StreamPool([counts[s] for s, _ in graph.keys])
    return Scheduler(graph, policy.ranks(mg), policy.strict, pool, WorkspacePool({0: ws_cap}))


class Checker:
    """Replays the scheduler against an oracle: dependencies, resources, maximality, priority."""

    def __init__(self, mg, sched, counts, ws_cap):
        self.mg, self.s, self.counts, self.ws_cap = mg, sched, counts, ws_cap
        self.preds = sched.g.predecessors()
        self.done: set[int] = set()
        self.running: dict[int, tuple] = {}
        self.launched: list[int] = []

    def blocked(self, v) -> bool:
        mv = self.mg.vertices[v]
        busy = sum(1 for u in self.running if self.mg.vertices[u].stream == mv.stream)
        if busy >= self.counts[mv.stream]:
            return True
        used = sum(self.mg.vertices[u].workspace for u in self.running)
        return used + mv.workspace > self.ws_cap

    def ready_unlaunched(self):
        started = set(self.launched)
        return [v for v in range(len(self.mg.vertices))
                if v not in started and all(p in self.done for p in self.preds[v])]

    def launches(self, items, strict: bool):
        for item in items:
            v = item.vertex
            assert all(p in self.done for p in self.preds[v]), f"{v} launched before its predecessors"
            mv = self.mg.vertices[v]
            assert not self.blocked(v), f"{v} launched without free resources"
            key = (mv.stream, 0)
            assert self.s.g.keys[item.key] == key
            assert all(r != (item.key, item.instance) for r in self.running.values()), "stream instance reused"
            self.running[v] = (item.key, item.instance)
            self.launched.append(v)
        rank = self.s.rank
        # one dispatch launches best rank first, across stream classes too
        assert [rank[i.vertex] for i in items] == sorted(rank[i.vertex] for i in items), "launched out of rank order"
        if strict:
            # the next vertex of each stream class in serial order launches as soon as it can
            started = set(self.launched)
            for cls in STREAMS:
                rest = [v for v in self.mg.serial if self.mg.vertices[v].stream == cls and v not in started]
                if rest and all(p in self.done for p in self.preds[rest[0]]):
                    assert self.blocked(rest[0]), f"{rest[0]} is next in serial order, ready, and not launched"
        if not strict:
            # maximal: every ready vertex left over is blocked by a resource
            for v in self.ready_unlaunched():
                assert self.blocked(v), f"{v} is ready with free resources but was not launched"
            # priority: no vertex launched now is outranked by a ready one of its stream that could have gone instead
            waiting = [v for v in self.ready_unlaunched()]
            for item in items:
                for u in waiting:
                    mu, mv = self.mg.vertices[u], self.mg.vertices[item.vertex]
                    if mu.stream == mv.stream and not mu.workspace:
                        assert rank[item.vertex] < rank[u], f"{item.vertex} launched before better-ranked {u}"

    def complete(self, v):
        del self.running[v]
        self.done.add(v)


def play(mg, policy, seed, counts=None, ws_cap=100):
    counts = counts or {Stream.COMPUTE: 2, Stream.H2D: 1, Stream.D2H: 1}
    sched = make_scheduler(mg, policy, counts, ws_cap)
    chk = Checker(mg, sched, counts, ws_cap)
    rng = random.Random(seed)
    chk.launches(sched.start(), policy.strict)
    while chk.running:
        v = rng.choice(sorted(chk.running))  # the fake backend completes a random in-flight vertex
        chk.complete(v)
        chk.launches(sched.complete(v), policy.strict)
    assert sched.finished and len(chk.done) == len(mg.vertices)
    return chk.launched


@pytest.mark.parametrize("seed", range(8))
def test_nondeterministic_respects_deps_resources_and_is_maximal(seed):
    mg = random_memgraph(60, seed)
    play(mg, SerialPolicy(), seed)


@pytest.mark.parametrize("seed", range(8))
def test_random_policy_valid_and_orders_differ(seed):
    mg = random_memgraph(60, seed)
    a = play(mg, RandomPolicy(seed=1), seed)
    b = play(mg, RandomPolicy(seed=2), seed)
    assert sorted(a) == sorted(b) == list(range(60))
    assert a != b


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shuffle", [False, True])
def test_deterministic_launches_in_serial_order_per_stream_class(seed, shuffle):
    mg = random_memgraph(60, seed, shuffle_serial=shuffle)
    launched = play(mg, DeterministicPolicy(), seed)
    for cls in STREAMS:
        got = [v for v in launched if mg.vertices[v].stream == cls]
        want = [v for v in mg.serial if mg.vertices[v].stream == cls]
        assert got == want


def test_deterministic_same_launch_order_for_any_completion_order():
    mg = random_memgraph(80, 3)
    orders = {tuple(play(mg, DeterministicPolicy(), s, counts={Stream.COMPUTE: 1, Stream.H2D: 1, Stream.D2H: 1}))
              for s in range(5)}
    per_class = {tuple(tuple(v for v in o if mg.vertices[v].stream == c) for c in STREAMS) for o in orders}
    assert len(per_class) == 1


def test_highest_priority_first_on_one_stream():
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(6):
        mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE)
    mg.serial = [4, 2, 0, 5, 1, 3]
    sched = make_scheduler(mg, SerialPolicy(), {Stream.COMPUTE: 1, Stream.H2D: 1, Stream.D2H: 1})
    order = [l.vertex for l in sched.start()]
    while not sched.finished:
        order += [l.vertex for l in sched.complete(order[-1])]
    assert order == mg.serial


def test_best_ranked_first_across_stream_classes():
    """Vertices of different stream classes ready together launch in rank order, not stream-class order.

    The order matters: the backends start them in this order, and a resource they compete for goes
    to the first. With every class's stream free, one dispatch launches all of them.
    """
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    # ids in stream-class order (compute, h2d, d2h), ranks interleaved and in neither id nor class order
    classes = [Stream.COMPUTE, Stream.COMPUTE, Stream.H2D, Stream.H2D, Stream.D2H, Stream.D2H]
    for cls in classes:
        mg.add_vertex(Kind.COMPUTE, cls)
    mg.serial = [4, 2, 0, 5, 3, 1]
    counts = {Stream.COMPUTE: 2, Stream.H2D: 2, Stream.D2H: 2}
    for policy in (SerialPolicy(), DeterministicPolicy()):
        assert [l.vertex for l in make_scheduler(mg, policy, counts).start()] == mg.serial, policy
    # one workspace slot that every class wants: the best-ranked vertex gets it, whatever its class
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for cls in classes:
        mg.add_vertex(Kind.COMPUTE, cls, workspace=60)
    mg.serial = [4, 2, 0, 5, 3, 1]
    sched = make_scheduler(mg, SerialPolicy(), counts, ws_cap=100)
    order = [l.vertex for l in sched.start()]
    while not sched.finished:
        order += [l.vertex for l in sched.complete(order[-1])]
    assert order == mg.serial


def test_lock_is_refused_until_a_resource_produces_locks():
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE)
    mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, lock="acc")
    with pytest.raises(ResourceError, match="vertex 1 \\(compute\\) asks for lock 'acc': no builder produces locks"):
        StaticGraph(mg)


def test_workspace_bounded_and_oversize_refused():
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(3):
        mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, workspace=60)
    sched = make_scheduler(mg, SerialPolicy(), {Stream.COMPUTE: 3, Stream.H2D: 1, Stream.D2H: 1}, ws_cap=100)
    assert [l.vertex for l in sched.start()] == [0]
    assert [l.vertex for l in sched.complete(0)] == [1]
    assert sched.workspace.peak[0] == 60
    mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, workspace=150)
    with pytest.raises(ResourceError, match="150 workspace bytes"):
        make_scheduler(mg, SerialPolicy(), ws_cap=100)


def test_workspace_heavy_random_graphs():
    for seed in range(5):
        mg = random_memgraph(80, 100 + seed, p_ws=0.6)
        play(mg, SerialPolicy(), seed, counts={Stream.COMPUTE: 4, Stream.H2D: 2, Stream.D2H: 2}, ws_cap=100)
        play(mg, DeterministicPolicy(), seed, counts={Stream.COMPUTE: 4, Stream.H2D: 2, Stream.D2H: 2}, ws_cap=100)


# -- drive(): the loop thread with a fake backend ------------------------------------------------------------------

class FakeBackend:
    """launch() only records; the completion queue hands back a random in-flight vertex (seeded)."""

    def __init__(self, seed=0, fail=(), raise_at_launch=()):
        self.rng = random.Random(seed)
        self.in_flight: list[int] = []
        self.fail, self.raise_at_launch = set(fail), set(raise_at_launch)
        self.extra: list[Completion] = []
        self.launched: list[int] = []
        self.completed: list[int] = []

    def launch(self, item):
        if item.vertex in self.raise_at_launch:
            raise RuntimeError(f"launch of {item.vertex} refused")
        self.launched.append(item.vertex)
        self.in_flight.append(item.vertex)

    # the queue interface drive() uses
    def put(self, completion):
        self.extra.append(completion)

    def get(self):
        if self.extra:
            return self.extra.pop(0)
        # fail first if a failing vertex is in flight, so the drain path sees other work still running
        failing = [v for v in self.in_flight if v in self.fail]
        v = failing[0] if failing else self.rng.choice(self.in_flight)
        self.in_flight.remove(v)
        self.completed.append(v)
        err = ValueError(f"vertex {v} exploded") if v in self.fail else None
        return Completion(v, err, 0.0, 0.0)


def test_drive_runs_everything():
    mg = random_memgraph(50, 7)
    be = FakeBackend(1)
    sched = make_scheduler(mg, SerialPolicy())
    records = drive(mg, sched, be.launch, be)
    assert sorted(r.vertex for r in records) == list(range(50))
    assert all(r.ok for r in records)


def test_drive_failure_drains_in_flight_then_raises():
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(4):
        mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE)
    mg.add_edge(0, 3, Edge.DATA)
    be = FakeBackend(0, fail={0})
    sched = make_scheduler(mg, SerialPolicy(), {Stream.COMPUTE: 3, Stream.H2D: 1, Stream.D2H: 1})
    with pytest.raises(VertexError, match="vertex 0 \\(compute\\).*exploded") as info:
        drive(mg, sched, be.launch, be)
    assert info.value.vertex == 0 and isinstance(info.value.__cause__, ValueError)
    assert sched.in_flight == 0 and be.in_flight == []  # drained: 1 and 2 completed before the raise
    assert sorted(be.completed) == [0, 1, 2]
    assert 3 not in be.launched  # nothing new launched after the failure


def test_drive_launch_that_raises_is_a_vertex_error():
    mg = random_memgraph(20, 2)
    be = FakeBackend(0, raise_at_launch={5})
    with pytest.raises(VertexError, match="launch of 5 refused"):
        drive(mg, make_scheduler(mg, SerialPolicy()), be.launch, be)
    assert be.in_flight == []


def test_drive_stall_on_cycle_names_stuck_vertices():
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(4):
        mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE)
    for src, dst in [(0, 1), (1, 2), (2, 1), (2, 3)]:
        mg.add_edge(src, dst, Edge.DATA)
    be = FakeBackend(0)
    with pytest.raises(StallError, match="3 of 4 vertices") as info:
        drive(mg, make_scheduler(mg, SerialPolicy()), be.launch, be)
    assert info.value.stuck == [1, 2, 3]
    assert "vertex 1 (compute): waits for [2]" in str(info.value)


def test_deterministic_stall_when_serial_contradicts_edges():
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(2):
        mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE)
    mg.add_edge(0, 1, Edge.DATA)
    mg.serial = [1, 0]
    be = FakeBackend(0)
    with pytest.raises(StallError, match="deterministic order on compute launches vertex 1 first"):
        drive(mg, make_scheduler(mg, DeterministicPolicy()), be.launch, be)


# -- policies and resource managers ------------------------------------------------------------------------------

def test_policies_and_stream_counts():
    mg = random_memgraph(10, 0)
    mg.serial = [3, 1]
    rank = serial_positions(mg)
    assert rank[3] == 0 and rank[1] == 1 and sorted(rank) == list(range(10))
    assert RandomPolicy(5).ranks(mg) == RandomPolicy(5).ranks(mg) != RandomPolicy(6).ranks(mg)
    assert make_policy("deterministic").strict and not make_policy("nondeterministic").strict
    with pytest.raises(ValueError, match="ordering must be one of"):
        make_policy("fastest")
    mg.serial = [3, 3]
    with pytest.raises(ValueError, match="twice"):
        serial_positions(mg)
    counts = stream_counts("cpu", {"compute": 4, Stream.H2D: 2})
    assert counts[Stream.COMPUTE] == 4 and counts[Stream.H2D] == 2 and counts[Stream.D2H] == 1
    cuda = stream_counts("cuda")
    assert (cuda[Stream.COMPUTE], cuda[Stream.H2D], cuda[Stream.D2H]) == (1, 2, 2)
    with pytest.raises(ValueError):
        stream_counts("cpu", {"compute": 0})


def test_resource_managers():
    pool = StreamPool([1, 2])
    a, b = pool.try_acquire(1), pool.try_acquire(1)
    assert {a, b} == {(1, 0), (1, 1)} and pool.try_acquire(1) is None and pool.busy(1) == 2
    assert pool.try_acquire(0) == (0, 0) and pool.busy(1) == 2
    pool.release(a)
    assert pool.try_acquire(1) == a
    ws = WorkspacePool({0: 10})
    six, four = (0, 6), (0, 4)
    held = ws.try_acquire(six)
    assert held is not None and ws.try_acquire(six) is None and ws.try_acquire(four) is not None
    ws.release(held)
    assert ws.used[0] == 4 and ws.peak[0] == 10
    assert ws.never_fits((0, 10)) is None and "11 workspace bytes" in ws.never_fits((0, 11))


def test_completion_path_cost_per_vertex():
    """Bookkeeping per vertex (complete + launch) with no backend; CUDA needs it well under 10 us."""
    mg = random_memgraph(20000, 11, p_edge=0.15, p_ws=0.0)
    sched = make_scheduler(mg, SerialPolicy(), {Stream.COMPUTE: 5, Stream.H2D: 2, Stream.D2H: 2})
    t0 = time.perf_counter()
    fifo = [l.vertex for l in sched.start()]
    i = 0
    while i < len(fifo):
        fifo.extend(l.vertex for l in sched.complete(fifo[i]))
        i += 1
    per_vertex = (time.perf_counter() - t0) / len(mg.vertices)
    assert sched.finished
    print(f"scheduler cost per vertex: {per_vertex * 1e6:.2f} us")
    assert per_vertex < 50e-6  # generous for slow CI machines; typically a few us
