"""memgraph.verify: accepts what build makes, and catches every single-point corruption.

Mutation tests: deleting one memory edge that no other path implies, or
moving one placement onto the bytes of a placement that is live at the same
time, must be reported. Targeted tests cover each family of violation.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import pytest
from synthetic import chain_of_blocks, random_plan, random_taskgraph
from turnip.ir.memgraph import Edge, Kind, MemGraph, Place
from turnip.ir.plan import Plan
from turnip.memgraph import build, verify
from turnip.memgraph.builder import minimum_budget


def built(seed: int, n: int = 80, fraction: float = 0.0) -> MemGraph:
    rng = random.Random(seed)
    tg = random_taskgraph(rng, n)
    plan = random_plan(rng, tg)
    low, _ = minimum_budget(tg, plan)
    plan.gpu_budget = int(low * (1 + fraction))
    mg = build(tg, plan)
    assert verify(mg) == []
    return mg


def reaches(mg: MemGraph, src: int, dst: int) -> bool:
    pos = {v: k for k, v in enumerate(mg.serial)}
    succs = mg.successors()
    seen, queue = {src}, deque([src])
    while queue:
        x = queue.popleft()
        if x == dst:
            return True
        for y in succs[x]:
            if y not in seen and pos[y] <= pos[dst]:
                seen.add(y)
                queue.append(y)
    return False


@pytest.mark.parametrize("seed", range(4))
def test_deleting_a_needed_memory_edge_is_reported(seed):
    mg = built(seed, fraction=0.05 * seed)
    rng = random.Random(seed)
    memory = [i for i, e in enumerate(mg.edges) if e[2] is Edge.MEMORY]
    assert memory, "a tight budget must produce memory edges"
    checked = 0
    for i in rng.sample(memory, min(80, len(memory))):
        edge = mg.edges.pop(i)
        try:
            if reaches(mg, edge[0], edge[1]):
                continue  # implied by other edges: deleting it changes nothing
            checked += 1
            assert verify(mg), f"deleting memory edge {edge} went unnoticed"
        finally:
            mg.edges.insert(i, edge)
    assert checked > 0
    assert verify(mg) == []


def placements(mg: MemGraph) -> list[tuple[int, int, Place, list[int]]]:
    """(writer, value, place, readers) of every write whose (value, place) is written once."""
    writes: dict[tuple, list[int]] = {}
    for mv in mg.vertices:
        for v, place in mv.writes.items():
            writes.setdefault((v, place), []).append(mv.id)
    out = []
    for (v, place), writers in writes.items():
        if len(writers) == 1 and (v, place) not in {(h, p) for h, p in mg.homes.items()}:
            readers = [mv.id for mv in mg.vertices if mv.reads.get(v) == place]
            out.append((writers[0], v, place, readers))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_moving_a_placement_onto_a_live_neighbour_is_reported(seed):
    mg = built(seed + 10, fraction=0.1 * seed)
    rng = random.Random(seed)
    pos = {v: k for k, v in enumerate(mg.serial)}
    pls = placements(mg)
    # a home whose value the step does not update must hold it to the end; an updated one is free
    # between the old version's last read and the write-back, where the builder may lend its bytes
    homes = [(-1, v, p, [len(mg.serial)]) for v, p in mg.homes.items()
             if mg.taskgraph.bindings.get(v, v) == v]
    span = {id(p): (pos.get(p[0], -1), max([pos.get(r, r) for r in p[3]], default=pos.get(p[0], -1)))
            for p in pls + homes}
    checked = 0
    for a in rng.sample(pls, min(60, len(pls))):
        wa, va, pa, readers = a
        lo, hi = span[id(a)]
        live = [b for b in pls + homes if b is not a and b[2].where == pa.where and b[2].offset != pa.offset
                and span[id(b)][0] <= hi and lo <= span[id(b)][1]]
        if not live:
            continue
        b = rng.choice(live)
        moved = dataclasses.replace(pa, offset=b[2].offset)
        touched = [wa] + readers
        saved = {m: (dict(mg.vertices[m].reads), dict(mg.vertices[m].writes)) for m in touched}
        for m in touched:
            mv = mg.vertices[m]
            if m == wa:
                mv.writes[va] = moved
            if mv.reads.get(va) == pa:
                mv.reads[va] = moved
        try:
            checked += 1
            assert verify(mg), f"value {va} moved onto live value {b[1]} went unnoticed"
        finally:
            for m, (reads, writes) in saved.items():
                mg.vertices[m].reads, mg.vertices[m].writes = reads, writes
    assert checked > 0
    assert verify(mg) == []


def test_valid_graphs_pass():
    for seed in range(3):
        built(seed + 20, n=200, fraction=seed * 0.5)
    tg = chain_of_blocks(10, act_bytes=16384, param_bytes=1024)
    assert verify(build(tg, Plan(gpu_budget=tg.live_peak(alignment=256) // 4))) == []


def test_cycle_is_reported():
    mg = built(1)
    computes = [mv.id for mv in mg.vertices if mv.kind is Kind.COMPUTE]
    mg.edges.append((computes[-1], computes[0], Edge.MEMORY))
    problems = verify(mg)
    assert any(p.startswith("(c)") and "cycle" in p for p in problems)


def test_backward_edge_in_serial_is_reported():
    mg = built(2)
    mg.serial = list(reversed(mg.serial))
    assert any(p.startswith("(c)") for p in verify(mg))


def test_missing_data_edge_is_reported():
    mg = built(3)
    i = next(i for i, e in enumerate(mg.edges) if e[2] is Edge.DATA and mg.vertices[e[1]].kind is Kind.COMPUTE)
    mg.edges[i] = (mg.edges[i][0], mg.edges[i][1], Edge.MEMORY)
    assert any(p.startswith("(a)") for p in verify(mg))


def test_missing_compute_vertex_is_reported():
    mg = built(4)
    mv = next(mv for mv in mg.vertices if mv.kind is Kind.COMPUTE)
    mv.task_vertex = (mv.task_vertex + 1) % len(mg.taskgraph.vertices)
    assert any(p.startswith("(a)") for p in verify(mg))


def test_lost_write_back_is_reported():
    mg = built(5)
    copy = next(mv for mv in mg.vertices if mv.kind is Kind.COPY)
    (v, place), = copy.writes.items()
    copy.writes[v] = dataclasses.replace(place, offset=place.offset + mg.alignment)
    assert verify(mg)


def test_place_outside_arena_is_reported():
    mg = built(6)
    mv = next(mv for mv in mg.vertices if mv.kind is Kind.COMPUTE and mv.writes)
    v, place = next(iter(mv.writes.items()))
    mv.writes[v] = dataclasses.replace(place, offset=mg.arena_bytes)
    assert any(p.startswith("(d)") for p in verify(mg))


def test_budgets_are_checked():
    mg = built(7)
    mg.plan = dataclasses.replace(mg.plan, gpu_budget=mg.arena_bytes - 1, cpu_budget=max(mg.cpu_bytes - 1, 0))
    problems = verify(mg)
    assert any("GPU budget" in p for p in problems)
    if mg.cpu_bytes:
        assert any("CPU budget" in p for p in problems)


def in_place_built(seed: int) -> MemGraph:
    rng = random.Random(seed)
    tg = chain_of_blocks(3, act_bytes=4096, param_bytes=1024, in_place=True, seed=seed)
    plan = Plan(gpu_budget=tg.live_peak(alignment=256) * (2 + seed) // 4)
    del rng
    mg = build(tg, plan)
    assert verify(mg) == [] and mg.stats["in_place"] > 0
    return mg


def in_place_vertices(mg: MemGraph) -> list[tuple[int, int, int]]:
    """(compute vertex, old value, new value) where the builder put new over old."""
    found = []
    for mv in mg.vertices:
        if mv.kind is Kind.COMPUTE:
            for old, new in mg.taskgraph.vertices[mv.task_vertex].copy_in:
                if mv.writes.get(new) is not None and mv.writes[new] == mv.reads.get(old):
                    found.append((mv.id, old, new))
    return found


@pytest.mark.parametrize("seed", range(3))
def test_missing_reader_before_in_place_update_is_reported(seed):
    """Every reader of a weight must finish before the update overwrites it where it lies."""
    mg = in_place_built(seed)
    targets = {mid for mid, _, _ in in_place_vertices(mg)}
    assert targets
    checked = 0
    for i, edge in enumerate(list(mg.edges)):
        if edge[1] not in targets or edge[2] is not Edge.MEMORY:
            continue
        mg.edges.pop(i)
        try:
            if reaches(mg, edge[0], edge[1]):
                continue
            checked += 1
            assert any("race" in p for p in verify(mg)), f"deleting {edge} before an in-place update went unnoticed"
        finally:
            mg.edges.insert(i, edge)
    assert checked > 0
    assert verify(mg) == []


def test_undeclared_in_place_write_is_a_race():
    """Only an op that declares the update (copy_in) may write its output over what it reads."""
    mg = in_place_built(0)
    mid, _old, _new = in_place_vertices(mg)[0]
    tv = mg.taskgraph.vertices[mg.vertices[mid].task_vertex]
    declared = tv.copy_in
    tv.copy_in = ()
    try:
        assert any("race" in p and f"vertex {mid} " in p for p in verify(mg))
    finally:
        tv.copy_in = declared
    assert verify(mg) == []
