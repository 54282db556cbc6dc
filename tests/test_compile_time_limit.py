"""Compile fast by default: the ILP's time limit scales with its size, the ILP must beat the greedy
plan it starts from (its cutoff), and when it cannot in time, or HiGHS does not stop by its
deadline, the greedy plan is the answer (planners/driver.py, planners/solver.py)."""

from __future__ import annotations

import logging
import math
import time

import highspy
import pytest
import torch
from turnip.memgraph import trace
from turnip.planners import driver
from turnip.planners import solver as solver_mod
from turnip.planners.costs import CostModel
from turnip.planners.driver import (
    SECONDS_PER_BINARY,
    TIME_LIMIT_CAP,
    TIME_LIMIT_FLOOR,
    ilp_time_limit,
    make_problem,
    plan_candidates,
    run_plan,
)
from turnip.planners.ilp import formulate
from turnip.planners.solver import DEADLINE_PASSED, SolveResult, deadline, solve

from turnip.gpt import GPT, GPTConfig, example_batch, lm_loss


@pytest.fixture(scope="module")
def small_gpt():
    """turnip/gpt.py's small GPT, traced with analytic costs, and a budget that needs a plan."""
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg)
    tg = trace(model, lm_loss, example_batch(cfg, batch=2), optimizer=torch.optim.AdamW(model.parameters()))
    CostModel(measure=False).annotate(tg)
    return tg, int(0.4 * tg.live_peak(alignment=64))


def test_the_default_limit_grows_with_the_binaries_between_a_floor_and_a_cap():
    assert ilp_time_limit(0) == TIME_LIMIT_FLOOR
    assert ilp_time_limit(10) == TIME_LIMIT_FLOOR
    assert ilp_time_limit(4_000) == pytest.approx(4_000 * SECONDS_PER_BINARY)
    assert 4_000 * SECONDS_PER_BINARY < TIME_LIMIT_CAP
    assert ilp_time_limit(3_000) < ilp_time_limit(4_000)
    assert ilp_time_limit(10**9) == TIME_LIMIT_CAP
    assert TIME_LIMIT_FLOOR < TIME_LIMIT_CAP


def test_a_plan_without_a_time_limit_gets_the_one_scaled_to_its_ilp(small_gpt, caplog):
    tg, budget = small_gpt
    with caplog.at_level(logging.INFO, logger="turnip.planners.driver"):
        plan = run_plan(tg, budget, alignment=64)
    stats = plan.stats
    assert stats["time_limit_source"] == "auto"
    assert stats["time_limit"] == ilp_time_limit(stats["binaries"])
    assert f"ILP time limit {stats['time_limit']:.3g} s" in caplog.text
    assert driver.outcome(stats)  # the compile report's words for it


def test_a_given_time_limit_is_used_as_given(small_gpt):
    tg, budget = small_gpt
    plan = run_plan(tg, budget, alignment=64, time_limit=7)
    assert plan.stats["time_limit"] == 7.0 and plan.stats["time_limit_source"] == "given"
    assert "given" in driver.outcome(plan.stats)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "10", True])
def test_time_limits_that_are_not_positive_seconds_are_refused(small_gpt, bad):
    tg, budget = small_gpt
    with pytest.raises(ValueError, match="time_limit"):
        run_plan(tg, budget, alignment=64, time_limit=bad)


def test_the_ilp_is_given_the_greedy_plan_as_start_and_cutoff(small_gpt, monkeypatch):
    tg, budget = small_gpt
    seen = {}
    real = solver_mod.solve

    def spy(f, start=None, **kwargs):
        seen.update(kwargs, f=f, start=start)
        return real(f, start, **kwargs)

    monkeypatch.setattr(solver_mod, "solve", spy)
    plan = run_plan(tg, budget, alignment=64, tie_blocks=False)
    greedy_plan = run_plan(tg, budget, alignment=64, method="greedy")
    f, start = seen["f"], seen["start"]
    assert start is not None
    assert seen["cutoff"] == pytest.approx(sum(c * v for c, v in zip(f.obj, start)))
    assert seen["cutoff"] == pytest.approx(greedy_plan.stats["objective"] / f.time_unit, rel=1e-9)
    assert seen["time_limit"] == plan.stats["time_limit"]
    assert plan.predicted_time <= greedy_plan.predicted_time


def test_with_blocks_tied_the_ilp_starts_from_the_better_of_greedy_and_the_probes(small_gpt, monkeypatch):
    """With blocks the ILP is rounds of probes and tied programs (block_search.py): the last tied
    program's start is priced at its cutoff, no higher than the greedy plan's, and it gets what
    the rounds before it left of the time limit."""
    tg, budget = small_gpt
    calls = []
    real = solver_mod.solve

    def spy(f, start=None, **kwargs):
        calls.append(dict(kwargs, f=f, start=start))
        return real(f, start, **kwargs)

    monkeypatch.setattr(solver_mod, "solve", spy)
    # a limit that leaves the untied program UNTIED_AFTER_BLOCKS after the rounds (the default, 0.5 s
    # for this small problem, does not)
    plan = run_plan(tg, budget, alignment=64, time_limit=2.0)
    greedy_plan = run_plan(tg, budget, alignment=64, method="greedy")
    tied = [call for call in calls if call["f"].ties]
    assert tied, "a tied program was solved"
    last = tied[-1]
    assert calls.index(last) > 0, "block probes ran before it"
    assert last["cutoff"] == pytest.approx(sum(c * v for c, v in zip(last["f"].obj, last["start"])))
    assert last["cutoff"] <= greedy_plan.stats["objective"] / last["f"].time_unit * (1 + 1e-9)
    assert last["time_limit"] <= plan.stats["time_limit"]  # what the rounds before it left
    assert plan.stats["block_rounds"] >= 1
    if plan.stats["ilp_program"] == "blocks" and "fallback" not in plan.stats:  # how far "optimal" goes
        assert f"over {plan.stats['block_patterns']} block patterns" in driver.outcome(plan.stats)
    else:  # the patterns found nothing better than greedy's: the untied program had the time left
        assert plan.stats["ilp_program"] == "blocks, then untied" and not calls[-1]["f"].ties
    assert plan.predicted_time <= greedy_plan.predicted_time


