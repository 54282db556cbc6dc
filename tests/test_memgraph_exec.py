"""Run built MemGraphs on a numpy byte arena in many random orders the edges permit.

Every task vertex computes a deterministic function of its inputs' bytes
(a hash-seeded byte stream), so any race (a value overwritten before a reader
ran, a read of the wrong place, a lost write-back) changes the bytes of the
step outputs or of the final homes. The reference runs the original, unexpanded
TaskGraph on a dict of values; a recomputed copy uses its original's function,
so it must reproduce the original's bytes exactly.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from synthetic import chain_of_blocks, random_plan, random_taskgraph, unconstrained_budget
from turnip.ir.memgraph import Kind, MemGraph
from turnip.ir.plan import Plan
from turnip.ir.taskgraph import TaskGraph, ValueKind
from turnip.memgraph import build, verify
from turnip.memgraph.builder import minimum_budget


def _bytes(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _compute(op_id: int, out_index: int, nbytes: int, inputs: list[np.ndarray]) -> np.ndarray:
    crc = 0
    for arr in inputs:
        crc = zlib.crc32(arr.tobytes(), crc)
    return _bytes((op_id * 1_000_003 + out_index * 7919 + crc) & 0xFFFFFFFF, nbytes)


def initial_state(tg: TaskGraph) -> dict[int, np.ndarray]:
    """Bytes of every input value (batch and persistent), fixed per value id."""
    return {v.id: _bytes(v.id + 17, v.nbytes) for v in tg.values if v.kind.is_input}


def reference(tg: TaskGraph, state: dict[int, np.ndarray]) -> tuple[dict, dict]:
    """(outputs by name, final bytes of each persistent input) of the step, run in program order."""
    vals = dict(state)
    for vertex in tg.vertices:
        ins = [vals[x] for x in vertex.inputs()]
        for k, out in enumerate(vertex.outputs):
            if out >= 0:
                vals[out] = _compute(vertex.id, k, tg.values[out].nbytes, ins)
    outputs = {name: vals[v] for name, v in tg.outputs.items()}
    homes = {v.id: vals[tg.bindings.get(v.id, v.id)] for v in tg.values if v.kind.is_persistent}
    return outputs, homes


def random_order(mg: MemGraph, rng: random.Random) -> list[int]:
    """A uniformly random pick among ready vertices at every step (Kahn)."""
    n = len(mg.vertices)
    succs = mg.successors()
    indeg = [len(p) for p in mg.predecessors()]
    ready = [v for v in range(n) if indeg[v] == 0]
    order = []
    while ready:
        v = ready.pop(rng.randrange(len(ready)))
        order.append(v)
        for w in succs[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    assert len(order) == n, "cycle"
    return order


def execute(mg: MemGraph, state: dict[int, np.ndarray], order: list[int]) -> tuple[dict, dict]:
    """Run the MemGraph in the given order on garbage-filled arena and CPU storage."""
    tg = mg.taskgraph
    arena = np.full(max(mg.arena_bytes, 1), 0xA5, dtype=np.uint8)
    cpu = np.full(max(mg.cpu_bytes, 1), 0x5A, dtype=np.uint8)
    storage = {"gpu": arena, "cpu": cpu}

    def read(v: int, place) -> np.ndarray:
        return storage[place.where][place.offset:place.offset + tg.values[v].nbytes].copy()

    def write(v: int, place, data: np.ndarray) -> None:
        assert data.size == tg.values[v].nbytes
        storage[place.where][place.offset:place.offset + data.size] = data

    for v, place in mg.homes.items():
        write(v, place, state[v])
    outputs = {}
    for mid in order:
        mv = mg.vertices[mid]
        if mv.kind is Kind.COMPUTE:
            vertex = tg.vertices[mv.task_vertex]
            op_id = vertex.recompute_of if vertex.recompute_of >= 0 else vertex.id
            ins = [read(x, mv.reads[x]) for x in vertex.inputs()]
            for k, out in enumerate(vertex.outputs):
                if out >= 0:
                    write(out, mv.writes[out], _compute(op_id, k, tg.values[out].nbytes, ins))
        elif mv.kind is Kind.INPUT:
            write(mv.value, mv.writes[mv.value], state[mv.value])
        elif mv.kind is Kind.OUTPUT:
            outputs[mv.name] = read(mv.value, mv.reads[mv.value])
        else:  # OFFLOAD, RELOAD, COPY: move bytes
            (v, src), = mv.reads.items()
            write(v, mv.writes[v], read(v, src))
    homes = {v: read(tg.bindings.get(v, v), place) for v, place in mg.homes.items()}
    return outputs, homes


def check_all_orders(tg: TaskGraph, plan: Plan, n_orders: int, seed: int) -> MemGraph:
    mg = build(tg, plan)
    assert verify(mg) == []
    state = initial_state(tg)
    ref_out, ref_homes = reference(tg, state)
    rng = random.Random(seed)
    orders = [list(mg.serial)] + [random_order(mg, rng) for _ in range(n_orders)]
    for order in orders:
        out, homes = execute(mg, state, order)
        assert out.keys() == ref_out.keys()
        for name in ref_out:
            assert np.array_equal(out[name], ref_out[name]), f"output {name} differs"
        assert homes.keys() == ref_homes.keys()
        for v in ref_homes:
            assert np.array_equal(homes[v], ref_homes[v]), f"final home of value {v} differs"
    return mg


@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_every_order_matches_reference(seed):
    rng = random.Random(seed)
    tg = random_taskgraph(rng, rng.choice([20, 60, 150]), max_bytes=rng.choice([4_000, 64_000]))
    plan = random_plan(rng, tg, cpu_budget=None)
    low, _ = minimum_budget(tg, plan)
    high = unconstrained_budget(tg, plan)
    for fraction in (0.0, 0.1, 0.5, 1.0):
        plan.gpu_budget = int(low + fraction * (high - low))
        check_all_orders(tg, plan, n_orders=8, seed=seed)


def test_chain_of_blocks_at_quarter_budget_matches_reference():
    tg = chain_of_blocks(6, act_bytes=16384, param_bytes=1024)
    plan = Plan(gpu_budget=tg.live_peak(alignment=256) // 4)
    mg = check_all_orders(tg, plan, n_orders=20, seed=1)
    assert mg.stats.get("offloads_evicted", 0) > 0


def test_cpu_homes_offloads_and_recompute_match_reference():
    rng = random.Random(99)
    tg = random_taskgraph(rng, 120)
    plan = random_plan(rng, tg, p_offload=0.4, p_cpu_home=0.6, n_recompute=6)
    plan.gpu_budget = minimum_budget(tg, plan)[0]
    mg = check_all_orders(tg, plan, n_orders=10, seed=2)
    kinds = {mv.kind for mv in mg.vertices}
    assert {Kind.RELOAD, Kind.OFFLOAD, Kind.COPY} <= kinds
    assert any(mg.taskgraph.vertices[mv.task_vertex].recompute_of >= 0
               for mv in mg.vertices if mv.kind is Kind.COMPUTE)
    assert any(v.kind is ValueKind.BATCH for v in tg.values)


@pytest.mark.parametrize("seed", range(8))
def test_in_place_updates_every_order_matches_reference(seed):
    """In-place ops (activations and optimizer updates): where nothing reads the old version after,
    the builder puts the new version over it; every order still computes the reference's bytes."""
    rng = random.Random(1000 + seed)
    tg = random_taskgraph(rng, rng.choice([40, 120]), p_in_place=0.6)
    plan = random_plan(rng, tg, cpu_budget=None)
    low, _ = minimum_budget(tg, plan)
    high = unconstrained_budget(tg, plan)
    placed_in_place = 0
    for fraction in (0.0, 0.3, 1.0):
        plan.gpu_budget = int(low + fraction * (high - low))
        mg = check_all_orders(tg, plan, n_orders=8, seed=seed)
        placed_in_place += mg.stats.get("in_place", 0)
    assert placed_in_place > 0


def test_in_place_weight_updates_need_no_write_back():
    tg = chain_of_blocks(4, act_bytes=4096, param_bytes=1024, in_place=True)
    mg = check_all_orders(tg, Plan(gpu_budget=unconstrained_budget(tg, Plan(gpu_budget=0))), n_orders=10, seed=3)
    assert mg.stats["in_place"] == 8 and not any(mv.kind is Kind.COPY for mv in mg.vertices)
    for old, new in tg.bindings.items():  # each updated weight was written straight into its home
        writer = next(mv for mv in mg.vertices if new in mv.writes)
        assert writer.kind is Kind.COMPUTE and writer.writes[new] == mg.homes[old] == writer.reads[old]
    tight = check_all_orders(tg, Plan(gpu_budget=tg.live_peak(alignment=256) // 3), n_orders=10, seed=4)
    assert tight.stats.get("offloads_evicted", 0) > 0
