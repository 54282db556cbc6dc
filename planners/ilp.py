"""The ILP: memory.py's cost model as a mixed-integer program over the option space of model.py.

Variables
  x[g, o]  binary, group g takes option o (keep, or offload/recompute with a given need time)
  y[i]     binary, item i (a parameter, or one parameter's optimizer states) is homed on the CPU
  T[k]     seconds of window k (>= its compute, >= its host launch time, >= its transfers in
           each direction)
  M[j]     bytes the decisions add to memory over segment j of positions (a running sum, so
           every interval touches two rows instead of every position it covers)
  z[b, p]  binary, tied block instance b takes pattern p (blocks.py), when block classes are given
Constraints
  one option per group; base + M[j] <= cap on every segment; pinned bytes <= CPU budget;
  a recomputation at position c needs every group it reads present at c (need-time chains), and
  a group's need time is exactly the earliest demand (so the ILP and memory.evaluate agree);
  a recomputation may not read a CPU-homed weight outside the windows it is streamed in;
  a tied block instance takes one pattern, and its groups' options and items' homes are the pattern's.
Objective
  sum of T[k] (recompute time lands in the windows' compute, launches in their host time), plus
  memory.TIE_BREAK times the seconds of every transfer, recomputation and launch, so equal-time
  plans prefer moving less.

Each family of constraints is one function below (window times, host times, memory, pinned
bytes, need times), called in that order by ``formulate``.

The formulation is plain arrays (``Formulation``); solver.py hands it to HiGHS with the greedy
plan as a warm start; decode_solution.py turns a solution back into Decisions and a Plan.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .blocks import BlockClass, BlockInstance, Pattern, choices, instance_pattern
from .memory import TIE_BREAK, item_seconds, option_seconds
from .model import KEEP, OFFLOAD, RECOMPUTE, Problem

log = logging.getLogger(__name__)


@dataclass
class Formulation:
    names: list[str] = field(default_factory=list)
    lb: list[float] = field(default_factory=list)
    ub: list[float | None] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    obj: list[float] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float | None, float | None]] = field(default_factory=list)
    row_names: list[str] = field(default_factory=list)
    x: dict[tuple[int, int], int] = field(default_factory=dict)  # (group, option) -> column
    y: dict[int, int] = field(default_factory=dict)  # item -> column
    T: list[int] = field(default_factory=list)  # window -> column
    M: list[int] = field(default_factory=list)  # segment -> column
    # tied block instances: (instance, its patterns, a z column per pattern)
    ties: list[tuple[BlockInstance, list[Pattern], list[int]]] = field(default_factory=list)
    seg_start: list[int] = field(default_factory=list)  # first position of each segment
    seg_terms: list[dict[int, float]] = field(default_factory=list)  # segment -> change of M (scaled bytes)
    byte_unit: float = 1.0
    time_unit: float = 1e-3  # objective in milliseconds

    def col(self, name: str, lb: float = 0.0, ub: float | None = None, integer: bool = False, obj: float = 0.0) -> int:
        self.names.append(name)
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(integer)
        self.obj.append(obj)
        return len(self.names) - 1

    def row(self, name: str, coefs: dict[int, float], lo: float | None = None, hi: float | None = None) -> None:
        self.rows.append(({c: v for c, v in coefs.items() if v != 0}, lo, hi))
        self.row_names.append(name)

    @property
    def n_binaries(self) -> int:
        return sum(self.integer)

    def objective(self, values: list[float]) -> float:
        """The objective of a complete assignment (e.g. a warm start: the cutoff a solution must beat)."""
        return sum(c * v for c, v in zip(self.obj, values) if c)

    def copy(self) -> Formulation:
        """A program to add rows and columns to (tie_blocks) without changing this one: new lists
        and maps, the rows' coefficient maps shared (nothing changes a row once made)."""
        return dataclasses.replace(self, **{f.name: copy.copy(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), (list, dict))})


@dataclass
class WindowLoads:
    """Per window: column -> amount the decision adds (seconds of compute or host time, bytes)."""

    compute: list[dict[int, float]]
    host: list[dict[int, float]]
    h2d: list[dict[int, float]]
    d2h: list[dict[int, float]]