def test_after_a_block_search_that_beat_nothing_the_untied_program_gets_at_most_a_round(small_gpt, monkeypatch):
    """When the rounds stay at greedy's plan, the program over every group's options runs within
    the time left but no longer than driver.UNTIED_SHARE of the limit (on the H200 it once ran its
    whole 10 s to find nothing); without blocks it gets the whole limit."""
    from turnip.planners import block_search

    tg, budget = small_gpt
    limits = []
    real = solver_mod.solve

    def spy(f, start=None, **kwargs):
        limits.append((bool(f.ties), kwargs["time_limit"]))
        return real(f, start, **kwargs)

    def beat_nothing(problem, untied, blocks, dec, ev, seconds, **opts):
        return block_search.Search([], dec, ev, 0.05, False, 1, None, None)

    monkeypatch.setattr(solver_mod, "solve", spy)
    monkeypatch.setattr(driver, "search_blocks", beat_nothing)
    monkeypatch.setattr(driver, "UNTIED_SHARE", 0.07)
    plan = run_plan(tg, budget, alignment=64, time_limit=10)
    assert plan.stats["ilp_program"] == "blocks, then untied"
    assert limits == [(False, pytest.approx(0.7))]
    limits.clear()
    plan = run_plan(tg, budget, alignment=64, time_limit=3, tie_blocks=False)
    assert plan.stats["ilp_program"] == "untied" and limits == [(False, 3.0)]


def test_an_ilp_that_finds_nothing_better_in_time_hands_back_the_greedy_plan(small_gpt, monkeypatch):
    def no_better(f, start=None, time_limit=None, **kwargs):  # stopped at the limit holding its warm start
        return SolveResult(values=list(start), status="Time limit reached", optimal=False,
                           objective=kwargs["cutoff"], seconds=time_limit)

    monkeypatch.setattr(solver_mod, "solve", no_better)
    tg, budget = small_gpt
    plan = run_plan(tg, budget, alignment=64)
    assert plan.planner == "greedy" and "no plan better than greedy's" in plan.stats["fallback"]
    assert plan.predicted_time == run_plan(tg, budget, alignment=64, method="greedy").predicted_time
    assert [p.planner for p in plan_candidates(tg, budget, alignment=64, headroom=0.9)] == ["greedy"]


@pytest.fixture
def slow_highs(monkeypatch):
    """HiGHS that spends 6 s before it starts solving (as one round of root cuts can)."""
    real = highspy.Highs.run

    def run(self):
        time.sleep(6.0)
        return real(self)

    monkeypatch.setattr(highspy.Highs, "run", run)


def test_highs_past_its_deadline_is_left_behind(small_gpt, slow_highs):
    tg, budget = small_gpt
    f = formulate(make_problem(tg, budget, alignment=64))
    started = time.perf_counter()
    result = solve(f, None, time_limit=0.2)
    waited = time.perf_counter() - started
    assert result.values is None and result.status == DEADLINE_PASSED
    assert deadline(0.2) <= waited < 4.0  # not the 6 s HiGHS takes


def test_a_plan_whose_ilp_passes_its_deadline_is_the_greedy_plan(small_gpt, slow_highs):
    tg, budget = small_gpt
    started = time.perf_counter()
    plan = run_plan(tg, budget, alignment=64, time_limit=0.2)
    assert time.perf_counter() - started < 4.0  # greedy and the wait, not the 6 s solve
    assert plan.planner == "greedy" and "no plan better than greedy's" in plan.stats["fallback"]
    assert plan.stats["status"] == DEADLINE_PASSED


def test_highs_finds_nothing_that_does_not_beat_the_cutoff(small_gpt):
    tg, budget = small_gpt
    f = formulate(make_problem(tg, budget, alignment=64))
    free = solve(f, None, time_limit=20, gap=1e-6)
    assert free.values is not None and free.objective > 0
    cut = solve(f, None, time_limit=20, gap=1e-6, cutoff=0.5 * free.objective)  # below the optimum
    assert cut.values is None


def test_measured_gpu_costs_get_a_longer_default_search_than_analytic_ones():
    assert driver.ilp_time_limit(3500, measured=True) > driver.ilp_time_limit(3500)
    assert driver.ilp_time_limit(100, measured=True) > 1.4 * driver.ilp_time_limit(100)
    assert driver.ilp_time_limit(10) == driver.ilp_time_limit(10, measured=True) == driver.TIME_LIMIT_FLOOR
    assert driver.ilp_time_limit(10**7, measured=True) == driver.TIME_LIMIT_CAP
