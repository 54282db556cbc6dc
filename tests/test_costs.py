"""Cost model: analytic estimates, measuring through the cache (on the CPU here), CUDA when present."""

from __future__ import annotations

import json

import pytest
import torch
from turnip.ir.costs import CostModel as Interface
from turnip.ir.costs import FixedRates
from turnip.ir.taskgraph import TaskGraph, ValueKind
from turnip.memgraph import trace
from turnip.planners import costs as costs_mod
from turnip.planners import measure as measure_mod
from turnip.planners.costs import H100, CostCache, CostModel, DeviceSpec, analytic_time, signature

from turnip.gpt import GPT, GPTConfig, example_batch, lm_loss

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mm_graph(m: int, k: int, n: int, dtype=torch.float32) -> TaskGraph:
    tg = TaskGraph()
    item = torch.empty((), dtype=dtype).element_size()
    a = tg.add_value((m, k), (k, 1), dtype, m * k * item, ValueKind.PARAMETER, name="param:a")
    b = tg.add_value((k, n), (n, 1), dtype, k * n * item, ValueKind.BATCH, name="batch:b")
    c = tg.add_value((m, n), (n, 1), dtype, m * n * item)
    d = tg.add_value((m, n), (n, 1), dtype, m * n * item)
    tg.add_vertex("aten::mm", (tg.values[a].dense_ref, tg.values[b].dense_ref), outputs=(c,))
    tg.add_vertex("aten::gelu", (tg.values[c].dense_ref,), outputs=(d,))
    tg.outputs["loss"] = d
    return tg


@pytest.fixture(scope="module")
def gpt_step():
    cfg = GPTConfig()
    model = GPT(cfg)
    return trace(model, lm_loss, example_batch(cfg), optimizer=torch.optim.AdamW(model.parameters()))


def test_matmul_is_flop_bound_and_elementwise_bytes_bound():
    tg = _mm_graph(4096, 4096, 4096)
    mm, gelu = tg.vertices
    flops = 2 * 4096**3
    assert analytic_time(tg, mm, H100) == pytest.approx(flops / 50e12 + H100.launch)  # fp32: no TF32
    nbytes = 2 * 4096 * 4096 * 4
    assert analytic_time(tg, gelu, H100) == pytest.approx(nbytes / 3e12 + H100.launch)
    bf16 = _mm_graph(4096, 4096, 4096, torch.bfloat16)
    assert analytic_time(bf16, bf16.vertices[0], H100) == pytest.approx(flops / 700e12 + H100.launch)


def test_tiny_ops_cost_the_launch_floor():
    tg = _mm_graph(2, 2, 2)
    assert analytic_time(tg, tg.vertices[1], H100) == pytest.approx(H100.launch, rel=1e-3)


def test_attention_flops_count_causal_half(gpt_step):
    sdpa = [v for v in gpt_step.vertices if "scaled_dot_product" in v.op]
    fwd = next(v for v in sdpa if not v.op.endswith("backward"))
    bwd = next(v for v in sdpa if v.op.endswith("backward"))
    spec = DeviceSpec(launch=0.0, mem_bw=1e30)
    # (b=2, h=4, t=32, e=16): 4*b*h*t*t*e FLOPs, halved by the causal mask
    want = 4 * 2 * 4 * 32 * 32 * 16 * 0.5 / 50e12
    assert analytic_time(gpt_step, fwd, spec) == pytest.approx(want)
    assert analytic_time(gpt_step, bwd, spec) == pytest.approx(2.5 * want)


def test_annotate_fills_time_and_workspace_without_overwriting(gpt_step):
    tg = gpt_step.copy()
    tg.vertices[0].time = 1.0
    CostModel(measure=False).annotate(tg)
    assert tg.vertices[0].time == 1.0
    assert all(v.time > 0 for v in tg.vertices)
    mm = next(v for v in tg.vertices if v.op == "aten::mm")
    assert mm.workspace == 0  # mm.out writes straight into its place
    attention = next(v for v in tg.vertices if "scaled_dot_product" in v.op and v.phase == "forward")
    # no out= overload: computed, then copied into place, so the result is scratch memory
    assert attention.workspace == sum(tg.values[o].nbytes for o in attention.outputs if o >= 0)
    CostModel(measure=False, spec=DeviceSpec(launch=1.0)).annotate(tg, overwrite=True)
    assert tg.vertices[0].time >= 1.0


def test_identical_layers_share_signatures(gpt_step):
    sigs = {signature(gpt_step, v) for v in gpt_step.vertices}
    assert len(sigs) < len(gpt_step.vertices) / 2  # two identical blocks, many identical updates
    blocks = [v for v in gpt_step.vertices if v.module.startswith("blocks.") and v.phase == "forward"]
    by_block = {}
    for v in blocks:
        by_block.setdefault(v.module.split(".")[1], []).append(signature(gpt_step, v))
    assert by_block["0"] == by_block["1"]


