"""engine.simulate on hand-made MemGraphs whose step time is worked out by hand, plus a traced GPT.

Units: bandwidth 1e9 B/s, so 1e6 bytes take 1 ms; compute times are given in ms.
"""

from __future__ import annotations

import json

import pytest
import torch
from turnip.engine import StallError
from turnip.engine.timing_sim import simulate, step_floor
from turnip.ir.memgraph import Edge, Kind, MemGraph, Place, Stream
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph

from turnip import engine, memgraph

MS = 1e-3
BW = 1e9


class Hand:
    """A MemGraph built vertex by vertex: compute with a time, transfers with a byte count."""

    def __init__(self):
        self.tg = TaskGraph()
        self.mg = MemGraph(taskgraph=self.tg, plan=Plan(gpu_budget=0))

    def _edges(self, vid: int, after) -> int:
        for a in after:
            self.mg.add_edge(a, vid, Edge.DATA)
        return vid

    def compute(self, ms: float, after=(), workspace: int = 0) -> int:
        tv = self.tg.add_vertex("synthetic", time=ms * MS)
        vid = self.mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, task_vertex=tv, workspace=workspace, writes={})
        return self._edges(vid, after)

    def transfer(self, kind: Kind, ms: float, after=()) -> int:
        nbytes = int(ms * MS * BW)
        value = self.tg.add_value((nbytes // 4,), (1,), torch.float32, nbytes)
        gpu, cpu = Place("gpu", 0, nbytes), Place("cpu", 0, nbytes)
        if kind in (Kind.RELOAD, Kind.INPUT):
            reads = {} if kind is Kind.INPUT else {value: cpu}
            vid = self.mg.add_vertex(kind, Stream.H2D, value=value, reads=reads, writes={value: gpu})
        else:
            writes = {} if kind is Kind.OUTPUT else {value: cpu}
            vid = self.mg.add_vertex(kind, Stream.D2H, value=value, reads={value: gpu}, writes=writes)
        return self._edges(vid, after)

    def done(self, serial=None) -> MemGraph:
        self.mg.serial = list(serial) if serial is not None else list(range(len(self.mg.vertices)))
        return self.mg


def starts(res) -> dict[int, float]:
    return {s.vertex: round(s.start / MS, 9) for s in res.timeline}


def ends(res) -> dict[int, float]:
    return {s.vertex: round(s.end / MS, 9) for s in res.timeline}


@pytest.mark.parametrize("launch_ahead", [0, 1, 16])
def test_serial_chain_adds_up(launch_ahead):
    h = Hand()
    a = h.compute(1)
    b = h.compute(2, after=[a])
    c = h.compute(3, after=[b])
    res = simulate(h.done(), bandwidth=BW, launch_ahead=launch_ahead)
    assert res.step_time == pytest.approx(6 * MS)
    assert res.compute_idle == pytest.approx(0, abs=1e-12)
    assert starts(res) == {a: 0, b: 1, c: 3}
    assert next(s[:1] + s[2:] for s in res.timeline) == (a, 0.0, 1 * MS)  # (vertex, stream, start, end) tuples
    assert res.timeline[0].stream == "compute 0"


def test_transfer_overlaps_compute():
    # reload R (4 ms) runs beside c1 (5 ms); c2 needs both; offload O of c1's output after c1
    h = Hand()
    r = h.transfer(Kind.RELOAD, 4)
    c1 = h.compute(5)
    c2 = h.compute(1, after=[r, c1])
    o = h.transfer(Kind.OFFLOAD, 2, after=[c1])
    res = simulate(h.done(), bandwidth=BW)
    assert ends(res) == {r: 4, c1: 5, c2: 6, o: 7}
    assert res.step_time == pytest.approx(7 * MS)
    assert res.compute_busy == pytest.approx(6 * MS)
    assert res.compute_idle == pytest.approx(1 * MS)
    assert (res.bytes_h2d, res.bytes_d2h) == (4_000_000, 2_000_000)
    assert (res.h2d_busy, res.d2h_busy) == (pytest.approx(4 * MS), pytest.approx(2 * MS))
    floor = step_floor(h.mg, bandwidth=BW)
    assert floor["floor"] == pytest.approx(6 * MS) and floor["h2d"] == pytest.approx(4 * MS)


def test_transfer_that_cannot_overlap_leaves_compute_idle():
    h = Hand()
    c1 = h.compute(5)
    r = h.transfer(Kind.RELOAD, 4, after=[c1])
    h.compute(1, after=[r])
    res = simulate(h.done(), bandwidth=BW)
    assert res.step_time == pytest.approx(10 * MS)
    assert res.compute_idle == pytest.approx(4 * MS)
    assert starts(res)[r] == 5


def test_full_duplex_link_moves_both_directions_at_once():
    def graph():
        h = Hand()
        h.transfer(Kind.RELOAD, 4)
        h.transfer(Kind.OFFLOAD, 4)
        return h.done()

    assert simulate(graph(), bandwidth=BW).step_time == pytest.approx(4 * MS)
    half = simulate(graph(), bandwidth=BW, duplex=False)
    assert half.step_time == pytest.approx(8 * MS)
    assert ends(half) == {0: 8, 1: 8}  # shared fairly: both progress at half rate
    # different bandwidths per direction: each transfer at its own direction's rate
    assert simulate(graph(), bandwidth=(BW, BW / 2)).step_time == pytest.approx(8 * MS)


def test_two_streams_of_one_direction_share_its_bandwidth():
    def graph():
        h = Hand()
        h.transfer(Kind.RELOAD, 4)
        h.transfer(Kind.RELOAD, 4)
        return h.done()

    two = simulate(graph(), bandwidth=BW, streams={"h2d": 2})
    assert ends(two) == {0: 8, 1: 8}
    one = simulate(graph(), bandwidth=BW, streams={"h2d": 1})
    assert ends(one) == {0: 4, 1: 8}


def nondeterministic_wins() -> tuple[MemGraph, int]:
    """Serial order puts B (behind a 10 ms reload) before a chain of three 1 ms kernels."""
    h = Hand()
    r = h.transfer(Kind.RELOAD, 10)
    b = h.compute(1, after=[r])
    a1 = h.compute(1)
    a2 = h.compute(1, after=[a1])
    h.compute(1, after=[a2])
    return h.done(serial=[r, b, a1, a2, a2 + 1]), b


@pytest.mark.parametrize("launch_ahead", [0, 1, 16])
def test_nondeterministic_order_beats_deterministic(launch_ahead):
    mg, b = nondeterministic_wins()
    nondet = simulate(mg, bandwidth=BW, launch_ahead=launch_ahead)
    det = simulate(mg, bandwidth=BW, ordering="deterministic", launch_ahead=launch_ahead)
    # nondeterministic: the chain runs during the reload, B at 10 -> 11 ms
    assert nondet.step_time == pytest.approx(11 * MS)
    assert nondet.compute_idle == pytest.approx(7 * MS)
    # deterministic: the compute stream waits for B's turn: 10 ms idle, then B and the chain
    assert det.step_time == pytest.approx(14 * MS)
    assert det.compute_idle == pytest.approx(10 * MS)
    assert det.launch_order.index(b) < det.launch_order.index(b + 1)
    assert nondet.launch_order.index(b) > nondet.launch_order.index(b + 1)


def test_launch_ahead_commits_the_compute_queue_early():
    # serial [R, B, c1, c2, c3]: B's reload is done at 0.5 ms. Without launch-ahead the loop picks B
    # (earlier in serial) when c1 ends; with it, c1..c3 were already queued on the stream at t=0.
    h = Hand()
    r = h.transfer(Kind.RELOAD, 0.5)
    b = h.compute(1, after=[r])
    c1 = h.compute(1)
    c2 = h.compute(1, after=[c1])
    h.compute(1, after=[c2])
    mg = h.done()
    eager_loop = simulate(mg, bandwidth=BW, launch_ahead=0)
    ahead = simulate(mg, bandwidth=BW, launch_ahead=16)
    assert starts(eager_loop)[b] == 1 and starts(ahead)[b] == 3
    assert eager_loop.step_time == ahead.step_time == pytest.approx(4 * MS)
    assert ahead.launched_at[c2] == 0.0  # launched before c1 finished, started when it did
    assert starts(ahead)[c2] == 1


def test_early_launched_transfer_holds_its_stream_until_its_input_is_done():
    # c1 (2 ms) -> O1 (1 ms d2h); R0 (0.1 ms) -> O2 (1 ms d2h); one d2h stream.
    # With launch-ahead O1 is launched at t=0 (c1 reported early) and holds the d2h stream until c1
    # really ends, so O2 waits behind it; without it O2 takes the free stream at 0.1 ms.
    h = Hand()
    c1 = h.compute(2)
    o1 = h.transfer(Kind.OFFLOAD, 1, after=[c1])
    r0 = h.transfer(Kind.RELOAD, 0.1)
    o2 = h.transfer(Kind.OFFLOAD, 1, after=[r0])
    mg = h.done()
    ahead = simulate(mg, bandwidth=BW, streams={"d2h": 1}, launch_ahead=16)
    assert (starts(ahead)[o1], starts(ahead)[o2]) == (2, 3)
    assert ahead.step_time == pytest.approx(4 * MS)
    plain = simulate(mg, bandwidth=BW, streams={"d2h": 1}, launch_ahead=0)
    assert starts(plain)[o2] == pytest.approx(0.1)
    assert plain.step_time == pytest.approx(3 * MS)


def test_workspace_comes_from_the_engine_resource_manager():
    def graph(budget: int):
        h = Hand()
        h.compute(1, workspace=60)
        h.compute(1, workspace=60)
        mg = h.done()
        mg.plan.gpu_budget = budget  # workspace capacity = budget - arena (0 here)
        return mg

    kw = {"bandwidth": BW, "streams": {"compute": 2}, "launch_ahead": 0}
    assert starts(simulate(graph(100), **kw)) == {0: 0, 1: 1}  # 60 + 60 > 100: one after the other
    both = simulate(graph(200), **kw)
    assert starts(both) == {0: 0, 1: 0} and ends(both) == {0: 2, 1: 2}  # two streams share the GPU


def test_jitter_is_seeded_and_keeps_the_mean():
    def chain():
        h = Hand()
        prev = []
        for _ in range(20):
            prev = [h.compute(1, after=prev)]
        return h.done()

    mg = chain()
    a = simulate(mg, jitter=0.3, seed=1)
    assert a.step_time == simulate(mg, jitter=0.3, seed=1).step_time
    assert a.step_time != simulate(mg, jitter=0.3, seed=2).step_time
    mean = sum(simulate(mg, jitter=0.3, seed=s).step_time for s in range(200)) / 200
    assert mean == pytest.approx(20 * MS, rel=0.03)
    with pytest.raises(ValueError):
        simulate(mg, jitter=-1)


def test_stall_is_reported_like_the_engine():
    h = Hand()
    a = h.compute(1)
    b = h.compute(1, after=[a])
    h.mg.add_edge(b, a, Edge.DATA)  # a cycle: nothing can start
    with pytest.raises(StallError, match="stall"):
        simulate(h.done())


def test_costs_mapping_overrides_and_trace_file(tmp_path):
    mg, _ = nondeterministic_wins()
    res = simulate(mg, costs={0: 2 * MS}, bandwidth=BW)  # the reload now takes 2 ms: B ends with the chain
    assert res.step_time == pytest.approx(4 * MS)
    path = res.write_trace(tmp_path / "sim.json", mg)
    doc = json.loads(path.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(mg.vertices)
    assert doc["metadata"]["simulated"] is True
    assert {e["args"]["vertex"] for e in slices} == set(range(len(mg.vertices)))


@pytest.fixture(scope="module")
def gpt_memgraph():
    from turnip.bench.models.gpt import GPT, GPTConfig, example_batch, lm_loss
    from turnip.planners.costs import CostModel

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=64, n_layers=3, n_heads=4)
    model = GPT(cfg)
    batch = example_batch(cfg, batch=4)
    mg = memgraph.compile(model, lm_loss, batch, optimizer=torch.optim.AdamW(model.parameters()), budget=0.35,
                          device="cpu")
    costs = CostModel(device="cuda", measure=False)  # analytic H100-class times
    costs.annotate(mg.taskgraph)
    return mg, costs


@pytest.mark.parametrize("ordering", ["nondeterministic", "deterministic", "random"])
def test_traced_gpt_respects_dependencies_and_floor(gpt_memgraph, ordering):
    mg, costs = gpt_memgraph
    res = engine.simulate(mg, costs, jitter=0.2, ordering=ordering, seed=3)
    start = {s.vertex: s.start for s in res.timeline}
    end = {s.vertex: s.end for s in res.timeline}
    assert len(start) == len(mg.vertices)
    for src, dst, _ in mg.edges:
        assert start[dst] >= end[src] - 1e-15
    exact = engine.simulate(mg, costs, ordering=ordering, seed=3)
    floor = step_floor(mg, costs)
    assert exact.step_time >= floor["floor"] * (1 - 1e-9)
    assert exact.bytes_h2d == floor["bytes_h2d"] and exact.bytes_d2h == floor["bytes_d2h"]
    assert exact.bytes_d2h > 0  # the budget forced offloads
