"""Offsets for the keep-everything arena, packed offline from the values' lifetimes.

When nothing is ever evicted, every value's stay in the arena is known before the walk: from
the step that produces it (or first reads it, for a batch value) to the step that reads it
last. An online allocator that sees the stays one at a time leaves holes (about 5% of the
arena on a 350M-parameter GPT); packing them all at once, largest first, each into the
tightest gap among the stays it overlaps in time ("greedy by size", Pisarchyk and Lee,
"Efficient Memory Management for Deep Neural Net Inference", 2020), comes within a few
bytes of the bytes live at once. The walk (horizons.HorizonWalk) places each value at its
packed offset when those bytes are free, else wherever it fits, so a hint can never make
a build wrong, only larger.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.taskgraph import TaskGraph, ValueKind
from .schedule import Schedule


@dataclass
class Stay:
    values: list[int]  # one value, or a chain of in-place versions sharing the same bytes
    size: int
    first: int  # schedule step it is placed at
    last: int  # schedule step it is read last (inclusive: placed and read in one step overlap)


def stays(tg: TaskGraph, sched: Schedule, prefetch: int = 0, settle: int = 0) -> list[Stay]:
    """Arena stays of every value that is not a GPU home, evicting only where the plan says: a
    value the schedule releases (an offloaded activation, a CPU-homed weight between fetch runs)
    has one stay up to the release (and ``settle`` steps past it, the time its offload may still
    be running, as room allows before the next stay) and another from ``prefetch`` steps before its
    next use (the room its reload may start in) to its last use."""
    first: dict[int, int] = {}
    for s, step in enumerate(sched.steps):
        if step[0] != 0:  # OUT and WB steps read; they place nothing
            continue
        vid = step[1]
        for o in sched.outputs[vid]:
            first.setdefault(o, s)
        for x in sched.inputs[vid]:
            if not sched.gpu_home[x] and tg.values[x].kind is not ValueKind.INTERMEDIATE:
                first.setdefault(x, s)  # batch values and CPU homes arrive when first read
    chain: dict[int, int] = {}  # in-place version -> the value whose stay it continues
    for pairs in sched.in_place.values():
        for old, new in pairs:
            chain[new] = chain.get(old, old)
    by_root: dict[int, Stay] = {}
    for v, s in first.items():
        root = chain.get(v, v)
        if root in by_root or sched.gpu_home[root]:
            continue
        by_root[root] = Stay([root], sched.size[root], s, s)
    for v, root in chain.items():
        if root in by_root:
            by_root[root].values.append(v)
    for stay in by_root.values():
        for v in stay.values:
            uses = sched.uses[v]
            stay.last = max(stay.last, uses[-1] if uses else first.get(v, stay.first))
    released: dict[int, list[int]] = {}
    for s, vids in sched.release_at.items():
        for v in vids:
            released.setdefault(v, []).append(s)
    out = []
    for root, stay in by_root.items():
        cuts = sorted(released.get(root, ())) if len(stay.values) == 1 else []
        start = stay.first
        for r in cuts:
            later = [u for u in sched.uses[root] if u > r]
            if r < start or not later:
                continue
            held = min(r + settle, later[0] - prefetch - 1) if settle else r
            out.append(Stay([root], stay.size, start, max(r, held)))
            start = max(max(r, held) + 1, later[0] - prefetch)
        out.append(Stay([root], stay.size, start, stay.last))
    return out


def live_peak(items: list[Stay]) -> int:
    """The most bytes of stays that meet in time, at any one step: a lower bound of pack's bytes
    (stays that meet never share bytes), found without packing."""
    if not items:
        return 0
    firsts = np.array([stay.first for stay in items], dtype=np.int64)
    lasts = np.array([stay.last for stay in items], dtype=np.int64)
    sizes = np.array([stay.size for stay in items], dtype=np.int64)
    diff = np.zeros(int(max(lasts.max(), firsts.max())) + 2, dtype=np.int64)
    np.add.at(diff, firsts, sizes)
    np.add.at(diff, lasts + 1, -sizes)
    return int(np.cumsum(diff).max())


def pack(items: list[Stay]) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """({value: [(first step of a stay, its offset), ...] in step order}, bytes needed): largest
    first, each into the smallest gap that fits among the already packed stays it overlaps in
    time, else above them all."""
    order = sorted(range(len(items)), key=lambda i: (-items[i].size, items[i].first - items[i].last))
    firsts = np.array([items[i].first for i in order], dtype=np.int64)
    lasts = np.array([items[i].last for i in order], dtype=np.int64)
    offsets = np.zeros(len(order), dtype=np.int64)
    ends = np.zeros(len(order), dtype=np.int64)
    top = 0
    for k, i in enumerate(order):
        size = items[i].size
        live = np.flatnonzero((firsts[:k] <= lasts[k]) & (lasts[:k] >= firsts[k]))
        if len(live):
            by_offset = live[np.argsort(offsets[live], kind="stable")]
            starts = offsets[by_offset]
            # reach before each stay (in offset order): the highest end below it, from 0
            reach = np.maximum.accumulate(np.concatenate(([0], ends[by_offset])))
            gaps = starts - reach[:-1]
            fits = np.flatnonzero(gaps >= size)
            # the smallest gap that fits, the lowest of equal ones; else above them all
            at = int(reach[fits[np.argmin(gaps[fits])]]) if len(fits) else int(reach[-1])
        else:
            at = 0
        offsets[k], ends[k] = at, at + size
        top = max(top, at + size)
    placed: dict[int, list[tuple[int, int]]] = {}
    for k, i in enumerate(order):
        for v in items[i].values:
            placed.setdefault(v, []).append((items[i].first, int(offsets[k])))
    for spots in placed.values():
        spots.sort()
    return placed, int(top)
