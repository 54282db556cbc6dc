"""The ILP over repeated blocks (blocks.py): which whole-block plans (patterns) to offer, found by
probing, then the tied program over them, in rounds.

A *probe* frees one instance (its groups' options and its items' homes) with every other column
fixed to the best plan so far, and solves that small program to within PROBE_GAP (a few hundred
binaries after presolve, 0.1-1 s); its answer is that instance's best pattern given the rest, and a better
plan when it beats the one it started from. Probes run at instances spread over the chain (the
middle, then the quarters, ...), one after another, each from the last one's plan.

A *round* probes PROBES instances of each class, then solves the tied program (the untied program
with the block rows, ilp.tie_blocks): every tied instance takes one of the patterns found so far,
the rest of the step (the layers left untied, embedding, head, optimizer items) is free. A pattern
fixes every option of its instance, need time included, so that program is small and HiGHS solves
it to its gap in seconds. Its plan starts the next round. The rounds stop when a round's probes
offer no pattern the last tied program lacked, when the tied program does not beat the plan it
started from by ROUND_GAIN, when it ran ROUND_SHARE of the time limit without proving its gap, once
the search has taken LATER_ROUNDS_WITHIN of the limit, or at the time limit.

On the H100 export of gpt1.3b at 50% (2-core CPU, beside the other problem's search): the greedy
plan is priced at 278.9 ms, the first round's plan at 251.5 (6.4 s), where the program tied by kind
alone (need times free, the probes' patterns) held 252.1 after 10 s and after 30 s. On the H200 host
the tied programs of gpt1.3b and a Llama took 0.2-4.4 s, once 9.1 s
(bench/results/2026-11-29_h200_block-rounds.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from . import ilp, solver
from .blocks import BlockClass, Pattern, block_patterns, instance_pattern
from .decode_solution import from_solution
from .memory import Decisions, Evaluation, evaluate
from .model import Problem

log = logging.getLogger(__name__)

PROBES = 3  # instances probed per block class and round
# A probe stops within this relative gap of the whole step's objective. One instance is a small
# share of the step, so the program's gap (5e-3) would leave its choice loose; 1e-4 cost a Llama
# (22 layers) about 2 s a probe on the 2-core CPU, where HiGHS reaches 1e-3 in about 1 s or less.
PROBE_GAP = 1e-3
# the share of the time left that a round's probes may take; the tied program gets the rest
PROBE_SHARE = 0.5
# a round whose tied program improves the best plan by less than this (relative) is the last:
# on the H200 export of a Llama at 25% a second round took 4.3 s to gain 0.07%
ROUND_GAIN = 1e-3
# A round after the first starts only while the search has taken less than this share of its
# time (2.5 s of the default 10 s cap): later rounds are worth it where they are cheap. On the H200,
# gpt1.3b at 10%, a second round of 0.5 s gained 2.2% by the model (842.1 -> 823.3 ms); at 50% one
# after a first round of 3.6 s gained 0.44% in 4.6 s more, and took the warm compile from 9.4 to
# 12.4 s (bench/results/2026-11-29_h200_later-rounds.md).
LATER_ROUNDS_WITHIN = 0.25
# a round's tied program may run this share of the search's time (4 s of the default 10 s cap; a
# longer time_limit lets it run longer); one that reaches it without proving its gap is the last
# round: a round with more patterns would not prove it sooner. On the H200 exports of gpt1.3b and a
# Llama at 50/25/10%, the simulator's picks stay the same and planning takes up to 2.8 s less than
# with the whole limit per round; the 65B-shaped LoRA step plans the same plans in 21 s instead of
# 27 (bench/results/2026-11-29_h200_round-limit.md). A 3 s cap cut a Llama's first round short.
ROUND_SHARE = 0.4


@dataclass
class Search:
    patterns: list[tuple[BlockClass, list[Pattern]]]  # per block class, the patterns the last program offered
    decisions: Decisions  # the best plan met (the start's, a probe's or a tied program's)
    evaluation: Evaluation
    seconds: float
    improved: bool  # something beat the start
    rounds: int
    result: solver.SolveResult  # the last tied program's answer (every search solves one at least)
    program: ilp.Formulation  # the last tied program


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


def search_blocks(problem: Problem, untied: ilp.Formulation, blocks: list[BlockClass], decisions: Decisions,
                  evaluation: Evaluation, seconds: float, probes: int = PROBES, **solver_opts) -> Search:
    """Rounds of probes and the tied program (module docstring) from a plan, within about `seconds`
    in all (every class gets one probe and the program one solve, however little time is left;
    from a plan that does not fit, the first round solves the tied program without probes, from
    no start). untied: the problem's program without block rows (ilp.formulate(problem)), which the
    probes solve with all but one instance fixed; it is left as it was."""
    started = time.perf_counter()
    deadline = started + seconds
    round_limit = ROUND_SHARE * seconds
    best, best_ev, improved = decisions, evaluation, False
    found = [set(block_patterns(problem, block, [(decisions, evaluation)])) for block in blocks]
    offered: list[tuple[BlockClass, list[Pattern]]] | None = None
    rounds = 0
    while True:
        rounds += 1
        probes_started = time.perf_counter()
        if best_ev.feasible:  # (from a plan that does not fit, every probe would be infeasible)
            until = probes_started + PROBE_SHARE * (deadline - probes_started)
            best, best_ev, probed = _probe_round(problem, untied, blocks, found, best, best_ev, until, probes,
                                                 solver_opts)
            improved |= probed
        probe_seconds = time.perf_counter() - probes_started
        now = [(block, sorted(patterns)) for block, patterns in zip(blocks, found)]
        if offered is not None and (now == offered or time.perf_counter() >= deadline):
            break  # the same program again, or no time for it
        offered = now
        program = untied.copy()  # the untied program's rows, made once, and the block rows
        ilp.tie_blocks(problem, program, offered)
        start = ilp.start_values(problem, program, best_ev.options, best.cpu, best_ev.window_time) \
            if best_ev.feasible else None
        cutoff = program.objective(start) if start is not None else None
        left = deadline - time.perf_counter()
        result = solver.solve(program, start, time_limit=max(min(left, round_limit), 0.1), cutoff=cutoff,
                              **solver_opts)
        capped = not result.optimal and left > round_limit
        tied_better = False
        if result.values is not None:
            dec = from_solution(problem, program, result.values)
            ev = evaluate(problem, dec)
            if not ev.feasible:
                log.warning("tied program's solution fails the exact check (%s)", ev.reason)
            elif not best_ev.feasible or ev.objective < best_ev.objective:
                tied_better = not best_ev.feasible or ev.objective < best_ev.objective * (1 - ROUND_GAIN)
                best, best_ev, improved = dec, ev, True
        log.info("block search round %d: probes %.1f s, %s; the tied program %s in %.1f s, best plan %.3f ms "
                 "(%.1f s in all)", rounds, probe_seconds, ", ".join(f"{len(p)} patterns of {b.path!r}" for b, p in offered),
                 result.status, result.seconds, best_ev.time * 1e3, time.perf_counter() - started)
        late = time.perf_counter() - started >= LATER_ROUNDS_WITHIN * seconds
        if not tied_better or capped or late or time.perf_counter() >= deadline:
            break
    return Search(offered, best, best_ev, time.perf_counter() - started, improved, rounds, result, program)


def _probe_round(problem: Problem, untied: ilp.Formulation, blocks: list[BlockClass], found: list[set[Pattern]],
                 best: Decisions, best_ev: Evaluation, deadline: float, probes: int, solver_opts: dict
                 ) -> tuple[Decisions, Evaluation, bool]:
    """Probe `probes` instances of each class from the best plan, adding each answer's pattern to
    the class's; the best plan met, and whether a probe beat the one it started from."""
    improved = False
    count = sum(min(probes, len(block.instances)) for block in blocks)
    probe_opts = {k: v for k, v in solver_opts.items() if k != "gap"}
    for block, patterns in zip(blocks, found):
        for k, index in enumerate(spread(len(block.instances))[:probes]):
            left = deadline - time.perf_counter()
            if left <= 0 and k > 0:  # every class gets one probe, however little time is left
                break
            instance = block.instances[index]
            values = _solve_one_free(problem, untied, best, best_ev, instance.groups, instance.items,
                                     max(left, 0.0) / max(1, count), probe_opts)
            count -= 1
            if values is None:
                continue
            dec = from_solution(problem, untied, values)
            ev = evaluate(problem, dec)
            pattern = instance_pattern(problem, instance, ev.options, dec.cpu)
            if pattern is not None:
                patterns.add(pattern)
            if ev.feasible and ev.objective < best_ev.objective:
                best, best_ev, improved = dec, ev, True
    return best, best_ev, improved


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
        result = solver.solve(f, start, time_limit=max(seconds, 0.1), cutoff=f.objective(start),
                              **{**solver_opts, "gap": PROBE_GAP})
    finally:
        f.lb[:], f.ub[:] = lb, ub
    return result.values
