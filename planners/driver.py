"""plan(): costs -> Problem -> greedy (baseline, warm start) -> ILP -> the better plan -> Plan."""

from __future__ import annotations

import logging
import math
import time

from turnip.memgraph.budget import format_bytes
from turnip.memgraph.taskgraph import TaskGraph
from turnip.planners.costs import CostModel, default_costs
from turnip.planners.decode import from_solution, to_plan
from turnip.planners.greedy import greedy
from turnip.planners.memory import Decisions, Evaluation, evaluate
from turnip.planners.model import OFFLOAD, RECOMPUTE, Problem
from turnip.planners.plan import Plan
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
    return build_problem(tg, int(gpu_budget), cpu_budget, bw_h2d=costs.h2d_bandwidth, bw_d2h=costs.d2h_bandwidth,
                         **model)


def run_plan(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
             time_limit: float = 30.0, costs: CostModel | None = None, **opts) -> Plan:
    if method not in METHODS:
        raise ValueError(f"unknown planner method {method!r} (choose from {', '.join(METHODS)})")
    unknown = set(opts) - set(_MODEL_OPTS) - set(_SOLVER_OPTS)
    if unknown:
        raise TypeError(f"unknown planner options: {', '.join(sorted(unknown))}")
    started = time.perf_counter()
    problem = make_problem(tg, gpu_budget, cpu_budget, costs, **opts)
    build_seconds = time.perf_counter() - started
    g_dec, g_ev, g_stats = greedy(problem)
    stats = {"problem_seconds": build_seconds, "greedy_seconds": g_stats["seconds"],
             "greedy_time": g_ev.time if g_ev.feasible else None, "method": method}
    keep_all = not any(k != "keep" for k in g_dec.groups) and not any(g_dec.cpu)
    if method == "greedy" or (g_ev.feasible and keep_all):
        # keeping everything on the GPU is optimal whenever it fits: nothing to solve
        if not g_ev.feasible:
            raise_infeasible(problem, g_ev)
        stats["reason"] = "greedy requested" if method == "greedy" else "everything fits"
        return to_plan(problem, g_dec, g_ev, "greedy", stats)

    from turnip.planners.ilp import formulate, start_values
    from turnip.planners.solver import solve

    solver_opts = {k: v for k, v in opts.items() if k in _SOLVER_OPTS and v is not None}
    solver_opts.setdefault("gap", 1e-3)
    f = formulate(problem)
    start = start_values(problem, f, g_ev.options, g_dec.cpu, g_ev.window_time) if g_ev.feasible else None
    result = solve(f, start, time_limit=time_limit, **solver_opts)
    stats.update({"solver": result.solver, "status": result.status, "optimal": result.optimal,
                  "gap": result.gap, "objective_ms": result.objective, "bound_ms": result.bound,
                  "solve_seconds": result.seconds, "ilp_build_seconds": result.stats.get("build_seconds"),
                  "columns": len(f.names), "binaries": f.n_binaries, "rows": len(f.rows),
                  "time_limit": time_limit})
    if result.values is None:
        if not g_ev.feasible:
            raise_infeasible(problem, g_ev)
        log.warning("ILP found no solution in %.0fs (%s); using the greedy plan", time_limit, result.status)
        stats["fallback"] = "ilp found no solution"
        return to_plan(problem, g_dec, g_ev, "greedy", stats)
    dec = from_solution(problem, f, result.values)
    ev = evaluate(problem, dec)
    if not ev.feasible:
        log.warning("ILP solution fails the exact check (%s); using the greedy plan", ev.reason)
        if not g_ev.feasible:
            raise_infeasible(problem, g_ev)
        stats["fallback"] = f"ilp solution rejected: {ev.reason}"
        return to_plan(problem, g_dec, g_ev, "greedy", stats)
    if g_ev.feasible and g_ev.time < ev.time:  # cannot happen with the warm start; belt and braces
        stats["fallback"] = "greedy plan faster than the ILP's"
        return to_plan(problem, g_dec, g_ev, "greedy", stats)
    stats["improvement_over_greedy"] = (g_ev.time / ev.time - 1.0) if g_ev.feasible and ev.time > 0 else None
    return to_plan(problem, dec, ev, "ilp", stats)


def least_memory(problem: Problem) -> Evaluation:
    """The smallest peak among the most memory-saving configurations we know how to make."""
    best = None
    for prefer in (RECOMPUTE, OFFLOAD):
        kinds = []
        for g in problem.groups:
            other = OFFLOAD if prefer == RECOMPUTE else RECOMPUTE
            kinds.append(prefer if g.option(prefer, g.n0) is not None else
                         other if g.option(other, g.n0) is not None else "keep")
        for cpu in (True, False):
            ev = evaluate(problem, Decisions(kinds, [cpu] * len(problem.items)))
            if ev.reason.startswith("group") or "absent" in ev.reason:
                continue  # outside the option space
            if best is None or ev.peak < best.peak:
                best = ev
    return best


def smallest_budget(problem: Problem, ev: Evaluation | None = None) -> int:
    candidates = [e for e in (ev, least_memory(problem)) if e is not None]
    peak = min(e.peak for e in candidates)
    # values must fit in headroom * (budget - workspace)
    return int(math.ceil(peak / problem.headroom)) + problem.max_workspace


def raise_infeasible(problem: Problem, ev: Evaluation) -> None:
    needed = smallest_budget(problem, ev)
    msg = (f"GPU budget {format_bytes(problem.gpu_budget)} ({problem.gpu_budget} bytes) is too small for this "
           f"step: even keeping nothing that can be offloaded or recomputed, it needs about "
           f"{format_bytes(needed)} ({needed} bytes) with {problem.headroom:.0%} headroom for fragmentation "
           f"and {format_bytes(problem.max_workspace)} of op workspace")
    err: Exception | None = None
    try:
        from turnip.memgraph.build import InfeasibleBudget
    except ImportError:
        InfeasibleBudget = None  # noqa: N806
    if InfeasibleBudget is not None:
        for args, kwargs in (((msg,), {}), ((), {"message": msg, "needed": needed, "budget": problem.gpu_budget})):
            try:
                err = InfeasibleBudget(*args, **kwargs)
                break
            except TypeError:
                continue
    if err is None:
        err = ValueError(msg)
    for attr, val in (("needed", needed), ("smallest_budget", needed), ("budget", problem.gpu_budget)):
        try:
            setattr(err, attr, val)
        except AttributeError:
            pass
    raise err
