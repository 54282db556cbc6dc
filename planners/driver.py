"""plan(): costs -> Problem -> greedy (baseline, warm start) -> ILP -> the better plan -> Plan."""

from __future__ import annotations

import logging
import time

from turnip.ir.budget import format_bytes
from turnip.ir.errors import InfeasibleBudget
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph
from turnip.planners import ilp, solver
from turnip.planners.costs import CostModel, default_costs
from turnip.planners.decode import from_solution, to_plan
from turnip.planners.greedy import greedy
from turnip.planners.memory import Decisions, Evaluation, evaluate
from turnip.planners.model import Problem
from turnip.planners.problem import build_problem

log = logging.getLogger(__name__)

METHODS = ("auto", "ilp", "greedy")
_MODEL_OPTS = ("headroom", "alignment", "windows", "depth", "max_candidates", "max_chain", "max_items", "order")
_SOLVER_OPTS = ("gap", "msg", "solver", "threads")


def make_problem(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, costs: CostModel | None = None,
                 **opts) -> Problem:
    costs = costs if costs is not None else default_costs(tg)
    costs.annotate(tg)
    model = {k: v for k, v in opts.items() if k in _MODEL_OPTS and v is not None}
    model.setdefault("alignment", 256 if tg.device == "cuda" else 64)
    # the host cost is the engine's that will run the graph, so the graph's device picks it
    return build_problem(tg, int(gpu_budget), cpu_budget, bw_h2d=costs.h2d_bandwidth, bw_d2h=costs.d2h_bandwidth,
                         host_per_vertex=costs.host_per_vertex_on(tg.device), **model)


def run_plan(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
             time_limit: float = 30.0, costs: CostModel | None = None, **opts) -> Plan:
    return _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, **opts)[0]


def plan_candidates(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
                    time_limit: float = 30.0, costs: CostModel | None = None, **opts) -> list[Plan]:
    """Plans worth building and comparing (memgraph.compile simulates each built one): the plan
    run_plan returns, then the greedy plan the ILP started from when it fits the model too; and,
    for method "auto" without an explicit headroom, the same two planned against the whole budget
    (headroom 1.0). The default headroom keeps slack for fragmentation and prefetching, which costs
    transfers when the budget is only just below the peak; whether the builder fits a plan of the
    whole budget without evicting more is known only once built."""
    plans = _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, **opts)
    if method == "auto" and "headroom" not in opts:
        plans += _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, headroom=1.0, **opts)
    return plans


