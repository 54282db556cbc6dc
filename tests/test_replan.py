"""Planner research without the GPU (bench/replan.py, ir/step_file.py): a traced step saved without
its weights but with its op costs plans and simulates anywhere, as compile would on the GPU."""

from __future__ import annotations

import json

import pytest
import torch
from turnip.bench import replan
from turnip.bench.models.sizes import make_workload
from turnip.ir.plan import Plan
from turnip.ir.step_file import load_step, save_step
from turnip.memgraph.builder import build
from turnip.memgraph.compiler import UNBOUNDED, unplanned_peak

from turnip import memgraph


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("steps")
    return replan.export(make_workload("gpt350m", tiny=True), "cpu", out)


def test_a_step_file_keeps_costs_and_structure_but_no_weights(exported):
    tg = load_step(exported)
    assert tg.initial_state == {} and all(v.time > 0 for v in tg.vertices)
    facts = json.loads(exported.with_suffix(".json").read_text())
    assert facts["vertices"] == len(tg.vertices) and facts["eager_status"] == "ok"
    assert exported.stat().st_size < 200_000  # the tiny model's weights alone would be larger
    peak = unplanned_peak(build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=256, compact=True))
    assert peak > 0


def test_a_step_file_round_trips_and_refuses_other_files(tmp_path, exported):
    tg = load_step(exported)
    again = tmp_path / "again.step"
    save_step(tg, again)
    tg2 = load_step(again)
    assert [(v.op, v.time, v.outputs) for v in tg2.vertices] == [(v.op, v.time, v.outputs) for v in tg.vertices]
    mg = memgraph.compile(*_tiny_parts(), device="cpu", verbose=False, cache=False)
    mg_file = tmp_path / "step.mg"
    mg.save(mg_file)
    with pytest.raises(ValueError, match="not a traced step"):
        load_step(mg_file)


def _tiny_parts():
    w = make_workload("gpt350m", tiny=True)
    return w.model, w.loss_fn, w.batch


def test_replan_rows_pick_the_fastest_simulated_candidate_per_budget(exported, tmp_path):
    rows = replan.replan(exported, ["0.6", "0.4"], {})
    assert {r["budget"] for r in rows} == {"0.6", "0.4"}
    for budget in ("0.6", "0.4"):
        mine = [r for r in rows if r["budget"] == budget]
        picked = [r for r in mine if r.get("picked")]
        assert len(picked) == 1 and picked[0]["simulated_s"] == min(r["simulated_s"] for r in mine)
        assert all(r["arena_bytes"] <= r["budget_bytes"] for r in mine)
    assert max(r["bytes_h2d"] for r in rows if r["budget"] == "0.4") > 0  # 40% needs transfers
    text = replan.format_rows(rows)
    assert text.count("*") == 2


def test_the_command_writes_json(exported, tmp_path, capsys):
    assert replan.main(["plan", "--step", str(exported), "--budgets", "0.5", "--out", str(tmp_path),
                        "--planner-option", "time_limit=2"]) == 0
    doc = json.loads((tmp_path / "replan_gpt350m-tiny.json").read_text())
    assert doc["benchmark"] == "replan" and doc["rows"][0]["options"] == {"time_limit": 2}
    assert "picked" in capsys.readouterr().out


def test_a_split_export_plans_with_the_unsplit_steps_eager_facts(exported, tmp_path):
    out = exported.parent
    split = replan.export(make_workload("gpt350m", tiny=True), "cpu", out, eager=False, loss_blocks=4)
    assert split.name == "step_gpt350m-tiny_split4.step"
    tg = load_step(split)
    assert sum(v.op == "aten::nll_loss_forward" for v in tg.vertices) == 4
    rows = replan.replan(split, ["0.5"], {})
    assert rows and all(r["loss_blocks"] == 4 for r in rows)


def test_without_a_gpu_a_step_is_priced_as_a_cuda_step(tmp_path):
    """--analytic-cuda: a stand-in for planner experiments on a machine without a GPU."""
    path = replan.export(make_workload("gpt350m", tiny=True), "cpu", tmp_path, eager=False, analytic_cuda=True)
    facts = json.loads(path.with_suffix(".json").read_text())
    tg = load_step(path)
    assert tg.device == "cuda" and facts["device"] == "cuda" and facts["costs"] == "analytic H100-class"
    assert facts["host_per_vertex"] > 0  # launches cost host time on the CUDA engine
    rows = replan.replan(path, ["0.5"], {})
    assert rows and all(r["simulated_s"] > 0 for r in rows)


