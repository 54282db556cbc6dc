"""How the CUDA backend learns that a unit finished and tells the loop: polled events or stream callbacks.

    engine.run(mg, batch, completion="events")     # the default
    engine.run(mg, batch, completion="callback")   # needs CuPy (the cuda12 / cuda13 extras)

Every unit the CUDA runtime launches joins the FIFO of its lane (one CUDA stream instance; a stream
finishes its work in order). ``LaneCompletions`` keeps the books both modes share: which units
finished, which were already reported to the loop (launch-ahead reports a unit when it is enqueued,
while its lane holds fewer than ``depth`` reported unfinished units), and the reports waiting for
the loop. Both look at the streams when no report waits, and every LOOK_WHILE_BUSY_S while reports
wait (a busy loop always has some: launch-ahead reports units at enqueue), so a unit waiting for
another's run is heard of within that. The modes differ only in how they see the head of a lane finish:

- ``EventCompletions`` ("events"): the loop thread queries the event recorded after each lane's
  head unit, spinning between polls; no other thread runs Python.
- ``CallbackCompletions`` ("callback"): a host function enqueued on the stream after each unit
  (``cudaLaunchHostFunc``, through CuPy) puts the unit's id on a queue, and the loop thread blocks
  on that queue. The host function is ``SimpleQueue.put`` itself: it makes no CUDA call (CUDA
  forbids them there) and allocates nothing but the queue's slot; CuPy holds it and its argument
  until it has run. It runs on a CUDA driver thread and takes the GIL, and its stream starts nothing
  queued behind it until it returns, so while the loop thread holds the GIL the stream waits: which
  mode costs less per vertex is measured by bench/engine_overhead.py, not assumed.

In callback mode the loop thread must not block in a CUDA call while it holds the GIL, or a host
function waiting for the GIL would wait forever: torch's synchronize calls and op dispatch release
the GIL, and launch-ahead keeps the work queued per stream far below the depth at which a launch
blocks.

``get(timeout)`` returns within about ``timeout`` seconds (raising queue.Empty, as a queue does),
so the loop looks for a Ctrl-C while the device works. Each step's callbacks go to a queue of its
own: a host function of a stopped step that runs late reaches that step's queue, never the next's.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import time

import torch

from .errors import EngineError
from .loop import Completion, Ran
from .resources import LOOK_WHILE_BUSY_S

log = logging.getLogger(__name__)

COMPLETIONS = ("events", "callback")
CUDA_COMPLETION = "events"  # the default until bench/engine_overhead.py has measured both on the GPU
CALLBACK_QUIET_S = 1.0  # no callback for this long: check the streams for an error instead of waiting on


def completion_mode(device_type: str, completion: str | None) -> str:
    """The completion mechanism a step uses: ``completion``, else the default. Raises ValueError for
    an unknown name and EngineError for "callback" on CUDA without CuPy, before the step runs. The
    CPU backend's workers always report through a queue, so there the name is checked and ignored."""
    if completion is None:
        return CUDA_COMPLETION
    if not isinstance(completion, str) or completion not in COMPLETIONS:
        raise ValueError(f"completion must be one of {', '.join(map(repr, COMPLETIONS))} (None: "
                         f"{CUDA_COMPLETION!r}), got {completion!r}")
    if completion == "callback" and device_type == "cuda":
        launch_host_func()
    return completion


def launch_host_func():
    """CuPy's binding of cudaLaunchHostFunc: ``launchHostFunc(stream handle, fn, int arg)`` enqueues
    ``fn(arg)``, run on a CUDA driver thread once the stream's earlier work finished. CuPy is imported
    only here: events mode does not need it."""
    try:
        from cupy.cuda import runtime
    except ImportError as exc:
        raise EngineError(f"completion='callback' needs CuPy for cudaLaunchHostFunc ({exc}): "
                          f"{cupy_install_hint()}, or run with completion='events'") from exc
    return runtime.launchHostFunc


def cupy_install_hint() -> str:
    """Which extra brings the CuPy wheel of the CUDA major version this torch was built for."""
    cuda = torch.version.cuda
    if cuda is None:
        return ("pip install 'turnip[cuda12]' or 'turnip[cuda13]', the one of the CUDA version a CUDA build of "
                "torch reports (python -c \"import torch; print(torch.version.cuda)\")")
    return f"pip install 'turnip[cuda{cuda.split('.')[0]}]' (this torch is built for CUDA {cuda})"


def crosses_keys(graph) -> bytearray:
    """Per unit of a StaticGraph: 1 if a successor runs on another stream key (class or device). In
    callback mode only these units, and those of a key with several instances, record an event:
    no other stream ever waits for the rest."""
    key_of = graph.key_of
    return bytearray(any(key_of[s] != key_of[u] for s in succs) for u, succs in enumerate(graph.succs))


