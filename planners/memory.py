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


def need_times(problem: Problem, kinds: list[str], at: list[int] | None = None,
               only: set[int] | None = None) -> list[int]:
    """When each non-kept group is needed again: its first backward use, pulled earlier by
    recomputed groups that read it (their recomputation runs at their own need time). at, only:
    the need times of other decisions and the groups whose need time may differ from them (those
    decisions changed, and every group they read, transitively: read_closure); the rest are
    taken from at."""
    if only is None:
        at, order = [-1] * len(problem.groups), problem.latest_first
    else:
        at, order = list(at), sorted(sorted(only), key=lambda gi: -problem.groups[gi].pos)
    for gi in order:
        if kinds[gi] == KEEP:
            at[gi] = -1
            continue
        s = problem.groups[gi].n0
        for hi in problem.required_by[gi]:
            if kinds[hi] == RECOMPUTE and 0 <= at[hi] < s:
                s = at[hi]
        at[gi] = s
    return at


def read_closure(problem: Problem, changed) -> set[int]:
    """The groups whose need time may change when the decisions of `changed` do: those, and every
    group their recomputations read, transitively."""
    seen, stack = set(changed), list(changed)
    while stack:
        for gi in problem.groups[stack.pop()].requires:
            if gi not in seen:
                seen.add(gi)
                stack.append(gi)
    return seen


def structural_problems(problem: Problem, decisions: Decisions, at: list[int] | None = None,
                        only: list[int] | None = None) -> list[str]:
    """Reasons the decisions are outside the option space (independent of budgets); only: the
    groups to check (every group when None), e.g. those a move could have made invalid."""
    at = need_times(problem, decisions.groups) if at is None else at
    return chosen_options(problem, decisions, at, only)[1]


def chosen_options(problem: Problem, decisions: Decisions, at: list[int],
                   only: list[int] | None = None) -> tuple[list[int], list[str]]:
    """(per group the index of its option for its decision and need time, -1 where it has none; the
    reasons the decisions are outside the option space). only: the groups to look at, in order
    (the others are reported as -1, with no reasons)."""
    lookup = _lookup(problem)
    kinds, cpu, groups = decisions.groups, decisions.cpu, problem.groups
    if only is None:
        found = [lookup.keep[gi] if kind == KEEP else lookup.index[gi].get((kind, at[gi]))
                 for gi, kind in enumerate(kinds)]
        looked = range(len(kinds))
    else:
        found = [-1] * len(kinds)
        for gi in only:
            found[gi] = lookup.keep[gi] if kinds[gi] == KEEP else lookup.index[gi].get((kinds[gi], at[gi]))
        looked = only
    out = []
    for gi in [gi for gi in looked if found[gi] is None or (kinds[gi] == RECOMPUTE and lookup.reads[gi])]:
        g = groups[gi]
        if found[gi] is None:
            out.append(f"group {gi} (vertex {g.vertex}) cannot {kinds[gi]} for position {at[gi]}")
            continue
        for w in g.persistent:
            ii = problem.item_of[w]
            if cpu[ii] and not problem.items[ii].covers(w, at[gi]):
                out.append(f"group {gi} recomputes at {at[gi]} where CPU-homed value {w} is absent")
    return [-1 if oi is None else oi for oi in found], out


class _Lookup:
    """Per group: its option index, its keep option, whether a recomputation reads persistent values."""

    def __init__(self, problem: Problem):
        self.key = len(problem.groups)
        self.index = [g.index for g in problem.groups]
        self.keep = [g.index.get((KEEP, -1)) for g in problem.groups]
        self.reads = [bool(g.persistent) for g in problem.groups]


def _lookup(problem: Problem) -> _Lookup:
    lookup = problem.__dict__.get("_option_lookup")
    if lookup is None or lookup.key != len(problem.groups):
        lookup = problem.__dict__["_option_lookup"] = _Lookup(problem)
    return lookup


KINDS = (KEEP, OFFLOAD, RECOMPUTE)  # _Tables.kind_code indexes this


