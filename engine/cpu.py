"""CPU backend: the runtime contract on threads, one worker thread per stream instance.

The "arena" and the "pinned storage" are plain CPU uint8 tensors, so every
MemGraph runs on a laptop or in CI, and real concurrency between lanes lets
the random ordering fuzz that every order the MemGraph permits gives the same
bytes. Workers time each vertex with time.perf_counter and report through the
loop's completion queue; they never touch the loop's bookkeeping.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import weakref

import torch
from turnip.engine.errors import EngineError
from turnip.engine.loop import Completion, Launch
from turnip.engine.runtime import Runtime
from turnip.ir.memgraph import Kind, MemGraph
from turnip.kernels.step import RngReplay, StepContext

log = logging.getLogger(__name__)

# Fill a fresh arena with 0xFF bytes: floats read as NaN, integers as -1, so a
# vertex that reads bytes nobody wrote (a missing dependency) shows up at once.
POISON = 0xFF
FUZZ_DELAY_S = 200e-6  # upper bound of the random delay a worker adds per vertex under random ordering


class Lane:
    """A worker thread running one stream instance's vertices in order.

    Work items carry the function to run, so a lane holds no reference to
    its runtime between steps and the runtime can be collected (which then
    stops the lane).
    """

    def __init__(self, name: str):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        # grad mode is per thread: the engine writes into arena views, never records autograd history
        torch.set_grad_enabled(False)
        while True:
            item = self.queue.get()
            if item is None:
                return
            fn, vid, notify = item
            item = None
            t0 = time.perf_counter()
            try:
                fn(vid)
                err = None
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the loop
                err = exc
            notify(Completion(vid, err, t0, time.perf_counter()))
            fn = notify = err = None  # drop references before blocking again

    def stop(self) -> None:
        self.queue.put(None)


def _stop_lanes(lanes: dict) -> None:
    for lane in lanes.values():
        lane.stop()


class CpuRuntime(Runtime):
    device_type = "cpu"

    def __init__(self, mg: MemGraph):
        self._lanes: dict[tuple[int, int], Lane] = {}
        self._step_state = None
        self._rng = None
        super().__init__(mg)
        self._finalizer = weakref.finalize(self, _stop_lanes, self._lanes)

    def _allocate(self, mg: MemGraph) -> None:
        # One allocation per device and one for the storage, for the life of the MemGraph.
        for dev in self.devices:
            self.arenas[dev] = torch.full((mg.arena_bytes,), POISON, dtype=torch.uint8)
        self.storage = torch.full((mg.cpu_bytes,), POISON, dtype=torch.uint8)
        log.debug("cpu runtime: arena %d bytes x %d devices, storage %d bytes",
                  mg.arena_bytes, len(self.devices), mg.cpu_bytes)

    # -- step ----------------------------------------------------------------------------
    def begin_step(self, mg: MemGraph, leaves: list, step: int) -> None:
        if self._rng is None:  # its scratch buffers are reused by every step
            self._rng = RngReplay(mg.taskgraph, torch.device("cpu"))
        ctx = StepContext(mg.taskgraph, step, torch.device("cpu"), rng=self._rng)
        self._step_state = (mg, ctx, leaves, {})

    def end_step(self) -> dict:
        outputs = self._step_state[3]
        self._step_state = None
        return outputs

    def abort_step(self) -> None:
        self._step_state = None

    def launch(self, item: Launch, notify) -> None:
        lane = self._lanes.get((item.key, item.instance))
        if lane is None:
            stream, dev = self.graph.keys[item.key]
            lane = Lane(f"turnip-cpu{dev}-{stream.value}-{item.instance}")
            self._lanes[(item.key, item.instance)] = lane
        work = self.execute
        if self.fuzz_seed is not None:
            # random priorities only reorder vertices that are ready together; random delays
            # also change which finish first, so a missing edge shows up as a race
            delay = random.Random(hash((self.fuzz_seed, item.vertex))).random() * FUZZ_DELAY_S

            def work(vid, _run=self.execute, _delay=delay):
                time.sleep(_delay)
                _run(vid)

        lane.queue.put((work, item.vertex, notify))

    def close(self) -> None:
        self._finalizer()
        super().close()

    # -- vertices (run on worker threads) ------------------------------------------------
    def execute(self, vid: int) -> None:
        mg, ctx, leaves, outputs = self._step_state
        mv = mg.vertices[vid]
        kind = mv.kind
        if kind is Kind.COMPUTE:
            self._compute(mg, ctx, mv)
        elif kind in (Kind.OFFLOAD, Kind.RELOAD, Kind.COPY):
            self._copy(mg, mv)
        elif kind is Kind.INPUT:
            self._input(mg, mv, leaves)
        elif kind is Kind.OUTPUT:
            self._output(mg, mv, outputs)
        else:
            raise EngineError(f"vertex {vid}: unknown kind {kind!r}")

    def _compute(self, mg: MemGraph, ctx, mv) -> None:
        prepared = self.prepared(mg, mv)
        prepared(ctx.scalars, ctx.rng_state(prepared.vertex), ctx.device)

    def _copy(self, mg: MemGraph, mv) -> None:
        """OFFLOAD, RELOAD and COPY all move a value's bytes from its read place to its write place."""
        values = mg.taskgraph.values
        if mv.reads.keys() == mv.writes.keys():
            pairs = [(v, mv.reads[v], mv.writes[v]) for v in mv.reads]
        elif len(mv.reads) == 1 and len(mv.writes) == 1:
            (v, src), (dst,) = next(iter(mv.reads.items())), mv.writes.values()
            pairs = [(v, src, dst)]
        else:
            raise EngineError(f"{mv.kind.value} vertex {mv.id} reads {sorted(mv.reads)} but writes "
                              f"{sorted(mv.writes)}: cannot pair them")
        for v, src, dst in pairs:
            n = values[v].nbytes
            self.bytes_of(dst, n).copy_(self.bytes_of(src, n))

    def _input(self, mg: MemGraph, mv, leaves: list) -> None:
        idx = self.leaf_of.get(mv.value)
        if idx is None:
            raise EngineError(f"input vertex {mv.id} loads value {mv.value}, which is not a batch input")
        place = mv.writes.get(mv.value)
        if place is None:
            if len(mv.writes) != 1:
                raise EngineError(f"input vertex {mv.id} does not say where value {mv.value} goes")
            (place,) = mv.writes.values()
        self.view(mg, place, mv.value).copy_(leaves[idx])

    def _output(self, mg: MemGraph, mv, outputs: dict) -> None:
        place = mv.reads.get(mv.value)
        if place is None:
            if len(mv.reads) != 1:
                raise EngineError(f"output vertex {mv.id} does not say where value {mv.value} is read")
            (place,) = mv.reads.values()
        name = self.output_name(mv)
        # a fresh tensor the next step cannot overwrite; dict item assignment is atomic under the GIL
        outputs[name] = self.view(mg, place, mv.value).clone()


def create_runtime(mg: MemGraph) -> CpuRuntime:
    return CpuRuntime(mg)
