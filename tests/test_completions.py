"""The CUDA backend's completion sources (engine/completions.py) without CUDA: a fake GPU thread runs
each fake stream's work in order and fires its host functions, the real loop (engine.loop.drive)
consumes the reports. Also: engine.run's completion argument is checked before a step runs."""

from __future__ import annotations

import collections
import random
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from turnip.engine.completions import (
    COMPLETIONS,
    CallbackCompletions,
    EventCompletions,
    Lane,
    completion_mode,
    crosses_keys,
)
from turnip.engine.errors import EngineError
from turnip.engine.loop import Scheduler, StaticGraph, drive
from turnip.engine.policy import make_policy
from turnip.engine.resources import StreamPool, WorkspacePool
from turnip.ir.memgraph import Edge, Kind, MemGraph, Stream
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph


# -- the argument -----------------------------------------------------------------------------
def test_completion_mode_names_the_allowed_values():
    assert completion_mode("cuda", None) == "events"
    assert completion_mode("cuda", "events") == "events"
    assert completion_mode("cpu", "callback") == "callback"  # no CuPy needed: the CPU backend ignores it
    for bad in ("poll", "", "Callback", 1, True):
        with pytest.raises(ValueError, match="completion must be one of 'events', 'callback'"):
            completion_mode("cuda", bad)


@pytest.mark.parametrize("torch_cuda,extra", [("13.0", r"turnip\[cuda13\]'"), ("12.8", r"turnip\[cuda12\]'"),
                                              (None, r"turnip\[cuda12\]' or 'turnip\[cuda13\]'")])
def test_callback_without_cupy_says_which_extra_to_install(monkeypatch, torch_cuda, extra):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.runtime"):  # importing cupy now fails, installed or
        monkeypatch.setitem(sys.modules, name, None)          # not, imported by an earlier test or not
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    with pytest.raises(EngineError, match=rf"needs CuPy.*{extra}.*completion='events'"):
        completion_mode("cuda", "callback")


# -- a fake GPU ---------------------------------------------------------------------------------
class FakeStream:
    """A stream's FIFO of work, run by FakeGPU; query() is cudaStreamQuery (optionally failing)."""

    def __init__(self, handle: int):
        self.cuda_stream = handle
        self.ops: collections.deque = collections.deque()
        self.error: Exception | None = None

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return not self.ops


class FakeEvent:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeGPU:
    """One thread running the head op of a random non-empty stream, after random short delays:
    ("work", unit) marks the unit done (its event fires) once its predecessors are done, as a
    device-side wait would; ("host", fn, arg) calls fn(arg), as cudaLaunchHostFunc does."""

    def __init__(self, preds: list[list[int]], seed: int):
        self.preds = preds
        self.done = [FakeEvent() for _ in preds]
        self.streams: dict[int, FakeStream] = {}
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def stream(self) -> FakeStream:
        with self.lock:
            stream = self.streams[len(self.streams)] = FakeStream(len(self.streams))
        return stream

    def enqueue(self, handle: int, op: tuple) -> None:
        with self.lock:
            self.streams[handle].ops.append(op)

    def launch_host_func(self, handle: int, fn, arg: int) -> None:
        self.enqueue(handle, ("host", fn, arg))

    def _runnable(self, op: tuple) -> bool:
        return op[0] == "host" or all(self.done[p].done for p in self.preds[op[1]])

    def _run(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                heads = [s for s in self.streams.values() if s.ops and self._runnable(s.ops[0])]
                stream = self.rng.choice(heads) if heads else None
            if stream is None:
                time.sleep(1e-5)
                continue
            if self.rng.random() < 0.3:
                time.sleep(self.rng.random() * 1e-4)
            op = stream.ops[0]
            if op[0] == "work":
                self.done[op[1]].done = True
            else:
                op[1](op[2])
            with self.lock:
                stream.ops.popleft()  # after the host function returned, as CUDA does


def random_memgraph(n: int, seed: int, streams=(Stream.COMPUTE, Stream.COMPUTE, Stream.H2D, Stream.D2H)) -> MemGraph:
    """A random DAG of compute and copy vertices (of ``streams``, drawn evenly), some needing workspace."""
    rng = random.Random(seed)
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=0))
    for _ in range(n):
        stream = rng.choice(streams)
        mg.add_vertex(Kind.COMPUTE, stream, workspace=rng.choice((0, 0, 10)))
    for dst in range(n):
        for src in range(max(0, dst - 10), dst):
            if rng.random() < 0.15:
                mg.add_edge(src, dst, Edge.DATA)
    mg.serial = list(range(n))
    return mg


