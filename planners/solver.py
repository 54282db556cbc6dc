"""Hand a Formulation to a MILP solver and read the answer back: HiGHS through highspy, the model
passed as arrays (columns, rows in compressed form, integrality), warm-started from a complete
assignment; or, asked by name, CBC through PuLP (PuLP 3.x and 4.x), given the warm start only.
A cutoff (the objective a solution must beat, the greedy plan's) goes to HiGHS as its objective
bound, so the search prunes every node that cannot beat it.

HiGHS checks its time limit between steps of its search, and one round of root cuts can run 10 s
past it. So it runs on a thread of its own, and the caller waits at most the limit plus a grace
(``deadline``): past that, solve returns no solution with status DEADLINE_PASSED (the caller
keeps the plan it started from) and leaves HiGHS to stop at its next check. Such threads are
joined when the interpreter exits, before HiGHS's libraries are torn down.
"""

from __future__ import annotations

import atexit
import ctypes
import inspect
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import highspy
import numpy as np
import pulp

from .ilp import Formulation

log = logging.getLogger(__name__)

CUTOFF_SLACK = 1e-9  # relative: a solution priced at the cutoff (the warm start) is not pruned
# HiGHS options of every solve. Probing (presolve rule 2^15) spends seconds on these programs (the
# memory rows chain every segment to the next): without it HiGHS solved a 12-layer GPT at 25% to
# optimality in 2.3 s instead of 7.3 s, a 32-layer one in 2.8 s instead of 5.2 s, the tests' deep
# GPT in 9.5-14.5 s instead of 14-17 s (2-core CPU); the 30M GPT-2 at 50% took 39 s instead of 18 s.
HIGHS_OPTIONS = {"presolve_rule_off": 1 << 15}
GRACE_SECONDS, GRACE_FRACTION = 0.25, 0.1  # past the time limit, how long to wait for HiGHS to stop
DEADLINE_PASSED = "Deadline passed"
_ABANDONED: list[threading.Thread] = []  # HiGHS runs still stopping after their caller moved on


def deadline(time_limit: float) -> float:
    """Seconds to wait for HiGHS given its time limit: the limit plus a grace for its next check."""
    return time_limit * (1.0 + GRACE_FRACTION) + GRACE_SECONDS


class _Overran(Exception):
    """HiGHS has not returned by the deadline; its thread goes on until its next limit check."""


def _run_by(model, seconds: float) -> None:
    """model.run() on a thread of its own (highspy releases the GIL while it solves), waiting at
    most `seconds`; raise _Overran past them."""
    done = threading.Event()

    def run() -> None:
        try:
            model.run()
        finally:
            done.set()

    thread = threading.Thread(target=run, name="turnip-highs", daemon=True)
    thread.start()
    if not done.wait(seconds):
        _ABANDONED.append(thread)
        raise _Overran(seconds)


@atexit.register
def join_abandoned(timeout: float = 120.0) -> None:
    """Wait for overrun HiGHS runs to stop (their time limits have passed): at exit, before HiGHS's
    libraries are torn down, and in benchmarks, before the next measurement."""
    for thread in _ABANDONED:
        thread.join(timeout)
    _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]


@dataclass
class SolveResult:
    values: list[float] | None  # None: no solution found
    status: str  # solver's words: "Optimal", "Time limit reached", "Infeasible", ...
    optimal: bool
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None  # relative
    seconds: float = 0.0
    solver: str = ""
    stats: dict = field(default_factory=dict)


def _expr(pairs: list[tuple[pulp.LpVariable, float]]):
    if hasattr(pulp.LpAffineExpression, "from_list"):  # PuLP 4
        return pulp.LpAffineExpression.from_list(pairs)
    return pulp.LpAffineExpression(pairs)


def _variable(prob: pulp.LpProblem, name: str, lb, ub, integer: bool) -> pulp.LpVariable:
    cat = pulp.LpInteger if integer else pulp.LpContinuous
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lb, ub, cat=cat)
    return pulp.LpVariable(name, lb, ub, cat)


_BANNER_LOCK = threading.Lock()
_banner_shown = False  # HiGHS's banner has been printed (or swallowed) in this process


