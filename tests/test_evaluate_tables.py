"""memory.evaluate adds the chosen options' effects with numpy: its Evaluation must be, bit for bit,
the one of the plain loop over groups and items it replaced (kept here as the reference), so no
plan changes. Random decisions, inside and outside the option space, on the planners' small
problems and on a traced GPT step."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_planners import SMALL, SMALL_HOST, _traced
from turnip.planners.driver import make_problem
from turnip.planners.greedy import greedy
from turnip.planners.memory import (
    TIE_BREAK,
    Decisions,
    Evaluation,
    evaluate,
    exceeds_cap_after,
    item_seconds,
    need_times,
    option_seconds,
    structural_problems,
    window_times,
)
from turnip.planners.model import KEEP, OFFLOAD, RECOMPUTE, Problem

from turnip.gpt import GPTConfig


def loop_structural_problems(problem: Problem, decisions: Decisions, at: list[int] | None = None) -> list[str]:
    """Reasons the decisions are outside the option space (independent of budgets)."""
    at = need_times(problem, decisions.groups) if at is None else at
    out = []
    for gi, g in enumerate(problem.groups):
        kind = decisions.groups[gi]
        if g.option(kind, at[gi]) is None:
            out.append(f"group {gi} (vertex {g.vertex}) cannot {kind} for position {at[gi]}")
            continue
        if kind == RECOMPUTE:
            for w in g.persistent:
                ii = problem.item_of[w]
                if decisions.cpu[ii] and not problem.items[ii].covers(w, at[gi]):
                    out.append(f"group {gi} recomputes at {at[gi]} where CPU-homed value {w} is absent")
    return out


def loop_evaluate(problem: Problem, decisions: Decisions) -> Evaluation:
    n = problem.n
    diff = np.zeros(n + 1, dtype=np.int64)
    compute = problem.base_compute.copy()
    host = problem.base_host.copy()
    h2d = problem.base_h2d.copy()
    d2h = problem.base_d2h.copy()
    at = need_times(problem, decisions.groups)
    reasons = loop_structural_problems(problem, decisions, at)
    cpu_bytes = 0.0
    moved = 0.0  # seconds of transfers, recomputation and launches, hidden or not
    options = []
    mix = {"bytes_kept": 0, "bytes_offloaded": 0, "bytes_recomputed": 0, "bytes_weights_streamed": 0,
           "bytes_states_streamed": 0, "recompute_seconds": 0.0, "host_seconds": 0.0,
           "host_seconds_added": 0.0}
    for gi, g in enumerate(problem.groups):
        oi = g.option(decisions.groups[gi], at[gi])
        options.append(-1 if oi is None else oi)
        if oi is None:
            continue
        opt = g.options[oi]
        for first, last, b in opt.intervals:
            diff[first] += b
            diff[last + 1] -= b
        if opt.extra:
            diff[opt.at] += opt.extra
            diff[opt.at + 1] -= opt.extra
        if opt.compute is not None:
            compute[opt.compute[0]] += opt.compute[1]
            mix["recompute_seconds"] += opt.compute[1]
        for k, t in opt.host:
            host[k] += t
            mix["host_seconds_added"] += t
        moved += option_seconds(problem, opt)
        if opt.h2d is not None:
            h2d[opt.h2d[0]] += opt.h2d[1]
        if opt.d2h is not None:
            d2h[opt.d2h[0]] += opt.d2h[1]
        if opt.kind == OFFLOAD:
            cpu_bytes += g.nbytes
        mix[{KEEP: "bytes_kept", OFFLOAD: "bytes_offloaded", RECOMPUTE: "bytes_recomputed"}[opt.kind]] += g.nbytes
    for ii, item in enumerate(problem.items):
        if not decisions.cpu[ii]:
            continue
        for first, last, b in item.delta:
            diff[first] += b
            diff[last + 1] -= b
        for k, b in item.h2d.items():
            h2d[k] += b
        for k, b in item.d2h.items():
            d2h[k] += b
        for k, t in item.host.items():
            host[k] += t
            mix["host_seconds_added"] += t
        moved += item_seconds(problem, item)
        cpu_bytes += item.nbytes
        key = "bytes_states_streamed" if item.kind == "optimizer_state" else "bytes_weights_streamed"
        mix[key] += item.nbytes
    profile = problem.base + np.cumsum(diff[:n])
    peak_pos = int(np.argmax(profile)) if n else 0
    peak = int(profile[peak_pos]) if n else 0
    window_time = window_times(compute, host, h2d, d2h, problem)
    mix["host_seconds"] = float(host.sum())  # the step's launches, the decisions' share included
    if peak > problem.cap:
        reasons.append(f"peak {peak} bytes at position {peak_pos} exceeds the {problem.cap}-byte cap")
    if cpu_bytes > problem.cpu_cap:
        reasons.append(f"pinned CPU bytes {int(cpu_bytes)} exceed the CPU budget {int(problem.cpu_cap)}")
    total = float(window_time.sum())
    return Evaluation(feasible=not reasons, reason="; ".join(reasons[:3]), time=total,
                      objective=total + TIE_BREAK * moved,
                      peak=peak, peak_pos=peak_pos, profile=profile, window_time=window_time, compute=compute,
                      host=host, h2d=h2d, d2h=d2h, at=at, options=options, cpu_bytes=cpu_bytes, mix=mix)


def random_decisions(rng: random.Random, problem: Problem) -> Decisions:
    groups = [rng.choice((KEEP, KEEP, OFFLOAD, RECOMPUTE)) for _ in problem.groups]
    return Decisions(groups, [rng.random() < 0.3 for _ in problem.items])


def same(a: Evaluation, b: Evaluation) -> None:
    for name in ("feasible", "reason", "time", "objective", "peak", "peak_pos", "at", "options", "cpu_bytes", "mix"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("profile", "window_time", "compute", "host", "h2d", "d2h"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("name,problem", SMALL[::4] + SMALL_HOST[::4], ids=lambda x: x if isinstance(x, str) else "")
def test_evaluate_is_the_loop_bit_for_bit_on_small_problems(name, problem):
    rng = random.Random(name)
    for _ in range(30):
        dec = random_decisions(rng, problem)
        same(evaluate(problem, dec), loop_evaluate(problem, dec))
        assert structural_problems(problem, dec) == loop_structural_problems(problem, dec)


def test_evaluate_is_the_loop_bit_for_bit_on_a_gpt_step():
    tg, peak = _traced(GPTConfig(), batch=2)
    problem = make_problem(tg, peak // 2, alignment=64)
    rng = random.Random(0)
    same(evaluate(problem, Decisions.keep_all(problem)), loop_evaluate(problem, Decisions.keep_all(problem)))
    for _ in range(40):
        dec = random_decisions(rng, problem)
        same(evaluate(problem, dec), loop_evaluate(problem, dec))
        assert structural_problems(problem, dec) == loop_structural_problems(problem, dec)


def _undo_trials(problem: Problem, rng: random.Random, tries: int = 40):
    """(feasible decisions, their evaluation, a trial undoing one of their moves, groups, items)."""
    start, _, _ = greedy(problem)
    for _ in range(tries):
        dec = start.copy()  # the greedy's plan, with more moved or recomputed at random
        for gi, kind in enumerate(dec.groups):
            if kind == KEEP and rng.random() < 0.2:
                dec.groups[gi] = rng.choice((OFFLOAD, RECOMPUTE))
        dec.cpu = [on_cpu or rng.random() < 0.1 for on_cpu in dec.cpu]
        ev = evaluate(problem, dec)
        if not ev.feasible:
            continue
        for gi, kind in enumerate(dec.groups):
            if kind != KEEP:
                trial = dec.copy()
                trial.groups[gi] = KEEP
                yield ev, trial, [gi], []
        for ii, on_cpu in enumerate(dec.cpu):
            if on_cpu:
                trial = dec.copy()
                trial.cpu[ii] = False
                yield ev, trial, [], [ii]


@pytest.mark.parametrize("cap_share", [0.3, 0.5, 0.7])
def test_the_undo_screen_refuses_exactly_what_evaluate_finds_over_the_cap(cap_share):
    """The greedy's undo skips a trial that exceeds_cap_after says is over the cap or outside the
    option space: that must be every trial evaluate puts over the cap, and never one it finds
    feasible, so the greedy's plans are the ones of evaluating every trial."""
    tg, peak = _traced(GPTConfig(), batch=2)
    problem = make_problem(tg, int(peak * cap_share), alignment=64)
    rng = random.Random(cap_share)
    screened = fitting = 0
    for ev, trial, groups, items in _undo_trials(problem, rng):
        full = evaluate(problem, trial)
        said = exceeds_cap_after(problem, ev, trial, groups, items)
        assert said == (full.peak > problem.cap or any(
            "cannot" in r or "absent" in r for r in full.reason.split("; "))), (groups, items, full.reason)
        screened += said
        fitting += not said
    assert screened and fitting  # both verdicts were put to the test
