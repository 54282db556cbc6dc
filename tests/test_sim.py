"""engine.simulate on hand-made MemGraphs whose step time is worked out by hand, plus a traced GPT.

Units: bandwidth 1e9 B/s, so 1e6 bytes take 1 ms; compute times are given in ms.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch
from turnip.engine import StallError
from turnip.engine.resources import LOOK_WHILE_BUSY_S
from turnip.engine.timing_sim import idle_by_wait, simulate, time_floor
from turnip.ir.costs import FixedRates
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
    floor = time_floor(h.mg, bandwidth=BW)
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


def test_idle_time_is_attributed_to_what_the_next_compute_waited_for():
    h = Hand()
    c1 = h.compute(5)
    r = h.transfer(Kind.RELOAD, 4, after=[c1])
    h.compute(1, after=[r])
    mg = h.done()
    res = simulate(mg, bandwidth=BW)
    idle = idle_by_wait(mg, res)
    assert list(idle) == [f"data reload {mg.taskgraph.values[mg.vertices[r].value].kind.value}"]
    assert sum(idle.values()) == pytest.approx(res.compute_idle) == pytest.approx(4 * MS)


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


def test_both_directions_at_once_run_at_the_links_duplex_rate():
    """With a duplex rate below the two directions' own rates added, each direction slows to its
    share while the other copies too, and runs at its own rate again once alone."""
    h = Hand()
    h.transfer(Kind.RELOAD, 4)
    h.transfer(Kind.OFFLOAD, 2)
    mg = h.done()
    # 1.5 GB/s in all for two 1 GB/s directions: each at 0.75 while both copy
    res = simulate(mg, bandwidth={"h2d": BW, "d2h": BW, "duplex": 1.5 * BW})
    assert ends(res)[1] == pytest.approx(2 / 0.75)  # 2 ms of d2h at 3/4 rate
    # the reload did 2 ms of its 4 by then, at 3/4 rate, and the rest alone at its own
    assert ends(res)[0] == pytest.approx(2 / 0.75 + (4 - 2))
    assert simulate(mg, bandwidth={"h2d": BW, "d2h": BW}).step_time == pytest.approx(4 * MS)


def test_the_hosts_links_together_move_at_most_what_the_host_moves():
    """Four devices each reloading at once: each at its own link's rate until the host's cap on
    every link together binds (HostLinks), then all slowed alike; each direction's cap and the cap
    on both at once apply, and without caps the devices do not slow one another."""
    from turnip.ir.costs import HostLinks

    h = Hand()
    for dev in range(4):
        for kind, ms in ((Kind.RELOAD, 4), (Kind.OFFLOAD, 2)):
            mv = h.mg.vertices[h.transfer(kind, ms)]  # moved to device `dev`'s links
            mv.writes = {v: dataclasses.replace(p, device=dev) if p.where == "gpu" else p for v, p in mv.writes.items()}
            mv.reads = {v: dataclasses.replace(p, device=dev) if p.where == "gpu" else p for v, p in mv.reads.items()}
    mg = h.done()

    def step_ms(links):
        return simulate(mg, FixedRates(h2d_bandwidth=BW, d2h_bandwidth=BW, host_links=links)).step_time / MS

    assert step_ms(HostLinks()) == pytest.approx(4)  # four links, each its own
    assert step_ms(HostLinks(h2d=2 * BW)) == pytest.approx(8)  # 16 ms of h2d bytes at 2 GB/s
    # both ways capped at 4 GB/s: every link at half speed until the offloads end (4 ms), then the
    # reloads' last 2 ms alone at 4 x 1 GB/s, within the cap
    assert step_ms(HostLinks(both=4 * BW)) == pytest.approx(6)
    assert step_ms(HostLinks(h2d=8 * BW, d2h=8 * BW, both=8 * BW)) == pytest.approx(4)  # caps that never bind


def test_the_floor_with_a_duplex_rate_bounds_what_both_directions_move_together():
    h = Hand()
    h.transfer(Kind.RELOAD, 4)
    h.transfer(Kind.OFFLOAD, 4)
    mg = h.done()
    capped = {"h2d": BW, "d2h": BW, "duplex": 1.5 * BW}
    floor = time_floor(mg, bandwidth=capped)
    assert floor["floor"] == pytest.approx(4 * MS)  # each direction alone
    assert floor["both_ways"] == pytest.approx(8 / 1.5 * MS)  # 8 ms of one-way bytes at 1.5 ms per ms
    assert floor["floor_both_ways"] == pytest.approx(8 / 1.5 * MS)
    assert simulate(mg, bandwidth=capped).step_time >= floor["floor_both_ways"] * (1 - 1e-9)
    uncapped = time_floor(mg, bandwidth=BW)
    assert uncapped["both_ways"] == 0.0 and uncapped["floor_both_ways"] == uncapped["floor"]


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


def test_a_copy_reported_at_enqueue_lets_its_reader_block_the_compute_stream():
    """The price of transfer_ahead (engine.run): B's reload is reported when queued, so the loop
    launches B right behind the chain's first kernel and the compute stream waits on the device for
    the 10 ms copy, the rest of the chain behind B (13 ms, against 11 when the loop sees the copy
    end); the H100 measured the trade worth it (bench/results/h100/engine_variants_*.json), and the
    simulator prices both."""
    mg, b = nondeterministic_wins()
    assert simulate(mg, bandwidth=BW, transfer_ahead=0).step_time == pytest.approx(11 * MS)
    ahead = simulate(mg, bandwidth=BW, transfer_ahead=1)
    assert ahead.step_time == pytest.approx(13 * MS)
    assert starts(ahead)[b] == pytest.approx(10) and starts(ahead)[b + 2] == pytest.approx(11)


@pytest.mark.parametrize("launch_ahead", [0, 1, 16])
def test_nondeterministic_order_beats_deterministic(launch_ahead):
    mg, b = nondeterministic_wins()
    nondet = simulate(mg, bandwidth=BW, launch_ahead=launch_ahead, transfer_ahead=0)
    det = simulate(mg, bandwidth=BW, ordering="deterministic", launch_ahead=launch_ahead, transfer_ahead=0)
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
    eager_loop = simulate(mg, bandwidth=BW, launch_ahead=0, transfer_ahead=0)
    ahead = simulate(mg, bandwidth=BW, launch_ahead=16, transfer_ahead=0)
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
    res = simulate(mg, costs={0: 2 * MS}, bandwidth=BW, transfer_ahead=0)  # the reload now takes 2 ms: B ends with the chain
    assert res.step_time == pytest.approx(4 * MS)
    path = res.write_timeline(tmp_path / "sim.json", mg)
    doc = json.loads(path.read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(mg.vertices)
    assert doc["metadata"]["simulated"] is True
    assert {e["args"]["vertex"] for e in slices} == set(range(len(mg.vertices)))


@pytest.fixture(scope="module")
def gpt_memgraph():
    from turnip.planners.costs import CostModel

    from turnip.gpt import GPT, GPTConfig, example_batch, lm_loss

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
    floor = time_floor(mg, costs)
    assert exact.step_time >= floor["floor"] * (1 - 1e-9)
    assert exact.bytes_h2d == floor["bytes_h2d"] and exact.bytes_d2h == floor["bytes_d2h"]
    assert exact.bytes_d2h > 0  # the budget forced offloads


# -- host time: the loop thread launches one vertex at a time -------------------------------------

HOST = 0.1 * MS


def chain(n: int, ms: float) -> MemGraph:
    h = Hand()
    prev = []
    for _ in range(n):
        prev = [h.compute(ms, after=prev)]
    return h.done()


def test_tiny_kernels_are_host_bound_with_launch_ahead():
    n, tiny = 40, 0.001  # ms: a hundredth of the host cost
    mg = chain(n, tiny)
    res = simulate(mg, bandwidth=BW, launch_ahead=16, host_per_vertex=HOST)
    # back-to-back launches; the GPU runs each kernel as its launch ends and then waits for the next
    assert res.launched_at == pytest.approx([i * HOST for i in range(n)], abs=1e-15)
    assert starts(res) == pytest.approx({v: (v + 1) * HOST / MS for v in range(n)})
    assert res.step_time == pytest.approx(n * HOST + tiny * MS)
    assert res.host_busy == pytest.approx(n * HOST)
    assert res.compute_idle == pytest.approx(n * HOST + tiny * MS - n * tiny * MS)
    # without launch-ahead the loop waits for each kernel before launching the next: host and GPU alternate,
    # which is the one case the older per-vertex ``overhead`` describes
    eager_loop = simulate(mg, bandwidth=BW, launch_ahead=0, host_per_vertex=HOST)
    assert eager_loop.step_time == pytest.approx(n * (HOST + tiny * MS))
    assert simulate(mg, bandwidth=BW, launch_ahead=0, overhead=HOST).step_time == pytest.approx(eager_loop.step_time)
    # but ``overhead`` books the host's time as GPU time: the GPU looks busy all along
    assert simulate(mg, bandwidth=BW, launch_ahead=16, overhead=HOST).compute_idle == pytest.approx(0, abs=1e-12)


def test_long_kernels_hide_host_time():
    n = 10  # 1 ms kernels, ten times the host cost: only the first launch shows
    res = simulate(chain(n, 1), bandwidth=BW, launch_ahead=16, host_per_vertex=HOST)
    assert res.step_time == pytest.approx(n * MS + HOST)
    assert starts(res) == pytest.approx({v: HOST / MS + v for v in range(n)})
    assert res.compute_idle == pytest.approx(HOST)
    assert res.compute_busy == pytest.approx(n * MS)  # host time is not device time
    assert res.host_busy == pytest.approx(n * HOST)
    # the older ``overhead`` lengthens every kernel instead, so it never hides
    assert simulate(chain(n, 1), bandwidth=BW, launch_ahead=16, overhead=HOST).step_time == pytest.approx(
        n * (MS + HOST))


def test_a_transfer_is_one_host_launch():
    # five tiny reloads on the two h2d streams: the host, not the link, sets the pace
    h = Hand()
    reloads = [h.transfer(Kind.RELOAD, 0.001) for _ in range(5)]
    mg = h.done()
    res = simulate(mg, bandwidth=BW, host_per_vertex=1 * MS)
    assert res.launched_at == pytest.approx([i * MS for i in range(5)], abs=1e-15)
    assert starts(res) == pytest.approx({v: v + 1 for v in reloads})
    assert res.step_time == pytest.approx(5.001 * MS)
    assert res.host_busy == pytest.approx(5 * MS) == res.summary()["host_busy"]
    floor = time_floor(mg, bandwidth=BW, host_per_vertex=1 * MS)
    assert floor["host"] == pytest.approx(5 * MS) and floor["floor"] == floor["host"] <= res.step_time
    # a reload behind a kernel: its launch follows the kernel's, it moves once that launch has ended
    h = Hand()
    c = h.compute(0.001)
    r = h.transfer(Kind.RELOAD, 0.001, after=[c])
    both = simulate(h.done(), bandwidth=BW, launch_ahead=0, host_per_vertex=1 * MS)
    assert both.launched_at[r] == pytest.approx(1.001 * MS)
    assert starts(both)[r] == pytest.approx(2.001)
    assert both.step_time == pytest.approx(2.002 * MS)


def random_dag(seed: int, n: int = 80) -> MemGraph:
    """Kernels with up to two predecessors, reloads and offloads, random durations (fixed by seed)."""
    rng = random.Random(seed)
    h = Hand()
    computes: list[int] = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            h.transfer(Kind.RELOAD, rng.uniform(0.05, 3), after=rng.sample(computes, min(len(computes), 1)))
        elif r < 0.3 and computes:
            h.transfer(Kind.OFFLOAD, rng.uniform(0.05, 3), after=[rng.choice(computes)])
        else:
            prev = list(range(len(h.mg.vertices)))
            computes.append(h.compute(rng.uniform(0.01, 2), after=rng.sample(prev, min(len(prev), 2))))
    return h.done()


# (step_time, sum of start times) from engine/timing_sim.py as of acb5efc, before it modelled host time
BEFORE_HOST_TIME = {
    (1, 0, "nondeterministic"): (0.05601683605288471, 2.024209008473775),
    (1, 0, "random"): (0.06080592781426041, 2.045206958614863),
    (1, 16, "nondeterministic"): (0.056016836052884725, 2.1516853521235877),
    (1, 16, "random"): (0.05550303373505037, 2.091380463023452),
    (2, 0, "nondeterministic"): (0.06170221944629402, 2.2767035806819016),
    (2, 0, "random"): (0.06560609014779259, 2.456112863024647),
    (2, 16, "nondeterministic"): (0.06170221944629402, 2.3526194211806692),
    (2, 16, "random"): (0.0642358803276705, 2.7441495557660502),
}


def host_costs() -> FixedRates:
    """A cost model that knows only a host cost (its compute times come from the TaskGraph)."""
    return FixedRates(h2d_bandwidth=BW, d2h_bandwidth=BW, host_per_vertex=1 * MS)


@pytest.mark.parametrize("seed", [1, 2])
def test_no_host_cost_is_the_simulator_before_it(seed):
    mg = random_dag(seed)
    for (s, launch_ahead, ordering), before in BEFORE_HOST_TIME.items():
        if s != seed:
            continue
        # the copy streams of CUDA's defaults then (two per direction), so the figures stay comparable
        streams = {"compute": 2 if ordering == "random" else 1, "h2d": 2, "d2h": 2}
        noisy = {"jitter": 0.2} if ordering == "random" else {}
        kw = {"seed": seed, "launch_ahead": launch_ahead, "ordering": ordering, "streams": streams, **noisy}
        default = simulate(mg, bandwidth=BW, **kw, transfer_ahead=0)  # no cost model: no host cost
        zero = simulate(mg, host_costs(), **kw, host_per_vertex=0, transfer_ahead=0)  # an explicit 0 beats the model's
        for res in (default, zero):
            # the sum of start times may differ from the recorded one in its last bit with the summation
            # order of the platform's float library; the timeline itself is compared exactly below
            assert (res.step_time, sum(sp.start for sp in res.timeline)) == pytest.approx(before, rel=1e-12, abs=0)
            assert res.host_busy == 0 and res.host_per_vertex == 0
        assert [tuple(sp) for sp in zero.timeline] == [tuple(sp) for sp in default.timeline]
        assert zero.launch_order == default.launch_order and zero.launched_at == default.launched_at


def test_host_cost_defaults_to_the_cost_model():
    mg = chain(3, 1)
    assert simulate(mg, host_costs()).host_per_vertex == 1 * MS  # the same on every backend
    assert simulate(mg, host_costs()).step_time == pytest.approx(3 * MS + 1 * MS)
    assert simulate(mg, {0: 1 * MS}).host_per_vertex == 0  # a mapping of durations has none

    class PerBackend(FixedRates):
        def host_per_vertex_on(self, device):
            return 2 * MS if device.startswith("cuda") else 0.0

    # the figure for the backend simulated, not for the device the model was made on
    assert simulate(mg, PerBackend(), backend="cuda").host_per_vertex == 2 * MS
    assert simulate(mg, PerBackend(), backend="cpu").host_per_vertex == 0
    assert simulate(mg, PerBackend(), host_per_vertex=0.5 * MS).host_per_vertex == 0.5 * MS
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="host_per_vertex"):
            simulate(mg, host_per_vertex=bad)


def test_traced_gpt_with_host_time(gpt_memgraph):
    mg, costs = gpt_memgraph
    h = 15e-6  # given, not the cost model's, so the test does not move with its default
    res = engine.simulate(mg, costs, host_per_vertex=h, seed=3)
    n = len(mg.vertices)
    start = {s.vertex: s.start for s in res.timeline}
    end = {s.vertex: s.end for s in res.timeline}
    for src, dst, _ in mg.edges:
        assert start[dst] >= end[src] - 1e-15
    launched = [res.launched_at[v] for v in res.launch_order]
    assert all(b - a >= h * (1 - 1e-9) for a, b in itertools.pairwise(launched))  # one launch at a time
    assert all(start[v] >= res.launched_at[v] + h * (1 - 1e-9) for v in range(n))
    assert res.host_busy == pytest.approx(n * h)
    floor = time_floor(mg, costs, host_per_vertex=h)
    assert floor["host"] == pytest.approx(n * h)
    assert res.step_time >= floor["floor"] * (1 - 1e-9)
    assert res.step_time > engine.simulate(mg, costs, host_per_vertex=0.0, seed=3).step_time


def test_host_takes_queued_reports_before_polling_the_device():
    # engine.loop.drive with the CUDA completions: when free, the loop takes a queued (early) report;
    # it polls the device when none is queued or LOOK_WHILE_BUSY_S after its last look, and then takes
    # all it finds, in order, behind the reports queued.
    two = {"bandwidth": BW, "host_per_vertex": 1 * MS, "streams": {"compute": 2, "h2d": 2}}
    # k0 -> k1 -> k2 report at launch; reload R ends at 1.001 ms, while the host launches k0. Each launch
    # takes 1 ms, so the loop looks at every report: at 2 ms it finds R behind k0's report, launches k1
    # for k0, then B for R, then k2 for k1
    h = Hand()
    r = h.transfer(Kind.RELOAD, 0.001)
    k0 = h.compute(0.001)
    k1 = h.compute(0.001, after=[k0])
    k2 = h.compute(0.001, after=[k1])
    b = h.compute(0.001, after=[r])
    res = simulate(h.done(), **two, transfer_ahead=0)
    assert res.launch_order == [r, k0, k1, b, k2]
    assert [res.launched_at[v] for v in (r, k0, k1, b, k2)] == pytest.approx([i * MS for i in range(5)])
    # 20 us a launch: a chain of long kernels keeps early reports queued. The loop looks at 40 us (its
    # first report), finds nothing, and looks again only at 240 us: R, ended at 120 us, is heard then,
    # and B launched at 260 us, not once the queue runs dry (600 us)
    fast = {**two, "host_per_vertex": 0.02 * MS}
    h = Hand()
    r = h.transfer(Kind.RELOAD, 0.1)
    chain = [h.compute(1.0)]
    for _ in range(29):
        chain.append(h.compute(1.0, after=[chain[-1]]))
    b = h.compute(0.001, after=[r])
    res = simulate(h.done(), **fast, transfer_ahead=0)
    assert LOOK_WHILE_BUSY_S == pytest.approx(0.2 * MS)
    assert res.launched_at[b] == pytest.approx(0.26 * MS)
    # reloads X and Y both end while the host launches; one poll at 3 ms finds both: X's successor BX,
    # then Y's successor BY, and only then CX, released by BX's report, which was queued behind Y
    h = Hand()
    x = h.transfer(Kind.RELOAD, 0.001)
    y = h.transfer(Kind.RELOAD, 0.001)
    h.compute(0.001)
    bx = h.compute(0.001, after=[x])
    cx = h.compute(0.001, after=[bx])
    by = h.compute(0.001, after=[y])
    res = simulate(h.done(), **two, transfer_ahead=0)
    assert res.launch_order[3:] == [bx, by, cx]
    assert [res.launched_at[v] for v in (bx, by, cx)] == pytest.approx([3 * MS, 4 * MS, 5 * MS])


def test_compile_keeps_the_candidate_the_simulator_runs_fastest():
    """Of two MemGraphs for one step, the one moving far more bytes over the link is slower in the simulator."""
    from synthetic import chain_of_blocks
    from turnip.memgraph.compiler import fastest_simulated

    tg = chain_of_blocks(6, act_bytes=1 << 20, param_bytes=1 << 16)
    for v in tg.vertices:
        v.time = 50e-6
    peak = tg.live_peak(alignment=256)
    roomy = memgraph.build(tg, Plan(gpu_budget=peak * 2, planner="roomy"))
    tight = memgraph.build(tg, Plan(gpu_budget=peak // 3, planner="tight"))
    assert tight.summary()["bytes_offloaded"] > roomy.summary()["bytes_offloaded"]
    best = fastest_simulated([tight, roomy], None, "cuda")
    assert best is roomy
    candidates = best.stats["simulated_candidates"]
    assert set(candidates) == {"tight#0", "roomy#1"} and candidates["roomy#1"] < candidates["tight#0"]
    assert best.stats["simulated_step_s"] == candidates["roomy#1"]


@pytest.mark.parametrize("transfer_ahead, step_ms", [(0, 6.0), (1, 4.5), (3, 4.5)])
def test_transfer_ahead_queues_the_next_copy_behind_the_running_one(transfer_ahead, step_ms):
    # four 1 ms reloads on one h2d stream, 0.5 ms of host per launch. Reported only when done, each
    # copy waits for the host to see the one before end and launch it: 0.5 + 4 x 1.5 ms. Reported at
    # enqueue, the next is already queued when one ends: back to back after the first launch.
    h = Hand()
    reloads = [h.transfer(Kind.RELOAD, 1) for _ in range(4)]
    res = simulate(h.done(), bandwidth=BW, streams={"h2d": 1}, host_per_vertex=0.5 * MS, transfer_ahead=transfer_ahead)
    assert res.step_time == pytest.approx(step_ms * MS)
    assert [starts(res)[r] for r in reloads] == sorted(starts(res)[r] for r in reloads)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_transfer_ahead_must_be_a_count(bad):
    h = Hand()
    h.transfer(Kind.RELOAD, 1)
    with pytest.raises(ValueError, match="transfer_ahead"):
        simulate(h.done(), bandwidth=BW, transfer_ahead=bad)


def test_trace_names_what_each_unit_waited_for(tmp_path):
    """The trace's "after" lists each unit's predecessors, and bench/trace_waits.py charges the compute
    stream's 9 ms gap (B queued behind its 10 ms reload) to that reload."""
    from turnip.bench.trace_waits import explain_gaps, load_units

    mg, b = nondeterministic_wins()
    res = simulate(mg, bandwidth=BW, transfer_ahead=1)
    units = load_units(res.write_timeline(tmp_path / "sim.json", mg))
    after = {e["args"]["vertex"]: e["args"].get("after", []) for e in units}
    assert after[b] == [0] and after[b + 1] == [] and after[b + 2] == [b + 1]
    assert all("launched" in e["args"] for e in units)
    gaps = explain_gaps(units)
    assert len(gaps) == 1
    assert gaps[0]["vertex"] == b and gaps[0]["gap_us"] == pytest.approx(9000, abs=50)
    assert gaps[0]["cause"] == "waits for reload" and gaps[0]["waited_for"]["vertex"] == 0


