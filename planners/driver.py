"""plan(): costs -> Problem -> greedy (baseline, warm start, cutoff) -> ILP (with repeated blocks:
rounds of block probes and the program over whole-block patterns) -> the better plan -> Plan.

The ILP runs under a time limit scaled to its size (``ilp_time_limit``: SECONDS_PER_BINARY per
binary variable, at least TIME_LIMIT_FLOOR, at most TIME_LIMIT_CAP seconds) unless the caller
gives one; with repeated blocks (block_search.py) the limit covers all its rounds, which usually
end well before it. It starts from the greedy plan and prunes whatever cannot beat it (that
plan's objective is its cutoff), so it always has a plan in hand; when it stops without beating
greedy's, the greedy plan is returned.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..ir.budget import format_bytes
from ..ir.describe import format_task_vertex
from ..ir.errors import InfeasibleBudget
from ..ir.plan import Plan
from ..ir.sizes import aligned
from ..ir.taskgraph import TaskGraph
from . import ilp, solver
from .block_search import search_blocks
from .blocks import find_blocks
from .costs import CostModel, default_costs
from .decode_solution import from_solution, to_plan
from .greedy import SharedRanking, greedy
from .memory import Decisions, Evaluation, evaluate
from .model import Problem
from .problem import build_problem, with_headroom

log = logging.getLogger(__name__)

METHODS = ("auto", "ilp", "greedy")
_MODEL_OPTS = ("headroom", "alignment", "windows", "depth", "max_candidates", "max_chain", "max_items", "order",
               "reload_room", "replay_receives")
_SOLVER_OPTS = ("gap", "msg", "solver", "threads")
_ILP_OPTS = ("tie_blocks",)  # False: the ILP over every group's options, repeated blocks untied (blocks.py)

# The ILP's default time limit with op costs not measured (the CPU backend, analytic rates): this
# many seconds per binary variable, within [floor, cap]: the floor for the 30M-parameter GPT-2 of
# bench/compile_time.py (1,883 binaries at 50%), 0.86 s for a 32-layer GPT (3,435). On that GPT-2 at
# 60% and 50% the ILP's plan at 0.5 s is the one it finds in 1 s (23.009 and 25.625 ms predicted,
# greedy's 23.453 and 25.899), at 0.25 s slower (23.147, 25.746), and 1 s took its compile past
# 2 s. Past the limit (and a grace, solver.deadline) the best plan found is used: compile stays
# fast, and a longer search is one time_limit= away.
SECONDS_PER_BINARY = 2.5e-4
# With op costs measured on the GPU the plan is for real steps, run thousands of times, so the ILP
# gets longer, up to the cap. The cap was 60 s while the ILP chose every group's option alone (on
# the H100 export of gpt1.3b at 50%, 3,918 binaries, HiGHS needed about 29 s of one core to find
# the plan that simulates at 201 ms). With whole-block patterns in rounds (block_search.py) the
# search usually ends on its own in 2-7 s, but a 3 s cap cut a Llama's first round short on the
# H200 (its tied program stopped after 1.3 s: simulated 380 ms at 25% against 316 before), so the
# cap stays 10 s (bench/results/2026-11-29_h200_block-rounds.md).
SECONDS_PER_BINARY_MEASURED = 1.5e-2
TIME_LIMIT_FLOOR = 0.5
TIME_LIMIT_CAP = 10.0
# When the block search beats nothing (its probes and program stay at greedy's plan, a local
# optimum), the program over every group's options gets what is left of the limit, at most
# UNTIED_SHARE of it (2 s of the default 10 s cap), when at least UNTIED_AFTER_BLOCKS seconds are
# left: on the tests' 12-layer GPT at 10% the rounds ended in 0.3 s at greedy's plan, the untied
# program proved one 0.8% faster in 2.2 s (2-core CPU); on the H200, gpt1.3b at 25% (3,918
# binaries), it found nothing in 10 s, then in 4 s, while its compile took 20 and 11 s
# (bench/results/2026-11-29_h200_round-limit.md).
UNTIED_AFTER_BLOCKS = 0.5
UNTIED_SHARE = 0.2


def ilp_time_limit(n_binaries: int, measured: bool = False) -> float:
    """Seconds the ILP may run by default: SECONDS_PER_BINARY (SECONDS_PER_BINARY_MEASURED when the
    op costs were measured on the target GPU) per binary, between the floor and the cap."""
    rate = SECONDS_PER_BINARY_MEASURED if measured else SECONDS_PER_BINARY
    return min(TIME_LIMIT_CAP, max(TIME_LIMIT_FLOOR, rate * n_binaries))


def check_options(method: str, time_limit: float | None = None, **opts) -> None:
    """Refuse an unknown method, an unknown option or a time limit that is not a positive number
    of seconds, as planning would (memgraph.compile asks before it looks in the plan cache)."""
    if method not in METHODS:
        raise ValueError(f"unknown planner method {method!r} (choose from {', '.join(METHODS)})")
    unknown = set(opts) - set(_MODEL_OPTS) - set(_SOLVER_OPTS) - set(_ILP_OPTS)
    if unknown:
        raise TypeError(f"unknown planner options: {', '.join(sorted(unknown))}")
    number = isinstance(time_limit, (int, float)) and not isinstance(time_limit, bool)
    if time_limit is not None and not (number and time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be a positive number of seconds or None (scaled to the problem), "
                         f"not {time_limit!r}")


def make_problem(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, costs: CostModel | None = None,
                 **opts) -> Problem:
    costs = costs if costs is not None else default_costs(tg)
    if not tg.has_costs():  # compile annotates once, before planning
        costs.annotate(tg)
    model = {k: v for k, v in opts.items() if k in _MODEL_OPTS and v is not None}
    model.setdefault("alignment", 256 if tg.device == "cuda" else 64)
    # the host cost is the engine's that will run the graph, so the graph's device picks it
    return build_problem(tg, int(gpu_budget), cpu_budget, bw_h2d=costs.h2d_bandwidth, bw_d2h=costs.d2h_bandwidth,
                         bw_duplex=costs.duplex_bandwidth,
                         host_per_vertex=costs.host_per_vertex_on(tg.device), **model)


Describe = Callable[[str], None]  # told what the planner does now ("greedy", "ILP, up to 3.2 s")


def run_plan(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
             time_limit: float | None = None, costs: CostModel | None = None, describe: Describe | None = None,
             **opts) -> Plan:
    """The plan: greedy's, or the ILP's when it beats greedy's in time. time_limit: seconds the ILP
    may run; None scales it to the problem (ilp_time_limit)."""
    return _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, describe, **opts)[0]


def plan_and_start(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
                   time_limit: float | None = None, costs: CostModel | None = None, **opts) -> list[Plan]:
    """run_plan's plan, then, where that is the ILP's, the greedy plan it started from when it fits
    the model too (one problem: no second headroom, as plan_candidates makes)."""
    return _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, **opts)


def plan_candidates(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
                    time_limit: float | None = None, costs: CostModel | None = None,
                    describe: Describe | None = None, planned: Callable[[list[Plan]], None] | None = None,
                    **opts) -> list[Plan]:
    """Plans worth building and comparing (memgraph.compile simulates each built one): the plan
    run_plan returns, then the greedy plan the ILP started from when it fits the model too; and,
    for method "auto" without an explicit headroom, the same two planned against the whole budget
    (headroom 1.0). The default headroom keeps slack for fragmentation and prefetching, which costs
    transfers when the budget is only just below the peak; whether the builder fits a plan of the
    whole budget without evicting more is known only once built.

    planned: called on a planning thread with each problem's plans as soon as they are made, while
    the other problem may still be solving (memgraph.compile builds them there)."""
    if not (method == "auto" and "headroom" not in opts):
        return _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, describe, **opts)
    costs = costs if costs is not None else default_costs(tg)
    if not tg.has_costs():  # once, before the threads read the graph
        costs.annotate(tg)
    # Two problems, not the four of before (also 97% of the budget, and the whole with recompute chains
    # of one vertex): on the H100 exports of gpt350m, gpt1.3b and a Llama at 60/50/25/10% of eager's
    # peak, planned twice with blocks tied, the fastest simulated candidate of these two was at most
    # 2.9% (mean 0.6%) slower than the fastest of all four, and planning them takes half the threads
    # (bench/results/h100/replan_blocks/, python -m turnip.bench.replan plan --step ... --budgets ...)
    variants = [{}, {"headroom": 1.0}]
    check_options(method, time_limit, **opts)
    # one problem made, the other the same but for its cap; the greedy's ranked moves, which do not
    # depend on the cap, made once for both
    base = make_problem(tg, gpu_budget, cpu_budget, costs, **opts)
    problems = [base, with_headroom(base, 1.0)]
    ranked = SharedRanking(base)
    # The problems are planned side by side: HiGHS releases the GIL while it solves, so one problem's
    # greedy search and ILP run while another's ILP does (compile time drops by about one ILP time
    # limit per extra problem on a machine with two cores).
    def plans_of(problem: Problem, variant: dict) -> list[Plan]:
        plans = _candidates(tg, gpu_budget, cpu_budget, method, time_limit, costs, describe, problem=problem,
                            ranked=ranked, **opts, **variant)
        if planned is not None:
            planned(plans)
        return plans

    with ThreadPoolExecutor(max_workers=len(variants), thread_name_prefix="turnip-plan") as pool:
        futures = [pool.submit(plans_of, problem, variant) for problem, variant in zip(problems, variants)]
        return [plan for future in futures for plan in future.result()]


def _candidates(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, method: str = "auto",
                time_limit: float | None = None, costs: CostModel | None = None, describe: Describe | None = None,
                problem: Problem | None = None, ranked: SharedRanking | None = None, **opts) -> list[Plan]:
    """The plan run_plan returns first; when that is the ILP's and the greedy plan it started from
    fits the model too, that one second (same problem, same greedy run). problem: the problem of
    these options when already made; ranked: the greedy's ranked moves of it, shared (greedy.SharedRanking)."""
    check_options(method, time_limit, **opts)
    describe = describe or (lambda detail: None)
    started = time.perf_counter()
    costs = costs if costs is not None else default_costs(tg)
    problem = problem if problem is not None else make_problem(tg, gpu_budget, cpu_budget, costs, **opts)
    floor = smallest_budget(problem.tg, problem.alignment)
    if gpu_budget < floor:
        raise_infeasible(problem, floor)
    describe("greedy")
    g_dec, g_ev, g_stats = greedy(problem, ranked=ranked)
    stats = {"problem_seconds": time.perf_counter() - started, "greedy_seconds": g_stats["seconds"],
             "greedy_time": g_ev.time if g_ev.feasible else None, "method": method, "fits_model": g_ev.feasible,
             "smallest_budget": floor, "variant": {k: opts[k] for k in ("headroom", "max_chain") if k in opts}}
    keep_all = not any(k != "keep" for k in g_dec.groups) and not any(g_dec.cpu)
    if method == "greedy" or (g_ev.feasible and keep_all):
        # keeping everything on the GPU is optimal whenever it fits: nothing to solve
        stats["reason"] = "greedy requested" if method == "greedy" else "everything fits"
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]

    solver_opts = {k: v for k, v in opts.items() if k in _SOLVER_OPTS and v is not None}
    solver_opts.setdefault("gap", 5e-3)  # the cost model itself is not more accurate than this
    f = ilp.formulate(problem)
    limit, source = ((float(time_limit), "given") if time_limit is not None else
                     (ilp_time_limit(f.n_binaries, bool(getattr(costs, "measure", False))), "auto"))
    log.info("ILP time limit %.3g s (%s), %d binaries; %s", limit,
             f"scaled to the problem within {TIME_LIMIT_FLOOR:g}-{TIME_LIMIT_CAP:g} s"
             if source == "auto" else "given", f.n_binaries,
             f"to beat: the greedy plan's {g_ev.time * 1e3:.3f} ms" if g_ev.feasible else "no greedy plan fits")
    describe(f"ILP, up to {limit:.3g} s")
    # Repeated blocks: rounds of probes for whole-block plans and the program over them
    # (block_search.py) are the ILP; without blocks, or when the patterns found nothing better than
    # greedy's plan and time is left, the program over every group's options
    found = find_blocks(problem) if opts.get("tie_blocks", True) else []
    dec, ev, blocks, search, seconds = None, None, [], None, 0.0
    if found:
        search = search_blocks(problem, f, found, g_dec, g_ev, limit, **solver_opts)
        result, program, blocks, seconds = search.result, search.program, search.patterns, search.seconds
        stats["ilp_program"] = "blocks"
        if search.improved:
            dec, ev = search.decisions, search.evaluation
    if search is None or (dec is None and limit - seconds >= UNTIED_AFTER_BLOCKS):
        stats["ilp_program"] = "untied" if search is None else "blocks, then untied"
        program = f
        start = ilp.start_values(problem, f, g_ev.options, g_dec.cpu, g_ev.window_time) if g_ev.feasible else None
        # what the ILP must beat: its warm start, the greedy plan, as it prices it
        cutoff = f.objective(start) if start is not None else None
        left = limit - seconds if search is None else min(limit - seconds, UNTIED_SHARE * limit)
        result = solver.solve(f, start, time_limit=left, cutoff=cutoff, **solver_opts)
        seconds += result.seconds
        if result.values is not None:
            dec = from_solution(problem, f, result.values)
            ev = evaluate(problem, dec)
            if not ev.feasible:
                log.warning("ILP solution fails the exact check (%s)", ev.reason)
                stats["rejected"] = f"ilp solution rejected: {ev.reason}"
                dec, ev = None, None
    stats.update({"solver": result.solver, "status": result.status, "optimal": result.optimal,
                  "gap": result.gap, "objective_ms": result.objective, "bound_ms": result.bound,
                  "solve_seconds": seconds, "ilp_build_seconds": result.stats.get("build_seconds"),
                  "columns": len(program.names), "binaries": program.n_binaries, "rows": len(program.rows),
                  "tied_instances": len(program.ties), "block_patterns": sum(len(p) for _, p in blocks),
                  "block_rounds": search.rounds if search else 0, "time_limit": limit, "time_limit_source": source})
    if dec is None:
        why = ("no plan better than greedy's" if result.status == solver.DEADLINE_PASSED or result.values is not None
               else f"no solution ({result.status})")
        stats["fallback"] = stats.pop("rejected", None) or f"ilp found {why} in {seconds:.1f} s (limit {limit:.3g} s)"
        log.info("ILP: %s; using the greedy plan", stats["fallback"])
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]
    stats["fits_model"] = True
    if g_ev.feasible and (g_ev.objective < ev.objective or (g_ev.objective == ev.objective and not result.optimal)):
        # stopped without beating the greedy plan it started from (or, belt and braces, worse)
        stats["fallback"] = (f"ilp found no plan better than greedy's in {seconds:.1f} s "
                             f"(limit {limit:.3g} s, {result.status})")
        log.info("ILP found no plan better than greedy's in %.1f s (limit %.3g s, %s); using the greedy plan",
                 seconds, limit, result.status)
        return [_finish(problem, g_dec, g_ev, "greedy", stats)]
    stats["improvement_over_greedy"] = (g_ev.time / ev.time - 1.0) if g_ev.feasible and ev.time > 0 else None
    log.info("ILP plan: predicted %.3f ms per step%s, %s in %.1f s (limit %.3g s)", ev.time * 1e3,
             f" against greedy's {g_ev.time * 1e3:.3f} ms" if g_ev.feasible else "", result.status,
             seconds, limit)
    best = _finish(problem, dec, ev, "ilp", stats)
    return [best, _finish(problem, g_dec, g_ev, "greedy", dict(stats))] if g_ev.feasible else [best]