def test_a_cap_on_what_the_host_moves_slows_a_step_that_moves_bytes(exported, tmp_path):
    """--host-links caps every link together in the simulator (ir.costs.HostLinks): a step that
    moves bytes at 40% is slower under a cap of 1 GB/s both ways, and 'none' leaves a cap out."""
    from turnip.ir.costs import HostLinks

    def picked(rows):
        return next(r["simulated_s"] for r in rows if r.get("picked"))

    free = replan.replan(exported, ["0.4"], {})
    capped = replan.replan(exported, ["0.4"], {}, host_links=HostLinks(both=1e9))
    assert picked(capped) > picked(free)
    assert replan.main(["plan", "--step", str(exported), "--budgets", "0.4", "--out", str(tmp_path),
                        "--host-links", "none,none,1e9"]) == 0
    doc = json.loads((tmp_path / "replan_gpt350m-tiny.json").read_text())
    assert min(r["simulated_s"] for r in doc["rows"]) == pytest.approx(picked(capped))


def test_a_step_over_devices_exports_in_either_layout(tmp_path):
    """--casts-travel: the layout compile takes below half the unplanned peak, where the weights'
    autocast casts cross between devices and the fp32 weights stay on their owners."""
    workload = make_workload("gpt350m", tiny=True)
    paths = {casts: replan.export(workload, "cpu", tmp_path, eager=False, analytic_cuda=True, devices=2,
                                  casts_travel=casts) for casts in (False, True)}
    assert paths[False].name == "step_gpt350m-tiny_x2.step" and paths[True].name == "step_gpt350m-tiny_x2_casts.step"

    def sent_casts(tg):  # bf16 values copied from another device: the weights' casts
        return sum(tg.transfer_source(v) is not None and tg.values[v.outputs[0]].dtype == torch.bfloat16
                   for v in tg.vertices)

    assert sent_casts(load_step(paths[False])) == 0 < sent_casts(load_step(paths[True]))


def test_the_exporting_hosts_update_rate_prices_host_updates_offline():
    """facts["host_update_rate"] (parameters/s the exporting host's cores update) goes into the
    offline cost model; older exports without it keep the spec's figure."""
    from turnip.planners.costs import DeviceSpec

    facts = {"h2d_bandwidth": 5e10, "d2h_bandwidth": 5e10, "host_per_vertex": 1e-5}
    assert replan.offline_costs(facts).host_update_rate == DeviceSpec.host_update_rate
    assert replan.offline_costs({**facts, "host_update_rate": 6.8e9}).host_update_rate == 6.8e9


def test_variant_regret_prices_each_subset_of_problems_against_all():
    from turnip.bench.replan import variant_regret

    def row(variant, seconds):
        return {"variant": variant, "simulated_s": seconds}

    tables = [[row({}, 1.0), row({"headroom": 1.0}, 1.2)],  # the default wins here
              [row({}, 2.2), row({"headroom": 1.0}, 2.0)]]  # the whole budget here
    results = variant_regret(tables)
    assert [len(r["variants"]) for r in results] == [1, 1, 2]
    both = results[-1]
    assert both["worst"] == 0 and both["mean"] == 0
    by_variant = {json.dumps(r["variants"][0]): r for r in results[:2]}
    assert by_variant["{}"]["worst"] == pytest.approx(0.1) and by_variant["{}"]["mean"] == pytest.approx(0.05)
    assert by_variant['{"headroom": 1.0}']["worst"] == pytest.approx(0.2)
    assert results[0]["variants"] == [{}]  # the better worst case first among single problems


def test_a_step_over_two_devices_cut_into_ranks_simulates_each_alone_and_together(tmp_path):
    """bench/replan_ranks.py: the exported step over two devices as two ranks, planned at each
    budget; together no rank ends before it would alone (its messages wait for their peer's)."""
    from turnip.bench import replan_ranks

    step = replan.export(make_workload("gpt350m", tiny=True), "cpu", tmp_path, eager=False, devices=2)
    assert replan_ranks.main(["--step", str(step), "--budgets", "1.0,0.5", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads(next((tmp_path / "out").glob("ranks_sim_*.json")).read_text())["rows"]
    assert [row["budget"] for row in rows] == ["1.0", "0.5"]
    assert rows[0]["planner"] == ["none", "none"] and all(p != "none" for p in rows[1]["planner"])
    for row in rows:
        assert row["ranks"] == 2 and row["devices_per_rank"] == 1 and min(row["messages_per_rank"]) > 0
        for alone, together in zip(row["solo_s"], row["joint_s"]):
            assert together >= alone * (1 - 1e-9), row
