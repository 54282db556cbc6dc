"""Offline packing of the keep-everything arena: stays that meet in time never share bytes, and the
compact build's arena comes down to the bytes live at once."""

from __future__ import annotations

import random

import pytest
from synthetic import chain_of_blocks, random_taskgraph
from turnip.ir.plan import Plan
from turnip.memgraph import build, verify
from turnip.memgraph.packing import Stay, pack, stays
from turnip.memgraph.schedule import Schedule

UNBOUNDED = 1 << 62


def test_pack_never_overlaps_stays_that_meet_in_time():
    rng = random.Random(5)
    items = []
    for v in range(300):
        first = rng.randrange(100)
        items.append(Stay([v], rng.choice([256, 512, 4096, 65536]), first, first + rng.randrange(20)))
    placed, top = pack(items)
    for a in items:
        for b in items:
            if a is b or a.first > b.last or b.first > a.last:
                continue
            oa, ob = placed[a.values[0]], placed[b.values[0]]
            assert oa + a.size <= ob or ob + b.size <= oa, f"stays {a} and {b} share bytes"
    assert top == max(placed[s.values[0]] + s.size for s in items)
    live_peak = max(sum(s.size for s in items if s.first <= t <= s.last) for t in range(120))
    assert live_peak <= top <= 1.15 * live_peak


def test_in_place_versions_share_one_stay():
    tg = chain_of_blocks(3, act_bytes=4096, param_bytes=1024, in_place=True)
    sched = Schedule(tg, list(range(len(tg.vertices))), Plan(gpu_budget=UNBOUNDED), 256)
    found = stays(tg, sched)
    covered = [v for s in found for v in s.values]
    assert len(covered) == len(set(covered))  # no value in two stays
    homes = [v for v in range(len(tg.values)) if sched.gpu_home[v]]
    assert not set(covered) & set(homes)  # homes live below the packed region


@pytest.mark.parametrize("seed", range(6))
def test_compact_build_reaches_the_live_peak(seed):
    rng = random.Random(seed)
    tg = random_taskgraph(rng, 150, p_in_place=0.3 * (seed % 2))
    mg = build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=256, compact=True)
    assert verify(mg) == []
    assert mg.stats["packed_placements"] > 0
    assert mg.arena_bytes <= mg.stats["packed_arena_bytes"]
    assert mg.arena_bytes <= 1.05 * tg.live_peak(alignment=256)


def test_compact_build_of_a_transformer_like_chain_is_exactly_the_live_peak():
    tg = chain_of_blocks(8, act_bytes=1 << 16, param_bytes=1 << 12, seed=2)
    mg = build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=256, compact=True)
    assert verify(mg) == []
    assert mg.arena_bytes == tg.live_peak(alignment=256)
