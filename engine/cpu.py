"""CPU backend: the runtime contract on threads, one worker thread per stream instance.

The "arena" and the "pinned storage" are plain CPU uint8 tensors, so every
MemGraph runs on a laptop or in CI, and real concurrency between lanes lets
the random ordering fuzz that every order the MemGraph permits gives the same
bytes. Workers time each vertex with time.perf_counter and report through the
loop's completion queue; they never touch the loop's bookkeeping.

Stopping a step: each work item carries its step's StepToken (engine/loop.py). Once the step is
cancelled (``cancel_step``) a worker skips the step's items it has not begun, reporting NotRun,
so a stopped step never starts another unit, not even in a later step's time; the units it
had begun are the token's ``started``, and ``quiesce`` waits for them to end. Completions go to
the queue of the step that launched the item, so nothing of one step reaches the next step's loop.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import weakref

import torch

from ..ir.memgraph import MemGraph
from ..kernels.launch import PreparedVertex
from ..kernels.step_state import RngReplay, StepContext
from .loop import Completion, Launch, NotRun, StepToken
from .runtime import InputBinding, OutputBinding, Runtime

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
            fn, vid, notify, token = item
            item = None
            t0 = time.perf_counter()
            if not token.begin(vid):  # its step was stopped before this unit began
                notify(Completion(vid, NotRun("cancelled: the step was stopping"), t0, t0))
                fn = notify = token = None
                continue
            try:
                fn(vid)
                err = None
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the loop
                err = exc
            finally:
                token.end()  # before the report: once the loop has every report, nothing of the step runs
            notify(Completion(vid, err, t0, time.perf_counter()))
            fn = notify = err = token = None  # drop references before blocking again

    def stop(self) -> None:
        self.queue.put(None)


def _stop_lanes(lanes: dict) -> None:
    for lane in lanes.values():
        lane.stop()


class CpuRuntime(Runtime):
    device_type = "cpu"

    def __init__(self, mg: MemGraph):
        self._lanes: dict[tuple[int, int], Lane] = {}
        # the current step's state, set by begin_step and read by the workers' run_ hooks
        self._mg: MemGraph | None = None
        self._ctx: StepContext | None = None
        self._leaves: list | None = None
        self._outputs: dict | None = None
        self._rng = None
        self._token = StepToken()  # the current (or last) step's units on the lanes
        self._rng_before: torch.Tensor | None = None  # the generator's state before the step's draws
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
        self._token = StepToken()  # first: cancel_step must never answer for the step before
        if self._rng is None:  # its scratch buffers are reused by every step
            self._rng = RngReplay(mg.taskgraph, torch.device("cpu"))
        # the draws below move the generator as eager's step would: put back if the step stops
        self._rng_before = self._rng.checkpoint()
        self._ctx = StepContext(mg.taskgraph, step, torch.device("cpu"), rng=self._rng)
        self._mg, self._leaves, self._outputs = mg, leaves, {}

    def end_step(self) -> dict:
        outputs = self._outputs
        self._rng_before = None
        self._forget_step()
        return outputs

    def abort_step(self) -> None:
        """The step stopped (after cancel_step and quiesce): forget it, and put the random generator
        back where it was before the step (a stopped step that updated no weight changes nothing)."""
        if self._rng_before is not None:
            if self._token.running:
                log.warning("a random vertex of the stopped step may still run: the random generator may end "
                            "where that step's draws left it")
            self._rng.restore(self._rng_before)
            self._rng_before = None
        self._forget_step()

    def _forget_step(self) -> None:
        self._mg = self._ctx = self._leaves = self._outputs = None

    def cancel_step(self) -> list[int]:
        """Start no other unit of the step; return the units that started (ran, or run now)."""
        return self._token.cancel()

    def quiesce(self, timeout: float | None) -> bool:
        """Wait until no unit of the last step runs, at most ``timeout`` seconds; True if none does."""
        return self._token.wait_idle(timeout)

    def launch(self, item: Launch, notify) -> None:
        lane = self._lanes.get((item.key, item.instance))
        if lane is None:
            stream, dev = self.graph.keys[item.key]
            lane = Lane(f"turnip-cpu{dev}-{stream.value}-{item.instance}")
            self._lanes[(item.key, item.instance)] = lane
        work = self.run_unit
        if self.fuzz_seed is not None:
            # random priorities only reorder vertices that are ready together; random delays
            # also change which finish first, so a missing edge shows up as a race
            delay = random.Random(hash((self.fuzz_seed, item.vertex))).random() * FUZZ_DELAY_S

            def work(vid, _run=self.run_unit, _delay=delay):
                time.sleep(_delay)
                _run(vid)

        lane.queue.put((work, item.vertex, notify, self._token))

    def close(self) -> None:
        self._finalizer()
        super().close()

    # -- vertices (run on worker threads) ------------------------------------------------
    def run_unit(self, unit: int) -> None:
        self.execute_unit(self._mg, unit)

    def run_compute(self, vid: int, prepared: PreparedVertex) -> None:
        ctx = self._ctx
        prepared(ctx.scalars, ctx.rng_state(prepared.vertex), ctx.device)

    def run_transfer(self, vid: int, pairs: tuple) -> None:
        for dst, src in pairs:
            dst.copy_(src)

    run_offload = run_reload = run_copy = run_transfer

    def run_input(self, vid: int, binding: InputBinding) -> None:
        binding.dst.copy_(self._leaves[binding.leaf])

    def run_output(self, vid: int, binding: OutputBinding) -> None:
        # a fresh tensor the next step cannot overwrite; dict item assignment is atomic under the GIL
        self._outputs[binding.name] = binding.src.clone()


def create_runtime(mg: MemGraph) -> CpuRuntime:
    return CpuRuntime(mg)