class _Tables:
    """Each option's and item's effects as flat arrays (built once per Problem), so evaluate adds
    the chosen ones with numpy in the order a loop over groups, then items, would: every float sum
    is the same sequence of additions (np.add.at and np.cumsum add one element after another), so
    the Evaluation is the loop's bit for bit."""

    def __init__(self, problem: Problem):
        self.key = (len(problem.groups), len(problem.items))
        self.offset = []  # group -> global id of its first option
        kinds, nbytes, seconds = [], [], []
        c_win, c_sec, d2h_win, d2h_b, h2d_win, h2d_b = [], [], [], [], [], []
        iv_lo, iv_hi, iv_b, iv_of, host_win, host_sec, host_of = [], [], [], [], [], [], []
        for g in problem.groups:
            self.offset.append(len(kinds))
            for opt in g.options:
                k = len(kinds)
                kinds.append(opt.kind)
                nbytes.append(g.nbytes)
                seconds.append(option_seconds(problem, opt))
                for first, last, b in opt.intervals:
                    iv_lo.append(first), iv_hi.append(last + 1), iv_b.append(b), iv_of.append(k)
                if opt.extra:
                    iv_lo.append(opt.at), iv_hi.append(opt.at + 1), iv_b.append(opt.extra), iv_of.append(k)
                c_win.append(opt.compute[0] if opt.compute is not None else -1)
                c_sec.append(opt.compute[1] if opt.compute is not None else 0.0)
                h2d_win.append(opt.h2d[0] if opt.h2d is not None else -1)
                h2d_b.append(opt.h2d[1] if opt.h2d is not None else 0)
                d2h_win.append(opt.d2h[0] if opt.d2h is not None else -1)
                d2h_b.append(opt.d2h[1] if opt.d2h is not None else 0)
                for w, t in opt.host:
                    host_win.append(w), host_sec.append(t), host_of.append(k)
        self.kind_code = np.array([KINDS.index(kind) for kind in kinds], dtype=np.int64)
        self.nbytes = np.array(nbytes, dtype=np.int64)
        self.seconds = np.array(seconds, dtype=np.float64)
        self.c_win, self.c_sec = np.array(c_win, dtype=np.int64), np.array(c_sec, dtype=np.float64)
        self.h2d_win, self.h2d_b = np.array(h2d_win, dtype=np.int64), np.array(h2d_b, dtype=np.float64)
        self.d2h_win, self.d2h_b = np.array(d2h_win, dtype=np.int64), np.array(d2h_b, dtype=np.float64)
        self.iv = _Ragged(len(kinds), iv_of, (iv_lo, np.int64), (iv_hi, np.int64), (iv_b, np.int64))
        self.host = _Ragged(len(kinds), host_of, (host_win, np.int64), (host_sec, np.float64))
        # items, each a run of entries in dict order (the loop's order)
        it_of, it_lo, it_hi, it_b = [], [], [], []
        ih_of, ih_win, ih_b, id_of, id_win, id_b, ihost_of, ihost_win, ihost_sec = ([] for _ in range(9))
        self.item_seconds = np.array([item_seconds(problem, item) for item in problem.items], dtype=np.float64)
        for ii, item in enumerate(problem.items):
            for first, last, b in item.delta:
                it_of.append(ii), it_lo.append(first), it_hi.append(last + 1), it_b.append(b)
            for k, b in item.h2d.items():
                ih_of.append(ii), ih_win.append(k), ih_b.append(b)
            for k, b in item.d2h.items():
                id_of.append(ii), id_win.append(k), id_b.append(b)
            for k, t in item.host.items():
                ihost_of.append(ii), ihost_win.append(k), ihost_sec.append(t)
        n_items = len(problem.items)
        self.it_iv = _Ragged(n_items, it_of, (it_lo, np.int64), (it_hi, np.int64), (it_b, np.int64))
        self.it_h2d = _Ragged(n_items, ih_of, (ih_win, np.int64), (ih_b, np.float64))
        self.it_d2h = _Ragged(n_items, id_of, (id_win, np.int64), (id_b, np.float64))
        self.it_host = _Ragged(n_items, ihost_of, (ihost_win, np.int64), (ihost_sec, np.float64))
        self.it_nbytes = np.array([item.nbytes for item in problem.items], dtype=np.int64)
        self.it_state = np.array([item.kind == "optimizer_state" for item in problem.items], dtype=bool)


class _Ragged:
    """Per owner (an option or an item) a run of entries, stored flat in owner order: ``pick``
    gives the entries of the owners asked for, in the order asked. columns: (values, dtype)."""

    def __init__(self, owners: int, of: list[int], *columns):
        self.start = np.searchsorted(np.array(of, dtype=np.int64), np.arange(owners + 1))
        self.columns = [np.array(values, dtype=dtype) for values, dtype in columns]

    def pick(self, owners: np.ndarray) -> list[np.ndarray]:
        lo = self.start[owners]
        counts = self.start[owners + 1] - lo
        total = int(counts.sum())
        if not total:
            return [c[:0] for c in self.columns]
        # each owner's run lo..hi-1, owners in the order given
        index = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(total)
        return [c[index] for c in self.columns]


def _tables(problem: Problem) -> _Tables:
    tables = problem.__dict__.get("_eval_tables")
    if tables is None or tables.key != (len(problem.groups), len(problem.items)):
        tables = problem.__dict__["_eval_tables"] = _Tables(problem)
    return tables


def _in_order_sum(values: np.ndarray) -> float:
    """values[0] + values[1] + ... one after another, as a loop adding them to 0.0 would."""
    return float(np.cumsum(values)[-1]) if len(values) else 0.0


