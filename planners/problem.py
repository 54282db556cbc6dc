"""Build the planning Problem (model.py) from a TaskGraph with costs.

Reads the graph once: who reads what at which position, which forward values the backward
pass needs (groups), what a recomputation would have to re-run (chains) and which other groups
it leans on, the possible need times of every group (candidates, bounded in depth so deep
recompute chains stay out of the space; a chain may run another group's vertex again for an output
only the chain reads), the memory/transfer profile of every home, and the
host seconds of every launch the step and each decision add (host_per_vertex per vertex).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from collections import Counter

import numpy as np

from ..ir.sizes import aligned, arena_capacity
from ..ir.taskgraph import MESSAGE_OPS, SEND, TaskGraph, ValueKind
from .model import KEEP, OFFLOAD, RECOMPUTE, Group, Item, Option, Problem, make_windows, step_order

log = logging.getLogger(__name__)

_HOMED = (ValueKind.PARAMETER, ValueKind.FROZEN, ValueKind.OPTIMIZER_STATE)


def default_windows(n: int) -> int:
    # enough windows that a transfer overlaps only nearby compute, few enough for the ILP
    return int(min(160, max(2, n // 8)))


# How many recomputations deep a value's candidate need times go (a value recomputed for a value
# recomputed for ...). 5 rather than 3: on the H100 export of gpt1.3b at 25% of eager's peak the
# greedy plan simulates at 340.0 ms against 359.7 and gpt350m's at 180.7 against 200.3 (`python -m
# turnip.bench.replan plan ... --planner-option depth=5`); on the H100 the two compiled steps ran
# alternately at 374.9 and 435.8 ms (bench/results/h100/planner_ab_gpt1.3b_25.json).
RECOMPUTE_DEPTH = 5


def build_problem(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None = None, *, bw_h2d: float,
                  bw_d2h: float, headroom: float = 0.92, alignment: int = 256, windows: int | None = None,
                  depth: int = RECOMPUTE_DEPTH, max_candidates: int = 6, max_chain: int = 8, max_items: int = 512,
                  order: list[int] | None = None, host_per_vertex: float = 0.0, reload_room: bool = False,
                  bw_duplex: float | None = None, replay_receives: bool = False) -> Problem:
    """replay_receives: a value received from another device may be received again for a
    recomputation (a device's share of a step of one process, memgraph/per_device.py: the whole
    step's copy between the devices runs again, reading its source where the other device still
    holds it). Over ranks a message runs once, and so does a receive here by default."""
    order = list(order) if order is not None else step_order(tg)
    # what a recomputation may not re-run: a send, whose peer receives once; a receive unless replayed
    once = (SEND,) if replay_receives else MESSAGE_OPS
    n = len(order)
    pos = np.full(len(tg.vertices), -1, dtype=np.int64)
    pos[order] = np.arange(n)
    times = np.array([float(tg.vertices[v].time) for v in order], dtype=np.float64)
    win_start, win_end = make_windows(times, windows or default_windows(n))
    window_of = np.zeros(n, dtype=np.int64)
    for k, (s, e) in enumerate(zip(win_start, win_end)):
        window_of[s:e + 1] = k

    def size(vid: int) -> int:
        return aligned(tg.values[vid].nbytes, alignment)

    phase = [tg.vertices[v].phase for v in order]
    readers: list[list[int]] = [[] for _ in tg.values]
    for p, vid in enumerate(order):
        for val in tg.vertices[vid].inputs():
            readers[val].append(p)
    step_outputs = set(tg.outputs.values())
    targets = {dst: src for src, dst in tg.bindings.items()}
    # (old, new) pairs where the op reading old last writes new over its bytes (in-place ops, the
    # optimizer's updates, trace/donate.py): BuildMemGraph counts those bytes once (schedule.py)
    taken_over = {(old, new) for p, vid in enumerate(order) for old, new in tg.vertices[vid].copy_in
                  if size(old) == size(new) and readers[old] and readers[old][-1] == p}
    # such an intermediate or batch value ends one step earlier: its result holds the bytes from there
    donated = {old for old, _ in taken_over if tg.values[old].kind in (ValueKind.INTERMEDIATE, ValueKind.BATCH)}

    # -- classify values ----------------------------------------------------------------------
    # saved_info: value -> (last use before its gap, first use after it, last use)
    transient, saved_info, forced = set(), {}, set()
    long_values = []  # backward/optimizer values idle for a while (e.g. a tied weight's gradient part)
    for val in tg.values:
        if val.kind is not ValueKind.INTERMEDIATE or val.producer < 0:
            continue
        prod = int(pos[val.producer])
        if phase[prod] != "forward":
            if val.id not in step_outputs and val.id not in targets and readers[val.id]:
                events = [prod] + readers[val.id]
                gap = max(range(len(events) - 1), key=lambda i: events[i + 1] - events[i])
                hold, nxt = events[gap], events[gap + 1]
                if window_of[nxt] - 1 > window_of[hold]:  # long enough for a round trip
                    saved_info[val.id] = (hold, nxt, events[-1])
                    long_values.append(val.id)
            continue
        fwd = [p for p in readers[val.id] if phase[p] == "forward"]
        later = [p for p in readers[val.id] if phase[p] != "forward"]
        lastfwd = max(fwd, default=prod)
        if not later and val.id not in step_outputs and val.id not in targets:
            transient.add(val.id)
        elif val.id in step_outputs or val.id in targets or not later or min(later) <= lastfwd:
            forced.add(val.id)
        else:
            saved_info[val.id] = (lastfwd, min(later), max(later))
    group_vertices = {}
    for vid in order:
        vertex = tg.vertices[vid]
        outs = [o for o in vertex.outputs if o >= 0]
        if vertex.phase != "forward" or not any(o in saved_info for o in outs):
            continue
        if any(o in forced for o in outs):  # e.g. the loss: keep every saved output of its vertex
            forced.update(o for o in outs if o in saved_info)
            continue
        group_vertices[vid] = [o for o in outs if o in saved_info]
    for o in list(saved_info):
        if o in forced:
            del saved_info[o]

    groups: list[Group] = []
    group_of_value: dict[int, int] = {}
    specs = [(vid, saved, True) for vid, saved in group_vertices.items()]
    specs += [(tg.values[v].producer, [v], False) for v in long_values]  # offload or keep only
    for vid, saved, forward in specs:
        g = Group(vertex=vid, pos=int(pos[vid]), saved=saved, nbytes=sum(size(o) for o in saved),
                  n0=min(saved_info[o][1] for o in saved), forward=forward)
        for o in saved:
            group_of_value[o] = len(groups)
        groups.append(g)
    group_vertex_set = set(group_vertices)

    # -- recompute chains ----------------------------------------------------------------------
    anchors: dict[int, list[int]] = {}  # group -> forced-keep values its recomputation reads
    batch_reads: dict[int, list[int]] = {}
    recomputable = []
    for gi, g in enumerate(groups):
        chain, requires, persistent, anchor, batch = set(), set(), set(), set(), set()
        # a message to or from another rank runs once: its peer sends or receives once (trace/ranks.py);
        # a receive between devices of one process may run again (replay_receives)
        ok, stack = g.forward and tg.vertices[g.vertex].op not in once, [g.vertex]
        while stack and ok:
            x = stack.pop()
            for u in tg.vertices[x].inputs():
                val = tg.values[u]
                if val.kind in _HOMED:
                    persistent.add(u)
                elif val.kind is ValueKind.BATCH:
                    batch.add(u)
                elif val.kind is ValueKind.CONSTANT:
                    pass
                elif u in group_of_value:
                    requires.add(group_of_value[u])
                elif u in forced:
                    anchor.add(u)
                elif u in transient and tg.vertices[val.producer].op not in once:
                    # also an unsaved output of another group's vertex (a layer norm's output, which
                    # only the bf16 cast after it reads): that vertex runs again in the chain
                    if val.producer not in chain:
                        chain.add(val.producer)
                        stack.append(val.producer)
                else:
                    ok = False  # a backward value, or one a message made
                    break
        ok = ok and len(chain) <= max_chain
        recomputable.append(ok)
        if ok:
            g.chain = sorted(chain)
            g.requires = sorted(requires - {gi})
            g.persistent = sorted(persistent)
            g.rc_time = float(tg.vertices[g.vertex].time + sum(tg.vertices[c].time for c in chain))
            anchors[gi] = sorted(anchor)
            batch_reads[gi] = sorted(batch)
    required_by: list[list[int]] = [[] for _ in groups]
    for hi, h in enumerate(groups):
        for gi in h.requires:
            required_by[gi].append(hi)

    last_of = {o: saved_info[o][2] for o in saved_info}

    def last_use(vid: int) -> int:
        return readers[vid][-1] if readers[vid] else -1

    def valid_recompute(hi: int, c: int) -> bool:
        if not recomputable[hi]:
            return False
        h = groups[hi]
        if any(c > min(last_of[o] for o in groups[gi].saved) for gi in h.requires):
            return False  # a group it reads is gone by then
        return all(c <= last_use(a) for a in anchors[hi])

    # -- candidate need times, from the latest group back --------------------------------------
    rc_valid: dict[int, list[tuple[int, int]]] = {}
    for gi in sorted(range(len(groups)), key=lambda i: -groups[i].pos):
        g = groups[gi]
        cand = {g.n0: 0}
        for hi in required_by[gi]:
            for c, d in rc_valid.get(hi, []):
                if c < g.n0 and d + 1 <= depth:
                    cand[c] = min(cand.get(c, depth + 1), d + 1)
        keep = sorted(cand.items(), key=lambda cd: (cd[1], -cd[0]))[:max_candidates]
        g.candidates = sorted(c for c, _ in keep)
        rc_valid[gi] = [(c, d) for c, d in keep if valid_recompute(gi, c)]

    # -- options ---------------------------------------------------------------------------------
    for gi, g in enumerate(groups):
        wp = int(window_of[g.pos])
        # (last use before the gap, last use holding its bytes, bytes)
        spans = [(saved_info[o][0], saved_info[o][2] - (o in donated), size(o)) for o in g.saved]
        extra = sum(size(o) for c in g.chain for o in tg.vertices[c].outputs if o >= 0) + \
            sum(size(o) for o in tg.vertices[g.vertex].outputs if o >= 0 and o not in g.saved)
        # another group's vertex run again in the chain makes its saved outputs again, and the copies
        # replace them for every reader after the recomputation (ir/plan.py): they are counted from
        # there to their last use, on top of what that group's own option holds (an upper bound;
        # a layer norm's mean and rstd, a few KiB)
        remade = [(saved_info[o][2], size(o)) for h in g.chain if h in group_vertex_set for o in group_vertices[h]]
        g.options.append(Option(KEEP, -1, [(g.pos, last, b) for _, last, b in spans]))
        n_saved, n_rc = len(g.saved), len(g.chain) + 1
        for c in g.candidates:
            wc = int(window_of[c])
            wr = max(wc - 1, wp)
            # Memory follows BuildMemGraph's serial accounting: an offloaded value leaves the
            # arena after its last use before the gap and is reloaded at the use after it, just
            # like a recomputed one; the transfers themselves cost time in the windows of
            # production and of the use (prefetched one window ahead).
            ivs = [iv for hold, last, b in spans for iv in _union(g.pos, hold, c, max(c, last), b)]
            if all(_gap_is_largest(g.pos, readers[o], saved_info[o][0], c) for o in g.saved):
                # one offload vertex per saved value after production, one reload before the use.
                # reload_room (experimental, off by default until measured on a GPU): the reload's
                # bytes are counted from the start of the window its transfer is charged to, as a
                # prefetch needs them; by default only from the use (the H100 trace of gpt350m at
                # 50% shows reloads that could not start early for want of arena room; with the
                # builder's reload reservations it simulated no better on the H100 export of gpt1.3b:
                # 359.7 ms either way at 25%, 238.0 against 223.4 at 50%)
                fetch = [max(hold + 1, min(c, int(win_start[wr]))) if reload_room else c for hold, _, _ in spans]
                off_ivs = [iv for (hold, last, b), f in zip(spans, fetch)
                           for iv in _union(g.pos, hold, f, max(c, last), b)]
                g.options.append(Option(OFFLOAD, c, off_ivs, h2d=(wr, g.nbytes), d2h=(wp, g.nbytes),
                                        host=launches(host_per_vertex, (wp, n_saved), (wr, n_saved))))
            if any(c == cc for cc, _ in rc_valid[gi]):
                g.options.append(Option(RECOMPUTE, c, ivs + [(c, max(c, last), b) for last, b in remade],
                                        compute=(wc, g.rc_time), extra=extra,
                                        host=launches(host_per_vertex, (wc, n_rc))))
        g.index = {(o.kind, o.at): i for i, o in enumerate(g.options)}

    # -- fixed memory ------------------------------------------------------------------------------
    diff = np.zeros(n + 1, dtype=np.int64)

    def add(first: int, last: int, b: int) -> None:
        diff[first] += b
        diff[last + 1] -= b

    batch_last: dict[int, int] = {}
    for gi, reads in batch_reads.items():
        for u in reads:
            top = max((c for c, _ in rc_valid.get(gi, [])), default=-1)
            batch_last[u] = max(batch_last.get(u, -1), top)
    base_h2d = np.zeros(len(win_start), dtype=np.float64)
    homed = []
    unplaced = tg.unused_persistent()  # nothing reads them: no place to decide (memgraph/schedule.py)
    for val in tg.values:
        vid = val.id
        if vid in unplaced:
            continue
        if val.kind in _HOMED:
            homed.append(vid)
        elif val.kind is ValueKind.CONSTANT:
            add(0, n - 1, size(vid))
        elif val.kind is ValueKind.BATCH:
            add(0, max(last_use(vid) - (vid in donated), batch_last.get(vid, -1), 0), size(vid))
            base_h2d[0] += size(vid)
        elif vid in saved_info or (vid in targets and tg.values[targets[vid]].kind in _HOMED):
            continue  # a group's saved output or an updated home value: decided below
        elif val.producer >= 0:
            prod = int(pos[val.producer])
            end = n - 1 if vid in step_outputs else max(prod, last_use(vid) - (vid in donated))
            add(prod, end, size(vid))

    items = _items(tg, homed, targets, readers, pos, window_of, win_start, win_end, n, size, add, max_items,
                   taken_over, host_per_vertex)
    item_of = {v: i for i, item in enumerate(items) for v in item.values}
    base = np.cumsum(diff[:n])

    base_compute = np.zeros(len(win_start), dtype=np.float64)
    np.add.at(base_compute, window_of, times)
    base_host = _base_host(tg, pos, window_of, len(win_start), readers, host_per_vertex)
    max_ws = tg.step_workspace()
    cap = planning_cap(gpu_budget, max_ws, alignment, headroom)
    problem = Problem(tg=tg, order=order, pos=pos, times=times, win_start=win_start, win_end=win_end,
                      window_of=window_of, base=base, base_compute=base_compute, base_h2d=base_h2d,
                      base_d2h=np.zeros(len(win_start)), base_host=base_host, groups=groups, items=items,
                      item_of=item_of, required_by=required_by, cap=cap,
                      cpu_cap=float("inf") if cpu_budget is None else float(cpu_budget),
                      bw_h2d=float(bw_h2d), bw_d2h=float(bw_d2h),
                      bw_duplex=float(bw_duplex) if bw_duplex else math.inf, max_workspace=max_ws, alignment=alignment,
                      gpu_budget=int(gpu_budget), headroom=headroom, host_per_vertex=float(host_per_vertex))
    log.info("problem: %d positions, %d windows, %d groups (%d options), %d home items, cap %d bytes",
             n, len(win_start), len(groups), sum(len(g.options) for g in groups), len(items), cap)
    return problem


def planning_cap(gpu_budget: int, step_workspace: int, alignment: int, headroom: float) -> int:
    """Bytes the planners let values take at any position: the headroom's share of the arena the
    budget leaves beside the step's workspace."""
    return math.floor(headroom * arena_capacity(gpu_budget, step_workspace, alignment))


