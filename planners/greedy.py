"""Greedy planner: the fast baseline and the ILP's warm start.

Moves, in the order a practitioner would try them: recompute values that are cheaper to
recompute than to move (elementwise ops, norms), offload the saved values that occupy the most
memory for the longest (large and early), stream optimizer states, stream weights last, and as
a last resort recompute what was offloaded. The shortest prefix of that list that fits is found
by bisection, then moves that turn out unnecessary are undone, costliest first. Two other
orders (recompute first, stream first) are tried the same way, for budgets where the first runs
dry; the fastest plan wins. Everything is judged by memory.evaluate, the ILP's own cost model
(host launch time included); the ranking only estimates it, a recomputation's cost being the
longer of its GPU time and the host's time to launch its chain.
"""

from __future__ import annotations

import logging
import threading
import time

from .memory import (
    Decisions,
    Evaluation,
    evaluate,
    exceeds_cap_after,
    item_seconds,
    need_times,
    read_closure,
    structural_problems,
)
from .model import KEEP, OFFLOAD, RECOMPUTE, Problem

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


STRATEGIES = ("practical", "recompute_first", "stream_first")


def recompute_seconds(problem: Problem, g) -> float:
    """About what recomputing a group costs: the longer of its GPU time and the host's time to
    launch its chain (a long chain of tiny ops is bound by the launches)."""
    return max(g.rc_time, (len(g.chain) + 1) * problem.host_per_vertex)


def offload_seconds(problem: Problem, g) -> float:
    """About what offloading a group costs: the longer of its two transfers and the host's time
    to launch an offload and a reload per saved value."""
    xfer = g.nbytes / problem.bw_d2h + g.nbytes / problem.bw_h2d
    return max(xfer, 2 * len(g.saved) * problem.host_per_vertex)


def rank_moves(problem: Problem, strategy: str = "practical") -> list[Move]:
    """All moves, most attractive first, each valid given the ones before it.

    practical: cheap recomputation, offload, stream states, stream weights, costly recomputation;
    recompute_first / stream_first: alternatives for budgets where that order runs dry."""
    groups = problem.groups
    xfer = [offload_seconds(problem, g) for g in groups]
    rc = [recompute_seconds(problem, g) for g in groups]
    can_r = [g.option(RECOMPUTE, g.n0) is not None for g in groups]
    can_o = [g.option(OFFLOAD, g.n0) is not None for g in groups]
    cheap = sorted((gi for gi, g in enumerate(groups) if can_r[gi] and rc[gi] <= xfer[gi] and g.nbytes),
                   key=lambda gi: rc[gi] / groups[gi].nbytes)
    cheap_set = set(cheap)
    offload = sorted((gi for gi, g in enumerate(groups) if can_o[gi] and gi not in cheap_set),
                     key=lambda gi: (-groups[gi].nbytes * (groups[gi].n0 - groups[gi].pos), groups[gi].pos))
    items = problem.items
    states = sorted((ii for ii, it in enumerate(items) if it.kind == "optimizer_state"), key=lambda i: -items[i].nbytes)
    weights = sorted((ii for ii, it in enumerate(items) if it.kind != "optimizer_state"), key=lambda i: -items[i].nbytes)
    late_r = sorted((gi for gi in range(len(groups)) if can_r[gi] and gi not in cheap_set),
                    key=lambda gi: rc[gi] / max(1, groups[gi].nbytes))
    recompute = [("group", gi, RECOMPUTE) for gi in cheap]
    offloads = [("group", gi, OFFLOAD) for gi in offload]
    streams = [("item", ii, True) for ii in states + weights]
    costly = [("group", gi, RECOMPUTE) for gi in late_r]
    if strategy == "recompute_first":
        proposals = recompute + costly + offloads + streams
    elif strategy == "stream_first":
        proposals = streams + recompute + offloads + costly
    else:
        proposals = recompute + offloads + streams + costly
    # keep only moves that stay inside the option space (chains shift need times); a rejected
    # recomputation is tried as an offload and vice versa, and a weight that a recomputation
    # needs outside its streamed span turns that recomputation into an offload
    dec = Decisions.keep_all(problem)
    state = {"cpu": 0.0}
    accepted: list[Move] = []
    # The decisions accepted so far are inside the option space, so a move can only take out the
    # groups whose kind or need time it changes (read_closure), and the recomputations reading a
    # weight it homes on the CPU: only those get new need times and are checked (the same verdict
    # as checking every group, in a fraction of the time)
    current_at = need_times(problem, dec.groups)
    readers_of_item: dict[int, list[int]] = {}
    for gi, g in enumerate(groups):
        for ii in sorted({problem.item_of[w] for w in g.persistent}):
            readers_of_item.setdefault(ii, []).append(gi)

    def pinned(moves: list[Move]) -> float:
        extra = 0.0
        for what, i, val in moves:
            if what == "item":
                extra += items[i].nbytes
            elif val == OFFLOAD and dec.groups[i] != OFFLOAD:
                extra += groups[i].nbytes
            elif val != OFFLOAD and dec.groups[i] == OFFLOAD:
                extra -= groups[i].nbytes
        return extra

    def attempt(moves: list[Move]) -> bool:
        nonlocal dec
        extra = pinned(moves)
        if state["cpu"] + extra > problem.cpu_cap:
            return False
        nonlocal current_at
        trial = _apply(dec, moves)
        suspects = read_closure(problem, [i for what, i, _ in moves if what == "group"])
        at = need_times(problem, trial.groups, current_at, suspects)
        for what, i, _ in moves:
            if what == "item":
                suspects.update(readers_of_item.get(i, ()))
        if structural_problems(problem, trial, at, sorted(suspects)):
            return False
        dec, current_at, state["cpu"] = trial, at, state["cpu"] + extra
        accepted.extend(moves)
        return True

    for move in proposals:
        what, i, val = move
        if what == "group" and dec.groups[i] == val:
            continue
        if attempt([move]):
            continue
        if what == "group":
            other = OFFLOAD if val == RECOMPUTE else RECOMPUTE
            if dec.groups[i] == KEEP and groups[i].option(other, groups[i].n0) is not None:
                attempt([("group", i, other)])
            continue
        blocking = [gi for gi, kind in enumerate(dec.groups) if kind == RECOMPUTE and any(
            problem.item_of[w] == i for w in groups[gi].persistent)]
        attempt([("group", gi, OFFLOAD) for gi in blocking] + [move])
    return accepted


