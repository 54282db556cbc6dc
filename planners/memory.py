"""Evaluate decisions on a Problem: memory at every position of the serial order, time per window.

This is the single definition of the cost model the planners optimize: the greedy calls it
directly, the ILP encodes it linearly (ilp.py) and the tests brute-force it. A window takes the
longest of its compute (recomputation included), the host's time to launch its vertices (the
engine's event loop runs beside the device, so it is a resource of its own) and its transfers in
each direction; the step takes the sum of its windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .model import KEEP, OFFLOAD, RECOMPUTE, Problem

# Transfers, recomputation and launches hidden under compute still use the link, the GPU and
# the host: among plans of equal step time, prefer the one that moves and recomputes least.
TIE_BREAK = 1e-3


@dataclass
class Decisions:
    groups: list[str]  # per group: KEEP | OFFLOAD | RECOMPUTE
    cpu: list[bool]  # per item: homed on the CPU

    @classmethod
    def keep_all(cls, problem: Problem) -> Decisions:
        return cls([KEEP] * len(problem.groups), [False] * len(problem.items))

    def copy(self) -> Decisions:
        return Decisions(list(self.groups), list(self.cpu))


@dataclass
class Evaluation:
    feasible: bool
    reason: str
    time: float  # predicted seconds per step
    objective: float  # time + TIE_BREAK * (transfer + recompute seconds): what the planners minimize
    peak: int  # bytes of values at the fullest position
    peak_pos: int
    profile: np.ndarray
    window_time: np.ndarray
    compute: np.ndarray
    host: np.ndarray  # host seconds of launches per window
    h2d: np.ndarray
    d2h: np.ndarray
    at: list[int]  # per group: position its backward copy is present from (-1: kept)
    options: list[int]  # per group: option index (-1: the decision has no such option)
    cpu_bytes: float
    mix: dict = field(default_factory=dict)


def option_seconds(problem: Problem, opt) -> float:
    """Seconds of link, recompute and launch work an option adds, whether or not compute hides it."""
    t = opt.compute[1] if opt.compute is not None else 0.0
    t += opt.h2d[1] / problem.bw_h2d if opt.h2d is not None else 0.0
    t += opt.d2h[1] / problem.bw_d2h if opt.d2h is not None else 0.0
    return t + sum(s for _, s in opt.host)


def item_seconds(problem: Problem, item) -> float:
    t = sum(item.h2d.values()) / problem.bw_h2d + sum(item.d2h.values()) / problem.bw_d2h
    return t + sum(item.host.values())


def window_times(compute: np.ndarray, host: np.ndarray, h2d: np.ndarray, d2h: np.ndarray,
                 problem: Problem) -> np.ndarray:
    """Seconds of each window: its busiest resource, since the GPU, the host and the link in each
    direction all work at once (the two directions together at most at the link's duplex rate)."""
    link = np.maximum(np.maximum(h2d / problem.bw_h2d, d2h / problem.bw_d2h), (h2d + d2h) / problem.bw_duplex)
    return np.maximum(np.maximum(compute, host), link)


def need_times(problem: Problem, kinds: list[str]) -> list[int]:
    """When each non-kept group is needed again: its first backward use, pulled earlier by
    recomputed groups that read it (their recomputation runs at their own need time)."""
    at = [-1] * len(problem.groups)
    for gi in problem.latest_first:
        if kinds[gi] == KEEP:
            continue
        s = problem.groups[gi].n0
        for hi in problem.required_by[gi]:
            if kinds[hi] == RECOMPUTE and 0 <= at[hi] < s:
                s = at[hi]
        at[gi] = s
    return at


def structural_problems(problem: Problem, decisions: Decisions, at: list[int] | None = None) -> list[str]:
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


def evaluate(problem: Problem, decisions: Decisions) -> Evaluation:
    n = problem.n
    diff = np.zeros(n + 1, dtype=np.int64)
    compute = problem.base_compute.copy()
    host = problem.base_host.copy()
    h2d = problem.base_h2d.copy()
    d2h = problem.base_d2h.copy()
    at = need_times(problem, decisions.groups)
    reasons = structural_problems(problem, decisions, at)
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
