"""engine.run on the CPU backend over hand-made MemGraphs: bitwise equal to direct computation in any order."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from engine_graphs import step_graph, wide_graph
from turnip.engine.completions import COMPLETIONS
from turnip.engine.errors import EngineError
from turnip.ir import memgraph as mgmod
from turnip.ir.memgraph import Kind, Stream

from turnip import engine

ORDERINGS = [("deterministic", None), ("nondeterministic", None)] + [("random", s) for s in range(20)]


def assert_same(got: dict, want: dict):
    assert set(want) <= set(got)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(got[k], w), f"{k} differs"


@pytest.mark.parametrize("ordering,seed", ORDERINGS)
def test_step_graph_bitwise_over_steps(ordering, seed):
    mg, batch, reference = step_graph()
    want_outs, want_weights = reference(2)
    for step in (1, 2):
        out = engine.run(mg, batch(step), ordering=ordering, seed=seed,
                         streams={"compute": 3, "h2d": 2, "d2h": 2})
        assert_same(out, want_outs[step - 1])
    assert_same(mg.state_dict(), want_weights)
    assert mg.runtime.step == 2


def test_wide_graph_bitwise_all_orders_on_one_memgraph():
    mg, batch, reference = wide_graph()
    want = reference(3)
    orders = set()
    for ordering, seed in ORDERINGS:
        out = engine.run(mg, batch(3), ordering=ordering, seed=seed, streams={"compute": 3, "h2d": 2, "d2h": 2})
        assert_same(out, want)
        orders.add(tuple(mg.runtime.last_launch_order))
    assert len(orders) > 10  # the random policy really explores different orders


def test_deterministic_launches_in_serial_order_per_class_on_threads():
    mg, batch, _ = wide_graph()
    # another topological order than vertex ids: all inputs first
    mg.serial = sorted(range(len(mg.vertices)), key=lambda v: (mg.vertices[v].kind is not Kind.INPUT, v))
    for _ in range(3):
        engine.run(mg, batch(1), ordering="deterministic", streams={"compute": 3})
        order = mg.runtime.last_launch_order
        for cls in Stream:
            assert [v for v in order if mg.vertices[v].stream == cls] == \
                   [v for v in mg.serial if mg.vertices[v].stream == cls]


def test_arena_allocated_once_outputs_fresh_and_state_reused():
    mg, batch, reference = step_graph()
    want_outs, _ = reference(3)
    out1 = engine.run(mg, batch(1))
    arena_ptr, storage_ptr = mg.runtime.arenas[0].data_ptr(), mg.runtime.storage.data_ptr()
    assert mg.runtime.arenas[0].numel() == mg.arena_bytes and mg.runtime.storage.numel() == mg.cpu_bytes
    engine.run(mg, batch(2))
    engine.run(mg, batch(3))
    assert mg.runtime.arenas[0].data_ptr() == arena_ptr and mg.runtime.storage.data_ptr() == storage_ptr
    assert_same(out1, want_outs[0])  # the next steps did not overwrite step 1's outputs


def test_save_load_continues_with_trained_weights(tmp_path):
    mg, batch, reference = step_graph()
    want_outs, want_weights = reference(3)
    engine.run(mg, batch(1))
    engine.run(mg, batch(2))
    state = mg.runtime.persistent_state(mg)
    assert set(state) == set(mg.homes)
    mg.save(tmp_path / "step.mg")
    mg2 = mgmod.load(tmp_path / "step.mg")
    assert mg2.runtime is None
    assert_same(engine.run(mg2, batch(3)), want_outs[2])
    assert_same(mg2.state_dict(), want_weights)


def test_state_dict_before_any_run_is_initial_state():
    mg, _, _ = step_graph()
    sd = mg.state_dict()
    assert torch.equal(sd["W"], mg.initial_state[mg.names["W"]])


def test_the_loop_says_where_its_time_went():
    """Every unit launched once; the loop's wait and its launching add up to the step's wall time."""
    mg, batch, _ = wide_graph(chains=3, length=4)
    engine.run(mg, batch(0), streams={"compute": 2})
    spent, runtime = mg.runtime.last_loop_time, mg.runtime
    assert spent.launches == runtime.graph.n == len(runtime.last_records)
    assert 0.0 <= spent.waiting_s <= spent.wall_s
    assert 0.0 <= spent.busy_s == pytest.approx(spent.wall_s - spent.waiting_s)
    engine.run(mg, batch(1))
    assert mg.runtime.last_loop_time is not spent  # each step its own


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cyclic_collector_does_not_run_during_a_step(monkeypatch, enabled):
    """With the collector's threshold at one allocation, a collection would start at the loop's first
    report; none starts while the loop drives the step (engine/collector.py), and the collector is
    left as the program had it."""
    import gc

    from turnip.engine import run_step

    mg, batch, _ = wide_graph(chains=3, length=4)
    engine.run(mg, batch(0))  # the runtime is built on the first step, outside the paused block
    driving, during = [False], []
    real_drive = run_step.drive

    def drive(*args, **kwargs):
        driving[0] = True
        try:
            return real_drive(*args, **kwargs)
        finally:
            driving[0] = False

    def seen(phase, info):
        if phase == "start" and driving[0]:
            during.append(info["generation"])

    monkeypatch.setattr(run_step, "drive", drive)
    threshold, was = gc.get_threshold(), gc.isenabled()
    gc.callbacks.append(seen)
    try:
        gc.set_threshold(1)
        (gc.enable if enabled else gc.disable)()
        engine.run(mg, batch(1))
        assert gc.isenabled() is enabled
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        (gc.enable if was else gc.disable)()
    assert during == []


def test_timeline_file_written_and_parses(tmp_path):
    mg, batch, _ = wide_graph(chains=3, length=3)
    path = tmp_path / "step.json"
    engine.run(mg, batch(0), timeline=str(path), streams={"compute": 2})
    doc = json.loads(path.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(mg.vertices)
    assert {e["args"]["vertex"] for e in slices} == set(range(len(mg.vertices)))
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"compute 0", "compute 1", "h2d 0", "d2h 0"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    ops = {e["name"] for e in slices if e["cat"] == "compute"}
    assert ops == {"aten::add.Tensor", "aten::mul.Tensor"}
    lanes = {(e["pid"], e["tid"]) for e in slices}
    assert len(lanes) >= 3
    assert doc["metadata"]["ok"] is True


def test_the_former_trace_keyword_still_writes_the_timeline_with_a_warning(tmp_path):
    mg, batch, _ = wide_graph(chains=2, length=2)
    path = tmp_path / "step.json"
    with pytest.warns(DeprecationWarning, match="timeline="):
        engine.run(mg, batch(0), trace=str(path))
    assert [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_concurrent_runs_on_one_memgraph_are_serialized():
    mg, batch, reference = wide_graph(chains=3, length=3)
    want = reference(1)
    results, errors = [], []

    def worker():
        try:
            results.append(engine.run(mg, batch(1), ordering="random"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 4
    for out in results:
        assert_same(out, want)


def test_missing_backend_and_unknown_device_are_clear():
    mg, batch, _ = wide_graph(chains=2, length=1)
    mg.device = "tpu"
    with pytest.raises(EngineError, match="no engine backend for device 'tpu'"):
        engine.run(mg, batch(0))
    if not torch.cuda.is_available():  # backend module missing, or present but without a device: both say so
        mg.device = "cuda:0"
        with pytest.raises(EngineError, match="(?i)cuda"):
            engine.run(mg, batch(0))
        assert mg.runtime is None


@pytest.mark.parametrize(("keyword", "bad"), [("transfer_ahead", b) for b in (-1, 2.5, True, "4")]
                         + [("completion", b) for b in ("poll", 0, "EVENTS")])
def test_run_options_are_checked_before_the_step_runs(keyword, bad):
    mg, batch, _ = step_graph()
    before = {k: v.clone() for k, v in mg.state_dict().items()}
    with pytest.raises(ValueError, match=keyword):
        engine.run(mg, batch(1), **{keyword: bad})
    for key, tensor in mg.state_dict().items():  # nothing ran: the weights are as they were
        assert torch.equal(tensor, before[key])
    assert mg.runtime is None or mg.runtime.step == 0
    # a count is taken (the CPU backend has no copy streams); both completion names are taken on the
    # CPU, whose workers always report by queue
    for good in ((2,) if keyword == "transfer_ahead" else COMPLETIONS):
        engine.run(mg, batch(1), **{keyword: good})