def run_on_fake_gpu(mode: str, mg: MemGraph, seed: int, depth: int, copies_ahead: int,
                    counts: dict[Stream, int]) -> tuple[list, dict]:
    """One step through drive() with a completion source over the fake GPU, as engine/cuda.py
    launches: the unit's work, then (callback mode) its host function, then the books."""
    graph = StaticGraph(mg)
    gpu = FakeGPU(graph.predecessors(), seed)
    lanes: dict[tuple[int, int], Lane] = {}
    if mode == "callback":
        source = CallbackCompletions(graph.needs, graph.watched, lanes, gpu.launch_host_func)
    else:
        source = EventCompletions(graph.needs, graph.watched, lanes, gpu.done)
    sizes = [counts[stream] for stream, _ in graph.keys]
    shared = all(n == 1 for (stream, _), n in zip(graph.keys, sizes) if stream is Stream.COMPUTE)
    source.begin_step(shared)
    early: dict[int, int] = collections.Counter()  # per lane: reported, not yet done, at each launch
    unmade: list[tuple[int, int]] = []  # (copy between devices, a predecessor not done when it launched)
    preds = graph.predecessors()

    def launch(item):
        if graph.waits_for_run[item.vertex]:
            unmade.extend((item.vertex, p) for p in preds[item.vertex] if not gpu.done[p].done)
        lane = lanes.get((item.key, item.instance))
        if lane is None:
            compute = graph.keys[item.key][0] is Stream.COMPUTE
            lane = lanes[(item.key, item.instance)] = Lane(gpu.stream(), compute, depth if compute else copies_ahead)
        early[id(lane)] = max(early[id(lane)], sum(1 for u in lane.in_flight if source.reported[u]))
        gpu.enqueue(lane.handle, ("work", item.vertex))
        source.enqueued(lane, item.vertex)

    policy = make_policy("random", seed)
    scheduler = Scheduler(graph, policy.ranks(mg), policy.strict, StreamPool(sizes), WorkspacePool({0: 20}))
    try:
        records = drive(mg, scheduler, launch, source)
    finally:
        gpu.stop.set()
        gpu.thread.join()
    depths = {id(lane): lane.depth for lane in lanes.values()}
    return records, {"early": early, "depths": depths, "source": source, "gpu": gpu, "unmade": unmade}


@pytest.mark.parametrize("mode", COMPLETIONS)
@pytest.mark.parametrize("depth,copies_ahead", [(0, 0), (2, 1), (16, 4)])
@pytest.mark.parametrize("seed", range(4))
def test_every_unit_is_reported_once_and_early_only_within_depth(mode, depth, copies_ahead, seed):
    mg = random_memgraph(120, seed)
    counts = {Stream.COMPUTE: 1 + seed % 2, Stream.H2D: 2, Stream.D2H: 1}
    records, seen = run_on_fake_gpu(mode, mg, seed, depth, copies_ahead, counts)
    source, gpu = seen["source"], seen["gpu"]
    # drive() refuses a second report of a unit (Scheduler.complete raises), so one record each
    assert sorted(r.vertex for r in records) == list(range(len(mg.vertices)))
    assert all(source.reported)
    for lane_id, most in seen["early"].items():
        assert most <= seen["depths"][lane_id]
    early = [r.vertex for r in records if r.end == 0.0]  # reported at enqueue
    if depth == 0 and copies_ahead == 0:
        assert early == []
    for r in records:  # a unit reported when done was done by then
        if r.end:
            assert gpu.done[r.vertex].done
    needs = StaticGraph(mg).needs
    if counts[Stream.COMPUTE] > 1:  # workspace is handed on only once the unit that held it finished
        assert not [v for v in early if needs[v]]


@pytest.mark.parametrize("mode", COMPLETIONS)
@pytest.mark.parametrize("seed", range(4))
def test_a_copy_between_devices_launches_only_once_what_it_reads_has_run(mode, seed):
    """Kernels are reported at enqueue (launch-ahead 16), so the loop learns of their real end only
    from the Ran that follows; a copy between devices launched on the report alone would hold its
    stream while its writer still runs. Fails if the scheduler releases such a copy on the report."""
    mg = random_memgraph(120, seed, streams=(Stream.COMPUTE, Stream.COMPUTE, Stream.D2D, Stream.H2D))
    counts = {Stream.COMPUTE: 1, Stream.D2D: 1, Stream.H2D: 2}
    records, seen = run_on_fake_gpu(mode, mg, seed, 16, 4, counts)
    assert sorted(r.vertex for r in records) == list(range(len(mg.vertices)))
    graph = StaticGraph(mg)
    copies = [v for v in range(len(mg.vertices)) if graph.waits_for_run[v]]
    assert any(graph.watched[p] for p in range(len(mg.vertices)))  # the graph has kernels copies wait for
    early = {r.vertex for r in records if r.end == 0.0}
    assert early & {p for v in copies for p in graph.predecessors()[v]}  # some reported before they ran
    assert seen["unmade"] == []