def with_headroom(problem: Problem, headroom: float) -> Problem:
    """The same problem with another headroom: only the cap differs, so the tables memory.py
    derives from the problem (and keeps on it) are shared, not made again."""
    other = copy.copy(problem)
    other.headroom = headroom
    other.cap = planning_cap(problem.gpu_budget, problem.max_workspace, problem.alignment, headroom)
    return other


def launches(host_per_vertex: float, *counts: tuple[int, int]) -> tuple[tuple[int, float], ...]:
    """(window, host seconds) of launching `count` vertices in each (window, count); nothing when
    launches cost the host nothing, so a zero host cost leaves every option as it was."""
    if host_per_vertex <= 0:
        return ()
    return tuple((k, count * host_per_vertex) for k, count in counts if count)


def _base_host(tg: TaskGraph, pos: np.ndarray, window_of: np.ndarray, n_windows: int, readers: list[list[int]],
               host_per_vertex: float) -> np.ndarray:
    """Host seconds per window of the launches every plan makes: one compute vertex per position,
    a copy-in per batch input read (in the first window, where their bytes are counted) and a
    read-back per step output (the builder runs it right after the producer)."""
    counts = np.bincount(window_of, minlength=n_windows).astype(np.float64)
    if len(window_of):
        counts[0] += sum(1 for v in tg.values if v.kind is ValueKind.BATCH and readers[v.id])
        for vid in tg.outputs.values():
            prod = tg.values[vid].producer
            if prod >= 0:
                counts[window_of[pos[prod]]] += 1
    return counts * host_per_vertex


