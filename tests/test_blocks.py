"""Repeated blocks planned once (planners/blocks.py): the layers of a step are found as one block
class, each tied instance takes a whole-block pattern in the ILP, the greedy plan stays feasible
there (so the ILP's answer is never worse than greedy's), and the tied plan runs bitwise as eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from turnip.memgraph import trace
from turnip.planners import driver, ilp, solver
from turnip.planners.blocks import block_patterns, element_of, find_blocks, instance_pattern
from turnip.planners.costs import CostModel
from turnip.planners.decode_solution import from_solution
from turnip.planners.greedy import greedy
from turnip.planners.memory import evaluate
from turnip.planners.model import KEEP

from turnip.gpt import GPT, GPTConfig, example_batch, lm_loss


@pytest.fixture(scope="module")
def gpt_problem():
    """turnip/gpt.py's GPT of four layers at 40% of its unplanned peak, analytic costs."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=4)
    model = GPT(cfg)
    tg = trace(model, lm_loss, example_batch(cfg, batch=2), optimizer=torch.optim.AdamW(model.parameters()))
    CostModel(measure=False).annotate(tg)
    return driver.make_problem(tg, int(0.4 * tg.live_peak(alignment=64)), alignment=64)


def test_a_module_path_lies_in_the_list_element_of_its_first_number():
    assert element_of("blocks.3.attn.qkv") == ("blocks", 3)
    assert element_of("model.layers.17") == ("model.layers", 17)
    assert element_of("model.layers.2.mlp.experts.5") == ("model.layers", 2)
    assert element_of("head") is None
    assert element_of("") is None


def test_the_layers_of_a_gpt_are_one_block_class_aligned_group_by_group(gpt_problem):
    problem = gpt_problem
    blocks = find_blocks(problem)
    assert [b.path for b in blocks] == ["blocks"]
    (block,) = blocks
    assert len(block.instances) >= 2
    assert [inst.index for inst in block.instances] == sorted(inst.index for inst in block.instances)
    tg = problem.tg
    first = block.instances[0]
    for inst in block.instances[1:]:
        assert len(inst.groups) == len(first.groups) > 0
        for g0, g in zip(first.groups, inst.groups):  # the same op at the same place of each layer
            v0, v = tg.vertices[problem.groups[g0].vertex], tg.vertices[problem.groups[g].vertex]
            assert v.op == v0.op
            assert v.module.replace(f"blocks.{inst.index}", "blocks.*") == \
                v0.module.replace(f"blocks.{first.index}", "blocks.*")
        names = [problem.items[i].name.replace(f"blocks.{inst.index}.", "blocks.*.") for i in inst.items]
        assert names == [problem.items[i].name.replace(f"blocks.{first.index}.", "blocks.*.") for i in first.items]
        assert names and all(f"blocks.{inst.index}." in problem.items[i].name for i in inst.items)