def test_callback_source_retires_everything_queued_before_a_fired_unit():
    """Stream order: the host function of the third unit means the first two finished too."""
    fired = []
    source = CallbackCompletions([()] * 3, [False] * 3, {}, lambda handle, fn, arg: fired.append((fn, arg)))
    source.begin_step(True)
    lane = Lane(FakeStream(7), compute=False, depth=0)
    for unit in range(3):
        source.enqueued(lane, unit)
    assert [arg for _, arg in fired] == [0, 1, 2] and not source.ready
    fn, arg = fired[2]
    fn(arg)  # only the last one's host function ran so far (the others are still queued for the loop)
    assert [source.get().vertex for _ in range(3)] == [0, 1, 2]
    assert not lane.in_flight and not lane.unreported and all(source.finished)


def test_callback_source_surfaces_a_failed_stream_instead_of_waiting(monkeypatch):
    monkeypatch.setattr("turnip.engine.completions.CALLBACK_QUIET_S", 0.01)
    stream = FakeStream(3)
    stream.ops.append(("work", 0))
    lanes = {(0, 0): Lane(stream, compute=False, depth=0)}
    source = CallbackCompletions([()], [False], lanes, lambda handle, fn, arg: None)
    source.begin_step(True)
    source.enqueued(lanes[(0, 0)], 0)
    stream.error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="illegal memory access"):
        source.get()
    stream.error = None
    stream.ops.clear()  # the stream ran everything, yet no host function fired
    with pytest.raises(EngineError, match="callbacks never ran"):
        source.get()


def test_callback_source_drops_what_a_failed_step_left_queued():
    source = CallbackCompletions([()] * 2, [False] * 2, {}, lambda handle, fn, arg: None)
    source.fired.put(1)
    source.begin_step(True)
    assert source.fired.empty() and not source.ready


def test_units_with_a_successor_on_another_stream_key_are_marked():
    mg = random_memgraph(80, 5)
    graph = StaticGraph(mg)
    crossing = crosses_keys(graph)
    for u, succs in enumerate(graph.succs):
        assert crossing[u] == any(graph.key_of[s] != graph.key_of[u] for s in succs)
    assert 0 < sum(crossing) < graph.n


@pytest.mark.parametrize("mode", COMPLETIONS)
def test_a_busy_loop_still_hears_of_finished_units_every_look_while_busy(mode, monkeypatch):
    """Reports wait (units 0 and 2, reported at enqueue) while unit 1, on another lane and watched,
    has run: a get() within LOOK_WHILE_BUSY_S of the last look gives the next report without looking;
    the first one after it has also heard of unit 1 (its Ran queued behind the waiting reports)."""
    from turnip.engine import completions as module
    from turnip.engine.loop import Ran

    clock = [100.0]  # the module's clock only: perf_counter set by hand, the rest as it is
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic))
    events, host_functions = [FakeEvent() for _ in range(3)], []
    lanes = {(0, 0): Lane(FakeStream(0), True, 2), (1, 0): Lane(FakeStream(1), True, 1)}
    needs, watched = [0, 0, 0], [0, 1, 0]
    if mode == "callback":
        source = CallbackCompletions(needs, watched, lanes, lambda handle, fn, arg: host_functions.append((fn, arg)))
    else:
        source = EventCompletions(needs, watched, lanes, events)
    source.begin_step(True)
    source.enqueued(lanes[(1, 0)], 1)
    assert source.get().vertex == 1  # reported at enqueue; the streams looked at, at 100.0
    source.enqueued(lanes[(0, 0)], 0)
    source.enqueued(lanes[(0, 0)], 2)
    events[1].done = True  # unit 1 ran: its event fired, or its host function ran
    for fn, unit in host_functions:
        if unit == 1:
            fn(unit)
    assert source.get().vertex == 0 and not source.finished[1]
    clock[0] += module.LOOK_WHILE_BUSY_S
    assert source.get().vertex == 2 and source.finished[1]
    ran = source.get()
    assert type(ran) is Ran and ran.vertex == 1