def test_trace_waits_charges_a_launch_on_another_devices_end_to_that_device():
    """Device 1 idles 4.9 ms before C: the loop launched C 50 us after A, C's predecessor on device 0,
    ended (a copy between devices is launched once its writer has run), so the gap is A's, not the
    host's. D, launched late with no such predecessor, stays the host's; E, launched 2.96 ms after its
    predecessor on device 0 ended, is the loop's late hearing."""
    from turnip.bench.trace_waits import explain_gaps

    def unit(vertex, pid, ts, dur, launched, after=()):
        return {"ph": "X", "name": f"u{vertex}", "cat": "compute", "pid": pid, "tid": pid, "ts": ts, "dur": dur,
                "args": {"vertex": vertex, "launched": launched, "after": list(after)}}

    units = [unit(0, 0, 0, 5000, 0), unit(1, 1, 0, 100, 0), unit(2, 1, 5060, 100, 5050, after=[0]),
             unit(3, 1, 8000, 100, 7990, after=[2]), unit(4, 0, 5000, 4000, 5000),
             unit(5, 1, 12000, 100, 11960, after=[4])]
    gaps = {g["vertex"]: g for g in explain_gaps(units)}
    assert gaps[2]["cause"] == "waits for compute on another device" and gaps[2]["waited_for"]["device"] == 0
    assert gaps[2]["gap_us"] == pytest.approx(4960)
    assert gaps[3]["cause"] == "host launch"
    # E launched 2.96 ms after its predecessor on device 0 ended: the loop heard of it late
    assert gaps[5]["cause"] == "loop heard late of another device" and gaps[5]["waited_for"]["heard_after_us"] == 2960