def _byte_unit(problem: Problem) -> float:
    """A power-of-two multiple of the alignment that keeps row values near 1e6 at most: every
    byte count is a multiple of the alignment, so half an alignment of slack absorbs the solver's
    tolerance without admitting a plan that overflows by a real byte."""
    a = max(1, problem.alignment)
    scale = max(problem.cap, int(problem.base.max()) if problem.n else 1, 1) / (a * 1e6)
    return float(a * 2 ** max(0, math.ceil(math.log2(scale)))) if scale > 1 else float(a)


def formulate(problem: Problem, blocks: list[tuple[BlockClass, list[Pattern]]] = ()) -> Formulation:
    """The program of the module docstring; blocks: block classes and the patterns their tied
    instances may take (blocks.py), none for the program over every group's options."""
    f = Formulation()
    f.byte_unit = _byte_unit(problem)
    _decision_columns(problem, f)
    loads = _window_loads(problem, f)
    _window_time_rows(problem, f, loads)
    _host_time_rows(problem, f, loads)
    _memory_rows(problem, f)
    _pinned_rows(problem, f)
    _need_time_rows(problem, f)
    log.info("ILP: %d columns (%d binary), %d rows, %d memory segments", len(f.names), f.n_binaries,
             len(f.rows), len(f.M))
    tie_blocks(problem, f, blocks)
    return f


def tie_blocks(problem: Problem, f: Formulation, blocks: list[tuple[BlockClass, list[Pattern]]]) -> None:
    """Add the block rows (and their z columns) to a program formulated without them: the tied
    program, the same as formulate(problem, blocks) gives."""
    for block, patterns in blocks:
        _block_rows(problem, f, block, patterns)
        log.info("ILP: %d instances of %r tied to %d patterns (%d columns, %d binary, %d rows in all)",
                 len(block.instances), block.path, len(patterns), len(f.names), f.n_binaries, len(f.rows))


def _decision_columns(problem: Problem, f: Formulation) -> None:
    """x (one option per group) and y (home per item), each priced in the objective at
    TIE_BREAK times the work it adds, hidden or not."""
    for gi, g in enumerate(problem.groups):
        for oi, opt in enumerate(g.options):
            f.x[gi, oi] = f.col(f"x_{gi}_{oi}", 0, 1, True, TIE_BREAK * option_seconds(problem, opt) / f.time_unit)
        f.row(f"one_{gi}", {f.x[gi, oi]: 1.0 for oi in range(len(g.options))}, 1.0, 1.0)
    for ii, item in enumerate(problem.items):
        f.y[ii] = f.col(f"y_{ii}", 0, 1, True, TIE_BREAK * item_seconds(problem, item) / f.time_unit)


def _window_loads(problem: Problem, f: Formulation) -> WindowLoads:
    def per_window() -> list[dict[int, float]]:
        return [defaultdict(float) for _ in range(problem.n_windows)]

    loads = WindowLoads(per_window(), per_window(), per_window(), per_window())
    for gi, g in enumerate(problem.groups):
        for oi, opt in enumerate(g.options):
            col = f.x[gi, oi]
            if opt.compute is not None:
                loads.compute[opt.compute[0]][col] += opt.compute[1]
            for k, t in opt.host:
                loads.host[k][col] += t
            if opt.h2d is not None:
                loads.h2d[opt.h2d[0]][col] += opt.h2d[1]
            if opt.d2h is not None:
                loads.d2h[opt.d2h[0]][col] += opt.d2h[1]
    for ii, item in enumerate(problem.items):
        for k, b in item.h2d.items():
            loads.h2d[k][f.y[ii]] += b
        for k, b in item.d2h.items():
            loads.d2h[k][f.y[ii]] += b
        for k, t in item.host.items():
            loads.host[k][f.y[ii]] += t
    return loads


def _time_row(f: Formulation, k: int, what: str, terms: dict[int, float], const: float, scale: float) -> None:
    """T[k] >= scale * (const + sum of terms), in the objective's time unit."""
    coefs = {c: -v * scale / f.time_unit for c, v in terms.items()}
    coefs[f.T[k]] = 1.0
    f.row(f"T_{k}_{what}", coefs, float(const) * scale / f.time_unit, None)