def test_measured_costs_are_cached_on_disk(gpt_step, tmp_path, monkeypatch):
    calls = []
    real = measure_mod.measure_vertex

    def counting(tg, vertex, device, runs=7, warmup=2):
        calls.append(vertex.op)
        return real(tg, vertex, device, runs=1, warmup=0)

    monkeypatch.setattr(measure_mod, "measure_vertex", counting)
    tg = gpt_step.copy()
    for v in tg.vertices:
        v.time = 0.0
    model = CostModel(device="cpu", measure=True, cache_dir=tmp_path)
    model.annotate(tg)
    distinct = len({signature(tg, v) for v in tg.vertices})
    assert len(calls) == distinct == model.measured  # identical ops measured once
    assert all(v.time > 0 for v in tg.vertices)
    files = list(tmp_path.glob("costs-*.json"))
    assert len(files) == 1 and torch.__version__.replace("+", "_") in files[0].name
    blob = json.loads(files[0].read_text())
    assert blob["torch"] == torch.__version__ and len(blob["ops"]) == distinct

    again = tg.copy()
    for v in again.vertices:
        v.time = 0.0
    fresh = CostModel(device="cpu", measure=True, cache_dir=tmp_path)
    fresh.annotate(again)
    assert len(calls) == distinct and fresh.measured == 0  # the cache answered everything
    assert [v.time for v in again.vertices] == [v.time for v in tg.vertices]


def test_cache_belongs_to_one_device_and_torch(tmp_path):
    cache = CostCache(tmp_path, "gpu-a", "2.0")
    cache.ops["abc"] = {"time": 1.0, "workspace": 0, "op": "x"}
    cache.save()
    assert CostCache(tmp_path, "gpu-a", "2.0").ops == cache.ops
    assert CostCache(tmp_path, "gpu-b", "2.0").ops == {}
    assert CostCache(tmp_path, "gpu-a", "2.1").ops == {}
    path = CostCache(tmp_path, "gpu-a", "2.0").path
    data = json.loads(path.read_text())
    data["device"] = "someone else"  # a file renamed by hand is not trusted
    path.write_text(json.dumps(data))
    assert CostCache(tmp_path, "gpu-a", "2.0").ops == {}


def test_unmeasurable_op_falls_back_to_the_estimate(tmp_path):
    tg = _mm_graph(4, 4, 4)
    tg.vertices[1].op = "synthetic"  # no such ATen op
    model = CostModel(device="cpu", measure=True, cache_dir=tmp_path)
    model.annotate(tg)
    assert tg.vertices[1].time == pytest.approx(analytic_time(tg, tg.vertices[1], H100))
    assert model.measured == 1


def test_bandwidth_is_measured_once_per_direction_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake(device):
        calls.append(device)
        return {"h2d": 25e9, "d2h": 20e9}

    monkeypatch.setattr(measure_mod, "measure_bandwidth", fake)
    model = CostModel(device="cuda", measure=True, cache_dir=tmp_path)
    assert model.h2d_bandwidth == 25e9 and model.d2h_bandwidth == 20e9
    assert model.transfer_time(50e9, "d2h") == pytest.approx(2.5)
    assert len(calls) == 1
    assert CostModel(device="cuda", measure=True, cache_dir=tmp_path).h2d_bandwidth == 25e9
    assert len(calls) == 1


def test_a_link_is_measured_by_its_fastest_copy_not_its_median():
    """Interference only slows a copy: one slow moment must not become the rate cached for the
    machine (two processes on one H200 host: medians of 46.9 and 55.0 GB/s)."""
    samples = [46.9e9, 55.0e9, 47.3e9, 46.5e9, 54.8e9]
    assert measure_mod.link_capacity(samples) == 55.0e9
    assert measure_mod.link_capacity(iter(samples)) == 55.0e9  # measure_host_links passes a generator


def test_both_ways_rate_counts_only_the_time_both_directions_copy():
    """The duplex rate is what moves while both directions are busy: a direction the copy engines
    served first, then left to finish alone, must not make the link look slower both ways."""
    mib = 1 << 20
    # even: both directions end each copy together, 4 copies in 1 s
    even = [[0.25, 0.5, 0.75, 1.0], [0.25, 0.5, 0.75, 1.0]]
    assert measure_mod.both_ways_rate(even, mib) == pytest.approx(8 * mib / 1.0)
    # uneven: host-to-device done at 1 s, when the other way had 2 copies done, then ran on alone (its
    # last copy ending at 2 s): the 6 copies done in the 1 s both were busy (timed to the last copy: 8 in 2 s)
    uneven = [[0.25, 0.5, 0.75, 1.0], [0.4, 0.8, 1.2, 2.0]]
    assert measure_mod.both_ways_rate(uneven, mib) == pytest.approx(6 * mib / 1.0)
    # one way after the other, no overlap: the first direction's rate alone
    serial = [[0.25, 0.5, 0.75, 1.0], [1.25, 1.5, 1.75, 2.0]]
    assert measure_mod.both_ways_rate(serial, mib) == pytest.approx(4 * mib / 1.0)