def _candidates(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
                time_limit: float = 30.0, costs: CostModel | None = None, **opts) -> list[Plan]:
    """The plan run_plan returns first; when that is the ILP's and the greedy plan it started from
    fits the model too, that one second (same problem, same greedy run)."""
    if method not in METHODS:
        raise ValueError(f"unknown planner method {method!r} (choose from {', '.join(METHODS)})")
    unknown = set(opts) - set(_MODEL_OPTS) - set(_SOLVER_OPTS)
    if unknown:
        raise TypeError(f"unknown planner options: {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    problem = make_problem(tg, gpu_budget, cpu_budget, costs, **opts)
    floor = builder_floor(problem)
    if gpu_budget < floor:
        raise_infeasible(problem, floor)
    g_dec, g_ev, g_stats = greedy(problem)
    stats = {"problem_seconds": time.perf_counter() - started, "greedy_seconds": g_stats["seconds"],
             "greedy_time": g_ev.time if g_ev.feasible else None, "method": method, "fits_model": g_ev.feasible,
             "smallest_budget": floor}
    keep_all = not any(k != "keep" for k in g_dec.groups) and not any(g_dec.cpu)
    if method == "greedy" or (g_ev.feasible and keep_all):
        # keeping everything on the GPU is optimal whenever it fits: nothing to solve
        stats["reason"] = "greedy requested" if method == "greedy" else "everything fits"
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]

    solver_opts = {k: v for k, v in opts.items() if k in _SOLVER_OPTS and v is not None}
    solver_opts.setdefault("gap", 5e-3)  # the cost model itself is not more accurate than this
    f = ilp.formulate(problem)
    start = ilp.start_values(problem, f, g_ev.options, g_dec.cpu, g_ev.window_time) if g_ev.feasible else None
    result = solver.solve(f, start, time_limit=time_limit, **solver_opts)
    stats.update({"solver": result.solver, "status": result.status, "optimal": result.optimal,
                  "gap": result.gap, "objective_ms": result.objective, "bound_ms": result.bound,
                  "solve_seconds": result.seconds, "ilp_build_seconds": result.stats.get("build_seconds"),
                  "columns": len(f.names), "binaries": f.n_binaries, "rows": len(f.rows),
                  "time_limit": time_limit})
    if result.values is None:
        stats["fallback"] = f"ilp found no solution ({result.status})"
        log.warning("ILP found no solution (%s after %.1fs); using the greedy plan", result.status, result.seconds)
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]
    dec = from_solution(problem, f, result.values)
    ev = evaluate(problem, dec)
    if not ev.feasible:
        log.warning("ILP solution fails the exact check (%s); using the greedy plan", ev.reason)
        stats["fallback"] = f"ilp solution rejected: {ev.reason}"
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]
    stats["fits_model"] = True
    if g_ev.feasible and g_ev.objective < ev.objective:  # cannot happen with the warm start; belt and braces
        stats["fallback"] = "greedy plan faster than the ILP's"
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]
    stats["improvement_over_greedy"] = (g_ev.time / ev.time - 1.0) if g_ev.feasible and ev.time > 0 else None
    best = _finish(problem, dec, ev, "ilp", stats)
    return [best, _finish(problem, g_dec, g_ev, "greedy", dict(stats))] if g_ev.feasible else [best]


def _finish(problem: Problem, dec: Decisions, ev: Evaluation, planner: str, stats: dict) -> Plan:
    if not ev.feasible:
        # Above the floor BuildMemGraph can always build (it evicts what does not fit), but our
        # model, which reserves headroom and plans transfers, finds no plan within the cap: hand
        # over the plan that saves the most memory and let the builder evict the rest.
        log.warning("no plan fits %s of the %s budget in the planner's model (best peak %s); passing the "
                    "most memory-saving plan to BuildMemGraph, which evicts under pressure",
                    f"{problem.headroom:.0%}", format_bytes(problem.gpu_budget), format_bytes(ev.peak))
        stats["note"] = "model cap not met; builder evicts the rest"
    return to_plan(problem, dec, ev, planner, stats)


def builder_floor(problem: Problem) -> int:
    """The smallest GPU budget any plan can run in: every weight homed on the CPU, the largest
    single step's inputs and outputs in the arena, plus the largest workspace (BuildMemGraph
    builds every budget from there up when pinned storage is unbounded). An in-place update's
    new version takes its old version's bytes, so it is counted once."""
    tg, a = problem.tg, max(1, problem.alignment)

    def size(v: int) -> int:
        return -(-max(tg.values[v].nbytes, 1) // a) * a

    need = 0
    for vertex in tg.vertices:
        in_place = {new for old, new in vertex.copy_in if size(old) == size(new)}
        outputs = sum(size(o) for o in vertex.outputs if o >= 0 and o not in in_place)
        need = max(need, outputs + sum(size(x) for x in vertex.inputs()))
    for dst in tg.bindings.values():
        need = max(need, size(dst))
    return need + tg.step_workspace()


def raise_infeasible(problem: Problem, needed: int) -> None:
    msg = (f"GPU budget {format_bytes(problem.gpu_budget)} ({problem.gpu_budget} bytes) is too small for this "
           f"step: the smallest budget that could work is {format_bytes(needed)} ({needed} bytes), the largest "
           f"single op's inputs and outputs plus {format_bytes(problem.max_workspace)} of op workspace, with every "
           f"weight and optimizer state streamed from the CPU")
    raise InfeasibleBudget(msg, minimum=needed)
