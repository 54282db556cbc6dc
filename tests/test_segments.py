"""Segments (memgraph/segments.py): runs of compute vertices launched as one unit.

The rules keep the unit graph acyclic and hold no transfer back; the engine runs a segment's
vertices in order as one launch (a CUDA graph on CUDA), and every order the unit graph permits
still gives eager's numbers bit for bit on the CPU backend.
"""

import contextlib
import dataclasses

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, eager_steps, make_case, trainable
from turnip.engine.loop import StaticGraph
from turnip.ir.memgraph import Kind
from turnip.kernels.ops import draws
from turnip.memgraph.segments import find_segments, segment_problems

from turnip import engine, memgraph


@pytest.fixture(scope="module", params=[None, 0.3])
def compiled(request):
    model, loss_fn, batches = make_case("gpt")
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                          budget=request.param, device="cpu")
    return mg, batches, [x.item() for x in want_losses], want_state


def with_segments(mg, max_size=None):
    seg = dataclasses.replace(mg, segments=find_segments(mg, max_size))
    seg.runtime = None
    return seg


def test_segments_follow_the_rules(compiled):
    mg = compiled[0]
    segments = find_segments(mg)
    assert segments, "a GPT step has long runs of compute"
    assert segment_problems(dataclasses.replace(mg, segments=segments)) == []
    preds, succs = mg.predecessors(), mg.successors()
    position = {vid: i for i, vid in enumerate(mg.serial)}
    for seg in segments:
        assert all(mg.vertices[v].kind is Kind.COMPUTE for v in seg)
        assert [position[v] for v in seg] == sorted(position[v] for v in seg)
        for v in seg[1:]:  # only the first may wait for a transfer
            assert all(mg.vertices[p].kind is Kind.COMPUTE for p in preds[v])
        for v in seg[:-1]:  # only the last may be waited for by one
            assert all(mg.vertices[s].kind is Kind.COMPUTE for s in succs[v])
    if mg.summary()["bytes_offloaded"]:
        assert len(segments) > 1, "transfers cut the compute into several segments"


def test_segment_size_bounds_and_one_means_none(compiled):
    mg = compiled[0]
    assert find_segments(mg, 1) == []
    assert max(len(s) for s in find_segments(mg, 5)) <= 5
    with pytest.raises(ValueError, match="at least 1"):
        find_segments(mg, 0)


def test_unit_graph_contracts_segments(compiled):
    mg = with_segments(compiled[0])
    graph = StaticGraph(mg)
    members = [v for unit in graph.units for v in unit]
    assert sorted(members) == list(range(len(mg.vertices)))
    assert graph.n == len(mg.vertices) - sum(len(s) - 1 for s in mg.segments)
    for src, dst, _ in mg.edges:
        a, b = graph.unit_of[src], graph.unit_of[dst]
        assert a == b or b in graph.succs[a]


@pytest.mark.parametrize("ordering,seed", [("deterministic", None), ("nondeterministic", None),
                                           ("random", 1), ("random", 2)])
def test_segmented_step_is_bitwise_eager(compiled, ordering, seed):
    base, batches, want_losses, want_state = compiled
    mg = with_segments(base, max_size=16)
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering=ordering, seed=seed)["loss"].item() for b in batches]
    assert losses == want_losses
    assert_same_state(mg.state_dict(), want_state)
    order = mg.runtime.last_launch_order
    assert sorted(order) == list(range(len(mg.vertices)))  # every vertex ran once
    at = {v: i for i, v in enumerate(order)}
    assert all(at[s] < at[d] for s, d, _ in mg.edges)
    for seg in mg.segments:  # a segment's vertices run back to back, in order
        assert order[at[seg[0]]:at[seg[0]] + len(seg)] == seg
    mg.release()


def test_verify_reports_bad_segments(compiled):
    mg = compiled[0]
    # a segment with an edge inside: reversed, it runs a vertex before its predecessor
    segment = next(seg for seg in find_segments(mg) if any(s in seg and d in seg for s, d, _ in mg.edges))
    transfer = next((mv.id for mv in mg.vertices if mv.kind is not Kind.COMPUTE), None)
    assert transfer is not None
    broken = {
        "kind": [segment + [transfer]],
        "twice": [segment, segment[:2]],
        "order": [list(reversed(segment))],
    }
    for name, segments in broken.items():
        problems = segment_problems(dataclasses.replace(mg, segments=segments))
        assert problems, name
        assert memgraph.verify(dataclasses.replace(mg, segments=segments)), name