class Lane:
    """One CUDA stream instance and the units it holds that have not finished, oldest first."""

    def __init__(self, stream, compute: bool, depth: int):
        self.stream = stream
        self.handle = stream.cuda_stream  # the raw cudaStream_t, for cudaLaunchHostFunc
        self.compute = compute
        self.host = getattr(stream, "host", False)  # engine/host_lane.py: reported only when run
        self.errors: dict[int, BaseException] = {}  # host units that raised, by unit
        self.started: dict[int, float] = {}  # host units: when the worker began them (perf_counter)
        self.depth = 0 if self.host else depth  # units reported to the loop at enqueue while unfinished
        self.in_flight: collections.deque = collections.deque()
        # enqueued, not yet told to the loop: at most one, since the loop gives a stream instance its
        # next unit only once the last one was reported
        self.unreported: collections.deque = collections.deque()
        self.reported_in_flight = 0

    def reset(self, depth: int) -> None:
        """A new step: the last one synchronized every stream, so nothing is in flight."""
        self.in_flight.clear()
        self.unreported.clear()
        self.reported_in_flight = 0
        self.errors.clear()
        self.started.clear()
        self.depth = 0 if self.host else depth


class LaneCompletions:
    """The books of the loop's completion source on CUDA; subclasses say how a lane's head is seen
    to finish. Only the loop thread calls these methods.

    ``needs``: per unit, the resources it holds beside its stream (StaticGraph.needs). ``watched``:
    per unit, whether a Ran must follow its report at enqueue once it has run (StaticGraph.watched).
    ``lanes``: the runtime's {(stream key, instance): Lane}, filled as streams are first used."""

    def __init__(self, needs: list, watched: list, lanes: dict):
        self.needs = needs
        self.watched = watched
        self.lanes = lanes
        n = len(needs)
        self.lane_of: list[Lane | None] = [None] * n  # set at enqueue; read only for units of this step
        self.finished = bytearray(n)
        self.reported = bytearray(n)
        self.ready: collections.deque[Completion] = collections.deque()
        self.shared_workspace = True
        self._looked = 0.0  # perf_counter of the last look at the streams (look)

    def begin_step(self, shared_workspace: bool) -> None:
        """``shared_workspace``: one compute stream per device, so a unit's workspace may be handed
        on in stream order before it finished (see enqueued)."""
        n = len(self.needs)
        self.finished = bytearray(n)
        self.reported = bytearray(n)
        self.ready.clear()
        self.shared_workspace = shared_workspace

    def put(self, completion: Completion) -> None:
        """A report made by the loop itself (a launch that raised)."""
        self.ready.append(completion)

    def get(self, timeout: float | None = None) -> Completion:
        """The next report; raises queue.Empty after ``timeout`` seconds without one (None: waits).
        While reports wait, the streams are still looked at every LOOK_WHILE_BUSY_S."""
        ready = self.ready
        if ready:
            if time.perf_counter() - self._looked >= LOOK_WHILE_BUSY_S:
                self.look()
            return ready.popleft()
        return self.wait(timeout)

    def look(self) -> None:
        """Retire the units the streams have finished, without waiting for one; note when (_looked)."""
        raise NotImplementedError

    def wait(self, timeout: float | None) -> Completion:
        """The next report when none waits: as ``get``."""
        raise NotImplementedError

    def enqueued(self, lane: Lane, unit: int) -> None:
        """Unit ``unit``'s work (and its event, where one is recorded) is queued on ``lane``'s stream."""
        self.lane_of[unit] = lane
        lane.in_flight.append(unit)
        # the loop frees a unit's workspace when it is reported: with another compute stream on the
        # device, that stream could take those bytes while the unit still runs. With one compute
        # stream per device, later temporaries are allocated in stream order behind it.
        if lane.reported_in_flight < lane.depth and (self.shared_workspace or not self.needs[unit]):
            lane.reported_in_flight += 1  # _report_early, inlined: this runs once per launch
            self.reported[unit] = 1
            self.ready.append(Completion(unit, None, 0.0, 0.0, ran=False))
        else:
            lane.unreported.append(unit)

    def retire_head(self, lane: Lane) -> None:
        """The oldest unit on ``lane`` finished: report it unless launch-ahead already did (then say
        it ran, if watched), then report early what the freed depth allows."""
        unit = lane.in_flight.popleft()
        self.finished[unit] = 1
        if self.reported[unit]:
            lane.reported_in_flight -= 1
            if self.watched[unit]:
                self.ready.append(Ran(unit))
        else:  # unreported units are in launch order too: this one is the first of them
            lane.unreported.popleft()
            self.reported[unit] = 1
            error, start = (lane.errors.pop(unit, None), lane.started.pop(unit, 0.0)) if lane.host else (None, 0.0)
            self.ready.append(Completion(unit, error, start, time.perf_counter()))
        while (lane.unreported and lane.reported_in_flight < lane.depth
               and (self.shared_workspace or not self.needs[lane.unreported[0]])):
            self._report_early(lane, lane.unreported.popleft())

    def host_ran(self, unit: int) -> None:
        """Called on the host lane's worker thread when host unit ``unit`` has run (or failed)."""

    def host_notifier(self):
        """What a host unit launched now calls when it has run (``host_ran`` of this step)."""
        return self.host_ran

    def _report_early(self, lane: Lane, unit: int) -> None:
        lane.reported_in_flight += 1
        self.reported[unit] = 1
        self.ready.append(Completion(unit, None, 0.0, 0.0, ran=False))