class SharedRanking:
    """rank_moves of one problem, each strategy's made once, when a greedy run first asks for it, and
    shared by the threads planning problems that differ from it only in their cap (problem.py's
    with_headroom): the moves do not depend on the cap, and on a 7B LoRA step ranking takes about
    2.5 s a strategy, two thirds of a greedy run."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self._lock = threading.Lock()
        self._moves: dict[str, list[Move]] = {}

    def __call__(self, strategy: str) -> list[Move]:
        with self._lock:  # a second thread waits for the first's ranking rather than making its own
            if strategy not in self._moves:
                self._moves[strategy] = rank_moves(self.problem, strategy)
            return self._moves[strategy]


def greedy(problem: Problem, undo_budget: int = 200, ranked: SharedRanking | None = None
           ) -> tuple[Decisions, Evaluation, dict]:
    """Decisions that fit (Evaluation.feasible) when any move order finds some, else the most
    memory-saving ones found (infeasible Evaluation). Tries each strategy, keeps the fastest.
    ranked: the moves of this problem or of one differing only in its cap, shared."""
    started = time.perf_counter()
    base = Decisions.keep_all(problem)
    ev = evaluate(problem, base)
    stats = {"moves": 0, "evaluations": 1, "strategy": None}
    if ev.feasible:
        stats["seconds"] = time.perf_counter() - started
        return base, ev, stats
    best = None
    for strategy in STRATEGIES:
        moves = ranked(strategy) if ranked is not None else rank_moves(problem, strategy)
        dec, e, st = _greedy_with(problem, base, moves, undo_budget)
        stats["evaluations"] += st["evaluations"]
        better = best is None or (e.feasible, -e.objective if e.feasible else -e.peak) > \
            (best[1].feasible, -best[1].objective if best[1].feasible else -best[1].peak)
        if better:
            best = (dec, e, st["moves"], strategy)
    dec, ev, stats["moves"], stats["strategy"] = best
    stats["seconds"] = time.perf_counter() - started
    log.info("greedy (%s): %d moves, %s, predicted %.3f ms, peak %d / cap %d, %d evaluations in %.2fs",
             stats["strategy"], stats["moves"], "fits" if ev.feasible else "does NOT fit", ev.time * 1e3, ev.peak,
             problem.cap, stats["evaluations"], stats["seconds"])
    return dec, ev, stats


def _greedy_with(problem: Problem, base: Decisions, moves: list[Move], undo_budget: int):
    stats = {"moves": 0, "evaluations": 0}
    cache: dict[int, Evaluation] = {}

    def at_prefix(k: int) -> Evaluation:
        if k not in cache:
            cache[k] = evaluate(problem, _apply(base, moves[:k]))
            stats["evaluations"] += 1
        return cache[k]

    n = len(moves)
    if not at_prefix(n).feasible:
        # the whole list does not fit: report the least memory we reached
        k = min(range(0, n + 1, max(1, n // 16)), key=lambda k: at_prefix(k).peak)
        k = k if at_prefix(k).peak < at_prefix(n).peak else n
        stats["moves"] = k
        return _apply(base, moves[:k]), at_prefix(k), stats
    lo, hi = 0, n
    while lo < hi:  # shortest fitting prefix (memory falls nearly monotonically along the list)
        mid = (lo + hi) // 2
        if at_prefix(mid).feasible:
            hi = mid
        else:
            lo = mid + 1
    stats["moves"] = lo
    dec, ev = _undo(problem, _apply(base, moves[:lo]), at_prefix(lo), moves[:lo], undo_budget, stats)
    return dec, ev, stats


def _undo(problem: Problem, dec: Decisions, ev: Evaluation, moves: list[Move], budget: int,
          stats: dict) -> tuple[Decisions, Evaluation]:
    """Undo moves that are not needed to fit, the ones costing the most time first."""
    def cost(move: Move) -> float:
        what, i, val = move
        if what == "item":
            return item_seconds(problem, problem.items[i])
        g = problem.groups[i]
        return recompute_seconds(problem, g) if val == RECOMPUTE else offload_seconds(problem, g)

    for move in sorted(moves, key=cost, reverse=True)[:budget]:
        what, i, _ = move
        trial = dec.copy()
        if what == "group":
            trial.groups[i] = KEEP
        else:
            trial.cpu[i] = False
        groups, items = ([i], []) if what == "group" else ([], [i])
        if exceeds_cap_after(problem, ev, trial, groups, items):
            continue
        e = evaluate(problem, trial)
        stats["evaluations"] += 1
        if e.feasible and e.objective <= ev.objective:
            dec, ev = trial, e
            stats["moves"] -= 1
    return dec, ev
