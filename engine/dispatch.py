"""What a MemGraph vertex means to the engine, decided once: which hook runs it, which places it uses.

One dispatch on the vertex kind. ``HOOKS`` names each kind's hooks, as
torch.fx's Interpreter routes a node by its op to one method: a runtime binds
a vertex with ``bind_<name>`` (engine/runtime.py) and runs it with
``run_<name>`` (each backend); the timing simulator prices it with
``time_<name>`` (engine/timing_sim.py). ``per_vertex`` looks the methods up
once per MemGraph, so a launch costs a list index, not an if/elif chain.

One decoding of places. ``transfer_pairs``, ``input_place`` and
``output_place`` say where an offload, reload, copy, input or output vertex
reads and writes; every backend uses them, so backends cannot disagree on
how a vertex's reads pair with its writes.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ir.describe import format_vertex
from ..ir.memgraph import Kind, MemGraph, MVertex, Place
from .errors import EngineError

HOOKS: dict[Kind, str] = {
    Kind.COMPUTE: "compute",
    Kind.OFFLOAD: "offload",
    Kind.RELOAD: "reload",
    Kind.COPY: "copy",
    Kind.INPUT: "input",
    Kind.OUTPUT: "output",
}


def per_vertex(owner: type | object, prefix: str, vertices: list[MVertex],
               unknown: Callable | None = None) -> list[Callable]:
    """``getattr(owner, prefix + HOOKS[kind])`` for every vertex, by its kind.

    Pass a class to get plain functions (called with the instance first), so
    an object that keeps the list makes no reference cycle with itself. A
    vertex whose kind is not in HOOKS gets ``unknown`` (an error if None).
    """
    table = {}
    for kind, name in HOOKS.items():
        hook = getattr(owner, prefix + name, None)
        if hook is None:
            raise TypeError(f"{getattr(owner, '__name__', type(owner).__name__)} has no {prefix + name}() "
                            f"for {kind.value} vertices")
        table[kind] = hook
    hooks = []
    for mv in vertices:
        hook = table.get(mv.kind) if isinstance(mv.kind, Kind) else None
        if hook is None:
            if unknown is None:
                raise EngineError(f"vertex {mv.id}: unknown kind {mv.kind!r}")
            hook = unknown
        hooks.append(hook)
    return hooks


def transfer_pairs(mg: MemGraph, mv: MVertex) -> list[tuple[int, Place, Place]]:
    """(value, read place, write place) for each value an offload, reload or copy vertex moves.

    The rule: each read value goes to the write place of the same value; or, for
    one read and one write of different values (an updated parameter copied into
    its home, which belongs to the old value), the read goes to the write.
    """
    reads, writes = mv.reads, mv.writes
    if reads.keys() == writes.keys():
        return [(v, reads[v], writes[v]) for v in reads]
    if len(reads) == 1 and len(writes) == 1:
        (v, src), (dst,) = next(iter(reads.items())), writes.values()
        return [(v, src, dst)]
    raise EngineError(f"{format_vertex(mg, mv.id, inputs=False)} reads values {sorted(reads)} but writes "
                      f"{sorted(writes)}: cannot pair them (each read value needs a write place of the same "
                      f"value, or one read and one write)")


def input_place(mg: MemGraph, mv: MVertex) -> Place:
    """Where an input vertex writes its batch value: the place of that value, else its only write."""
    return _place_of_value(mg, mv, mv.writes, "goes (it writes")


def output_place(mg: MemGraph, mv: MVertex) -> Place:
    """Where an output vertex reads its value: the place of that value, else its only read."""
    return _place_of_value(mg, mv, mv.reads, "is read (it reads")


def _place_of_value(mg: MemGraph, mv: MVertex, places: dict, where: str) -> Place:
    place = places.get(mv.value)
    if place is None:
        if len(places) != 1:
            raise EngineError(f"{format_vertex(mg, mv.id, inputs=False)} does not say where its value {where} "
                              f"{sorted(places)})")
        (place,) = places.values()
    return place