def test_a_step_without_a_repeated_block_has_none():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    tg = trace(model, lambda m, x: m(x).square().mean(), torch.randn(4, 16),
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    CostModel(measure=False).annotate(tg)
    problem = driver.make_problem(tg, int(0.5 * tg.live_peak(alignment=64)), alignment=64)
    assert find_blocks(problem) == []


class _Widening(nn.Module):
    """A list of layers of different widths: alike in ops, not in shapes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_layers_of_other_shapes_are_not_tied_together():
    model = _Widening()
    tg = trace(model, lambda m, x: m(x).square().mean(), torch.randn(8, 16),
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    CostModel(measure=False).annotate(tg)
    problem = driver.make_problem(tg, int(0.5 * tg.live_peak(alignment=64)), alignment=64)
    # only the two 32-wide layers are alike (layer 1 writes 32 wide too, but reads 16)
    assert [[inst.index for inst in block.instances] for block in find_blocks(problem)] == [[2, 3]]


def _satisfied(f: ilp.Formulation, values: list[float], tol: float = 1e-6) -> list[str]:
    broken = []
    for name, (coefs, lo, hi) in zip(f.row_names, f.rows):
        total = sum(v * values[c] for c, v in coefs.items())
        if (lo is not None and total < lo - tol) or (hi is not None and total > hi + tol):
            broken.append(name)
    return broken


def test_a_choice_names_an_option_by_kind_and_rank_from_the_first_use_after_the_gap(gpt_problem):
    """Rank 0 of a kind is its last option (need time: the first use after the gap, which every
    instance has), so a pattern read off one layer means the same options in another."""
    from turnip.planners.blocks import choice_of, choices

    problem = gpt_problem
    (block,) = find_blocks(problem)
    for inst in block.instances:
        for gi in inst.groups:
            group = problem.groups[gi]
            by_choice = choices(group)
            assert sorted(by_choice.values()) == list(range(len(group.options)))
            for oi in range(len(group.options)):
                assert by_choice[choice_of(group, oi)] == oi
            for kind in {o.kind for o in group.options}:
                last = max(oi for oi, o in enumerate(group.options) if o.kind == kind)
                assert by_choice[kind, 0] == last
            for kind in ("offload", "recompute"):  # rank 0: the need time of the first use after the gap
                if group.option(kind, group.n0) is not None:
                    assert by_choice[kind, 0] == group.option(kind, group.n0)


def test_the_greedy_plan_is_a_feasible_start_of_the_tied_program(gpt_problem):
    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    assert ev.feasible
    blocks = [(b, block_patterns(problem, b, [(dec, ev)])) for b in find_blocks(problem)]
    f = ilp.formulate(problem, blocks)
    assert f.ties and len(f.ties) == sum(len(b.instances) for b, _ in blocks)
    start = ilp.start_values(problem, f, ev.options, dec.cpu, ev.window_time)
    assert _satisfied(f, start) == []
    for _, patterns, z in f.ties:
        assert sum(start[c] for c in z) == 1.0
        assert (((KEEP, 0),) * len(patterns[0][0]), (False,) * len(patterns[0][1])) in patterns


def test_a_pattern_left_out_cannot_be_taken(gpt_problem):
    """Ties bind: with one pattern (the greedy plan's first layer), every tied layer takes it; with
    only keeping whole layers, which does not fit 40% of the peak, the program has no solution, where
    the untied one has."""
    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    (block,) = find_blocks(problem)
    only = [instance_pattern(problem, block.instances[0], ev.options, dec.cpu)]
    f = ilp.formulate(problem, [(block, only)])
    result = solver.solve(f, None, time_limit=30)
    assert result.values is not None
    tied = from_solution(problem, f, result.values)
    tied_ev = evaluate(problem, tied)
    assert all(instance_pattern(problem, inst, tied_ev.options, tied.cpu) == only[0] for inst in block.instances)
    keep_only = block_patterns(problem, block, [])
    assert keep_only == [(((KEEP, 0),) * len(block.instances[0].groups), (False,) * len(block.instances[0].items))]
    assert solver.solve(ilp.formulate(problem, [(block, keep_only)]), None, time_limit=30).values is None
    assert solver.solve(ilp.formulate(problem), None, time_limit=30).values is not None


def test_the_tied_ilp_is_never_worse_than_greedy_and_follows_its_patterns(gpt_problem):
    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    blocks = [(b, block_patterns(problem, b, [(dec, ev)])) for b in find_blocks(problem)]
    f = ilp.formulate(problem, blocks)
    start = ilp.start_values(problem, f, ev.options, dec.cpu, ev.window_time)
    cutoff = sum(c * v for c, v in zip(f.obj, start) if c)
    result = solver.solve(f, start, time_limit=30, cutoff=cutoff)
    assert result.values is not None
    tied = from_solution(problem, f, result.values)
    tied_ev = evaluate(problem, tied)
    assert tied_ev.objective <= ev.objective * (1 + 1e-9)
    for block, patterns in blocks:
        for inst in block.instances:  # need times included: the option of every group is the pattern's
            assert instance_pattern(problem, inst, tied_ev.options, tied.cpu) in patterns


def test_tie_blocks_false_plans_without_ties(gpt_problem):
    tg, budget = gpt_problem.tg, gpt_problem.gpu_budget
    tied = driver.run_plan(tg, budget, alignment=64, method="ilp", time_limit=5)
    free = driver.run_plan(tg, budget, alignment=64, method="ilp", time_limit=5, tie_blocks=False)
    assert tied.stats["tied_instances"] > 0 and tied.stats["block_patterns"] > 0 and tied.stats["block_rounds"] >= 1
    assert free.stats["tied_instances"] == 0 and free.stats["block_rounds"] == 0
    with pytest.raises(TypeError, match="unknown planner options: tie_block"):
        driver.run_plan(tg, budget, alignment=64, tie_block=True)


def test_probes_spread_over_the_chain():
    from turnip.planners.block_search import spread

    assert spread(24)[:3] == [12, 6, 18]
    for n in (1, 2, 3, 7, 24, 80):
        assert sorted(spread(n)) == list(range(n))


def test_a_probe_changes_only_the_instance_it_frees_and_the_search_keeps_greedys_patterns(gpt_problem):
    from turnip.planners import block_search

    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    (block,) = find_blocks(problem)
    f = ilp.formulate(problem)
    instance = block.instances[len(block.instances) // 2]
    values = block_search._solve_one_free(problem, f, dec, ev, instance.groups, instance.items, 20, {})
    assert values is not None
    probed = from_solution(problem, f, values)
    outside = [g for g in range(len(problem.groups)) if g not in instance.groups]
    assert [probed.groups[g] for g in outside] == [dec.groups[g] for g in outside]
    assert [probed.cpu[i] for i in range(len(problem.items)) if i not in instance.items] == \
        [dec.cpu[i] for i in range(len(problem.items)) if i not in instance.items]
    assert evaluate(problem, probed).objective <= ev.objective * (1 + 1e-9)
    bounds = (list(f.lb), list(f.ub), len(f.names), len(f.rows))
    search = block_search.search_blocks(problem, f, [block], dec, ev, seconds=30)
    assert (f.lb, f.ub, len(f.names), len(f.rows)) == bounds  # the untied program is left as it was
    ((_, patterns),) = search.patterns
    assert set(block_patterns(problem, block, [(dec, ev)])) <= set(patterns)
    assert search.evaluation.objective <= ev.objective * (1 + 1e-9)
    assert search.improved == (search.evaluation.objective < ev.objective)
    assert search.rounds >= 1 and search.program.ties and search.result is not None
    found = evaluate(problem, search.decisions)
    for inst in block.instances:  # the plan found takes one of the patterns the last program offered
        assert instance_pattern(problem, inst, found.options, search.decisions.cpu) in patterns or not search.improved


def test_the_rounds_stop_when_the_tied_program_no_longer_improves(gpt_problem, monkeypatch):
    """Each round's tied program starts from the best plan so far; the search stops at the first
    round whose program does not beat it (or whose probes offer nothing new), well before its time."""
    from turnip.planners import block_search

    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    blocks = find_blocks(problem)
    objectives = []
    real = solver.solve

    def spy(f, start=None, **kwargs):
        result = real(f, start, **kwargs)
        if f.ties:
            objectives.append((sum(c * v for c, v in zip(f.obj, start) if c), result.objective))
        return result

    monkeypatch.setattr(block_search.solver, "solve", spy)
    monkeypatch.setattr(block_search, "LATER_ROUNDS_WITHIN", 1.0)
    search = block_search.search_blocks(problem, ilp.formulate(problem), blocks, dec, ev, seconds=60)
    assert len(objectives) == search.rounds or len(objectives) == search.rounds - 1
    for (start, _), (_, before) in zip(objectives[1:], objectives):
        assert start <= before * (1 + 1e-6)  # a round starts where the last one ended, or from a probe's better plan
    assert search.seconds < 60


def test_the_greedy_time_bench_times_both_checks_and_restores_the_incremental_one(gpt_problem):
    from turnip.bench.greedy_time import time_modes
    from turnip.planners import greedy as greedy_module
    from turnip.planners.memory import read_closure

    modes = time_modes(gpt_problem, repeat=1)
    assert set(modes) == {"every group", "incremental"}
    assert modes["every group"]["objective"] == modes["incremental"]["objective"]
    assert all(m["greedy_s"] > 0 and m["rank_moves_s"] > 0 for m in modes.values())
    assert greedy_module.read_closure is read_closure


@pytest.mark.parametrize("seconds", [30, 60])
def test_a_tied_program_stopped_by_the_round_limit_is_the_last_round(gpt_problem, monkeypatch, seconds):
    """The tied program gets at most ROUND_SHARE of the search's time (a longer time limit, a longer
    round); when it stops there without proving its gap, no further round runs (a round with more
    patterns would not prove it sooner), even if its plan beat the last one."""
    from turnip.planners import block_search

    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    limits = []
    real = solver.solve

    def unproven(f, start=None, **kwargs):
        result = real(f, start, **kwargs)
        if f.ties:
            limits.append(kwargs["time_limit"])
            result.optimal, result.status = False, "Time limit reached"
        return result

    monkeypatch.setattr(block_search, "ROUND_SHARE", 0.5 / 60)
    monkeypatch.setattr(block_search, "ROUND_GAIN", -1.0)  # every round would otherwise go on
    monkeypatch.setattr(block_search, "LATER_ROUNDS_WITHIN", 1.0)
    monkeypatch.setattr(block_search.solver, "solve", unproven)
    search = block_search.search_blocks(problem, ilp.formulate(problem), find_blocks(problem), dec, ev,
                                        seconds=seconds)
    assert limits == [pytest.approx(0.5 * seconds / 60)] and search.rounds == 1


@pytest.mark.parametrize("within,rounds", [(0.0, 1), (1.0, 2)])
def test_a_later_round_starts_only_early_in_the_search(gpt_problem, monkeypatch, within, rounds):
    """LATER_ROUNDS_WITHIN: a round that ends after that share of the search's time is the last,
    even where its tied program proved its gap and gained; before it, the next round runs."""
    from turnip.planners import block_search

    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    tied = []
    real = solver.solve

    def count(f, start=None, **kwargs):
        if f.ties:
            tied.append(kwargs["time_limit"])
        return real(f, start, **kwargs)

    monkeypatch.setattr(block_search, "ROUND_GAIN", -1.0)  # every round would otherwise go on
    monkeypatch.setattr(block_search, "LATER_ROUNDS_WITHIN", within)
    monkeypatch.setattr(block_search.solver, "solve", count)
    search = block_search.search_blocks(problem, ilp.formulate(problem), find_blocks(problem), dec, ev, seconds=60)
    assert search.rounds >= rounds  # the second round started (its probes may offer nothing new)
    if within == 0.0:
        assert search.rounds == 1 and len(tied) == 1


def test_the_tied_program_made_from_a_copy_of_the_untied_one_is_the_one_formulated_with_blocks(gpt_problem):
    """block_search ties a copy of the untied program (Formulation.copy, ilp.tie_blocks) instead of
    formulating the whole program again each round: the same program, the untied one unchanged."""
    problem = gpt_problem
    dec, ev, _ = greedy(problem)
    blocks = [(block, block_patterns(problem, block, [(dec, ev)])) for block in find_blocks(problem)]
    untied = ilp.formulate(problem)
    before = (list(untied.names), list(untied.ub), len(untied.rows), dict(untied.x))
    tied = untied.copy()
    ilp.tie_blocks(problem, tied, blocks)
    whole = ilp.formulate(problem, blocks)
    fields = ("names", "lb", "ub", "integer", "obj", "rows", "row_names", "x", "y", "T", "M")
    assert all(getattr(tied, name) == getattr(whole, name) for name in fields)
    assert [(i.groups, p, z) for i, p, z in tied.ties] == [(i.groups, p, z) for i, p, z in whole.ties]
    assert (untied.names, untied.ub, len(untied.rows), untied.x) == before and not untied.ties