def _swallow_banner() -> None:
    """Make this process's first HiGHS object with its standard output (file descriptor 1) pointed
    at /dev/null. HiGHS prints "Running HiGHS <version> ... Copyright ..." to the process's stdout
    from C++ when the first Highs object is made, before any option (output_flag) can be set, and
    never again; so the planner prints nothing, whatever msg says of the solve itself. Python's
    buffered stdout is flushed first and C's after, so no earlier output is lost or misplaced (what
    another thread writes to descriptor 1 in the instant it takes goes to /dev/null too)."""
    global _banner_shown
    with _BANNER_LOCK:
        if _banner_shown:
            return
        _banner_shown = True
        try:
            sys.stdout.flush()
        except (AttributeError, ValueError, OSError):  # no stdout, or closed
            pass
        libc = _libc()
        try:
            saved = os.dup(1)
        except OSError:  # no descriptor 1: nothing to print to
            highspy.Highs()
            return
        try:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 1)
                try:
                    highspy.Highs()
                finally:
                    if libc is not None:
                        libc.fflush(None)  # C's stdout buffer, while it still goes to /dev/null
                    os.dup2(saved, 1)
        finally:
            os.close(saved)


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:  # Windows: no process-wide C library handle
        return None


def _cbc(time_limit: float, gap: float, warm: bool, msg: bool):
    for name in ("COIN_CMD", "PULP_CBC_CMD"):
        cls = getattr(pulp, name, None)
        if cls is None:
            continue
        try:
            solver = cls(msg=msg, timeLimit=time_limit, gapRel=gap, warmStart=warm)
        except TypeError:
            continue
        if solver.available():
            return solver
    return None


def solve(f: Formulation, start: list[float] | None = None, time_limit: float = 30.0, gap: float = 1e-4,
          msg: bool = False, solver: str = "auto", threads: int | None = None,
          cutoff: float | None = None) -> SolveResult:
    """Solve f within time_limit seconds, from the warm start when given, stopping at the relative
    gap; with HiGHS (solver "auto" or "highs"), no answer (DEADLINE_PASSED) when it has not stopped
    by deadline(time_limit). cutoff: an objective value (in f's unit) no solution of interest
    reaches, e.g. the warm start's own; HiGHS keeps a solution of exactly the cutoff (slack of
    CUTOFF_SLACK), so a warm start priced at it stays the incumbent. Solver "cbc": CBC through
    PuLP, with the warm start only."""
    if solver in ("auto", "highs"):
        return _solve_highs(f, start, time_limit, gap, msg, threads, cutoff)
    if solver != "cbc":
        raise ValueError(f"unknown MILP solver {solver!r} (choose from auto, highs, cbc)")
    return _solve_cbc(f, start, time_limit, gap, msg)


def _highs_model(f: Formulation, msg: bool) -> highspy.Highs:
    """A Highs object holding f: columns and rows passed as arrays (rows in compressed form), the
    integer columns marked. Made in one pass over f, without a modelling layer between: PuLP's
    model took 0.3-0.4 s of the GIL per solve on gpt1.3b and about 1.5 s on a 7B LoRA step."""
    if not msg:
        _swallow_banner()
    model = highspy.Highs()
    model.setOptionValue("output_flag", bool(msg))
    inf = highspy.kHighsInf
    n = len(f.names)
    lower = np.array([-inf if lb is None else lb for lb in f.lb], dtype=np.float64)
    upper = np.array([inf if ub is None else ub for ub in f.ub], dtype=np.float64)
    none = np.zeros(0, dtype=np.int32)
    model.addCols(n, np.asarray(f.obj, dtype=np.float64), lower, upper, 0, none, none, np.zeros(0))
    starts = np.zeros(len(f.rows), dtype=np.int32)
    index, value, row_lo, row_hi = [], [], [], []
    for r, (coefs, lo, hi) in enumerate(f.rows):
        starts[r] = len(index)
        index.extend(coefs)
        value.extend(coefs.values())
        row_lo.append(-inf if lo is None else lo)
        row_hi.append(inf if hi is None else hi)
    model.addRows(len(f.rows), np.asarray(row_lo, dtype=np.float64), np.asarray(row_hi, dtype=np.float64),
                  len(index), starts, np.asarray(index, dtype=np.int32), np.asarray(value, dtype=np.float64))
    integers = np.flatnonzero(np.asarray(f.integer, dtype=bool)).astype(np.int32)
    if len(integers):
        model.changeColsIntegrality(len(integers), integers,
                                    np.full(len(integers), int(highspy.HighsVarType.kInteger), dtype=np.uint8))
    return model