class EventCompletions(LaneCompletions):
    """Completion by polling: the event recorded after each unit (``events[unit]``) is queried at
    the head of every lane."""

    def __init__(self, needs: list, watched: list, lanes: dict, events: list):
        super().__init__(needs, watched, lanes)
        self.events = events

    def look(self) -> None:
        self.poll()

    def wait(self, timeout: float | None) -> Completion:
        ready = self.ready
        spins = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready:
            if not self.poll():
                spins += 1
                if spins > 2000:  # nothing finished for a while: let other threads run, but never
                    os.sched_yield()  # sleep (a sleep takes 50-80 us on Linux, a transfer may end any time)
                if deadline is not None and not spins & 255 and time.monotonic() >= deadline:
                    raise queue.Empty
        return ready.popleft()

    def poll(self) -> bool:
        """Retire finished units at the heads of the lanes; True if the loop has news."""
        self._looked = time.perf_counter()
        before = len(self.ready)
        events = self.events
        for lane in self.lanes.values():
            q = lane.in_flight
            while q and events[q[0]].query():
                self.retire_head(lane)
        return len(self.ready) > before


class CallbackCompletions(LaneCompletions):
    """Completion by stream callbacks: after each unit, ``launch_host_func(stream handle, put, unit)``
    enqueues a host function that puts the unit's id on ``fired``; the loop blocks on ``fired``."""

    def __init__(self, needs: list, watched: list, lanes: dict, launch_host_func):
        super().__init__(needs, watched, lanes)
        self.fired: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._launch_host_func = launch_host_func
        self._fire = self.fired.put  # the host function: one C call, no CUDA, nothing else to keep alive
        self._quiet_since = time.monotonic()  # when a host function last fired (or the step began)

    def begin_step(self, shared_workspace: bool) -> None:
        super().begin_step(shared_workspace)
        # a queue of this step's own: host functions of an earlier step (a stopped one whose streams
        # were not waited for) hold the put of theirs, so they can never report to this step
        self.fired = queue.SimpleQueue()
        self._fire = self.fired.put
        self._quiet_since = time.monotonic()

    def host_notifier(self):
        return self._fire

    def enqueued(self, lane: Lane, unit: int) -> None:
        if not lane.host:  # the host lane's worker fires itself (host_ran)
            self._launch_host_func(lane.handle, self._fire, unit)
        super().enqueued(lane, unit)

    def host_ran(self, unit: int) -> None:
        self._fire(unit)

    def wait(self, timeout: float | None) -> Completion:
        ready = self.ready
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready:
            now = time.monotonic()
            wait = CALLBACK_QUIET_S - (now - self._quiet_since)
            if deadline is not None:
                if now >= deadline:
                    raise queue.Empty
                wait = min(wait, deadline - now)
            try:
                unit = self.fired.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if time.monotonic() - self._quiet_since >= CALLBACK_QUIET_S:
                    self._check_streams()
                    self._quiet_since = time.monotonic()
                continue
            self._quiet_since = time.monotonic()
            self.retire_through(unit)
        return ready.popleft()

    def look(self) -> None:
        """Retire every unit whose host function has fired, without waiting for one."""
        self._looked = time.perf_counter()
        while True:
            try:
                unit = self.fired.get_nowait()
            except queue.Empty:
                return
            self._quiet_since = time.monotonic()
            self.retire_through(unit)

    def retire_through(self, unit: int) -> None:
        """``unit``'s host function ran, so its stream finished it and everything queued before it."""
        lane = self.lane_of[unit]
        finished = self.finished
        while not finished[unit]:
            self.retire_head(lane)

    def _check_streams(self) -> None:
        """No host function ran for a while. A stream hit by a CUDA error never runs its host
        functions: raise that error (stream.query() does) rather than wait forever."""
        busy = [lane for lane in self.lanes.values() if lane.in_flight]
        idle = True
        for lane in busy:  # query every stream: any of them may hold the error
            idle = lane.stream.query() and idle
        if idle and self.fired.empty():  # a stream that ran its work has run its host functions too
            raise EngineError(f"{sum(len(lane.in_flight) for lane in busy)} units finished on their streams "
                              f"but their completion callbacks never ran")
        log.debug("no completion callback for %.1f s; %d streams still busy", CALLBACK_QUIET_S, len(busy))
