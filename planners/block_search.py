"""Patterns worth offering a repeated block's instances (blocks.py), found by probing a few of them.

The greedy plan's patterns alone are often too few: at 10% of eager's peak on the H100 export of
gpt1.3b every layer of the greedy plan streams all its weights, while the best plan the untied ILP
found in a minute keeps the layer norms' on the GPU and recomputes the first op of each layer. A
*probe* frees one instance (its groups' options and its items' homes) with every other column fixed
to the best plan so far, and solves that small program to optimality (a few dozen binaries, under a
second); its answer is that instance's best pattern given the rest, and a better plan when it beats
the one it started from. Probes run at instances spread over the chain (the middle, then the
quarters, ...), one after another, each from the last one's plan. On that export (headroom 1.0) the
tied ILP over the greedy plan's patterns found a plan the planner prices at 833.4 ms; with three
probes' patterns, 803.3 (the untied ILP's optimum is 789.6, reached in 60 s).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from . import ilp, solver
from .blocks import BlockClass, Pattern, block_patterns
from .decode_solution import from_solution
from .memory import Decisions, Evaluation, evaluate
from .model import Problem

log = logging.getLogger(__name__)

PROBES = 3  # instances probed per block class


@dataclass
class Search:
    patterns: list[tuple[BlockClass, list[Pattern]]]  # per block class, the patterns to offer
    decisions: Decisions  # the best plan met (the start's, or a probe's)
    evaluation: Evaluation
    seconds: float
    improved: bool  # a probe beat the start


def spread(count: int) -> list[int]:
    """0..count-1 in the order that keeps probes far apart: the middle, the quarters, the eighths..."""
    order, seen, parts = [], set(), 2
    while len(order) < count:
        for odd in range(1, parts, 2):
            index = min(count - 1, odd * count // parts)
            if index not in seen:
                seen.add(index)
                order.append(index)
        if parts > 2 * count:
            order.extend(i for i in range(count) if i not in seen)
            break
        parts *= 2
    return order


def probe_patterns(problem: Problem, untied: ilp.Formulation, blocks: list[BlockClass], decisions: Decisions,
                   evaluation: Evaluation, seconds: float, probes: int = PROBES, **solver_opts) -> Search:
    """Each block class's patterns (the start's, keeping the block, and every probe's answer), and
    the best plan met, within about `seconds` in all (but at least one probe per class). untied:
    the problem's program without block rows (formulate(problem)), which the probes solve with all
    but one instance fixed; it is left as it was. No probe runs from decisions that do not fit."""
    started = time.perf_counter()
    best, best_ev, improved = decisions, evaluation, False
    found = [set(block_patterns(block, [decisions])) for block in blocks]
    count = sum(min(probes, len(block.instances)) for block in blocks)
    for block, patterns in zip(blocks, found):
        if not evaluation.feasible:
            break
        for k, index in enumerate(spread(len(block.instances))[:probes]):
            left = seconds - (time.perf_counter() - started)
            if left <= 0 and k > 0:  # every class gets one probe, however little time is left
                break
            instance = block.instances[index]
            values = _solve_one_free(problem, untied, best, best_ev, instance.groups, instance.items,
                                     max(left, 0.0) / max(1, count), solver_opts)
            count -= 1
            if values is None:
                continue
            dec = from_solution(problem, untied, values)
            ev = evaluate(problem, dec)
            patterns.add(block.pattern(instance, dec))
            if ev.feasible and ev.objective < best_ev.objective:
                best, best_ev, improved = dec, ev, True
    spent = time.perf_counter() - started
    log.info("block probes: %s in %.1f s%s", ", ".join(f"{len(p)} patterns of {b.path!r}" for b, p in zip(blocks, found)),
             spent, f", a plan predicted at {best_ev.time * 1e3:.3f} ms" if improved else "")
    return Search([(block, sorted(patterns)) for block, patterns in zip(blocks, found)], best, best_ev, spent,
                  improved)


def _solve_one_free(problem: Problem, f: ilp.Formulation, dec: Decisions, ev: Evaluation, groups, items,
                    seconds: float, solver_opts: dict) -> list[float] | None:
    """The untied program with every decision column outside the given groups and items fixed to
    the plan's value; the values of its solution, None when it found nothing in time."""
    start = ilp.start_values(problem, f, ev.options, dec.cpu, ev.window_time)
    free = {f.x[gi, oi] for gi in groups for oi in range(len(problem.groups[gi].options))}
    free.update(f.y[ii] for ii in items)
    fixed = [c for c in [*f.x.values(), *f.y.values()] if c not in free]
    lb, ub = list(f.lb), list(f.ub)
    try:
        for c in fixed:
            f.lb[c] = f.ub[c] = start[c]
        cutoff = sum(c * v for c, v in zip(f.obj, start) if c)
        result = solver.solve(f, start, time_limit=max(seconds, 0.1), cutoff=cutoff,
                              **{**solver_opts, "gap": 1e-4})
    finally:
        f.lb[:], f.ub[:] = lb, ub
    return result.values