def exceeds_cap_after(problem: Problem, ev: Evaluation, decisions: Decisions, groups: list[int],
                      items: list[int]) -> bool:
    """Whether evaluate(problem, decisions) would find decisions infeasible for memory or structure
    (the peak over the cap, or a group without an option for its kind and need time), known from
    ev, the evaluation of feasible decisions that differ from these only in the kinds of `groups`
    and the homes of `items`, by moving the memory of only the groups whose option changes. Bytes
    are integers, so the peak is evaluate's exactly; False says only that evaluate must judge the
    rest (time, pinned bytes). The greedy's undo asks this before each full evaluation: on the 30M
    GPT-2 at 50% most of its trials fail on the peak."""
    tables = _tables(problem)
    suspects = read_closure(problem, groups)
    at = need_times(problem, decisions.groups, ev.at, suspects)
    looked = sorted(suspects)
    options, reasons = chosen_options(problem, decisions, at, looked)
    if reasons:
        return True
    changed = [gi for gi in looked if options[gi] != ev.options[gi]]
    old = np.array([tables.offset[gi] + ev.options[gi] for gi in changed], dtype=np.int64)
    new = np.array([tables.offset[gi] + options[gi] for gi in changed], dtype=np.int64)
    diff = np.zeros(problem.n + 1, dtype=np.int64)
    for sel, sign in ((old, -1), (new, 1)):
        lo, hi, b = tables.iv.pick(sel)
        np.add.at(diff, lo, sign * b)
        np.add.at(diff, hi, -sign * b)
    for ii in items:  # a home that changed: its intervals in or out
        sign = 1 if decisions.cpu[ii] else -1
        lo, hi, b = tables.it_iv.pick(np.array([ii], dtype=np.int64))
        np.add.at(diff, lo, sign * b)
        np.add.at(diff, hi, -sign * b)
    return bool(problem.n) and int((ev.profile + np.cumsum(diff[:problem.n])).max()) > problem.cap


def evaluate(problem: Problem, decisions: Decisions) -> Evaluation:
    n = problem.n
    tables = _tables(problem)
    at = need_times(problem, decisions.groups)
    options, reasons = chosen_options(problem, decisions, at)
    offset = tables.offset
    chosen = [offset[gi] + oi for gi, oi in enumerate(options) if oi >= 0]  # global option ids, in group order
    sel = np.array(chosen, dtype=np.int64)
    homed = np.array([ii for ii, on_cpu in enumerate(decisions.cpu) if on_cpu], dtype=np.int64)

    diff = np.zeros(n + 1, dtype=np.int64)
    lo, hi, b = tables.iv.pick(sel)
    ilo, ihi, ib = tables.it_iv.pick(homed)
    nbytes = np.concatenate([b, ib])
    np.add.at(diff, np.concatenate([lo, ilo]), nbytes)
    np.add.at(diff, np.concatenate([hi, ihi]), -nbytes)

    compute = problem.base_compute.copy()
    c_win, c_sec = tables.c_win[sel], tables.c_sec[sel]
    recomputed = c_win >= 0
    np.add.at(compute, c_win[recomputed], c_sec[recomputed])

    host = problem.base_host.copy()
    hw, hs = tables.host.pick(sel)
    ihw, ihs = tables.it_host.pick(homed)
    host_sec = np.concatenate([hs, ihs])
    np.add.at(host, np.concatenate([hw, ihw]), host_sec)

    h2d = problem.base_h2d.copy()
    d2h = problem.base_d2h.copy()
    for arr, win, by, ragged in ((h2d, tables.h2d_win, tables.h2d_b, tables.it_h2d),
                                 (d2h, tables.d2h_win, tables.d2h_b, tables.it_d2h)):
        w, bb = win[sel], by[sel]
        moves = w >= 0
        iw, ibb = ragged.pick(homed)
        np.add.at(arr, np.concatenate([w[moves], iw]), np.concatenate([bb[moves], ibb]))

    moved = _in_order_sum(np.concatenate([tables.seconds[sel], tables.item_seconds[homed]]))
    mix = {"bytes_kept": 0, "bytes_offloaded": 0, "bytes_recomputed": 0, "bytes_weights_streamed": 0,
           "bytes_states_streamed": 0, "recompute_seconds": _in_order_sum(c_sec[recomputed]), "host_seconds": 0.0,
           "host_seconds_added": _in_order_sum(host_sec)}
    # byte counts are integers, so their sums (and the float of them, below 2**53) are the same in any order
    codes, group_bytes = tables.kind_code[sel], tables.nbytes[sel]
    for code, key in enumerate(("bytes_kept", "bytes_offloaded", "bytes_recomputed")):
        mix[key] = int(group_bytes[codes == code].sum())
    item_bytes, states = tables.it_nbytes[homed], tables.it_state[homed]
    mix["bytes_states_streamed"] = int(item_bytes[states].sum())
    mix["bytes_weights_streamed"] = int(item_bytes[~states].sum())
    cpu_bytes = float(mix["bytes_offloaded"] + int(item_bytes.sum()))
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