def _gap_is_largest(prod: int, reads: list[int], hold: int, c: int) -> bool:
    """BuildMemGraph frees an offloaded value across the longest gap between its uses: the
    option only means what it says when that gap is the one from `hold` to `c`."""
    events = sorted({prod, c, *reads})
    if c - hold < 2:
        return False
    return all(b - a <= c - hold for a, b in itertools.pairwise(events) if not (a == hold and b == c))


def _union(a0: int, a1: int, b0: int, b1: int, b: int) -> list[tuple[int, int, int]]:
    """Intervals [a0, a1] and [b0, b1] (a0 <= b0) as disjoint pieces."""
    if b0 <= a1 + 1:
        return [(a0, max(a1, b1), b)]
    return [(a0, a1, b), (b0, b1, b)]


def _item_key(tg: TaskGraph, vid: int, level: int) -> str:
    val = tg.values[vid]
    name = val.name
    if not name:
        return f"{val.kind.value}:{vid}"
    prefix, _, path = name.partition(":")
    if val.kind is ValueKind.OPTIMIZER_STATE and prefix == "opt":
        prefix, path = "state", path.rpartition(".")[0]  # all states of one parameter move together
    for _ in range(level):  # coarser: by module, then by parent module
        path = path.rpartition(".")[0] or path
    return f"{prefix}:{path}"