def _window_time_rows(problem: Problem, f: Formulation, loads: WindowLoads) -> None:
    """T[k] at least the window's compute, its transfers in each direction, and both together at
    the link's duplex rate."""
    for k in range(problem.n_windows):
        f.T.append(f.col(f"T_{k}", 0.0, None, False, 1.0))
        _time_row(f, k, "compute", loads.compute[k], problem.base_compute[k], 1.0)
        _time_row(f, k, "h2d", loads.h2d[k], problem.base_h2d[k], 1.0 / problem.bw_h2d)
        _time_row(f, k, "d2h", loads.d2h[k], problem.base_d2h[k], 1.0 / problem.bw_d2h)
        if math.isfinite(problem.bw_duplex):  # both directions at once share the link
            both = dict(loads.h2d[k])
            for c, v in loads.d2h[k].items():
                both[c] = both.get(c, 0.0) + v
            _time_row(f, k, "link", both, problem.base_h2d[k] + problem.base_d2h[k], 1.0 / problem.bw_duplex)


def _host_time_rows(problem: Problem, f: Formulation, loads: WindowLoads) -> None:
    """T[k] at least the host's time to launch the window's vertices (the step's own, plus the
    recomputations, offloads, reloads, fetches and write-backs the decisions add there). A window
    without launch costs gets no row: T[k] >= 0 already, and a zero host cost then leaves the
    program exactly as it was without this family."""
    for k in range(problem.n_windows):
        if problem.base_host[k] > 0 or loads.host[k]:
            _time_row(f, k, "host", loads.host[k], problem.base_host[k], 1.0)