def test_verify_reports_a_segment_that_would_make_a_cycle():
    model, loss_fn, batches = make_case("mlp")
    mg = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["sgd"](trainable(model)),
                          budget=0.25, device="cpu")
    succs = mg.successors()
    # a compute vertex feeding a transfer that feeds a later compute vertex: together they make a cycle
    for v in mg.serial:
        if mg.vertices[v].kind is not Kind.COMPUTE:
            continue
        for t in succs[v]:
            if mg.vertices[t].kind is Kind.COMPUTE:
                continue
            later = [w for w in succs[t] if mg.vertices[w].kind is Kind.COMPUTE]
            if later:
                at = {x: i for i, x in enumerate(mg.serial)}
                seg = sorted({v, later[0]}, key=at.__getitem__)
                problems = segment_problems(dataclasses.replace(mg, segments=[seg]))
                assert any("cycle" in p for p in problems), problems
                return
    pytest.fail("no compute -> transfer -> compute path at a 25% budget")


def test_a_failing_vertex_inside_a_segment_is_named(compiled):
    base, batches = compiled[0], compiled[1]
    mg = with_segments(base)
    seg = max(mg.segments, key=len)
    victim = seg[len(seg) // 2]
    engine.run(mg, batches[0])  # binds every vertex
    prepared = mg.runtime._bound[victim]

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    mg.runtime._bound[victim] = type("Failing", (), {"__call__": fail, "vertex": prepared.vertex})()
    with pytest.raises(engine.VertexError) as info:
        engine.run(mg, batches[1], ordering="deterministic")
    assert info.value.vertex == victim
    mg.release()


def test_a_segment_whose_scalars_keep_changing_stops_being_captured(monkeypatch):
    """The CUDA engine's bookkeeping of captured segments, with the capture faked (no GPU needed):
    a segment is captured on its second run and replayed while its scalars stay; new scalars (an LR
    scheduler) capture it again once, and when they change again it runs as plain launches for
    good. A segment without scalars is never affected."""
    from types import SimpleNamespace

    from turnip.engine import cuda_graphs
    from turnip.ir.taskgraph import ScalarRef

    replays = []

    class FakeGraph:
        def __init__(self, n):
            self.n = n

        def replay(self):
            replays.append(self.n)

    made = []

    def fake_capture(launch, pool=None):
        made.append(len(made))
        return FakeGraph(made[-1])

    monkeypatch.setattr(cuda_graphs, "captured", fake_capture)
    tasks = [SimpleNamespace(args=(ScalarRef("g0.lr"),), kwargs={})] + [SimpleNamespace(args=(), kwargs={})] * 3
    mg = SimpleNamespace(taskgraph=SimpleNamespace(vertices=tasks),
                         vertices=[SimpleNamespace(task_vertex=k) for k in range(4)])
    pools = SimpleNamespace(handle=lambda lane: object(), allocating_from=lambda lane: contextlib.nullcontext(),
                            clear=lambda: None)
    graphs = cuda_graphs.SegmentGraphs(mg, [(0, 1), (2, 3)], pools)  # unit 0 reads lr, unit 1 reads nothing
    launches = []

    def step(lr):
        for unit in (0, 1):
            graphs.run(unit, ("compute", 0), {"g0.lr": lr}, lambda u=unit: launches.append(u))

    step(1.0)  # first run: plain launches
    step(1.0)  # second: captured (then replayed)
    step(1.0)  # replayed
    assert graphs.captures == 2 and launches == [0, 1] and not graphs.volatile
    step(0.5)  # lr changed: unit 0 captured again
    assert graphs.captures == 3 and not graphs.volatile
    step(0.25)  # changed again: unit 0 launches plainly from now on
    step(0.125)
    assert graphs.volatile == {0} and graphs.captures == 3
    assert launches == [0, 1, 0, 0]
    replays.clear()
    step(0.125)
    assert replays == [1]  # unit 1 is still replayed, unit 0 is not


def test_attention_without_dropout_joins_segments_and_dropout_stays_alone():
    """An attention op is random by its schema (it may drop out) but draws nothing at dropout_p 0
    (kernels/ops.py draws): it joins segments; a dropout, which draws, stays alone; and the step with
    its random vertices so split is still eager's bit for bit."""
    model, loss_fn, batches = make_case("gpt", dropout=0.1)
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    base = memgraph.compile(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)),
                            budget=None, device="cpu")
    mg = with_segments(base)
    members = {v for seg in mg.segments for v in seg}
    tasks = mg.taskgraph.vertices
    random = [mv.id for mv in mg.vertices if mv.kind is Kind.COMPUTE and tasks[mv.task_vertex].random]
    attention = [v for v in random if "attention" in tasks[mg.vertices[v].task_vertex].op]
    dropping = [v for v in random if draws(tasks[mg.vertices[v].task_vertex])]
    assert attention and dropping and not set(attention) & set(dropping)
    assert set(attention) & members, "attention ops without dropout join segments"
    assert not set(dropping) & members, "a vertex that draws runs alone, from its own generator state"
    torch.manual_seed(123)
    losses = [engine.run(mg, b, ordering="random", seed=3)["loss"].item() for b in batches]
    assert losses == [x.item() for x in want_losses]
    assert_same_state(mg.state_dict(), want_state)
