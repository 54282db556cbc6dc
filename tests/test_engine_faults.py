"""Faults: a vertex that raises, a stall, a wrong batch. Each raises its error; the next engine.run works."""

from __future__ import annotations

import threading

import pytest
import torch
from engine_graphs import Placer, add_value, finish, new_memgraph, ref, step_graph, wide_graph
from turnip.bench.models.mlp import MLP
from turnip.engine import BatchError, StallError, VertexError
from turnip.engine.cpu import CpuRuntime
from turnip.engine.errors import EngineError, ResourceError
from turnip.ir.memgraph import Edge, Kind, Place, Stream
from turnip.ir.taskgraph import TaskGraph, ValueKind

from turnip import engine, memgraph


def run_bounded(fn, timeout=30.0):
    """Call fn in a thread; fail (instead of hanging the suite) if it does not return."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "engine.run hung"
    if "error" in box:
        raise box["error"]
    return box["value"]


def assert_graph(chains: int = 4):
    """Wide chains beside an assertion on a batch flag: flag == 0 makes one compute vertex raise mid-step."""
    tg = TaskGraph()
    flag = add_value(tg, (), kind=ValueKind.BATCH, name="batch:flag")
    x = add_value(tg, (64, 64), kind=ValueKind.BATCH, name="batch:x")
    tg.batch_inputs = [flag, x]
    mg = new_memgraph(tg)
    P = Placer(tg)
    A_flag, A_x = P.gpu(flag), P.gpu(x)
    m_flag = mg.add_vertex(Kind.INPUT, Stream.H2D, value=flag, writes={flag: A_flag})
    m_x = mg.add_vertex(Kind.INPUT, Stream.H2D, value=x, writes={x: A_x})
    t_assert = tg.add_vertex("aten::_assert_async.msg", (ref(tg, flag), "flag must be nonzero"), outputs=(),
                             module="guard")
    m_assert = mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t_assert, reads={flag: A_flag})
    mg.add_edge(m_flag, m_assert, Edge.DATA)
    outs = []
    for c in range(chains):
        cur, place, writer = x, A_x, m_x
        for _ in range(3):
            nxt = add_value(tg, (64, 64))
            t = tg.add_vertex("aten::mm", (ref(tg, cur), ref(tg, cur)), outputs=(nxt,), module=f"chain{c}")
            nplace = P.gpu(nxt)
            m = mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, task_vertex=t, reads={cur: place}, writes={nxt: nplace})
            mg.add_edge(writer, m, Edge.DATA)
            cur, place, writer = nxt, nplace, m
        mo = mg.add_vertex(Kind.OUTPUT, Stream.D2H, value=cur, reads={cur: place}, name=f"y{c}")
        mg.add_edge(writer, mo, Edge.DATA)
        mg.add_edge(m_assert, mo, Edge.DATA)  # outputs wait for the guard
        outs.append(cur)
    tg.outputs = {f"y{c}": v for c, v in enumerate(outs)}
    return finish(mg, P), m_assert, t_assert


def assert_batch(ok: bool):
    x = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) / 64
    return {"flag": torch.tensor(1.0 if ok else 0.0), "x": x}


def test_vertex_that_raises_names_it_and_the_engine_stays_usable():
    mg, m_assert, _ = assert_graph()
    ok = run_bounded(lambda: engine.run(mg, assert_batch(True)))
    for good_steps, (ordering, seed) in enumerate([("nondeterministic", None), ("random", 1),
                                                    ("deterministic", None)], start=1):
        with pytest.raises(VertexError) as info:
            run_bounded(lambda o=ordering, s=seed: engine.run(mg, assert_batch(False), ordering=o, seed=s,
                                           streams={"compute": 3}))
        err = info.value
        assert err.vertex == m_assert and err.kind == "compute" and err.op == "aten::_assert_async.msg"
        assert err.module == "guard" and err.inputs == [(0, (), torch.float32)]
        msg = str(err)
        assert f"vertex {m_assert} (compute aten::_assert_async.msg) in module 'guard'" in msg
        assert "value 0 [] torch.float32" in msg and "flag must be nonzero" in msg
        assert isinstance(err.__cause__, RuntimeError)
        # drained: everything launched also completed; the failed step did not count
        rt = mg.runtime
        assert len(rt.last_records) == len(rt.last_launch_order)
        assert rt.step == good_steps
        assert not any(r.vertex >= 0 and mg.vertices[r.vertex].kind is Kind.OUTPUT for r in rt.last_records)
        out = run_bounded(lambda o=ordering, s=seed: engine.run(mg, assert_batch(True), ordering=o, seed=s))
        for k in ok:
            assert torch.equal(out[k], ok[k])


def test_failing_transfer_is_a_vertex_error():
    mg, batch, reference = wide_graph(chains=2, length=2)
    bad = next(mv for mv in mg.vertices if mv.kind is Kind.OFFLOAD)
    (val, good_place), = bad.writes.items()
    bad.writes = {val: Place("cpu", mg.cpu_bytes + 1024, good_place.nbytes)}  # outside the CPU storage
    with pytest.raises(VertexError, match=f"vertex {bad.id} \\(offload\\).*do not fit"):
        run_bounded(lambda: engine.run(mg, batch(0)))
    bad.writes = {val: good_place}
    out = run_bounded(lambda: engine.run(mg, batch(0)))
    assert torch.equal(out["total"], reference(0)["total"])


def test_transfer_whose_reads_and_writes_cannot_be_paired_names_it():
    mg, batch, reference = wide_graph(chains=2, length=2)
    bad = next(mv for mv in mg.vertices if mv.kind is Kind.RELOAD)
    good_reads = bad.reads
    (val, cpu_place), = good_reads.items()
    other = mg.taskgraph.batch_inputs[0]
    bad.reads = {val: cpu_place, other: cpu_place}  # two values read, one written: which goes where?
    with pytest.raises(VertexError, match=f"vertex {bad.id} \\(reload\\) of value {val} reads values "
                                          f"\\[.*\\] but writes \\[{val}\\]: cannot pair them"):
        run_bounded(lambda: engine.run(mg, batch(0)))
    bad.reads = good_reads
    out = run_bounded(lambda: engine.run(mg, batch(0)))
    assert torch.equal(out["total"], reference(0)["total"])


def test_vertex_is_decoded_once_per_memgraph():
    mg, batch, _ = step_graph()
    engine.run(mg, batch(1))
    rt = mg.runtime
    first = list(rt._bound)
    assert all(b is not None for b in first)  # every vertex ran, so every vertex is bound
    engine.run(mg, batch(2))
    assert all(a is b for a, b in zip(first, rt._bound))  # the second step reused every binding


def test_vertex_with_a_lock_is_refused_before_any_work():
    mg, batch, reference = step_graph()
    mg.vertices[2].lock = "acc"
    with pytest.raises(ResourceError, match="vertex 2 \\(compute aten::mm\\) in module 'lin' asks for lock 'acc'"):
        engine.run(mg, batch(1))
    assert mg.runtime is None
    mg.vertices[2].lock = None
    want_outs, _ = reference(1)
    assert torch.equal(engine.run(mg, batch(1))["loss"], want_outs[0]["loss"])


def cycle_graph():
    """input -> a -> b -> a (cycle) -> output: a, b and the output can never run."""
    tg = TaskGraph()
    x = add_value(tg, (4,), kind=ValueKind.BATCH, name="batch:x")
    a = add_value(tg, (4,))
    b = add_value(tg, (4,))
    tg.batch_inputs = [x]
    ta = tg.add_vertex("aten::add.Tensor", (ref(tg, x), ref(tg, x)), outputs=(a,))
    tb = tg.add_vertex("aten::mul.Tensor", (ref(tg, a), ref(tg, a)), outputs=(b,))
    mg = new_memgraph(tg)
    P = Placer(tg)
    A_x, A_a, A_b = P.gpu(x), P.gpu(a), P.gpu(b)
    m_in = mg.add_vertex(Kind.INPUT, Stream.H2D, value=x, writes={x: A_x})
    m_a = mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, task_vertex=ta, reads={x: A_x}, writes={a: A_a})
    m_b = mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, task_vertex=tb, reads={a: A_a}, writes={b: A_b})
    m_out = mg.add_vertex(Kind.OUTPUT, Stream.D2H, value=b, reads={b: A_b}, name="b")
    for src, dst, kind in [(m_in, m_a, Edge.DATA), (m_a, m_b, Edge.DATA), (m_b, m_a, Edge.MEMORY),
                           (m_b, m_out, Edge.DATA)]:
        mg.add_edge(src, dst, kind)
    return finish(mg, P), (m_a, m_b, m_out)


def test_stall_raises_naming_stuck_vertices_and_never_hangs():
    mg, stuck = cycle_graph()
    for _ in range(2):  # again: the runtime is not wedged by the first stall
        with pytest.raises(StallError) as info:
            run_bounded(lambda: engine.run(mg, {"x": torch.ones(4)}), timeout=10)
        assert info.value.stuck == list(stuck)
        msg = str(info.value)
        assert "3 of 4 vertices can never run" in msg
        assert f"vertex {stuck[0]} (compute aten::add.Tensor)" in msg and f"waits for [{stuck[1]}]" in msg
    assert mg.runtime.step == 0
    # the engine keeps working for other MemGraphs
    mg2, batch, reference = wide_graph(chains=2, length=2)
    assert torch.equal(run_bounded(lambda: engine.run(mg2, batch(0)))["total"], reference(0)["total"])


def test_wrong_batch_is_refused_before_any_work():
    mg, batch, reference = step_graph()
    good = batch(1)
    cases = [
        ({"x": torch.zeros(4, 9)}, "batch input 'x' (leaf 0): expected shape (4, 8) float32, got (4, 9) float32"),
        ({"x": torch.zeros(4, 8, dtype=torch.float64)},
         "batch input 'x' (leaf 0): expected shape (4, 8) float32, got (4, 8) float64"),
        ({"x": good["x"], "y": good["x"]}, "batch has 2 leaves, the traced example had 1 ('x')"),
        ({"x": 3.0}, "batch input 'x' (leaf 0): expected a tensor of shape (4, 8) float32, got float"),
    ]
    for bad, message in cases:
        with pytest.raises(BatchError) as info:
            engine.run(mg, bad)
        assert str(info.value) == message
        assert mg.runtime is None  # nothing allocated, nothing ran
    want_outs, _ = reference(2)
    assert torch.equal(engine.run(mg, batch(1))["loss"], want_outs[0]["loss"])
    with pytest.raises(BatchError, match="expected shape"):
        engine.run(mg, {"x": torch.zeros(2, 8)})
    assert mg.runtime.step == 1  # a refused batch does not count as a step
    assert torch.equal(engine.run(mg, batch(2))["loss"], want_outs[1]["loss"])


def test_batch_structure_checked_when_traced_spec_known():
    from torch.utils._pytree import tree_flatten

    mg, batch, _ = step_graph()
    mg.taskgraph.batch_spec = tree_flatten({"x": torch.zeros(4, 8)})[1]
    with pytest.raises(BatchError, match="batch structure"):
        engine.run(mg, {"z": torch.zeros(4, 8)})
    engine.run(mg, batch(1))


def test_workspace_over_budget_refused_and_bad_ordering():
    mg, batch, _ = step_graph()
    mg.plan.gpu_budget = mg.arena_bytes + 100  # leaves 100 workspace bytes beside the arena
    mg.vertices[2].workspace = 101
    with pytest.raises(ResourceError, match="101 workspace bytes"):
        engine.run(mg, batch(1))
    mg, batch, _ = step_graph()
    mg.plan.gpu_budget = mg.arena_bytes + 100
    mg.vertices[2].workspace = 100
    engine.run(mg, batch(1))
    with pytest.raises(ValueError, match="ordering must be one of"):
        engine.run(mg, batch(2), ordering="fast")
    assert mg.runtime.step == 1


def compiled_mlp(seed: int = 0):
    """(MemGraph, batch) of a small MLP trained with SGD, everything kept, on the CPU backend."""
    torch.manual_seed(seed)
    model = MLP(8, 16, 4, depth=4)
    batch = (torch.randn(16, 8), torch.randn(16, 4))

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    mg = memgraph.compile(model, loss_fn, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          budget=1.0, device="cpu")
    return mg, batch


def fail_at(monkeypatch, vid: int) -> dict:
    """Make compute vertex vid raise while the returned switch is on."""
    real, armed = CpuRuntime.run_compute, {"on": True}

    def flaky(self, v, prepared):
        if armed["on"] and v == vid:
            raise RuntimeError("injected fault")
        return real(self, v, prepared)

    monkeypatch.setattr(CpuRuntime, "run_compute", flaky)
    return armed


def test_failure_after_in_place_updates_marks_the_weights_mixed(monkeypatch):
    """Updates write the weights in their homes: a step failing after some of them ran cannot be rerun."""
    mg, batch = compiled_mlp()
    fresh, _ = compiled_mlp()
    want = engine.run(fresh, batch)["loss"]
    home_places = set(mg.homes.values())
    writers = [v for v in mg.serial if mg.vertices[v].kind is Kind.COMPUTE
               and any(p in home_places for p in mg.vertices[v].writes.values())]
    assert len(writers) > 1
    armed = fail_at(monkeypatch, writers[-1])
    with pytest.raises(VertexError, match="injected fault") as info:
        engine.run(mg, batch, ordering="deterministic")
    assert any("mix steps 0 and 1" in note for note in info.value.__notes__)
    with pytest.raises(EngineError, match="mix steps 0 and 1"):
        engine.run(mg, batch)
    with pytest.raises(EngineError, match="mg.release"):
        mg.state_dict()
    armed["on"] = False
    mg.release()  # back to the compiled weights: the step runs as the first one
    assert torch.equal(engine.run(mg, batch)["loss"], want)
    assert all(torch.equal(a, b) for a, b in zip(mg.state_dict().values(), fresh.state_dict().values()))


def test_failure_before_any_update_leaves_the_weights_as_they_were(monkeypatch):
    mg, batch = compiled_mlp()
    before = mg.state_dict()  # the compiled weights
    first = next(v for v in mg.serial if mg.vertices[v].kind is Kind.COMPUTE)
    armed = fail_at(monkeypatch, first)
    with pytest.raises(VertexError, match="injected fault"):
        engine.run(mg, batch, ordering="deterministic")
    after_failure = mg.state_dict()
    assert before.keys() == after_failure.keys()
    assert all(torch.equal(before[k], after_failure[k]) for k in before)
    armed["on"] = False
    engine.run(mg, batch)  # nothing was updated: the step simply runs again


def test_a_list_batch_is_the_tuple_example_and_a_short_batch_gets_a_hint():
    """A DataLoader yields lists where the example was a tuple; the last batch may be short."""
    mg, batch = compiled_mlp()
    want = engine.run(mg, batch)["loss"]
    mg.release(keep=False)
    assert torch.equal(engine.run(mg, list(batch))["loss"], want)
    short = (batch[0][:5], batch[1][:5])
    with pytest.raises(BatchError, match=r"expected shape \(16, 8\) float32, got \(5, 8\) float32 \(a last, "
                                         r"partial batch\? use DataLoader\(\.\.\., drop_last=True\)"):
        engine.run(mg, short)
    with pytest.raises(BatchError, match="batch structure"):
        engine.run(mg, {"x": batch[0], "y": batch[1]})
