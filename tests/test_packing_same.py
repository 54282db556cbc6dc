"""memgraph.packing.pack finds each stay's gap with numpy: its offsets must be, for every input, the
ones of the per-stay loop it replaced (kept here as the reference), so no arena changes."""

from __future__ import annotations

import random

import numpy as np
import pytest
from turnip.memgraph.packing import Stay, live_peak, pack


def loop_pack(items: list[Stay]) -> tuple[dict[int, list[tuple[int, int]]], int]:
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
        best, best_gap, reach = None, None, 0
        for j in live[np.argsort(offsets[live], kind="stable")]:
            gap = offsets[j] - reach
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = reach, gap
            reach = max(reach, ends[j])
        at = best if best is not None else reach
        offsets[k], ends[k] = at, at + size
        top = max(top, at + size)
    placed: dict[int, list[tuple[int, int]]] = {}
    for k, i in enumerate(order):
        for v in items[i].values:
            placed.setdefault(v, []).append((items[i].first, int(offsets[k])))
    for spots in placed.values():
        spots.sort()
    return placed, int(top)


@pytest.mark.parametrize("seed", range(12))
def test_pack_places_every_stay_where_the_loop_did(seed):
    rng = random.Random(seed)
    items = []
    for v in range(rng.choice([0, 1, 5, 60, 400])):
        first = rng.randrange(150)
        values = [v] if rng.random() < 0.9 else [v, 10_000 + v]
        items.append(Stay(values, rng.choice([64, 256, 512, 4096, 65536]) * rng.randint(1, 3), first,
                          first + rng.randrange(rng.choice([1, 5, 40]))))
    assert pack(items) == loop_pack(items)


@pytest.mark.parametrize("seed", range(6))
def test_the_live_peak_bounds_the_packed_bytes_from_below(seed):
    rng = random.Random(100 + seed)
    items = []
    for v in range(rng.choice([1, 30, 300])):
        first = rng.randrange(80)
        items.append(Stay([v], rng.choice([64, 4096, 65536]), first, first + rng.randrange(30)))
    live = max(sum(s.size for s in items if s.first <= t <= s.last) for t in range(120))
    assert live_peak(items) == live <= pack(items)[1]
    assert live_peak([]) == 0