def test_a_copy_between_devices_waits_for_its_writer_off_its_stream():
    """Device 0 runs a long kernel, device 2 a short one; device 1 copies in each one's output on its
    one copy stream, the long one's copy first in priority. Both kernels are reported at enqueue, so
    launched on that report the long one's copy would hold the stream until the kernel ends and the
    short one's copy would wait behind it; the loop launches a copy between devices once its writer
    has run, so the short kernel's copy goes first."""
    mg = MemGraph(taskgraph=TaskGraph(), plan=Plan(gpu_budget=1 << 20))
    on = {d: Place("gpu", 0, 1 << 20, device=d) for d in (0, 1, 2)}
    long = mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, writes={0: on[0]})
    short = mg.add_vertex(Kind.COMPUTE, Stream.COMPUTE, writes={1: on[2]})
    long_copy = mg.add_vertex(Kind.COMPUTE, Stream.D2D, reads={0: on[0]}, writes={2: on[1]})
    short_copy = mg.add_vertex(Kind.COMPUTE, Stream.D2D, reads={1: on[2]}, writes={3: on[1]})
    mg.add_edge(long, long_copy, Edge.DATA)
    mg.add_edge(short, short_copy, Edge.DATA)
    mg.serial = [long, short, long_copy, short_copy]
    costs = {long: 10e-3, short: 1e-3, long_copy: 1e-3, short_copy: 1e-3}
    res = simulate(mg, costs, backend="cuda", host_per_vertex=0.0)
    span = {s.vertex: s for s in res.timeline}
    assert span[short_copy].start == pytest.approx(1e-3)
    assert span[long_copy].start == pytest.approx(10e-3)
    assert res.step_time == pytest.approx(11e-3)