def _memory_rows(problem: Problem, f: Formulation) -> None:
    """Running sum over segments between events, base + M[j] <= cap on every segment."""
    bu = f.byte_unit
    half = max(1, problem.alignment) / 2 / bu
    events: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))

    def interval(first: int, last: int, b: float, col: int) -> None:
        events[first][col] += b / bu
        if last + 1 < problem.n:
            events[last + 1][col] -= b / bu

    for gi, g in enumerate(problem.groups):
        for oi, opt in enumerate(g.options):
            for first, last, b in opt.intervals:
                interval(first, last, b, f.x[gi, oi])
            if opt.extra:
                interval(opt.at, opt.at, opt.extra, f.x[gi, oi])
    for ii, item in enumerate(problem.items):
        for first, last, b in item.delta:
            interval(first, last, b, f.y[ii])
    starts = sorted(set(events) | {0})
    bounds = starts[1:] + [problem.n]
    cap_rhs = (problem.cap // max(1, problem.alignment)) * max(1, problem.alignment) / bu + half
    prev = None
    for j, (s, e) in enumerate(zip(starts, bounds)):
        m = f.col(f"M_{j}", None, None)
        f.M.append(m)
        f.seg_start.append(s)
        delta = dict(events.get(s, {}))
        f.seg_terms.append(delta)
        coefs = {c: -v for c, v in delta.items()}
        coefs[m] = 1.0
        if prev is not None:
            coefs[prev] = -1.0
        f.row(f"flow_{j}", coefs, 0.0, 0.0)
        base_max = float(problem.base[s:e].max()) / bu
        f.row(f"mem_{j}", {m: 1.0}, None, cap_rhs - base_max)
        prev = m


def _pinned_rows(problem: Problem, f: Formulation) -> None:
    """Pinned CPU bytes (homes and offloaded values) within the CPU budget, when there is one."""
    if not math.isfinite(problem.cpu_cap):
        return
    bu = f.byte_unit
    half = max(1, problem.alignment) / 2 / bu
    coefs = {f.y[ii]: item.nbytes / bu for ii, item in enumerate(problem.items)}
    for gi, g in enumerate(problem.groups):
        for oi, opt in enumerate(g.options):
            if opt.kind == OFFLOAD:
                coefs[f.x[gi, oi]] = g.nbytes / bu
    f.row("cpu", coefs, None, problem.cpu_cap / bu + half)


def _need_time_rows(problem: Problem, f: Formulation) -> None:
    """Need-time chains: a recomputation finds what it reads present, and a group's need time is
    exactly its earliest demand."""
    groups, items = problem.groups, problem.items
    for hi, h in enumerate(groups):
        for oi, opt in enumerate(h.options):
            if opt.kind != RECOMPUTE:
                continue
            c = opt.at
            for gi in h.requires:  # every group it reads is present at c
                g = groups[gi]
                coefs = {f.x[hi, oi]: 1.0}
                for oj, gopt in enumerate(g.options):
                    if gopt.kind == KEEP or gopt.at <= c:
                        coefs[f.x[gi, oj]] = -1.0
                f.row(f"need_{hi}_{c}_{gi}", coefs, None, 0.0)
            absent = sorted({problem.item_of[w] for w in h.persistent if not items[problem.item_of[w]].covers(w, c)})
            for ii in absent:  # a CPU-homed weight must be streamed in there anyway
                f.row(f"home_{hi}_{c}_{ii}", {f.x[hi, oi]: 1.0, f.y[ii]: 1.0}, None, 1.0)
    for gi, g in enumerate(groups):  # need time == earliest demand, not earlier
        for oj, gopt in enumerate(g.options):
            if gopt.kind == KEEP or gopt.at >= g.n0:
                continue
            coefs = {f.x[gi, oj]: 1.0}
            for hi in problem.required_by[gi]:
                oi = groups[hi].option(RECOMPUTE, gopt.at)
                if oi is not None:
                    coefs[f.x[hi, oi]] = -1.0
            f.row(f"exact_{gi}_{oj}", coefs, None, 0.0)


def _block_rows(problem: Problem, f: Formulation, block: BlockClass, patterns: list[Pattern]) -> None:
    """Each tied instance takes one pattern: each option of its groups is taken exactly when the
    instance's pattern picks it, and an item is homed on the CPU as its pattern says. A pattern
    one instance cannot take (a group without the option it picks) is closed to it (its column
    bounded to 0), so every instance has the same columns."""
    for instance in block.instances:
        z = [f.col(f"z_{block.path}_{instance.index}_{k}", 0, 1, True) for k in range(len(patterns))]
        f.ties.append((instance, patterns, z))
        f.row(f"pattern_{block.path}_{instance.index}", {c: 1.0 for c in z}, 1.0, 1.0)
        offered = [choices(problem.groups[gi]) for gi in instance.groups]
        for k, (picks, _) in enumerate(patterns):
            if any(pick not in offered[j] for j, pick in enumerate(picks)):
                f.ub[z[k]] = 0
        for j, gi in enumerate(instance.groups):
            for choice, oi in offered[j].items():
                coefs = {f.x[gi, oi]: 1.0}
                coefs.update({z[k]: -1.0 for k, (picks, _) in enumerate(patterns) if picks[j] == choice})
                f.row(f"tie_{gi}_{oi}", coefs, 0.0, 0.0)
        for j, ii in enumerate(instance.items):
            coefs = {f.y[ii]: 1.0}
            coefs.update({z[k]: -1.0 for k, (_, homes) in enumerate(patterns) if homes[j]})
            f.row(f"tie_item_{ii}", coefs, 0.0, 0.0)


def start_values(problem: Problem, f: Formulation, options: list[int], cpu: list[bool],
                 window_time: np.ndarray) -> list[float]:
    """A complete assignment of every column for given option indices and homes (warm start)."""
    vals = [0.0] * len(f.names)
    for gi, oi in enumerate(options):
        vals[f.x[gi, oi]] = 1.0
    for ii, flag in enumerate(cpu):
        vals[f.y[ii]] = 1.0 if flag else 0.0
    for instance, patterns, z in f.ties:
        taken = instance_pattern(problem, instance, options, cpu)
        if taken in patterns:
            vals[z[patterns.index(taken)]] = 1.0
    for k, t in enumerate(f.T):
        vals[t] = float(window_time[k]) / f.time_unit
    running = 0.0
    for j, m in enumerate(f.M):
        running += sum(v * vals[c] for c, v in f.seg_terms[j].items())
        vals[m] = running
    return vals