def _solve_highs(f: Formulation, start: list[float] | None, time_limit: float, gap: float, msg: bool,
                 threads: int | None, cutoff: float | None) -> SolveResult:
    built = time.perf_counter()
    model = _highs_model(f, msg)
    model.setOptionValue("mip_rel_gap", float(gap))
    model.setOptionValue("time_limit", float(time_limit))
    if threads:
        model.setOptionValue("threads", int(threads))
    for option, value in HIGHS_OPTIONS.items():
        model.setOptionValue(option, value)  # an older HiGHS without the option says so and goes on
    if cutoff is not None:  # HiGHS's MIP solver starts with this as its upper limit
        model.setOptionValue("objective_bound", float(cutoff + CUTOFF_SLACK * max(1.0, abs(cutoff))))
    if start is not None:
        model.setSolution(len(start), np.arange(len(start), dtype=np.int32), np.asarray(start, dtype=np.float64))
    build_seconds = time.perf_counter() - built
    name = "HiGHS (highspy)"
    started = time.perf_counter()
    try:
        _run_by(model, deadline(time_limit))
    except _Overran as exc:
        seconds = time.perf_counter() - started
        log.info("%s: no answer %.1f s after the start (time limit %.3g s); leaving it to stop by itself",
                 name, exc.args[0], time_limit)
        return SolveResult(values=None, status=DEADLINE_PASSED, optimal=False, seconds=seconds, solver=name,
                           stats={"build_seconds": build_seconds})
    seconds = time.perf_counter() - started
    status = model.getModelStatus()
    words = model.modelStatusToString(status)
    info = model.getInfo()
    # a MIP solution is there whatever the status (time limit, gap reached, optimal)
    found = int(info.primal_solution_status) == int(highspy.SolutionStatus.kSolutionStatusFeasible)
    optimal = status == highspy.HighsModelStatus.kOptimal
    result = SolveResult(values=[float(v) for v in model.getSolution().col_value] if found else None,
                         status=words, optimal=optimal, seconds=seconds, solver=name,
                         stats={"build_seconds": build_seconds})
    if found:
        result.objective = float(info.objective_function_value)
        result.bound = float(info.mip_dual_bound)
        result.gap = float(info.mip_gap)
        result.stats["nodes"] = int(info.mip_node_count)
    log.info("%s: %s in %.2fs (objective %s, gap %s)", name, words, seconds, result.objective, result.gap)
    return result


def _solve_cbc(f: Formulation, start: list[float] | None, time_limit: float, gap: float, msg: bool) -> SolveResult:
    built = time.perf_counter()
    prob = pulp.LpProblem("turnip_plan", pulp.LpMinimize)
    cols = [_variable(prob, name, lb, ub, integer)
            for name, lb, ub, integer in zip(f.names, f.lb, f.ub, f.integer)]
    prob.setObjective(_expr([(cols[j], c) for j, c in enumerate(f.obj) if c]))
    for name, (coefs, lo, hi) in zip(f.row_names, f.rows):
        expr = _expr([(cols[j], v) for j, v in coefs.items()])
        if lo is not None and hi is not None and lo == hi:
            prob += (expr == lo, name)
            continue
        if lo is not None:
            prob += (expr >= lo, name)
        if hi is not None:
            prob += (expr <= hi, name if lo is None else name + "_hi")
    if start is not None:
        for var, val in zip(cols, start):
            var.setInitialValue(val, check=False) if _takes_check() else var.setInitialValue(val)
    build_seconds = time.perf_counter() - built
    engine = _cbc(time_limit, gap, start is not None, msg)
    if engine is None:
        raise RuntimeError("CBC is not available (PuLP installs it as PULP_CBC_CMD); use solver='highs'")
    started = time.perf_counter()
    returned = prob.solve(engine)
    seconds = time.perf_counter() - started
    found, optimal, words = _outcome(prob, returned)
    has_solution = found and all(v.varValue is not None for v in cols)
    result = SolveResult(values=[float(v.varValue) for v in cols] if has_solution else None, status=words,
                         optimal=optimal, seconds=seconds, solver="CBC", stats={"build_seconds": build_seconds})
    if has_solution:
        result.objective = float(pulp.value(prob.objective))
        result.gap = 0.0 if result.optimal else None
    log.info("CBC: %s in %.2fs (objective %s, gap %s)", words, seconds, result.objective, result.gap)
    return result


def _takes_check() -> bool:
    try:
        return "check" in inspect.signature(pulp.LpVariable.setInitialValue).parameters
    except (TypeError, ValueError):
        return False


def _outcome(prob, returned) -> tuple[bool, bool, str]:
    """(a solution came back, it is optimal, the status in words) across PuLP versions: up to 4.1
    the problem carries sol_status; from 4.2 solve() returns an LpSolveStats."""
    sol_status = getattr(prob, "sol_status", None)
    if sol_status is not None:
        words = pulp.LpStatus.get(prob.status, str(prob.status))
        return (sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible),
                sol_status == pulp.LpSolutionOptimal, words)
    status = getattr(returned, "status", None)
    name = getattr(status, "name", str(status))
    # GapLimit: HiGHS stopped at the requested MIP gap, which is what "optimal" means here
    return bool(getattr(returned, "has_solution", False)), name in ("Optimal", "GapLimit"), name
