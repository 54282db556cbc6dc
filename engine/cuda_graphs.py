"""CUDA graphs of a MemGraph's segments: captured once, replayed every step.

A segment (memgraph/segments.py) is a run of compute vertices whose places never move, so the
kernels it launches are the same every step: only the per-step host scalars (the optimizer's
hyperparameters; Adam's bias corrections live in device step tensors) can differ. Each segment
runs as ordinary launches the first time (cuBLAS / cuDNN handles and lazily allocated buffers are
made then, outside any capture), is captured on its second run, and is replayed from then on,
one host call instead of one per kernel. A segment whose scalars changed since its capture (an LR
scheduler stepping) is captured again; one whose scalars keep changing (RECAPTURES_BEFORE_PLAIN
times: a scheduler that steps every step) runs as ordinary launches from then on, since a capture
costs more host time than the launches it saves once. The fused optimizer kernels read their
learning rate as a host double; their tensor-lr form reads a float32, which would round eager's
learning rate, so the scalars cannot move to device memory without changing the numbers.
Temporaries that ops allocate come from one memory pool per stream instance (engine/lane_pools.py),
shared by the segments captured on it and the kernels launched plainly there, which is safe because
the work of one stream never runs at the same time; a segment launched on another instance of its
stream class is captured again there, with that instance's pool.

A segment that cannot be captured (an op that synchronizes with the host, say) is logged once and
runs as ordinary launches from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from ..ir.memgraph import MemGraph
from ..kernels.capture import captured
from ..kernels.launch import scalar_names
from .lane_pools import LanePools

log = logging.getLogger(__name__)

# captures of one segment made again because its scalars changed, before it runs as plain launches
RECAPTURES_BEFORE_PLAIN = 2


class SegmentGraphs:
    """The captured graph of each multi-vertex unit of the loop, with what it baked in."""

    def __init__(self, mg: MemGraph, units: list[tuple[int, ...]], pools: LanePools):
        self.lane_pools = pools
        tasks = mg.taskgraph.vertices
        self.scalars: dict[int, tuple[str, ...]] = {}
        for u, unit in enumerate(units):
            if len(unit) > 1:
                names = set()
                for vid in unit:
                    tv = tasks[mg.vertices[vid].task_vertex]
                    names |= scalar_names(tv.args) | scalar_names(tv.kwargs)
                self.scalars[u] = tuple(sorted(names))
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # (unit, lane) -> graph, scalars
        self.runs: dict[tuple, int] = {}
        self.uncapturable: set[int] = set()
        self.volatile: set[int] = set()  # units whose scalars change step after step: plain launches
        self.recaptures: dict[int, int] = {}  # unit -> captures made again for changed scalars
        self.captures = 0  # how many captures were made (tests, logs)

    def run(self, unit: int, lane: tuple, step_scalars: Mapping[str, float], launch: Callable[[], None]) -> None:
        """Run unit ``unit`` on the current stream, lane ``lane`` ((stream key, instance)): replay
        its graph, or ``launch()`` its vertices (first run, or uncapturable), or capture ``launch()``
        and replay it. The lane's pool (self.lane_pools) exists: its temporaries come from there."""
        baked = tuple(step_scalars[name] for name in self.scalars[unit])
        key = (unit, lane)
        stored = self.graphs.get(key)
        if stored is not None and stored[1] == baked:
            stored[0].replay()
            return
        outdated_for_good = stored is not None and self._changes_again(unit)  # new scalars, too often
        if not outdated_for_good and self._captured(unit, lane, key, baked, launch):
            return
        with self.lane_pools.allocating_from(lane):  # first run, uncapturable, or volatile: plain launches
            launch()

    def _captured(self, unit: int, lane: tuple, key: tuple, baked: tuple, launch: Callable[[], None]) -> bool:
        """Capture ``launch()`` into the lane's pool and replay it (True), unless this is the unit's
        first run on the lane, or it cannot be captured, or its scalars keep changing (False)."""
        runs = self.runs.get(key, 0)
        self.runs[key] = runs + 1
        if runs == 0 or unit in self.uncapturable or unit in self.volatile:
            return False
        try:
            graph = captured(launch, self.lane_pools.handle(lane))
        except Exception as exc:  # noqa: BLE001 - a capture that fails launched nothing: run it plainly
            self.uncapturable.add(unit)
            self.graphs.pop(key, None)
            self.lane_pools.renew(lane)
            log.warning("segment %d cannot be captured as a CUDA graph (%s: %s); it runs as ordinary "
                        "launches", unit, type(exc).__name__, exc)
            return False
        self.graphs[key] = (graph, baked)
        self.captures += 1
        graph.replay()
        return True

    def _changes_again(self, unit: int) -> bool:
        """Count a capture of ``unit`` outdated by new scalars; True once the unit has become
        volatile (its graphs dropped: it launches plainly from now on)."""
        count = self.recaptures[unit] = self.recaptures.get(unit, 0) + 1
        if count < RECAPTURES_BEFORE_PLAIN:
            return False
        self.volatile.add(unit)
        for key in [k for k in self.graphs if k[0] == unit]:
            del self.graphs[key]
        log.info("segment %d: its per-step scalars (%s) changed %d times since its capture; it runs as "
                 "ordinary launches from now on", unit, ", ".join(self.scalars[unit]), count)
        return True

    def clear(self) -> None:
        self.graphs.clear()
        self.lane_pools.clear()
