"""Greedy planner: the fast baseline and the ILP's warm start.

Moves, in the order a practitioner would try them: recompute values that are cheaper to
recompute than to move (elementwise ops, norms), offload the saved values that occupy the most
memory for the longest (large and early), stream optimizer states, stream weights last, and as
a last resort recompute what was offloaded. The shortest prefix of that list that fits is found
by bisection, then moves that turn out unnecessary are undone, costliest first.
"""

from __future__ import annotations

import logging
import time

from turnip.planners.memory import Decisions, Evaluation, evaluate, need_times, structural_problems
from turnip.planners.model import KEEP, OFFLOAD, RECOMPUTE, Problem

log = logging.getLogger(__name__)

Move = tuple[str, int, object]  # ("group", index, kind) or ("item", index, True)


def _apply(dec: Decisions, moves: list[Move]) -> Decisions:
    out = dec.copy()
    for what, i, val in moves:
        if what == "group":
            out.groups[i] = val
        else:
            out.cpu[i] = val
    return out


def rank_moves(problem: Problem) -> list[Move]:
    """All moves, most attractive first, each valid given the ones before it."""
    groups = problem.groups
    xfer = [g.nbytes / problem.bw_d2h + g.nbytes / problem.bw_h2d for g in groups]
    can_r = [g.option(RECOMPUTE, g.n0) is not None for g in groups]
    can_o = [g.option(OFFLOAD, g.n0) is not None for g in groups]
    cheap = sorted((gi for gi, g in enumerate(groups) if can_r[gi] and g.rc_time <= xfer[gi] and g.nbytes),
                   key=lambda gi: groups[gi].rc_time / groups[gi].nbytes)
    cheap_set = set(cheap)
    offload = sorted((gi for gi, g in enumerate(groups) if can_o[gi] and gi not in cheap_set),
                     key=lambda gi: (-groups[gi].nbytes * (groups[gi].n0 - groups[gi].pos), groups[gi].pos))
    items = problem.items
    states = sorted((ii for ii, it in enumerate(items) if it.kind == "optimizer_state"), key=lambda i: -items[i].nbytes)
    weights = sorted((ii for ii, it in enumerate(items) if it.kind != "optimizer_state"), key=lambda i: -items[i].nbytes)
    late_r = sorted((gi for gi in range(len(groups)) if can_r[gi] and gi not in cheap_set),
                    key=lambda gi: groups[gi].rc_time / max(1, groups[gi].nbytes))
    proposals: list[Move] = [("group", gi, RECOMPUTE) for gi in cheap]
    proposals += [("group", gi, OFFLOAD) for gi in offload]
    proposals += [("item", ii, True) for ii in states + weights]
    proposals += [("group", gi, RECOMPUTE) for gi in late_r]
    # keep only moves that stay inside the option space (chains shift need times)
    dec = Decisions.keep_all(problem)
    cpu_bytes = 0.0
    accepted: list[Move] = []
    for move in proposals:
        what, i, val = move
        if what == "item" and cpu_bytes + items[i].nbytes > problem.cpu_cap:
            continue
        if what == "group" and val == OFFLOAD and cpu_bytes + groups[i].nbytes > problem.cpu_cap:
            continue
        trial = _apply(dec, [move])
        if structural_problems(problem, trial, need_times(problem, trial.groups)):
            continue
        if what == "item":
            cpu_bytes += items[i].nbytes
        elif val == OFFLOAD:
            cpu_bytes += groups[i].nbytes
        elif dec.groups[i] == OFFLOAD:
            cpu_bytes -= groups[i].nbytes
        dec = trial
        accepted.append(move)
    return accepted


def greedy(problem: Problem, undo_budget: int = 200) -> tuple[Decisions, Evaluation, dict]:
    """Decisions that fit (Evaluation.feasible) when the option space allows, else the most
    memory-saving ones found (infeasible Evaluation)."""
    started = time.perf_counter()
    base = Decisions.keep_all(problem)
    ev = evaluate(problem, base)
    stats = {"moves": 0, "evaluations": 1}
    if ev.feasible:
        stats["seconds"] = time.perf_counter() - started
        return base, ev, stats
    moves = rank_moves(problem)
    cache: dict[int, Evaluation] = {}

    def at_prefix(k: int) -> Evaluation:
        if k not in cache:
            cache[k] = evaluate(problem, _apply(base, moves[:k]))
            stats["evaluations"] += 1
        return cache[k]

    def fits(e: Evaluation) -> bool:
        return e.feasible

    lo, hi = 0, len(moves)
    if not fits(at_prefix(hi)):
        # the whole list does not fit: report the least memory we reached
        best_k = min(range(0, len(moves) + 1, max(1, len(moves) // 16)), key=lambda k: at_prefix(k).peak)
        best_k = best_k if at_prefix(best_k).peak < at_prefix(len(moves)).peak else len(moves)
        stats["seconds"] = time.perf_counter() - started
        return _apply(base, moves[:best_k]), at_prefix(best_k), stats
    while lo < hi:  # shortest fitting prefix (memory falls nearly monotonically along the list)
        mid = (lo + hi) // 2
        if fits(at_prefix(mid)):
            hi = mid
        else:
            lo = mid + 1
    k = lo
    dec, ev = _apply(base, moves[:k]), at_prefix(k)
    stats["moves"] = k
    dec, ev = _undo(problem, dec, ev, moves[:k], undo_budget, stats)
    stats["seconds"] = time.perf_counter() - started
    log.info("greedy: %d moves, predicted %.3f ms, peak %d / cap %d, %d evaluations in %.2fs",
             stats["moves"], ev.time * 1e3, ev.peak, problem.cap, stats["evaluations"], stats["seconds"])
    return dec, ev, stats


def _undo(problem: Problem, dec: Decisions, ev: Evaluation, moves: list[Move], budget: int,
          stats: dict) -> tuple[Decisions, Evaluation]:
    """Undo moves that are not needed to fit, the ones costing the most time first."""
    def cost(move: Move) -> float:
        what, i, val = move
        if what == "item":
            it = problem.items[i]
            return sum(it.h2d.values()) / problem.bw_h2d + sum(it.d2h.values()) / problem.bw_d2h
        g = problem.groups[i]
        return g.rc_time if val == RECOMPUTE else g.nbytes / problem.bw_h2d + g.nbytes / problem.bw_d2h

    for move in sorted(moves, key=cost, reverse=True)[:budget]:
        what, i, _ = move
        trial = dec.copy()
        if what == "group":
            trial.groups[i] = KEEP
        else:
            trial.cpu[i] = False
        e = evaluate(problem, trial)
        stats["evaluations"] += 1
        if e.feasible and e.time <= ev.time:
            dec, ev = trial, e
            stats["moves"] -= 1
    return dec, ev
