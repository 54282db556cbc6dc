"""bench/scale.py: the projection of a step over nodes of GPUs from one GPU's exported step."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from turnip.bench import scale
from turnip.bench.models.sizes import make_workload
from turnip.bench.replan import export

INFINITE = scale.Topology(nvlink=math.inf, nvlink_latency=0.0, nic=math.inf, nic_latency=0.0)
SLOW_NIC = scale.Topology(nvlink=400e9, nic=1e9, nic_latency=5e-6)  # 1 GB/s per node: the NIC bounds


@pytest.fixture(scope="module")
def step_path(tmp_path_factory) -> Path:
    """A tiny gpt step traced on the CPU and priced as a CUDA step (as replan export --analytic-cuda)."""
    out = tmp_path_factory.mktemp("steps")
    return export(make_workload("gpt350m", tiny=True), "cpu", out, eager=False, analytic_cuda=True)


@pytest.fixture(scope="module")
def step(step_path) -> scale.Step:
    return scale.load(step_path)


def test_one_gpu_reproduces_the_single_gpu_simulated_step(step):
    budget = int(0.5 * step.eager_peak)
    alone = scale.simulate_at_budget(step.tg, step.facts, budget, "greedy")[0]
    row = scale.project(step, dataclasses.replace(SLOW_NIC, nodes=1, gpus_per_node=1), 0.5, 2**40, "greedy")
    assert row["turnip_s"] == pytest.approx(alone, rel=1e-9)
    assert row["turnip_exposed_comm_s"] == 0.0
    eager = sum(v.time for v in step.tg.vertices)
    assert row["ddp_s"] == pytest.approx(eager, rel=1e-9)
    assert row["fsdp2_s"] == pytest.approx(eager, rel=1e-9)


def test_states_and_update_shrink_by_the_workers(step):
    sharded = scale.sharded_step(step.tg, 4)
    states = [v for v in step.tg.values if v.kind.value == "optimizer_state" and v.nbytes > 1024]
    assert states and all(sharded.values[v.id].nbytes == v.nbytes // 4 for v in states)
    opt = [v for v in step.tg.vertices if v.phase == "optimizer"]
    assert all(sharded.vertices[v.id].time == pytest.approx(v.time / 4) for v in opt)
    forward = [v for v in step.tg.vertices if v.phase == "forward"]
    assert all(sharded.vertices[v.id].time == v.time for v in forward)


def test_gradients_are_every_trained_parameters(step):
    grads = scale.gradients(step.tg)
    params = [v for v in step.tg.values if v.kind.value == "parameter"]
    assert len(grads) == len(params)
    assert sum(g.param_bytes for g in grads) == pytest.approx(sum(p.nbytes for p in params), rel=1e-3)
    assert all(step.tg.vertices[g.producer].phase == "backward" for g in grads)


def test_hierarchical_collective_prices_each_level():
    one_node = scale.Topology(nodes=1, gpus_per_node=8, nvlink=100e9, nvlink_latency=0.0, nic=1.0)
    assert scale.reduce_scatter_seconds(8e9, one_node) == pytest.approx(7 / 8 * 8e9 / 100e9)
    one_gpu = scale.Topology(nodes=4, gpus_per_node=1, nvlink=1.0, nic=50e9, nic_latency=0.0)
    assert scale.reduce_scatter_seconds(8e9, one_gpu) == pytest.approx(3 / 4 * 8e9 / 50e9)
    both = scale.Topology(nodes=2, gpus_per_node=4, nvlink=100e9, nvlink_latency=0.0, nic=200e9, nic_latency=1e-3)
    assert scale.all_reduce_seconds(8e9, both) == pytest.approx(2 * (3 / 4 * 8e9 / 100e9 + 1 / 2 * 2e9 / 50e9 + 1e-3))


def test_communication_grows_with_nodes_when_the_nic_is_the_bottleneck(step):
    # the same 8 workers (the same planned step), more of their traffic across nodes
    rows = [scale.project(step, dataclasses.replace(SLOW_NIC, nodes=n, gpus_per_node=8 // n), 0.5, 2**40, "greedy")
            for n in (1, 2, 4, 8)]
    assert len({r["turnip_simulated_one_gpu_s"] for r in rows}) == 1
    for key in ("turnip_comm_busy_s", "turnip_s", "ddp_s", "fsdp2_exposed_comm_s"):
        values = [r[key] for r in rows]
        assert values == sorted(values) and values[-1] > values[0], key
    assert rows[-1]["turnip_exposed_comm_s"] > rows[0]["turnip_exposed_comm_s"]


def test_communication_vanishes_with_infinite_bandwidth(step):
    row = scale.project(step, dataclasses.replace(INFINITE, nodes=16, gpus_per_node=8), 0.5, 2**40, "greedy")
    assert row["turnip_comm_busy_s"] == 0.0
    assert row["turnip_exposed_comm_s"] == pytest.approx(0.0, abs=1e-12)
    assert row["turnip_s"] == pytest.approx(row["turnip_simulated_one_gpu_s"])
    assert row["ddp_exposed_comm_s"] == pytest.approx(0.0, abs=1e-12)
    assert row["fsdp2_exposed_comm_s"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("nodes,per_node", [(1, 2), (2, 4), (16, 8)])
def test_overlap_never_predicts_less_than_the_compute(step, nodes, per_node):
    for topo in (SLOW_NIC, scale.Topology()):
        row = scale.project(step, dataclasses.replace(topo, nodes=nodes, gpus_per_node=per_node), 0.5, 2**40,
                            "greedy")
        assert row["turnip_s"] >= row["turnip_simulated_one_gpu_s"]
        assert row["ddp_s"] >= sum(v.time for v in step.tg.vertices) * (1 - 1e-12)
        compute = sum(v.time for v in step.tg.vertices if v.phase != "optimizer")
        assert row["fsdp2_s"] >= compute


def test_tail_waits_for_the_last_bucket_and_the_link():
    grads = [scale.Gradient(value=k, producer=k, nbytes=100 * scale.MIB, param_bytes=100 * scale.MIB, update=0.0,
                            ready=0.001 * k) for k in range(10)]
    topo = scale.Topology(nodes=2, gpus_per_node=1, nic=10e9, nic_latency=0.0)
    end, busy = scale.turnip_tail(grads, topo, cap=100 * scale.MIB)
    per_bucket = 2 * scale.reduce_scatter_seconds(100 * scale.MIB, topo)
    assert busy == pytest.approx(10 * per_bucket)
    assert end == pytest.approx(max(10 * per_bucket, 0.009 + per_bucket))  # the link is the bottleneck here


def test_ddp_is_not_reported_where_eager_peak_does_not_fit(step):
    topo = dataclasses.replace(scale.Topology(), nodes=1, gpus_per_node=4)
    small_gpu = scale.project(step, topo, 0.5, step.eager_peak // 2, "greedy")
    assert small_gpu["ddp_ms"] is None and not small_gpu["ddp_fits_gpu"]
    assert small_gpu["turnip_ms"] is not None
    big_gpu = scale.project(step, topo, 0.5, 2**40, "greedy")
    assert big_gpu["ddp_ms"] is not None and not big_gpu["ddp_fits_budget"]  # runs, but not in half of eager's peak
    assert big_gpu["fsdp2_peak_bytes"] < big_gpu["ddp_peak_bytes"]


def test_cli_writes_the_json_and_the_plot(step_path, tmp_path, capsys):
    assert scale.main(["--step", str(step_path), "--nodes", "1,2", "--gpus-per-node", "2", "--budgets", "0.5",
                       "--planner", "greedy", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "scale_gpt350m-tiny.json").read_text())
    assert doc["benchmark"] == "scale" and doc["check"] == []  # no measured rows for this step's device
    assert [(r["nodes"], r["gpus"]) for r in doc["rows"]] == [(1, 2), (2, 4)]
    for key in ("turnip_ms", "ddp_ms", "fsdp2_ms", "turnip_tokens_per_s", "turnip_compute_s",
                "turnip_exposed_comm_s"):
        assert all(r[key] is not None for r in doc["rows"]), key
    assert doc["rows"][1]["turnip_tokens_per_s"] > doc["rows"][0]["turnip_tokens_per_s"]
    assert (tmp_path / "scale_gpt350m-tiny.png").stat().st_size > 1000
    assert "turnip ms" in capsys.readouterr().out
