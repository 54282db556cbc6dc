"""Planners: the ILP against a brute force of the same cost model, against the greedy baseline,
and real GPT graphs through plan -> build -> verify."""

from __future__ import annotations

import itertools
import math
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic import random_taskgraph
from turnip.ir.taskgraph import TaskGraph, ValueKind
from turnip.memgraph import trace
from turnip.planners.costs import CostModel, DeviceSpec
from turnip.planners.decode_solution import from_solution, to_plan
from turnip.planners.driver import make_problem, smallest_budget
from turnip.planners.greedy import greedy
from turnip.planners.ilp import formulate, start_values
from turnip.planners.memory import TIE_BREAK, Decisions, evaluate, need_times, structural_problems, window_times
from turnip.planners.model import KEEP, OFFLOAD, RECOMPUTE, step_order
from turnip.planners.solver import solve

from turnip import memgraph, planners
from turnip.gpt import GPT, GPTConfig, example_batch, lm_loss

SLOW_LINK = DeviceSpec(name="slow link", h2d=2e6, d2h=2e6)  # transfers cost about as much as compute


# -- tiny graphs -----------------------------------------------------------------------------------

def tiny_step(rng: random.Random, layers: int, states: bool = True) -> TaskGraph:
    """x -> layer_0 -> ... -> loss, backward mirrored, one parameter (and state) per layer.
    Each layer sometimes has a cheap elementwise op after it and sometimes a skip connection, so
    recomputation chains, multi-output ops and transient values all appear."""
    tg = TaskGraph()

    def val(nbytes, kind=ValueKind.INTERMEDIATE, name=""):
        return tg.add_value((nbytes // 4,), (1,), "float32", nbytes, kind, name=name)

    def vert(ins, outs, phase, t):
        return tg.add_vertex("synthetic", tuple(tg.values[x].dense_ref for x in ins), outputs=tuple(outs),
                             phase=phase, time=t)

    def size():
        return 64 * rng.randint(1, 32)

    x = val(size(), ValueKind.BATCH, "batch:0")
    params = [val(size(), ValueKind.PARAMETER, f"param:l{i}.w") for i in range(layers)]
    st = {p: val(tg.values[p].nbytes, ValueKind.OPTIMIZER_STATE, f"opt:l{i}.w.m")
          for i, p in enumerate(params) if states and rng.random() < 0.7}
    h, saved, prev = x, [], None
    for i, p in enumerate(params):
        out = val(size())
        extra = [val(64)] if rng.random() < 0.3 else []
        ins = [h, p] + ([prev] if prev is not None and rng.random() < 0.3 else [])
        vert(ins, [out] + extra, "forward", rng.uniform(1e-5, 1e-3))
        saved.append((h, out, extra))
        prev = h
        h = out
        if rng.random() < 0.5:  # a cheap elementwise op
            act = val(size())
            vert([h], [act], "forward", rng.uniform(1e-6, 2e-5))
            h = act
    loss = val(4)
    vert([h], [loss], "forward", 1e-5)
    tg.outputs["loss"] = loss
    g = val(tg.values[h].nbytes)
    vert([loss, h], [g], "backward", 1e-5)
    grads = {}
    for i in reversed(range(layers)):
        inp, out, extra = saved[i]
        gin, gp = val(tg.values[inp].nbytes), val(tg.values[params[i]].nbytes)
        vert([g, inp, out, params[i]] + extra, [gin, gp], "backward", rng.uniform(1e-5, 2e-3))
        grads[params[i]] = gp
        g = gin
    for p in params:
        new_p = val(tg.values[p].nbytes)
        if p in st:
            new_s = val(tg.values[st[p]].nbytes)
            vert([st[p], grads[p]], [new_s], "optimizer", 1e-5)
            vert([p, new_s], [new_p], "optimizer", 1e-5)
            tg.bindings[st[p]] = new_s
        else:
            vert([p, grads[p]], [new_p], "optimizer", 1e-5)
        tg.bindings[p] = new_p
    tg.validate()
    return tg


def synthetic_step(seed: int, n: int = 16) -> TaskGraph:
    rng = random.Random(seed)
    tg = random_taskgraph(rng, n_vertices=n, n_params=2, max_bytes=4096)
    for v in tg.vertices:
        v.time = rng.uniform(1e-6, 1e-3)
    return tg


def brute_force(problem) -> tuple[float, Decisions] | None:
    """Every keep/offload/recompute choice per group and home per item, by the same evaluator."""
    best = None
    for kinds in itertools.product((KEEP, OFFLOAD, RECOMPUTE), repeat=len(problem.groups)):
        at = need_times(problem, list(kinds))
        if any(g.option(k, a) is None for g, k, a in zip(problem.groups, kinds, at)):
            continue  # outside the option space whatever the homes (evaluate says so too)
        for cpu in itertools.product((False, True), repeat=len(problem.items)):
            dec = Decisions(list(kinds), list(cpu))
            ev = evaluate(problem, dec)
            if ev.feasible and (best is None or ev.objective < best[0] - 1e-15):
                best = (ev.objective, dec)
    return best


def ilp_optimum(problem, warm: bool = True):
    f = formulate(problem)
    start = None
    if warm:
        dec, ev, _ = greedy(problem)
        if ev.feasible:
            start = start_values(problem, f, ev.options, dec.cpu, ev.window_time)
    result = solve(f, start, time_limit=60, gap=1e-9)
    if result.values is None:
        return None, result, f
    dec = from_solution(problem, f, result.values)
    return evaluate(problem, dec), result, f


def small_problems(hosts: tuple[float, ...] = (), seeds: int = 80, prefix: str = ""):
    """(name, problem) pairs small enough to enumerate, with caps spread between the least memory
    the planners can reach and what keeping everything takes, so every kind of choice binds.
    hosts: host seconds per launched vertex to draw from (none: the CPU backend's, zero)."""
    out = []
    for seed in range(seeds):
        rng = random.Random(seed)
        if seed % 3:
            tg = tiny_step(rng, layers=rng.randint(2, 4), states=rng.random() < 0.4)
        else:
            tg = synthetic_step(seed, n=rng.randint(10, 16))
        link = DeviceSpec(h2d=rng.choice([2e6, 2e7, 2e8]), d2h=rng.choice([2e6, 2e7, 2e8]))
        costs = CostModel(spec=link, host_per_vertex=rng.choice(hosts)) if hosts else CostModel(spec=link)
        kw = {"costs": costs, "alignment": 64, "windows": rng.choice([2, 3, 5]), "headroom": 1.0}
        probe = make_problem(tg, 1 << 40, **kw)
        if 3 ** len(probe.groups) * 2 ** len(probe.items) > 6000 or not probe.groups:
            continue
        most = evaluate(probe, Decisions.keep_all(probe)).peak
        least = greedy(make_problem(tg, smallest_budget(probe.tg, probe.alignment), **kw))[1].peak
        frac = rng.choice([0.0, 0.2, 0.5, 0.8])
        budget = int(least + frac * max(0, most - least)) + probe.max_workspace
        out.append((f"{prefix}seed{seed}-{frac}", make_problem(tg, max(budget, smallest_budget(probe.tg, probe.alignment)), **kw)))
    return out


SMALL = small_problems()
# the same kind of problems with launches costing the host from about an op's time to far more
SMALL_HOST = small_problems(hosts=(2e-5, 2e-4, 1e-3), seeds=40, prefix="host-")


def test_enough_small_problems():
    assert len(SMALL) >= 30
    assert sum(1 for _, p in SMALL if len(p.groups) >= 3) >= 10
    optima = [brute_force(p) for _, p in SMALL]
    assert sum(o is not None for o in optima) >= 0.8 * len(SMALL)
    chosen = {k for o in optima if o is not None for k in o[1].groups}
    assert chosen == {KEEP, OFFLOAD, RECOMPUTE}  # every kind of decision is optimal somewhere
    assert any(any(o[1].cpu) for o in optima if o is not None)


def test_enough_small_host_problems():
    """The host-cost problems exercise the host rows: some optima are bound by launches, and
    some pay for launches their decisions add."""
    assert len(SMALL_HOST) >= 15
    assert all(p.host_per_vertex > 0 and p.base_host.all() for _, p in SMALL_HOST)
    optima = [(p, brute_force(p)) for _, p in SMALL_HOST]
    evs = [evaluate(p, o[1]) for p, o in optima if o is not None]
    assert len(evs) >= 0.8 * len(SMALL_HOST)
    host_bound = [ev for ev in evs if np.any(ev.window_time == ev.host) and np.any(ev.host > ev.compute)]
    assert len(host_bound) >= 0.25 * len(evs)
    assert any(ev.mix["host_seconds_added"] > 0 for ev in host_bound)
    chosen = {k for _, o in optima if o is not None for k in o[1].groups}
    assert {OFFLOAD, RECOMPUTE} <= chosen


def ilp_beside_brute_force(name, problem):
    """(brute-force optimum, ILP evaluation, solver result, formulation); None when neither finds a plan."""
    want = brute_force(problem)
    got, result, f = ilp_optimum(problem, warm=(hash(name) % 2 == 0))
    if want is None:
        assert got is None or not got.feasible, f"{name}: ILP found a plan the brute force says cannot exist"
        return None
    assert got is not None and got.feasible, f"{name}: ILP found no plan ({result.status}); brute force {want[0]}"
    return want[0], got, result, f


@pytest.mark.parametrize("name,problem", SMALL, ids=[n for n, _ in SMALL])
def test_ilp_matches_brute_force(name, problem):
    found = ilp_beside_brute_force(name, problem)
    if found is None:
        return
    want, got, result, f = found
    assert got.objective == pytest.approx(want, rel=1e-7, abs=1e-12)
    # the solver's objective is the evaluator's (in milliseconds)
    assert result.objective * f.time_unit == pytest.approx(got.objective, rel=1e-6, abs=1e-12)


# HiGHS stops once the incumbent is within this much of its bound (its default mip_abs_gap, in the
# objective's unit, Formulation.time_unit): host costs make many plans equal in time, and their
# tie-breaks can differ by less than that
HIGHS_ABS_GAP = 1e-6


@pytest.mark.parametrize("name,problem", SMALL_HOST, ids=[n for n, _ in SMALL_HOST])
def test_ilp_matches_brute_force_with_host_cost(name, problem):
    """The ILP's host rows encode evaluate's host time: same optimum as the brute force (to the
    solver's absolute gap), and the solver's objective is exactly evaluate's for its solution."""
    found = ilp_beside_brute_force(name, problem)
    if found is None:
        return
    want, got, result, f = found
    assert got.objective >= want * (1 - 1e-9)
    assert got.objective == pytest.approx(want, rel=1e-7, abs=HIGHS_ABS_GAP * f.time_unit)
    assert result.objective * f.time_unit == pytest.approx(got.objective, rel=1e-6, abs=1e-12)
    # the window times the solver settled on are evaluate's, host-bound windows included
    solved = np.array([result.values[t] for t in f.T]) * f.time_unit
    assert solved == pytest.approx(got.window_time, rel=1e-6, abs=1e-12)


def test_need_times_follow_recompute_chains():
    rng = random.Random(3)
    for _ in range(20):
        tg = tiny_step(rng, layers=3)
        problem = make_problem(tg, tg.live_peak(), costs=CostModel(spec=SLOW_LINK), alignment=64, windows=3)
        kinds = [rng.choice((KEEP, OFFLOAD, RECOMPUTE)) for _ in problem.groups]
        at = need_times(problem, kinds)
        for gi, g in enumerate(problem.groups):
            if kinds[gi] == KEEP:
                assert at[gi] == -1
                continue
            demands = [g.n0] + [at[h] for h in problem.required_by[gi] if kinds[h] == RECOMPUTE]
            assert at[gi] == min(demands)


# -- the ILP against the greedy baseline ---------------------------------------------------------

def suite():
    graphs = []
    for seed in range(6):
        rng = random.Random(100 + seed)
        graphs.append(("tiny", tiny_step(rng, layers=rng.randint(3, 6))))
        graphs.append(("synthetic", synthetic_step(100 + seed, n=40)))
    return graphs


@pytest.mark.parametrize("frac", [0.8, 0.5, 0.3])
@pytest.mark.parametrize("index", range(12))
def test_ilp_never_worse_than_greedy(index, frac):
    _, tg = suite()[index]
    costs = CostModel(spec=SLOW_LINK if index % 3 else DeviceSpec())
    budget = int(frac * tg.live_peak(alignment=64))
    problem = make_problem(tg, budget, costs=costs, alignment=64)
    budget = max(budget, smallest_budget(problem.tg, problem.alignment))
    problem = make_problem(tg, budget, costs=costs, alignment=64)
    _, g_ev, _ = greedy(problem)
    got, _, _ = ilp_optimum(problem)
    if g_ev.feasible:
        assert got is not None and got.feasible
        # HiGHS's optimality tolerance: with deeper recompute candidates it returned a plan of equal
        # time that streams 768 bytes more, 6e-9 of the objective above greedy's
        assert got.objective <= g_ev.objective * (1 + 1e-7)
        assert got.time <= g_ev.time * (1 + 2 * TIE_BREAK)
    plan = planners.plan(tg, budget, costs=costs, alignment=64, time_limit=20)
    if g_ev.feasible:
        assert plan.stats["objective"] <= g_ev.objective * (1 + 1e-9)


@pytest.mark.parametrize("index", range(12))
def test_ilp_never_worse_than_greedy_with_host_cost(index):
    """The same with the measured CUDA launch cost: greedy judges moves by evaluate, which now
    counts launches, and the ILP's host rows must price them the same way."""
    _, tg = suite()[index]
    costs = CostModel(spec=SLOW_LINK if index % 3 else DeviceSpec(), host_per_vertex=15e-6)
    problem = make_problem(tg, int(0.5 * tg.live_peak(alignment=64)), costs=costs, alignment=64)
    problem = make_problem(tg, max(problem.gpu_budget, smallest_budget(problem.tg, problem.alignment)), costs=costs, alignment=64)
    _, g_ev, _ = greedy(problem)
    got, result, f = ilp_optimum(problem)
    if g_ev.feasible:
        assert got is not None and got.feasible
        assert got.objective <= g_ev.objective * (1 + 1e-9)
    if got is not None:
        assert result.objective * f.time_unit == pytest.approx(got.objective, rel=1e-6, abs=1e-12)


# -- host launch time ------------------------------------------------------------------------------

FAST_LINK = DeviceSpec(name="fast link", h2d=1e15, d2h=1e15)


def chain_step(chain: int = 7, filler: int = 4, big: int = 1 << 16, t: float = 1e-6) -> tuple[TaskGraph, int]:
    """x -> `chain` tiny ops -> one op whose `big` output the backward pass reads at the very end,
    with `filler` big forward ops between. Recomputing that output re-runs the chain (chain + 1
    launches); offloading it moves one value (an offload and a reload). Returns (graph, value)."""
    tg = TaskGraph()

    def op(ins, nbytes, phase):
        out = tg.add_value((nbytes // 4,), (1,), "float32", nbytes)
        tg.add_vertex("synthetic", tuple(tg.values[x].dense_ref for x in ins), outputs=(out,), phase=phase, time=t)
        return out

    h = tg.add_value((16,), (1,), "float32", 64, ValueKind.BATCH, name="batch:0")
    for _ in range(chain):
        h = op([h], 64, "forward")
    saved = h = op([h], big, "forward")
    for _ in range(filler):
        h = op([h], big, "forward")
    tg.outputs["loss"] = op([h], 4, "forward")
    g = op([tg.outputs["loss"]], 64, "backward")
    for _ in range(filler):
        g = op([g], 64, "backward")
    op([g, saved], 64, "backward")
    tg.validate()
    return tg, saved


def test_host_time_counts_every_launch():
    """With launches far slower than the ops and the link, every window is bound by its host time:
    the step costs one launch per vertex, batch input and output, and each decision adds exactly
    its own launches (recompute: the chain and the vertex; offload: an offload and a reload per
    saved value; a CPU home: a fetch per streamed run and a write-back per updated value)."""
    host = 1.0
    graphs = [chain_step()[0]] + [tiny_step(random.Random(seed), layers=4) for seed in range(6)]
    checked = {OFFLOAD: 0, RECOMPUTE: 0, "item": 0}
    for tg in graphs:
        problem = make_problem(tg, 1 << 40, costs=CostModel(spec=FAST_LINK, host_per_vertex=host), alignment=64,
                               windows=3)
        keep = Decisions.keep_all(problem)
        base = evaluate(problem, keep)
        launches = len(tg.vertices) + 1 + len(tg.outputs)  # one batch input
        assert base.time == pytest.approx(host * launches, rel=1e-12)
        assert base.mix["host_seconds"] == pytest.approx(base.time, rel=1e-12)
        for gi, g in enumerate(problem.groups):
            added = {OFFLOAD: 2 * len(g.saved), RECOMPUTE: len(g.chain) + 1}
            for kind in (OFFLOAD, RECOMPUTE):
                if g.option(kind, g.n0) is None:
                    continue
                dec = Decisions(keep.groups[:gi] + [kind] + keep.groups[gi + 1:], keep.cpu)
                ev = evaluate(problem, dec)
                assert ev.time - base.time == pytest.approx(host * added[kind], rel=1e-9)
                assert ev.mix["host_seconds_added"] == pytest.approx(host * added[kind], rel=1e-12)
                checked[kind] += 1
        for ii, item in enumerate(problem.items):
            dec = Decisions(keep.groups, [i == ii for i in range(len(problem.items))])
            runs = sum(len(item.present[w]) for w in item.values)
            write_backs = sum(1 for w in item.values if w in tg.bindings)
            assert evaluate(problem, dec).time - base.time == pytest.approx(host * (runs + write_backs), rel=1e-9)
            checked["item"] += 1
    assert min(checked.values()) >= 5


def test_large_host_cost_prefers_offload_to_a_long_recompute_chain():
    """Recomputing eight tiny ops beats moving 64 KiB when launches are free; when each launch
    costs the host 100 us, the two launches of an offload beat the eight of the recomputation,
    and the recompute plan's predicted time grows by exactly those eight launches."""
    tg, saved = chain_step()
    link = DeviceSpec(name="1 GB/s", h2d=1e9, d2h=1e9)
    budget = int(2.5 * tg.values[saved].nbytes)
    host = 1e-4
    plans = {}
    for h in (0.0, host):
        for method in ("ilp", "greedy"):
            plans[h, method] = planners.plan(tg, budget, costs=CostModel(spec=link, host_per_vertex=h),
                                             method=method, alignment=64, headroom=1.0, time_limit=10)
    for method in ("ilp", "greedy"):
        free, costly = plans[0.0, method], plans[host, method]
        assert free.stats["fits_model"] and costly.stats["fits_model"]
        assert len(free.recompute) == 8 and not free.offload
        assert costly.offload == {saved} and not costly.recompute
        assert free.stats["host_seconds"] == 0.0
        # predicted time includes every launch: the step's 19 vertices, its input and output, and
        # the offload and the reload
        assert costly.predicted_time == pytest.approx(host * (len(tg.vertices) + 2 + 2), rel=1e-9)
        assert costly.stats["host_seconds"] == pytest.approx(costly.predicted_time, rel=1e-9)
        assert costly.stats["host_seconds_added"] == pytest.approx(2 * host, rel=1e-9)
        assert costly.stats["host_per_vertex"] == host
    problem = make_problem(tg, budget, costs=CostModel(spec=link, host_per_vertex=host), alignment=64, headroom=1.0)
    keep, rc, off = (evaluate(problem, Decisions([k], [])) for k in (KEEP, RECOMPUTE, OFFLOAD))
    assert not keep.feasible and rc.feasible and off.feasible
    assert rc.time - keep.time == pytest.approx(8 * host, rel=1e-9)
    assert off.objective < rc.objective


def test_zero_host_cost_leaves_the_model_as_it_was():
    """Without a launch cost (the CPU backend's default) the problem, the ILP and the evaluation
    are the ones without the host resource: no host terms, no host rows, window time the longest
    of compute and transfers, and the objective's tie-break counts transfers and recomputation."""
    rng = random.Random(5)
    for name, problem in SMALL:
        assert problem.host_per_vertex == 0.0 and not problem.base_host.any(), name
        assert all(opt.host == () for g in problem.groups for opt in g.options)
        assert all(item.host == {} for item in problem.items)
        assert not [r for r in formulate(problem).row_names if r.endswith("_host")]
        for _ in range(5):
            kinds = [rng.choice((KEEP, OFFLOAD, RECOMPUTE)) for _ in problem.groups]
            ev = evaluate(problem, Decisions(kinds, [rng.random() < 0.5 for _ in problem.items]))
            want = np.maximum(ev.compute, np.maximum(ev.h2d / problem.bw_h2d, ev.d2h / problem.bw_d2h))
            assert np.array_equal(ev.window_time, want) and ev.time == float(want.sum())
            moved = ev.mix["recompute_seconds"] + float(ev.h2d.sum() - problem.base_h2d.sum()) / problem.bw_h2d + \
                float(ev.d2h.sum() - problem.base_d2h.sum()) / problem.bw_d2h
            assert ev.objective == pytest.approx(ev.time + TIE_BREAK * moved, rel=1e-9, abs=1e-15)
            assert ev.mix["host_seconds"] == 0.0 and ev.mix["host_seconds_added"] == 0.0


def test_cuda_graphs_pay_the_launch_cost_unless_told_otherwise():
    """A graph traced for CUDA is planned with the measured 15 us per launch by default; an
    explicit zero gives exactly the CPU backend's plan."""
    tg, saved = chain_step()
    cuda = tg.copy()
    cuda.device = "cuda"
    link = DeviceSpec(name="1 GB/s", h2d=1e9, d2h=1e9)
    budget = int(2.5 * tg.values[saved].nbytes)
    kw = {"alignment": 64, "headroom": 1.0, "time_limit": 10}
    cpu_plan = planners.plan(tg, budget, costs=CostModel(spec=link), **kw)
    zero = planners.plan(cuda, budget, costs=CostModel(spec=link, host_per_vertex=0.0), **kw)
    paid = planners.plan(cuda, budget, costs=CostModel(spec=link), **kw)
    assert cpu_plan.stats["host_per_vertex"] == zero.stats["host_per_vertex"] == 0.0
    assert (zero.recompute, zero.offload, zero.home, zero.predicted_time, zero.stats["objective"]) == \
        (cpu_plan.recompute, cpu_plan.offload, cpu_plan.home, cpu_plan.predicted_time, cpu_plan.stats["objective"])
    assert paid.stats["host_per_vertex"] == 15e-6
    assert paid.stats["host_seconds"] >= 15e-6 * len(tg.vertices)
    assert paid.predicted_time > cpu_plan.predicted_time


# -- plans on real graphs ------------------------------------------------------------------------

def _traced(cfg: GPTConfig, batch: int) -> tuple[TaskGraph, int]:
    """A traced step with analytic costs filled in, and its unplanned peak (workspace included)."""
    model = GPT(cfg)
    tg = trace(model, lm_loss, example_batch(cfg, batch=batch), optimizer=torch.optim.AdamW(model.parameters()))
    CostModel(measure=False).annotate(tg)
    return tg, tg.live_peak(alignment=64)


@pytest.fixture(scope="module")
def small_gpt():
    return _traced(GPTConfig(), batch=2)  # turnip/gpt.py's small GPT as configured by default


@pytest.fixture(scope="module")
def deep_gpt():
    # deep enough that 10% of the peak is above the largest single op (the hidden MLP layer)
    return _traced(GPTConfig(vocab=64, seq=64, d_model=32, n_layers=12), batch=8)


def _build_and_verify(tg, plan):
    mg = memgraph.build(tg, plan, alignment=64)
    assert memgraph.verify(mg) == []
    assert mg.arena_bytes + max((v.workspace for v in mg.taskgraph.vertices), default=0) <= plan.gpu_budget
    return mg


def _check_plan(tg, plan, budget):
    assert plan.gpu_budget == budget
    assert sorted(plan.order) == list(range(len(tg.vertices)))
    assert plan.predicted_time > 0 and plan.predicted_peak <= budget
    assert plan.stats["fits_model"]
    mix = plan.stats
    assert mix["bytes_offloaded"] + mix["bytes_recomputed"] + mix["bytes_weights_streamed"] + \
        mix["bytes_states_streamed"] > 0
    graph, order = plan.expand(tg)  # recomputation is well formed
    assert len(order) == len(graph.vertices)


@pytest.mark.parametrize("frac", [0.5, 0.25])
def test_small_gpt_plans_build_and_verify(small_gpt, frac):
    tg, peak = small_gpt
    budget = int(frac * peak)
    plan = planners.plan(tg, budget, time_limit=20, alignment=64)
    _check_plan(tg, plan, budget)
    _build_and_verify(tg, plan)


def test_small_gpt_at_10_percent_is_refused_with_the_smallest_budget(small_gpt):
    # The AdamW update of the 64 KiB tied embedding alone needs more than 10% of this step's peak
    tg, peak = small_gpt
    with pytest.raises(ValueError) as info:  # memgraph.build.InfeasibleBudget is a ValueError
        planners.plan(tg, int(0.1 * peak), alignment=64)
    floor = info.value.minimum
    assert floor > 0.1 * peak and str(floor) in str(info.value)
    plan = planners.plan(tg, floor, alignment=64, time_limit=20)  # and that budget is accepted
    _build_and_verify(tg, plan)


@pytest.mark.parametrize("frac", [0.5, 0.25, 0.1])
def test_deep_gpt_plans_build_and_verify(deep_gpt, frac):
    tg, peak = deep_gpt
    budget = int(frac * peak)
    # At 10% the block patterns do not beat greedy's plan and the program over every group finds a
    # better one in about 3 s on one core; it gets a fifth of the limit (driver.UNTIED_SHARE), so the
    # limit leaves room for a loaded 2-core CI machine (CI once ran out at 20 s)
    plan = planners.plan(tg, budget, time_limit=60, alignment=64)
    _check_plan(tg, plan, budget)
    assert plan.planner == "ilp" and plan.stats["status"], plan.stats.get("fallback")
    _build_and_verify(tg, plan)


def test_slow_link_prefers_recomputation(deep_gpt):
    tg, peak = deep_gpt
    tg = tg.copy()
    for v in tg.vertices:
        v.time = 0.0
    budget = int(0.25 * peak)
    # transfers dominate this step: the ILP improves on greedy but does not close its gap quickly
    plan = planners.plan(tg, budget, costs=CostModel(spec=SLOW_LINK), time_limit=4, alignment=64)
    assert plan.recompute and plan.stats["bytes_recomputed"] > 0
    for rc in plan.recompute:
        assert tg.vertices[rc.vertex].phase == "forward"
    _build_and_verify(tg, plan)


def test_everything_fits_keeps_everything(small_gpt):
    tg, peak = small_gpt
    plan = planners.plan(tg, 2 * peak, alignment=64)  # twice: the plan keeps headroom for fragmentation
    assert not plan.recompute and not plan.offload and not plan.home
    assert plan.stats["reason"] == "everything fits"


def test_method_greedy_and_unknown(small_gpt):
    tg, peak = small_gpt
    budget = int(0.3 * peak)
    plan = planners.plan(tg, budget, method="greedy", alignment=64)
    assert plan.planner == "greedy" and plan.stats["fits_model"]
    with pytest.raises(ValueError):
        planners.plan(tg, budget, method="magic")
    with pytest.raises(TypeError):
        planners.plan(tg, budget, colour="blue")


def test_cpu_budget_is_respected(small_gpt):
    tg, peak = small_gpt
    budget = int(0.4 * peak)
    free = planners.plan(tg, budget, alignment=64, time_limit=20)
    pinned = free.stats["pinned_bytes"]
    assert pinned > 0
    for method in ("greedy", "ilp"):
        tight = planners.plan(tg, budget, cpu_budget=pinned // 2, alignment=64, time_limit=20, method=method)
        if tight.stats["fits_model"]:
            assert tight.stats["pinned_bytes"] <= pinned // 2


def test_optimizer_updates_follow_their_gradients(small_gpt):
    tg, _ = small_gpt
    order = step_order(tg)
    pos = {v: i for i, v in enumerate(order)}
    first_opt = min(pos[v.id] for v in tg.vertices if v.phase == "optimizer")
    last_bwd = max(pos[v.id] for v in tg.vertices if v.phase == "backward")
    assert first_opt < last_bwd  # interleaved, so gradients die early
    for v in tg.vertices:  # still a topological order
        for x in v.inputs():
            prod = tg.values[x].producer
            assert prod < 0 or pos[prod] < pos[v.id]


def test_fused_updates_do_not_wait_for_each_other():
    """A CUDA trace's fused updates all read one step counter: each update still goes right after
    its own block's gradients, so the last block's update runs before the first block's backward
    (before, the shared counter held every update, and so every gradient, to the end)."""
    from turnip.ir.step_file import load_step
    tg = load_step(Path(__file__).parent.parent / "bench/results/h100/steps/step_gpt350m.step")
    assert any(tg.values[i].name == "opt:step" for v in tg.vertices if v.phase == "optimizer" for i in v.inputs())
    order = step_order(tg)
    pos = {v: i for i, v in enumerate(order)}
    def updates(block: int) -> list:
        return [v for v in tg.vertices if v.phase == "optimizer" and v.module == f"blocks.{block}"]

    blocks = sorted({int(v.module.split(".")[1]) for v in tg.vertices if v.module.startswith("blocks.")})
    first_gradients = [tg.values[i].producer for v in updates(blocks[0]) for i in v.inputs()
                       if tg.values[i].producer >= 0 and tg.vertices[tg.values[i].producer].phase == "backward"]
    assert first_gradients
    assert max(pos[v.id] for v in updates(blocks[-1])) < min(pos[g] for g in first_gradients)
    for v in tg.vertices:  # still a topological order
        assert all(tg.values[x].producer < 0 or pos[tg.values[x].producer] < pos[v.id] for x in v.inputs())


def test_ilp_solution_decodes_to_plan(small_gpt):
    tg, peak = small_gpt
    problem = make_problem(tg, int(0.25 * peak), alignment=64)
    ev, result, f = ilp_optimum(problem)
    assert ev is not None and ev.feasible
    plan = to_plan(problem, from_solution(problem, f, result.values), ev, "ilp", {})
    assert plan.predicted_peak == ev.peak + problem.max_workspace
    assert math.isclose(plan.predicted_time, ev.time)


def test_ilp_without_a_solution_falls_back_to_greedy(small_gpt, monkeypatch):
    from turnip.planners import solver as solver_mod

    def nothing(f, start=None, **kwargs):
        return solver_mod.SolveResult(values=None, status="Time limit reached", optimal=False)

    monkeypatch.setattr(solver_mod, "solve", nothing)
    tg, peak = small_gpt
    plan = planners.plan(tg, int(0.4 * peak), alignment=64)
    assert plan.planner == "greedy" and "no solution" in plan.stats["fallback"]
    assert plan.stats["fits_model"]


@pytest.mark.filterwarnings("ignore:PULP_CBC_CMD is deprecated")
@pytest.mark.parametrize("name", [n for n, _ in SMALL[:6] + SMALL_HOST[:3]])
def test_cbc_agrees_with_highs(name):
    problem = dict(SMALL + SMALL_HOST)[name]
    f = formulate(problem)
    try:
        cbc = solve(f, None, time_limit=20, gap=1e-9, solver="cbc")
    except RuntimeError as err:
        pytest.skip(str(err))
    highs = solve(f, None, time_limit=20, gap=1e-9)
    assert (cbc.values is None) == (highs.values is None)
    if cbc.values is not None:
        assert evaluate(problem, from_solution(problem, f, cbc.values)).objective == pytest.approx(
            evaluate(problem, from_solution(problem, f, highs.values)).objective, rel=1e-7)


@pytest.mark.parametrize("how", ["ilp", "all_recompute"])
def test_recomputing_plans_run_like_eager(how):
    """Plans with recomputation (dropout included: random vertices replay their RNG state) build
    and train bit for bit like eager PyTorch on the CPU backend."""
    from cases import OPTIMIZERS, assert_same_state, eager_steps, make_case, trainable
    from turnip.memgraph.builder import build

    from turnip import engine, memgraph

    model, loss_fn, batches = make_case("gpt", dropout=0.1)
    want_losses, want_state = eager_steps(model, loss_fn, batches, OPTIMIZERS["adamw"])
    tg = trace(model, loss_fn, batches[0], optimizer=OPTIMIZERS["adamw"](trainable(model)), device="cpu")
    costs = CostModel(spec=SLOW_LINK)
    peak = CostModel(measure=False).annotate(tg.copy()).live_peak(alignment=64)
    budget = int(0.3 * peak) if how == "ilp" else peak  # the second keeps weights on the GPU
    if how == "ilp":
        plan = planners.plan(tg, budget, costs=costs, time_limit=10, alignment=64)
    else:  # every group that can be recomputed is, chains of in-place dropout ops included
        problem = make_problem(tg, budget, costs=costs, alignment=64)
        kinds = [KEEP] * len(problem.groups)
        for gi, g in enumerate(problem.groups):
            trial = kinds[:gi] + [RECOMPUTE] + kinds[gi + 1:]
            if not structural_problems(problem, Decisions(trial, [False] * len(problem.items))):
                kinds = trial
        dec = Decisions(kinds, [False] * len(problem.items))
        plan = to_plan(problem, dec, evaluate(problem, dec), "test", {})
        assert any(tg.vertices[rc.vertex].random for rc in plan.recompute)
    assert plan.recompute, "a slow link should make recomputation attractive"
    mg = build(tg, plan, alignment=64)
    mg.initial_state, mg.names, mg.device = dict(tg.initial_state), dict(tg.state_names), "cpu"
    assert memgraph.verify(mg) == []
    torch.manual_seed(123)
    losses = [engine.run(mg, b)["loss"].item() for b in batches]
    assert losses == [x.item() for x in want_losses]
    assert_same_state(mg.state_dict(), want_state)


def test_candidates_are_the_ilp_plan_then_the_greedy_plan_it_started_from(small_gpt):
    tg, peak = small_gpt
    # the block patterns beat nothing here; the untied program proves greedy's plan optimal in about
    # 0.3 s, given a fifth of the limit (driver.UNTIED_SHARE)
    first, *rest = planners.plan_candidates(tg, int(0.4 * peak), alignment=64, headroom=0.9, time_limit=10)
    assert first.planner == "ilp" and [p.planner for p in rest] == ["greedy"], first.stats.get("fallback")
    assert rest[0].predicted_time >= first.predicted_time  # the ILP starts from the greedy plan
    again = planners.plan(tg, int(0.4 * peak), alignment=64, headroom=0.9, time_limit=10)
    assert first.predicted_time == again.predicted_time


def test_auto_candidates_also_plan_the_whole_budget(small_gpt):
    """Without an explicit headroom, the candidates add plans made against the whole budget, which
    keep at least as much (a larger cap can only help the model)."""
    tg, peak = small_gpt
    plans = planners.plan_candidates(tg, int(0.4 * peak), alignment=64)
    headrooms = [p.stats["headroom"] for p in plans]
    assert headrooms[0] < 1.0 and headrooms[-1] == 1.0
    default = [p for p in plans if p.stats["headroom"] < 1.0]
    whole = [p for p in plans if p.stats["headroom"] == 1.0]
    assert min(p.predicted_time for p in whole) <= min(p.predicted_time for p in default)


def test_the_auto_problems_are_planned_side_by_side(small_gpt, monkeypatch):
    """plan_candidates plans the default-headroom, the near-whole, the whole-budget and the short-chain
    problems on threads of their own (HiGHS releases the GIL, so one ILP runs while another problem is
    searched): each fake planner below waits for the others, which only returns when all run at once."""
    import threading

    from turnip.planners import driver

    tg, peak = small_gpt
    together = threading.Barrier(2, timeout=10)

    def fake(tg, gpu_budget, cpu_budget, method, time_limit, costs, describe, **opts):
        together.wait()  # raises BrokenBarrierError unless the other problems are planned meanwhile
        return [(opts.get("headroom", "default"), opts.get("max_chain"))]

    monkeypatch.setattr(driver, "_candidates", fake)
    assert driver.plan_candidates(tg, int(0.4 * peak), alignment=64) == [  # in order
        ("default", None), (1.0, None)]
    assert driver.plan_candidates(tg, int(0.4 * peak), alignment=64, max_chain=3) == [("default", 3), (1.0, 3)]


def test_window_time_counts_both_directions_at_the_links_duplex_rate():
    """A window moving bytes both ways takes at least their sum over the duplex rate, the
    direction rates alone when the duplex rate is unbounded (problem.bw_duplex = inf)."""
    zero = np.zeros(2)
    h2d, d2h = np.array([50e9, 50e9]), np.array([50e9, 0.0])  # window 0 both ways, window 1 one way
    capped = types.SimpleNamespace(bw_h2d=55e9, bw_d2h=55e9, bw_duplex=100e9)
    free = types.SimpleNamespace(bw_h2d=55e9, bw_d2h=55e9, bw_duplex=float("inf"))
    assert window_times(zero, zero, h2d, d2h, capped) == pytest.approx([1.0, 50 / 55])
    assert window_times(zero, zero, h2d, d2h, free) == pytest.approx([50 / 55, 50 / 55])


def test_the_greedys_incremental_checks_accept_exactly_the_moves_a_full_check_would(deep_gpt, monkeypatch):
    """rank_moves rechecks only the groups a move can affect (memory.read_closure); checking every
    group instead must accept the same moves, on each strategy."""
    from turnip.planners import greedy as greedy_mod
    from turnip.planners.memory import read_closure

    tg, peak = deep_gpt
    problem = make_problem(tg, int(0.25 * peak), alignment=64)
    quick = {s: greedy_mod.rank_moves(problem, s) for s in greedy_mod.STRATEGIES}
    monkeypatch.setattr(greedy_mod, "read_closure", lambda problem, changed: set(range(len(problem.groups))))
    full = {s: greedy_mod.rank_moves(problem, s) for s in greedy_mod.STRATEGIES}
    assert quick == full and any(quick.values())
    # need times updated over a closure equal those computed afresh
    kinds = [KEEP] * len(problem.groups)
    at = need_times(problem, kinds)
    for gi in range(0, len(problem.groups), 3):
        options = {o.kind for o in problem.groups[gi].options}
        kinds[gi] = RECOMPUTE if RECOMPUTE in options else OFFLOAD
        updated = need_times(problem, kinds, at, read_closure(problem, [gi]))
        assert updated == need_times(problem, kinds)
        at = updated


@pytest.mark.parametrize("frac", [0.5, 0.25, 0.1])
def test_a_problem_with_another_headroom_plans_as_one_built_with_it(deep_gpt, frac):
    """plan_candidates makes the whole-budget problem from the default one (problem.py's
    with_headroom) and ranks the greedy's moves once for both: the same cap, greedy plan and ILP
    program as a problem built with that headroom."""
    from turnip.planners.greedy import SharedRanking
    from turnip.planners.problem import with_headroom

    tg, peak = deep_gpt
    budget = int(frac * peak)
    base = make_problem(tg, budget, alignment=64)
    derived = with_headroom(base, 1.0)
    built = make_problem(tg, budget, alignment=64, headroom=1.0)
    assert base.headroom < 1.0 and derived.cap == built.cap > base.cap
    dec, ev, _ = greedy(derived, ranked=SharedRanking(base))
    own_dec, own_ev, _ = greedy(built)
    assert (dec.groups, dec.cpu) == (own_dec.groups, own_dec.cpu)
    assert ev.feasible and (ev.time, ev.peak) == (own_ev.time, own_ev.peak)
    assert formulate(derived).rows == formulate(built).rows