def outcome(stats: dict) -> str:
    """What the planner did, in words, from a Plan's stats: which plan won and why, and the ILP's
    time limit (for logs and the compile report); "" for a plan no planner of this module made."""
    if "reason" in stats:
        return f"greedy plan ({stats['reason']})"
    limit = stats.get("time_limit")
    if limit is None:
        return ""
    scaled = f"scaled to {stats.get('binaries')} binaries" if stats.get("time_limit_source") == "auto" else "given"
    how = f"ILP time limit {limit:.3g} s ({scaled})"
    if "fallback" in stats:
        return f"greedy plan: {stats['fallback']}; {how}"
    gain = stats.get("improvement_over_greedy")
    faster = f", {gain:.0%} faster than greedy's" if gain else ""
    status = stats.get("status")
    if stats.get("ilp_program") == "blocks":  # optimal, where it is, among the whole-block patterns offered
        status = f"{status} over {stats.get('block_patterns')} block patterns, {stats['block_rounds']} rounds"
    return f"ILP plan{faster}: {status} in {stats.get('solve_seconds') or 0.0:.1f} s; {how}"


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


def smallest_budget(tg: TaskGraph, alignment: int) -> int:
    """The smallest GPU budget any plan can run in: every weight homed on the CPU, the largest
    single step's inputs and outputs in the arena, plus the largest workspace (BuildMemGraph
    builds every budget from there up when pinned storage is unbounded). An in-place update's
    new version takes its old version's bytes, so it is counted once."""
    return floor_vertex(tg, alignment)[0]


