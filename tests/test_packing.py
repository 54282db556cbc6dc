"""Offline packing of the keep-everything arena: stays that meet in time never share bytes, and the
compact build's arena comes down to the bytes live at once."""

from __future__ import annotations

import random

import pytest
from synthetic import chain_of_blocks, random_taskgraph
from turnip.ir.plan import Plan
from turnip.ir.sizes import aligned
from turnip.memgraph import build, verify
from turnip.memgraph.builder import build_walks
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
            (_, oa), = placed[a.values[0]]
            (_, ob), = placed[b.values[0]]
            assert oa + a.size <= ob or ob + b.size <= oa, f"stays {a} and {b} share bytes"
    assert top == max(placed[s.values[0]][0][1] + s.size for s in items)
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


@pytest.mark.parametrize("prefetch", [0, 3])
def test_a_planned_offload_splits_its_value_into_two_stays(prefetch):
    """An offloaded activation leaves the arena between its forward and backward uses: packed as
    two stays, its bytes serve others in the gap, and its reload's stay starts `prefetch` steps
    early (never before the release)."""
    tg = chain_of_blocks(6, act_bytes=1 << 16, param_bytes=1 << 12, seed=2)
    keep = Schedule(tg, list(range(len(tg.vertices))), Plan(gpu_budget=UNBOUNDED), 256)
    offload = {v for v in range(len(tg.values)) if len(keep.uses[v]) > 1 and keep.uses[v][-1] - keep.uses[v][0] > 10
               and tg.values[v].producer >= 0 and not keep.gpu_home[v]}
    assert offload
    plan = Plan(gpu_budget=UNBOUNDED, offload=offload)
    sched = Schedule(tg, list(range(len(tg.vertices))), plan, 256)
    found = stays(tg, sched, prefetch)
    by_value: dict[int, list] = {}
    for stay in found:
        by_value.setdefault(stay.values[0], []).append(stay)
    released = {v: s for s, vids in sched.release_at.items() for v in vids}
    assert released
    for v, r in released.items():
        first, second = sorted(by_value[v], key=lambda st: st.first)
        assert first.last == r and r < second.first <= next(u for u in sched.uses[v] if u > r)
        assert second.first >= next(u for u in sched.uses[v] if u > r) - prefetch
    unsplit = sum(s.size for s in stays(tg, keep))
    assert sum(s.size * (s.last - s.first + 1) for s in found) < sum(
        s.size * (s.last - s.first + 1) for s in stays(tg, keep)) or unsplit == 0


@pytest.mark.parametrize("settle", [2, 5])
def test_an_offloaded_value_keeps_its_bytes_while_its_copy_may_run(settle):
    """settle: the first stay of an offloaded value lasts up to ``settle`` steps past its release
    (the copy may still be queued on the link; the next tenant of those bytes would wait for it),
    never into its reload's prefetch room; a compact build whose arena has that room uses it."""
    tg = chain_of_blocks(8, act_bytes=1 << 16, param_bytes=1 << 12, seed=2)
    keep = Schedule(tg, list(range(len(tg.vertices))), Plan(gpu_budget=UNBOUNDED), 256)
    offload = {v for v in range(len(tg.values)) if len(keep.uses[v]) > 1 and keep.uses[v][-1] - keep.uses[v][0] > 10
               and tg.values[v].producer >= 0 and not keep.gpu_home[v]}
    sched = Schedule(tg, list(range(len(tg.vertices))), Plan(gpu_budget=UNBOUNDED, offload=offload), 256)
    prefetch = 3
    plain, settled = stays(tg, sched, prefetch), stays(tg, sched, prefetch, settle)
    released = {v: s for s, vids in sched.release_at.items() for v in vids}
    extended = 0
    for v, r in released.items():
        before = sorted((st for st in plain if st.values[0] == v), key=lambda st: st.first)
        after = sorted((st for st in settled if st.values[0] == v), key=lambda st: st.first)
        assert before[0].last == r and r <= after[0].last <= r + settle
        assert after[0].last < after[1].first and after[1].first == before[1].first
        extended += after[0].last > r
    assert extended > 0
    full = build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=256, compact=True).arena_bytes
    mg = build(tg, Plan(gpu_budget=full, offload=offload), alignment=256, compact=True)
    assert verify(mg) == [] and mg.stats["packed_settle_steps"] > 0


def test_compact_build_of_an_offload_plan_places_reloads_where_packed():
    tg = chain_of_blocks(8, act_bytes=1 << 16, param_bytes=1 << 12, seed=2)
    keep = Schedule(tg, list(range(len(tg.vertices))), Plan(gpu_budget=UNBOUNDED), 256)
    offload = {v for v in range(len(tg.values)) if len(keep.uses[v]) > 1 and keep.uses[v][-1] - keep.uses[v][0] > 10
               and tg.values[v].producer >= 0 and not keep.gpu_home[v]}
    full = build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=256, compact=True).arena_bytes
    budget = int(0.8 * full)
    mg = build(tg, Plan(gpu_budget=budget, offload=offload), alignment=256, compact=True)
    assert verify(mg) == []
    assert mg.arena_bytes <= budget
    assert "packed_prefetch_steps" in mg.stats and mg.stats["packed_placements"] > 0
    planned = sum(aligned(tg.values[v].nbytes, 256) for v in offload)
    assert mg.summary()["bytes_offloaded"] <= planned  # nothing evicted beyond the plan


def test_build_walks_gives_both_walks_once_and_build_keeps_the_fewer_transfers():
    tg = chain_of_blocks(8, act_bytes=1 << 16, param_bytes=1 << 12, seed=2)
    full = build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=256, compact=True).arena_bytes
    plan = Plan(gpu_budget=int(0.7 * full))
    walks = build_walks(tg, plan, alignment=256)
    assert list(walks) == ["ahead", "compact"]  # one device: no transfers between devices to keep apart
    ahead, packed = walks["ahead"], walks["compact"]
    assert "seconds_pack" not in ahead.stats and "seconds_pack" in packed.stats
    assert verify(ahead) == [] and verify(packed) == []
    moved = [mg.summary()["bytes_offloaded"] for mg in (ahead, packed)]
    chosen = build(tg, plan, alignment=256).summary()["bytes_offloaded"]
    assert chosen == (min(moved) if moved[0] > 0 else moved[0])
