"""The plan cache (planners/cache.py): a second compile of the same step reads its plan back instead
of planning; the key follows the step, the budgets, the device, the planner and its options; a
damaged or foreign file is ignored with a warning and overwritten, and reading one runs no code.
Every test keeps the cache under tmp_path (TURNIP_CACHE_DIR or cache=...), never in the home folder."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from cases import OPTIMIZERS, assert_same_state, eager_steps, make_case, trainable
from turnip.bench.models import mlp
from turnip.memgraph import compiler as compile_module
from turnip.memgraph import trace
from turnip.memgraph.builder import build_walks
from turnip.planners import cache as cache_mod
from turnip.planners import driver
from turnip.planners.cache import FORMAT, PLAN_CACHE_VERSION, PlanCache, default_plan_dir, plan_key, taskgraph_digest
from turnip.planners.costs import CostModel

from turnip import engine, memgraph

CACHE_LOGGER = "turnip.planners.cache"


@pytest.fixture
def plans(tmp_path, monkeypatch):
    """The default plan cache, moved under tmp_path by TURNIP_CACHE_DIR (conftest.py's per-test
    TURNIP_PLAN_CACHE_DIR removed, so the default folder is the one users get)."""
    monkeypatch.delenv("TURNIP_PLAN_CACHE_DIR", raising=False)
    monkeypatch.setenv("TURNIP_CACHE_DIR", str(tmp_path / "turnip"))
    return tmp_path / "turnip" / "plans"


def refuse_planning(monkeypatch) -> None:
    """Planning raises from here on: a compile that still succeeds did not plan."""
    def refuse(*args, **kwargs):
        raise AssertionError("the planner ran")

    monkeypatch.setattr(driver, "_candidates", refuse)


def tiny_step(hidden: int = 256):
    torch.manual_seed(0)
    model = mlp.MLP(depth=6, hidden=hidden)
    return model, mlp.mlp_loss, mlp.example_batch(batch=64), torch.optim.AdamW(model.parameters(), lr=1e-3)


def compiled(budget=0.4, hidden: int = 256, **kw):
    model, loss_fn, batch, opt = tiny_step(hidden)
    return memgraph.compile(model, loss_fn, batch, optimizer=opt, budget=budget, device="cpu", verbose=False, **kw)


def entries(folder) -> list:
    return sorted(folder.glob("*.json")) if folder.exists() else []


def decisions(plan) -> tuple:
    return plan.planner, plan.gpu_budget, plan.order, plan.recompute, plan.offload, plan.home, plan.release_after


def test_a_second_compile_of_the_same_step_reads_its_plan_back(plans, monkeypatch):
    first = compiled()
    assert first.stats["plan_cache"] == "miss" and len(entries(plans)) == 1
    refuse_planning(monkeypatch)
    second = compiled()
    assert second.stats["plan_cache"] == "hit"
    assert decisions(second.plan) == decisions(first.plan)
    assert second.serial == first.serial and second.arena_bytes == first.arena_bytes
    assert second.vertices == first.vertices
    assert memgraph.verify(second) == []


def test_a_step_built_from_a_cached_plan_trains_like_eager(plans):
    model, loss_fn, batches = make_case("gpt")
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    for expected in ("miss", "hit"):
        opt = OPTIMIZERS["adamw"](trainable(model))
        mg = memgraph.compile(model, loss_fn, batches[0], optimizer=opt, budget=0.4, device="cpu", verbose=False)
        assert mg.stats["plan_cache"] == expected
    torch.manual_seed(123)
    losses = [engine.run(mg, b)["loss"] for b in batches]
    assert [x.item() for x in losses] == [x.item() for x in want_losses]
    assert_same_state(mg.state_dict(), want_state)


def test_another_budget_is_planned_again(plans, monkeypatch):
    compiled(0.4)
    calls = []
    real = driver._candidates

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "_candidates", counting)
    compiled(0.35)
    assert len(calls) == 1 and len(entries(plans)) == 2
    compiled(0.35)
    assert len(calls) == 1


@pytest.fixture(scope="module")
def traced():
    model, loss_fn, batch, opt = tiny_step()
    tg = trace(model, loss_fn, batch, optimizer=opt, device="cpu")
    costs = CostModel(measure=False)
    costs.annotate(tg)
    return tg, costs


def key_of(tg, costs, budget=1 << 24, cpu_budget=None, device="cpu", planner="auto", options=None, alignment=64):
    return plan_key(tg, budget, cpu_budget, device=device, planner=planner, options=options or {},
                    alignment=alignment, costs=costs)


def test_the_key_follows_budgets_planner_options_and_alignment(traced):
    tg, costs = traced
    key = key_of(tg, costs)
    assert key == key_of(tg, costs)
    others = [key_of(tg, costs, budget=(1 << 24) + 64), key_of(tg, costs, cpu_budget=1 << 30),
              key_of(tg, costs, planner="greedy"), key_of(tg, costs, options={"time_limit": 5}),
              key_of(tg, costs, options={"headroom": 0.9}), key_of(tg, costs, alignment=256),
              key_of(tg, CostModel(measure=False, host_per_vertex=1e-5), device="cpu")]
    assert len({key, *others}) == len(others) + 1


def test_the_key_follows_the_device_name(traced, monkeypatch):
    tg, costs = traced
    key = key_of(tg, costs)
    monkeypatch.setattr(cache_mod, "device_name", lambda device: "another CPU")
    assert key_of(tg, costs) != key


def test_the_digest_is_the_steps_not_the_objects(traced):
    tg, costs = traced
    model, loss_fn, batch, opt = tiny_step()  # traced again: new objects, same step
    again = trace(model, loss_fn, batch, optimizer=opt, device="cpu")
    costs.annotate(again)
    assert taskgraph_digest(again) == taskgraph_digest(tg)
    slower = again.copy()
    slower.vertices[3].time *= 2  # op costs are part of the step the planner sees
    assert taskgraph_digest(slower) != taskgraph_digest(tg)
    model, loss_fn, _, opt = tiny_step()
    wider = trace(model, loss_fn, mlp.example_batch(batch=32), optimizer=opt, device="cpu")
    costs.annotate(wider)
    assert taskgraph_digest(wider) != taskgraph_digest(tg)


def _valid_entry(path) -> dict:
    doc = json.loads(path.read_text())
    assert doc["format"] == FORMAT and doc["version"] == PLAN_CACHE_VERSION and doc["key"] == path.stem
    return doc


def _tampered(doc: dict, how: str) -> bytes:
    doc = json.loads(json.dumps(doc))
    if how == "version":
        doc["version"] = 99
    elif how == "format":
        doc["format"] = "someone.else"
    elif how == "key":
        doc["key"] = "0" * 64
    elif how == "order":  # not a permutation of the step's vertices
        doc["plan"]["v"]["order"] = [0, 0, 1]
    elif how == "ids":  # offloads a value the step does not have
        doc["plan"]["v"]["offload"] = {"t": "set", "v": [10**9]}
    elif how == "budget":
        doc["plan"]["v"]["gpu_budget"] += 64
    elif how == "type":  # a type the codec does not build
        doc["plan"] = {"t": "system", "v": {"command": "touch pwned"}}
    else:
        raise KeyError(how)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("how", ["garbage", "not-json", "pickle", "empty", "list", "version", "format", "key",
                                 "order", "ids", "budget", "type"])
def test_a_damaged_or_foreign_file_is_ignored_with_a_warning_and_overwritten(plans, caplog, monkeypatch, how):
    compiled()
    (path,) = entries(plans)
    good = _valid_entry(path)
    raw = {"garbage": b"\x00\xff\xfe garbage", "not-json": b"{'plan': None", "empty": b"", "list": b"[1, 2, 3]",
           "pickle": pickle.dumps({"format": FORMAT})}
    path.write_bytes(raw[how] if how in raw else _tampered(good, how))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        mg = compiled()
    assert mg.stats["plan_cache"] == "miss"
    warned = [r for r in caplog.records if r.name == CACHE_LOGGER and r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(path) in warned[0].getMessage()
    rewritten = _valid_entry(path)["plan"]["v"]
    assert {k: v for k, v in rewritten.items() if k != "stats"} == \
        {k: v for k, v in good["plan"]["v"].items() if k != "stats"}
    assert memgraph.verify(mg) == []


def test_a_cached_plan_that_does_not_build_is_planned_again(plans, monkeypatch, caplog):
    first = compiled()
    assert len(entries(plans)) == 1
    calls = []
    build = compile_module.build

    def failing_once(tg, plan, **kwargs):
        if plan.planner != "none" and not calls:
            calls.append(plan)
            raise RuntimeError("does not build")
        return build(tg, plan, **kwargs)

    monkeypatch.setattr(compile_module, "build", failing_once)
    with caplog.at_level(logging.WARNING):
        again = compiled()
    assert calls and "does not build" in caplog.text
    assert again.stats["plan_cache"] == "miss" and decisions(again.plan) == decisions(first.plan)


def test_cache_false_plans_every_time_and_writes_nothing(plans):
    for _ in range(2):
        mg = compiled(cache=False)
        assert mg.stats["plan_cache"] == "off"
    assert entries(plans) == []


def test_a_folder_given_to_compile_is_used_instead_of_the_default(plans, tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    compiled(cache=mine)
    assert len(entries(mine)) == 1 and entries(plans) == []
    refuse_planning(monkeypatch)
    assert compiled(cache=str(mine)).stats["plan_cache"] == "hit"


def test_the_default_folder_follows_TURNIP_CACHE_DIR(plans, tmp_path, monkeypatch):
    assert default_plan_dir() == plans
    assert PlanCache.open(True).directory == plans
    assert PlanCache.open(False) is None
    monkeypatch.setenv("TURNIP_PLAN_CACHE_DIR", str(tmp_path / "own"))
    assert default_plan_dir() == tmp_path / "own"


def test_the_suite_keeps_plans_out_of_the_home_folder():
    """conftest.py points every test's plan cache at a folder of its own under pytest's tmp."""
    folder = default_plan_dir()
    assert Path.home() not in folder.parents and folder.name != "plans"


def test_a_cache_argument_that_is_no_folder_is_refused(plans):
    with pytest.raises(TypeError, match="cache"):
        compiled(cache=3)


def test_unknown_planner_options_are_refused_even_with_a_cached_plan(plans):
    compiled()
    with pytest.raises(TypeError, match="colour"):
        compiled(colour="blue")
    with pytest.raises(ValueError, match="time_limit"):
        compiled(time_limit=-1)
    with pytest.raises(TypeError, match="replay_receives is not a compile option"):  # per-device planning's own
        compiled(replay_receives=True)


def test_everything_kept_needs_no_plan_and_no_cache(plans):
    mg = compiled(1.0)
    assert "plan_cache" not in mg.stats and entries(plans) == []


@pytest.mark.parametrize("walk", ["ahead", "compact"])
def test_the_build_that_won_is_built_again_from_the_cache(traced, walk):
    """On CUDA compile builds both walks of each candidate plan and keeps the fastest simulated one;
    the cache remembers which, and rebuilds exactly that MemGraph (exercised here on a CPU graph)."""
    tg, costs = traced
    candidates = driver.plan_candidates(tg, int(0.5 * tg.live_peak(alignment=64)), alignment=64, costs=costs)
    built = [(mg, w) for plan in candidates
             for w, mg in build_walks(tg, plan, alignment=64).items()]
    won, won_walk, _ = compile_module.build_candidates(tg, candidates, 64, costs, "cuda")
    assert won_walk in ("ahead", "compact") and won.stats["simulated_step_s"] > 0
    mg = next(mg for mg, w in built if w == walk)
    again = compile_module.build_cached(tg, cache_mod.CachedPlan(mg.plan, walk, 0.25), 64)
    assert (again.serial, again.arena_bytes, again.vertices) == (mg.serial, mg.arena_bytes, mg.vertices)
    assert again.stats["simulated_step_s"] == 0.25


def test_the_compact_walk_is_built_only_near_the_peak(traced):
    """compile_module.compact_walks: the compact walk for COMPACT_FOR plans at budgets of at least
    COMPACT_ABOVE of the unplanned peak, for none below; built_walks builds what it is told."""
    tg, costs = traced
    peak = 10_000
    assert compile_module.compact_walks(int(compile_module.COMPACT_ABOVE * peak), peak) == compile_module.COMPACT_FOR
    assert compile_module.compact_walks(int(compile_module.COMPACT_ABOVE * peak) - 1, peak) == 0
    candidates = driver.plan_candidates(tg, int(0.5 * tg.live_peak(alignment=64)), alignment=64, costs=costs)
    for compact_for in (0, 1):
        found, refused = compile_module.built_walks(tg, candidates, 64, costs, "cuda", compact_for)
        assert not refused
        assert sorted(b.walk for b in found) == sorted(["ahead"] * len(candidates) + ["compact"] * compact_for)
        assert {b.index for b in found} == set(range(len(candidates)))


def test_the_walks_built_while_planning_are_the_ones_built_after_it(traced):
    """Layout.built_ahead: each planning problem's plans built (allocate-ahead walk) and simulated on
    the planning thread as soon as they are made; built_walks then takes those MemGraphs as they
    are, and builds what it would have built after planning, the same."""
    tg, costs = traced
    keep_all, peak = compile_module.everything_kept(tg, 64)
    layout = compile_module.Layout(tg, keep_all, peak, casts_travel=False)
    handed = []

    def planned(plans):
        handed.append(len(plans))
        layout.built_ahead(64, costs, "cuda")(plans)

    candidates = driver.plan_candidates(tg, int(0.5 * tg.live_peak(alignment=64)), alignment=64, costs=costs,
                                        planned=planned)
    assert sum(handed) == len(candidates) and len(handed) == 2  # each problem's plans, once each
    assert set(layout.ahead) == {id(plan) for plan in candidates}
    assert all("simulated_step_s" in mg.stats for _, mg in layout.ahead.values())
    early, _ = compile_module.built_walks(tg, candidates, 64, costs, "cuda", 1, ahead=layout.ahead)
    late, _ = compile_module.built_walks(tg, candidates, 64, costs, "cuda", 1)
    assert [(b.index, b.walk) for b in early] == [(b.index, b.walk) for b in late]
    for e, lt in zip(early, late):
        if e.walk == "ahead":
            assert e.mg is layout.ahead[id(e.plan)][1]
        assert (len(e.mg.vertices), e.mg.arena_bytes, len(e.mg.edges)) == (len(lt.mg.vertices), lt.mg.arena_bytes,
                                                                           len(lt.mg.edges))
        assert compile_module.simulated_step(e.mg, costs, "cuda") == compile_module.simulated_step(lt.mg, costs, "cuda")
    assert compile_module.Layout(tg, keep_all, peak, casts_travel=False).built_ahead(64, costs, "cpu") is None


def test_a_layout_left_at_its_greedy_plans_is_cached_and_decided_alike_without_planning(plans, monkeypatch):
    """On two devices below the peak, a layout whose greedy plans lag (here: any lag, the margin made
    negative) is left there, its greedy plan cached under its key: a second compile plans nothing,
    finds both layouts, and keeps the same one."""
    from cases import bf16_autocast

    monkeypatch.setattr(compile_module, "PLANNER_GAIN_AT_MOST", -0.9)
    model, loss_fn, batches = make_case("gpt")

    def two_devices():
        return memgraph.compile(model, bf16_autocast(loss_fn), batches[0], optimizer=torch.optim.AdamW(
            model.parameters(), lr=1e-3), budget=0.45, device="cpu", devices=2, verbose=False)

    first = two_devices()
    screened = first.stats["weight_layouts_screened_s"]
    assert set(screened) == {"replicas"} and set(first.stats["weight_layouts_simulated_s"]) == {"casts"}
    assert first.stats["weight_layout"] == "casts" and len(entries(plans)) == 2
    refuse_planning(monkeypatch)
    second = two_devices()
    assert second.stats["plan_cache"] == "hit" and second.stats["weight_layout"] == "casts"
    times = second.stats["weight_layouts_simulated_s"]
    assert times["replicas"] == pytest.approx(screened["replicas"]) and times["casts"] < times["replicas"]