def floor_vertex(tg: TaskGraph, alignment: int) -> tuple[int, int, int]:
    """(smallest_budget, the vertex whose inputs and outputs set it, their bytes): the vertex is -1
    when a value bound at the end of the step (an updated weight or state) is larger than any
    vertex's inputs and outputs."""
    def size(v: int) -> int:
        return aligned(tg.values[v].nbytes, alignment)

    need, vertex = 0, -1
    for index, v in enumerate(tg.vertices):
        in_place = {new for old, new in v.copy_in if size(old) == size(new)}
        outputs = sum(size(o) for o in v.outputs if o >= 0 and o not in in_place)
        here = outputs + sum(size(x) for x in v.inputs())
        if here > need:
            need, vertex = here, index
    for dst in tg.bindings.values():
        if size(dst) > need:
            need, vertex = size(dst), -1
    return need + tg.step_workspace(), vertex, need


def raise_infeasible(problem: Problem, needed: int) -> None:
    floor, vertex, io_bytes = floor_vertex(problem.tg, problem.alignment)
    if floor != needed:  # a floor computed otherwise: no vertex to blame
        vertex = -1
    if vertex >= 0:
        setter = (f"; the floor is set by {format_task_vertex(problem.tg, vertex)}, whose inputs and outputs "
                  f"take {format_bytes(io_bytes)} at once")
    elif floor == needed:
        setter = f"; the floor is set by one value of the step's state ({format_bytes(io_bytes)})"
    else:
        setter = ""
    msg = (f"GPU budget {format_bytes(problem.gpu_budget)} ({problem.gpu_budget} bytes) is too small for this "
           f"step: the smallest budget that could work is {format_bytes(needed)} ({needed} bytes), the largest "
           f"single op's inputs and outputs plus {format_bytes(problem.max_workspace)} of op workspace, with every "
           f"weight and optimizer state streamed from the CPU{setter}")
    raise InfeasibleBudget(msg, minimum=needed, vertex=vertex)