def test_analytic_model_never_touches_the_disk(tmp_path, gpt_step):
    model = CostModel(measure=False, cache_dir=tmp_path / "nowhere")
    model.annotate(gpt_step.copy(), overwrite=True)
    assert model.h2d_bandwidth == H100.h2d == 50e9
    assert not (tmp_path / "nowhere").exists()


def test_default_costs_follow_the_device(gpt_step):
    model = costs_mod.default_costs(gpt_step)
    assert model.measure == (gpt_step.device == "cuda" and torch.cuda.is_available())


def test_host_cost_per_launch_follows_the_backend():
    """15 us per launched vertex on CUDA (the engine's measured event-loop cost), nothing on the
    CPU backend (its host time is inside the op times), and an explicit figure wins everywhere."""
    assert H100.host_per_vertex == 15e-6 and costs_mod.CPU.host_per_vertex == 0.0
    model = CostModel(device="cuda", measure=False)
    assert model.host_per_vertex == 15e-6
    assert model.host_per_vertex_on("cuda:1") == 15e-6 and model.host_per_vertex_on("cpu") == 0.0
    assert CostModel(device="cpu").host_per_vertex == 0.0
    assert CostModel(device="cuda", measure=False, spec=DeviceSpec(host_per_vertex=4e-6)).host_per_vertex == 4e-6
    override = CostModel(device="cpu", host_per_vertex=2e-5)
    assert override.host_per_vertex_on("cpu") == override.host_per_vertex_on("cuda") == 2e-5
    assert CostModel(device="cuda", measure=False, host_per_vertex=0.0).host_per_vertex == 0.0
    for bad in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            CostModel(host_per_vertex=bad)


def test_planner_prices_launches_for_the_graphs_device():
    from turnip.planners.driver import make_problem

    tg = _mm_graph(64, 64, 64)
    cuda = tg.copy()
    cuda.device = "cuda"
    analytic = CostModel(device="cpu", measure=False)
    assert make_problem(tg, 1 << 30, costs=analytic).host_per_vertex == 0.0
    problem = make_problem(cuda, 1 << 30, costs=analytic)  # the engine that runs the graph decides
    assert problem.host_per_vertex == 15e-6
    # two vertices, the batch input's copy-in and the loss's read-back
    assert problem.base_host.sum() == pytest.approx(4 * 15e-6)


@cuda
def test_measures_on_cuda(tmp_path):
    tg = _mm_graph(1024, 1024, 1024)
    model = CostModel(device="cuda", cache_dir=tmp_path)
    assert model.measure
    model.annotate(tg)
    mm, gelu = tg.vertices
    assert 0 < mm.time < 0.1 and 0 < gelu.time < 0.1
    assert mm.workspace >= 0
    assert 1e9 < model.h2d_bandwidth < 1e12 and 1e9 < model.d2h_bandwidth < 1e12
    # both ways at once: at least one direction's rate (its copies alone), at most the two added
    one_way = min(model.h2d_bandwidth, model.d2h_bandwidth)
    assert 0.9 * one_way <= model.duplex_bandwidth <= model.h2d_bandwidth + model.d2h_bandwidth
    assert CostModel(device="cuda", cache_dir=tmp_path).h2d_bandwidth == model.h2d_bandwidth


def test_convolution_flops():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(8 * 16, 2))
    batch = (torch.randn(4, 3, 4, 4), torch.tensor([0, 1, 0, 1]))
    tg = trace(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), batch,
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    spec = DeviceSpec(launch=0.0, mem_bw=1e30)
    fwd = next(v for v in tg.vertices if v.op == "aten::convolution")
    bwd = next(v for v in tg.vertices if v.op == "aten::convolution_backward")
    per_output = 2 * 3 * 3 * 3  # C_in * kh * kw multiply-adds
    assert analytic_time(tg, fwd, spec) == pytest.approx(per_output * 4 * 8 * 4 * 4 / 50e12)
    assert analytic_time(tg, bwd, spec) == pytest.approx(2 * per_output * 4 * 8 * 4 * 4 / 50e12)


def test_in_place_versions_are_timed_over_their_old_buffer(gpt_step):
    """The engine runs an in-place version (a donated buffer, an optimizer update in its home) where
    its old version lies; timing binds it the same way, with no copy of the old version first."""
    tg = gpt_step
    in_place = [v for v in tg.vertices if v.copy_in]
    assert any(v.phase == "optimizer" for v in in_place) and any(v.phase != "optimizer" for v in in_place)
    for vertex in in_place:
        prepared = measure_mod.prepare_for_timing(tg, vertex, torch.device("cpu"))
        assert prepared.copies == [], vertex.op
    # the signature marks the change, so costs cached when they were timed after a copy are retimed
    assert signature(tg, in_place[0]) != signature(
        tg, type(in_place[0])(**{**in_place[0].__dict__, "copy_in": ()}))


def test_the_planners_cost_model_is_what_the_simulator_reads():
    """The simulator (engine/) reads ir.costs.CostModel; planners.costs.CostModel and FixedRates implement it."""
    model = CostModel(device="cpu", measure=False)
    assert isinstance(model, Interface) and isinstance(FixedRates(), Interface)
    assert model.hbm_bandwidth == model.spec.mem_bw > 0
