"""How full a MemGraph's arena is over its serial order, read from the MemGraph alone.

A tenancy is one value at one arena place: from the vertex that writes it there to the last
vertex that reads it there (serial positions, both inclusive). Weights and optimizer states
homed on the GPU hold their bytes for the whole step. An in-place op reads the old version and
writes the new one over the same bytes in one vertex; those bytes are counted once. So
``arena_timeline(mg)[k]`` is the arena bytes holding live values while the k-th vertex of the
serial order runs; its maximum is at most ``mg.arena_bytes`` (the difference is fragmentation).
Op workspace is not part of the arena and not counted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..ir.memgraph import Kind, MemGraph, Place

GPU = "gpu"
PHASES = ("forward", "backward", "optimizer")


@dataclass
class PhaseMemory:
    phase: str  # forward, backward, optimizer
    vertices: int  # MemGraph vertices in it (transfers take the phase of the compute before them)
    peak_bytes: int  # most arena bytes in use while one of its vertices runs
    bytes_offloaded: int
    bytes_reloaded: int


def _home_ranges(mg: MemGraph) -> list[tuple[int, int]]:
    """Merged [start, end) ranges of the GPU homes."""
    ranges = sorted({(p.offset, p.end) for p in mg.homes.values() if p.where == GPU and p.nbytes > 0})
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _in_home(place: Place, homes: list[tuple[int, int]], starts: list[int]) -> bool:
    k = bisect.bisect_right(starts, place.offset) - 1
    return k >= 0 and place.offset < homes[k][1]


def _overlap(a: Place, b: Place) -> int:
    return max(0, min(a.end, b.end) - max(a.offset, b.offset))


def arena_timeline(mg: MemGraph) -> list[int]:
    """Arena bytes in use while each vertex of ``mg.serial`` runs (GPU homes included)."""
    n = len(mg.serial)
    if n == 0:
        return []
    pos = {vid: k for k, vid in enumerate(mg.serial)}
    homes = _home_ranges(mg)
    starts = [a for a, _ in homes]
    home_bytes = sum(b - a for a, b in homes)
    tenancies: list[list] = []  # [first, last, place]
    current: dict[tuple[int, int], list] = {}  # (value, offset) -> its tenancy there now
    for vid in mg.serial:
        v, k = mg.vertices[vid], pos[vid]
        for places, writing in ((v.reads, False), (v.writes, True)):
            for value, place in places.items():
                if place.where != GPU or place.nbytes <= 0 or _in_home(place, homes, starts):
                    continue
                entry = current.get((value, place.offset))
                if writing or entry is None:  # every write (a producer, a reload) starts a tenancy
                    current[(value, place.offset)] = entry = [k, k, place]
                    tenancies.append(entry)
                entry[1] = k
    delta = [0] * (n + 1)
    ends_at: dict[int, list[int]] = {}
    starts_at: dict[int, list[int]] = {}
    for t, (first, last, place) in enumerate(tenancies):
        delta[first] += place.nbytes
        delta[last + 1] -= place.nbytes
        ends_at.setdefault(last, []).append(t)
        starts_at.setdefault(first, []).append(t)
    timeline, live = [], home_bytes
    for k in range(n):
        live += delta[k]
        # in place: the old version's last read and the new version's write share their bytes
        shared = sum(_overlap(tenancies[a][2], tenancies[b][2])
                     for a in ends_at.get(k, ()) for b in starts_at.get(k, ()) if a != b)
        timeline.append(live - shared)
    return timeline


def phase_of_vertices(mg: MemGraph) -> list[str]:
    """The phase of each vertex of ``mg.serial``: a compute vertex's op's; a transfer, input or
    output takes the phase of the compute vertex before it (the first compute's, at the start)."""
    tg = mg.taskgraph
    phases: list[str | None] = []
    for vid in mg.serial:
        v = mg.vertices[vid]
        phases.append(tg.vertices[v.task_vertex].phase if v.kind is Kind.COMPUTE else None)
    first = next((p for p in phases if p is not None), PHASES[0])
    current, out = first, []
    for p in phases:
        current = p if p is not None else current
        out.append(current)
    return out


def memory_by_phase(mg: MemGraph, timeline: list[int] | None = None) -> list[PhaseMemory]:
    """Per phase (in PHASES' order; updates run inside the backward, so not in the order they first
    appear): vertices, peak arena bytes in use, bytes moved."""
    timeline = arena_timeline(mg) if timeline is None else timeline
    rows: dict[str, PhaseMemory] = {}
    for k, (vid, phase) in enumerate(zip(mg.serial, phase_of_vertices(mg))):
        row = rows.setdefault(phase, PhaseMemory(phase, 0, 0, 0, 0))
        v = mg.vertices[vid]
        row.vertices += 1
        row.peak_bytes = max(row.peak_bytes, timeline[k])
        moved = sum(p.nbytes for p in v.writes.values())
        if v.kind is Kind.OFFLOAD:
            row.bytes_offloaded += moved
        elif v.kind is Kind.RELOAD:
            row.bytes_reloaded += moved
    rank = {phase: k for k, phase in enumerate(PHASES)}
    return sorted(rows.values(), key=lambda row: rank.get(row.phase, len(rank)))