def _items(tg, homed, targets, readers, pos, window_of, win_start, win_end, n, size, add, max_items, taken_over,
           host_per_vertex) -> list[Item]:
    inverse = {src: dst for dst, src in targets.items()}
    level, keys = 0, None
    while True:
        keys = {v: _item_key(tg, v, level) for v in homed}
        if len(set(keys.values())) <= max_items or level >= 4:
            break
        level += 1
    by_key: dict[str, list[int]] = {}
    for v in homed:
        by_key.setdefault(keys[v], []).append(v)
    items = []
    for key, values in by_key.items():
        delta, h2d, d2h, need = [], {}, {}, {}
        fetches, writes = [], []  # windows of the item's fetch and write-back vertices
        nbytes = 0
        for w in values:
            b = size(w)
            nbytes += b
            add(0, n - 1, b)  # GPU home: resident the whole step (the CPU home subtracts via delta)
            delta.append((0, n - 1, -b))
            wins = sorted({int(window_of[p]) for p in readers[w]})
            present = set()
            for k in wins:
                present.update((k - 1, k) if k > 0 else (k,))
            spans = []
            for first, last in _runs(sorted(present)):
                # fetched in the run's first window (time); in the arena from the run's first
                # reader to its last, as BuildMemGraph reloads on demand (memory)
                inside = [p for p in readers[w] if first <= window_of[p] <= last]
                spans.append((int(inside[0]), int(inside[-1])))
                delta.append((int(inside[0]), int(inside[-1]), b))
                h2d[first] = h2d.get(first, 0) + b
                fetches.append(first)
            need[w] = spans
            u = inverse.get(w)
            if u is None:
                continue
            bu = size(u)
            p_u = int(pos[tg.values[u].producer])
            own_last = readers[u][-1] if readers[u] else p_u
            old_last = readers[w][-1] if readers[w] else p_u
            gpu_end = max(p_u, own_last, old_last)  # copied into its home once the old value is dead
            cpu_end = max(own_last, p_u)  # written back (d2h) as soon as it is produced
            # an update in place writes the new version over the old one's bytes: no second buffer,
            # on a GPU home or a reloaded copy
            in_place = (w, u) in taken_over
            if not in_place:
                add(p_u, gpu_end, bu)
                delta.append((p_u, gpu_end, -bu))
            if not in_place or cpu_end > p_u:
                delta.append((p_u + in_place, cpu_end, bu))
            d2h[int(window_of[p_u])] = d2h.get(int(window_of[p_u]), 0) + bu
            writes.append(int(window_of[p_u]))
        host = dict(launches(host_per_vertex, *Counter(fetches + writes).items()))
        items.append(Item(name=key, kind=tg.values[values[0]].kind.value, values=values, nbytes=nbytes,
                          delta=delta, h2d=h2d, d2h=d2h, present=need, host=host))
    return items


def _runs(sorted_windows: list[int]) -> list[tuple[int, int]]:
    runs = []
    for k in sorted_windows:
        if runs and runs[-1][1] == k - 1:
            runs[-1] = (runs[-1][0], k)
        else:
            runs.append((k, k))
    return runs
