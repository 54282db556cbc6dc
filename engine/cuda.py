"""CUDA backend: one arena per device, pinned CPU storage, streams, and completions by events or callbacks.

Completion path (engine/completions.py; measured by bench/engine_overhead.py): each unit (a
segment or one vertex) joins the FIFO of its lane, one CUDA stream instance, and
``engine.run(..., completion=...)`` picks how the loop sees a lane's head finish:

- ``"events"`` (the default): the unit records a CUDA event after its work, and the loop thread
  polls the event at the head of each lane (streams complete in order); no Python callback
  competes with the loop for the GIL.
- ``"callback"``: a host function enqueued after the unit (``cudaLaunchHostFunc`` through CuPy,
  the cuda12 / cuda13 extras) puts the unit's id on a queue the loop blocks on. An event is then
  recorded only where another stream may have to wait for the unit on the device: a successor of
  another stream class or device, or a stream class with several instances this step.

Segments: the loop launches each segment of mg.segments (memgraph/segments.py) as one unit,
replayed as a CUDA graph from its second run on (engine/cuda_graphs.py), so a run of small kernels
costs one host call. Every vertex outside a segment launches alone as below.

Launch-ahead (both modes): a compute unit is reported complete to the loop as soon as it is
enqueued, while its stream holds fewer than ``depth`` reported unfinished units, so chains of
small kernels keep the GPU queue fed instead of paying a host round trip per kernel; when it
really finishes it is retired without a second report. Correctness does not depend on it: a unit
launched on one stream waits (``cudaStreamWaitEvent``) for every predecessor on another stream
that has not been seen finished. Transfers are reported only when really finished, so a compute
vertex is launched only once its reloaded inputs are there: the loop still picks, at run time,
whichever compute is ready instead of queueing behind a slow copy. With
``engine.run(..., transfer_ahead=k)`` a copy stream also reports its first k unfinished copies at
enqueue, so the next copy (and what reads it) is queued behind the running one on the device
instead of waiting for the host to see it end; the same events keep every edge.

Stopping a step (a vertex that raised, Ctrl-C): what is queued on a GPU stream runs; every unit
the loop launched counts as started (``cancel_step``), and ``quiesce`` polls the streams until
they ran it, for a bounded time. Host-lane units not yet begun are skipped (their StepToken).
The runtime never blocks in a CUDA synchronize while a step runs: it polls (``_wait_idle``), so a
Ctrl-C is seen. A step begins only once every stream ran what earlier steps queued (engine.run's
settle), and each step's callbacks go to a queue of its own, so nothing of a stopped step is
reported to the next one.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time

import torch

from ..ir.budget import format_bytes
from ..ir.memgraph import MemGraph, Stream
from ..ir.sizes import lane_block
from ..kernels.launch import PreparedVertex
from ..kernels.step_state import RngReplay, StepContext
from ..kernels.threads import host_threads
from .completions import (
    CallbackCompletions,
    EventCompletions,
    Lane,
    LaneCompletions,
    crosses_keys,
    launch_host_func,
)
from .cuda_graphs import SegmentGraphs
from .errors import EngineError
from .host_lane import HostDone, HostStream
from .host_memory import describe_host, host_memory
from .lane_pools import LanePools
from .loop import POLL_S, Launch, NotRun, StepToken
from .resources import CUDA_LAUNCH_AHEAD, CUDA_TRANSFER_AHEAD, reported_ahead
from .runtime import InputBinding, OutputBinding, Runtime, arena_devices

log = logging.getLogger(__name__)

DEFAULT_DEPTH = CUDA_LAUNCH_AHEAD  # unfinished compute vertices a stream may hold before the loop waits


class CudaRuntime(Runtime):
    device_type = "cuda"

    def __init__(self, mg: MemGraph, depth: int = DEFAULT_DEPTH, huge_pages: bool = False):
        self.depth = depth
        self.huge_pages = huge_pages  # pinned storage from huge pages (pinned_bytes), for comparison
        self.transfer_depth = CUDA_TRANSFER_AHEAD  # set per step by engine.run's transfer_ahead
        self.mg = mg
        # the step's device d is GPU first + d: a rank's MemGraph compiled for cuda:1 runs there (torchrun's
        # LOCAL_RANK), and a MemGraph over several devices for cuda:k runs on cuda:k, cuda:k + 1, ...
        self.first_gpu = torch.device(mg.device).index or 0
        self.rng = RngReplay(mg.taskgraph, self.gpu(arena_devices(mg)[0]))
        self.rng.measure()  # before the arena exists (RngReplay.measure)
        super().__init__(mg)
        graph = self.graph
        n = graph.n
        # a host unit's entry is a HostDone flag (engine/host_lane.py), queried like an event
        self.events = [HostDone() if graph.keys[graph.key_of[u]][0] is Stream.HOST else torch.cuda.Event()
                       for u in range(n)]
        self.preds = graph.predecessors()
        self.crosses_keys = crosses_keys(graph)  # the units another stream class may wait for
        self.lanes: dict[tuple[int, int], Lane] = {}
        self._sources: dict[str, LaneCompletions] = {}  # completion mode -> its source, made on first use
        self.completions: LaneCompletions = self._source(self.completion)
        self._record_every = True  # set per step: False in callback mode
        self._shared_keys: list[bool] = []  # per stream key, set per step: several instances this step
        self.outputs: dict[str, torch.Tensor] = {}
        self.host_out: dict[int, torch.Tensor] = {}
        self.lane_pools = LanePools(lane_block(mg.taskgraph.largest_workspace(), mg.taskgraph.step_workspace()))
        self.segment_graphs = SegmentGraphs(mg, self.graph.units, self.lane_pools)
        self.shared_workspace = True  # set per step: False when a device has several compute streams
        self._ctx = None
        self._leaves = None
        self._current: torch.cuda.Stream | None = None
        # a transfer unit -> the device it copies from. torch copies between GPUs on the source device's
        # current stream, fenced both ways against the destination's (ATen's Copy.cu): each device gets
        # a stream of its own for outgoing copies, so they wait neither for nor behind its kernels
        self.transfer_from = {u: next(p.device for vid in graph.units[u] for p in mg.vertices[vid].reads.values()
                                      if p.where == "gpu" and p.device != graph.device[u])
                              for u in range(n) if graph.keys[graph.key_of[u]][0] is Stream.D2D}
        self._outgoing: dict[int, torch.cuda.Stream] = {}
        self._caller_stream: torch.cuda.Stream | None = None
        self._caller_streams: list[torch.cuda.Stream] = []
        self._batch_ready = torch.cuda.Event()
        self._timers: list | None = None  # (start, end) timing events per vertex, made on the first traced step
        self._origin: dict[int, torch.cuda.Event] = {}
        self._origin_host = 0.0  # perf_counter when the origins were recorded (begin_step)
        self._started: list[int] = []  # this step's units handed to a GPU stream (their work may run)
        self._host_token = StepToken()  # this step's host-lane units
        self._rng_before: torch.Tensor | None = None  # the generator's state before the step moved it
        for dev in self.devices:  # the initial state was written on each device's default stream
            torch.cuda.synchronize(self.gpu(dev))

    def gpu(self, device: int) -> torch.device:
        """The GPU of the step's device ``device``."""
        return torch.device("cuda", self.first_gpu + device)

    def _allocate(self, mg: MemGraph) -> None:
        for dev in self.devices:
            self.arenas[dev] = torch.empty(mg.arena_bytes, dtype=torch.uint8, device=self.gpu(dev))
        self.storage = pinned_bytes(mg.cpu_bytes, self.huge_pages)
        self._pinned = mg.cpu_bytes > 0  # registered with CUDA: unregister before the bytes go back to the heap
        log.info("cuda runtime: arena %d bytes on %s, pinned storage %d bytes", mg.arena_bytes, self.devices,
                 mg.cpu_bytes)

    # -- step ----------------------------------------------------------------------------
    def begin_step(self, mg: MemGraph, leaves: list, step: int) -> None:
        self._started = []
        self._host_token = StepToken()
        device = self.gpu(self.devices[0])
        # the step moves the generator as eager's would: put back if the step stops
        self._rng_before = self.rng.checkpoint()
        self._ctx = StepContext(mg.taskgraph, step, device, self.rng)
        self._leaves = leaves
        self.outputs = {}
        for (key, _), lane in self.lanes.items():
            lane.reset(self._depth(self.graph.keys[key][0]))
        self.completions = self._source(self.completion)
        self.completions.begin_step(self.shared_workspace)
        self._record_every = self.completion == "events"
        self._shared_keys = [n > 1 for n in self.stream_sizes]  # read only when not _record_every
        self._caller_stream = self._current = torch.cuda.current_stream()
        # launches make the lanes' streams current on their devices: each device gets its own back at the end
        self._caller_streams = [torch.cuda.current_stream(self.gpu(d)) for d in self.devices]
        self._batch_ready.record()  # the batch may come from work queued on the caller's stream
        if self.timing and self._timers is None:
            self._timers = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                            for _ in range(self.graph.vertex_count)]  # used by each unit's first vertex
            # one origin per device (events of two devices cannot be compared), each recorded on that device's
            # idle stream at about the same host moment
            self._origin = {d: torch.cuda.Event(enable_timing=True) for d in self.devices}
        if self.timing:
            for d, event in self._origin.items():
                event.record(torch.cuda.current_stream(self.gpu(d)))
            # the host moment the idle devices passed their origins: device times count from here, not from
            # the step's start, which came before this step's timers were made (~9 ms for 5,000 vertices),
            # and a timeline set against the host's launch times must not shift by that
            self._origin_host = time.perf_counter()
            self.launched = {}

    def _finish(self) -> None:
        if self._caller_stream is not None:
            for caller in self._caller_streams:
                torch.cuda.set_stream(caller)
            torch.cuda.set_stream(self._caller_stream)  # and the caller's device current again
        self._ctx = self._leaves = self._caller_stream = self._current = None

    def end_step(self) -> dict:
        """Wait for the streams to run the step's work (polling: a Ctrl-C is seen), then its outputs.
        After a Ctrl-C it waits until the drain's deadline: all the step's work is queued, so if it
        ends by then the step counts; otherwise the interrupt is raised and the step is stopped."""
        interrupts = self.interrupts
        deadline = None
        while not self._wait_idle(POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())):
            if interrupts is not None and interrupts.pending is not None:
                if deadline is None:
                    deadline = interrupts.drain_deadline()
                elif time.monotonic() >= deadline:
                    raise interrupts.pending
        self._rng_before = None
        self._finish()
        return {name: t.clone() for name, t in self.outputs.items()}

    def abort_step(self) -> None:
        """The step stopped (engine.run has cancelled it and waited, as far as it could): forget it,
        and put the random generator back where it was before the step."""
        self.rng.restore(self._rng_before)
        self._rng_before = None
        self._finish()

    def cancel_step(self) -> list[int]:
        """Start no other host-lane unit of the step; return the units that started: every unit given
        to a GPU stream (its work is queued there and will run) and the host units begun."""
        return self._started + self._host_token.cancel()

    def quiesce(self, timeout: float | None) -> bool:
        """Wait until every stream ran what it was given, at most ``timeout`` seconds (None: no limit);
        True if all did. Raises the device's error (a CUDA error) if a stream reports one."""
        return self._wait_idle(timeout)

    def _wait_idle(self, timeout: float | None) -> bool:
        """Poll the lanes' streams (host lane included) until all are idle (True) or ``timeout``
        seconds passed (False). Sleeps between polls, so callback-mode host functions get the GIL."""
        lanes = list(self.lanes.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        polls = 0
        while not all(lane.stream.query() for lane in lanes):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            polls += 1
            time.sleep(0 if polls < 2000 else 1e-4)
        return True

    def close(self) -> None:
        for stream in self._outgoing.values():  # fenced into the lanes already; these go back idle
            stream.synchronize()
        self._outgoing.clear()
        for lane in self.lanes.values():
            lane.stream.synchronize()
            if lane.host:
                lane.stream.close()
        self.lanes.clear()
        self.segment_graphs.clear()
        self.host_out.clear()
        self.rng = None
        self._unpin()
        super().close()
        # cuBLAS keeps a workspace per stream it ran on, even after the stream is gone: drop them, or
        # every MemGraph released in this process leaves its streams' workspaces allocated
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()

    def _unpin(self) -> None:
        if getattr(self, "_pinned", False):
            unpin(self.storage)
            self._pinned = False

    def __del__(self) -> None:
        # a MemGraph dropped without release(): its storage returns to the heap right after this, and a
        # later registration of the same addresses would fail ("already registered")
        with contextlib.suppress(Exception):  # at interpreter exit the CUDA runtime may already be gone
            self._unpin()

    def device_records(self, records: list, origin: float) -> list:
        """Replace host-side times by when each vertex ran on the GPU (the step has synchronized), on the
        host's clock: counted from when the devices' origin events were recorded, not from ``origin``."""
        if not self.timing or self._timers is None:
            return records
        out = []
        keys = self.graph.keys
        for rec in records:
            if keys[rec.key][0] is Stream.HOST:  # ran on the host: the loop's own times are the real ones
                out.append(rec)
                continue
            start, end = self._timers[rec.vertex]
            try:
                t0 = self._origin[keys[rec.key][1]]
                begin_s, end_s = t0.elapsed_time(start) / 1e3, t0.elapsed_time(end) / 1e3
            except RuntimeError:  # never recorded (a failed step): keep the host times
                out.append(rec)
                continue
            out.append(rec._replace(start=self._origin_host + begin_s, end=self._origin_host + end_s))
        return out

    def _source(self, mode: str) -> LaneCompletions:
        source = self._sources.get(mode)
        if source is None:
            if mode == "callback":
                source = CallbackCompletions(self.graph.needs, self.graph.watched, self.lanes, launch_host_func())
            else:
                source = EventCompletions(self.graph.needs, self.graph.watched, self.lanes, self.events)
            self._sources[mode] = source
        return source

    def _depth(self, stream_class: Stream) -> int:
        """Vertices a lane reports at launch: compute launch-ahead, this step's transfer_ahead for
        the host link's copies, none for copies between devices (resources.reported_ahead)."""
        return reported_ahead(stream_class, self.depth, self.transfer_depth)

    def lane(self, item: Launch) -> Lane:
        lane = self.lanes.get((item.key, item.instance))
        if lane is None:
            stream_class, dev = self.graph.keys[item.key]
            compute = stream_class is Stream.COMPUTE
            stream = (HostStream(f"turnip-host-{item.instance}", host_threads()) if stream_class is Stream.HOST
                      else torch.cuda.Stream(device=self.gpu(dev)))
            lane = Lane(stream, compute, self._depth(stream_class))
            self.lanes[(item.key, item.instance)] = lane
            if compute:
                self.lane_pools.add((item.key, item.instance), stream, prewarm=self.shared_workspace)
        return lane

    def launch(self, item: Launch, notify) -> None:
        unit = item.vertex  # a segment or one vertex
        lane = self.lane(item)
        stream = lane.stream
        completions = self.completions
        finished, lane_of, events = completions.finished, completions.lane_of, self.events
        if lane.host:
            self._launch_host(unit, lane)
            return
        self._started.append(unit)  # from here on its work may be on the stream
        for p in self.preds[unit]:
            if not finished[p] and lane_of[p] is not lane:
                stream.wait_event(events[p])
        source = self.transfer_from.get(unit)
        if source is not None:
            outgoing = self._outgoing.get(source)
            if outgoing is None:
                outgoing = self._outgoing[source] = torch.cuda.Stream(device=self.gpu(source))
            torch.cuda.set_stream(outgoing)
            self._current = outgoing
        if self._current is not stream:  # cheaper than a stream context per launch
            torch.cuda.set_stream(stream)
            self._current = stream
        timers = self._timers if self.timing else None
        head = self.graph.head[unit]
        if timers is not None:
            self.launched[head] = time.perf_counter()
            timers[head][0].record(stream)
        if len(self.graph.units[unit]) > 1:
            self.segment_graphs.run(unit, (item.key, item.instance), self._ctx.scalars,
                                    lambda: self.execute_unit(self.mg, unit))
        elif lane.compute:
            with self.lane_pools.allocating_from((item.key, item.instance)):
                self.execute(self.mg, head)
        else:
            self.execute(self.mg, head)
        if timers is not None:
            timers[head][1].record(stream)
        if self._record_every or self.crosses_keys[unit] or self._shared_keys[item.key]:
            events[unit].record(stream)
        completions.enqueued(lane, unit)

    def _launch_host(self, unit: int, lane: Lane) -> None:
        """Queue a host unit on the host lane's worker: it waits for its GPU predecessors' events
        (those the loop has not seen finish), runs on pinned storage, then sets its flag."""
        completions = self.completions
        waits = [self.events[p] for p in self.preds[unit] if not completions.finished[p]]
        done = self.events[unit]
        done.clear()
        head, mg = self.graph.head[unit], self.mg
        token, ran = self._host_token, completions.host_notifier()  # this step's, even if run late

        def job() -> None:
            lane.started[unit] = time.perf_counter()  # the loop's record of the unit: its real span
            if not token.begin(unit):  # the step stopped before this unit began
                lane.errors[unit] = NotRun("cancelled: the step was stopping")
                done.set()
                ran(unit)
                return
            try:
                for event in waits:
                    event.synchronize()
                self.execute(mg, head)
            except BaseException as exc:  # noqa: BLE001 - reported as the unit's failure by the loop
                exc.failed_vertex = head
                lane.errors[unit] = exc
            finally:
                token.end()
            done.set()
            ran(unit)

        completions.enqueued(lane, unit)
        lane.stream.submit(job)

    # -- vertices (run on the loop thread, on the current stream: the lane's) -----------------
    def run_compute(self, vid: int, prepared: PreparedVertex) -> None:
        ctx = self._ctx
        # a random op draws from its own GPU's generator, set to the state eager's one generator had
        device = ctx.device if not prepared.vertex.device else self.gpu(prepared.vertex.device)
        prepared(ctx.scalars, ctx.rng_state(prepared.vertex), device)

    def run_transfer(self, vid: int, pairs: tuple) -> None:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)

    run_offload = run_reload = run_copy = run_transfer

    def run_input(self, vid: int, binding: InputBinding) -> None:
        torch.cuda.current_stream().wait_event(self._batch_ready)
        binding.dst.copy_(self._leaves[binding.leaf], non_blocking=True)

    def run_output(self, vid: int, binding: OutputBinding) -> None:
        src = binding.src
        host = self.host_out.get(vid)
        if host is None:  # pinned once; reused every step
            host = self.host_out[vid] = torch.empty_like(src, device="cpu").pin_memory()
        host.copy_(src, non_blocking=True)
        self.outputs[binding.name] = host


def pinned_bytes(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """Exactly nbytes of page-locked host memory. torch's pinned allocator rounds a request up to
    a power of two (11 GB becomes 16 GiB); registering an ordinary buffer with cudaHostRegister
    pins only what is asked for, and copies from it run asynchronously like any pinned memory.

    huge_pages: the buffer is an anonymous mapping advised MADV_HUGEPAGE (transparent huge pages,
    where the kernel allows them) instead of torch's heap. On the H100 it made no difference (a
    step's reloads, and copies spread over 8 GiB, alike: `python -m turnip.bench.pinned_memory`),
    so it is off by default."""
    memory = host_memory()
    if memory is not None and nbytes > memory[1]:  # refused before the host is pushed into swap
        raise EngineError(f"the plan pins {format_bytes(nbytes)} ({nbytes} bytes) of host memory for its CPU "
                          f"storage, more than {describe_host(memory)}: compile it again here (compile plans "
                          f"within the host's memory) or with a smaller cpu_budget, or free host memory")
    buf = _huge_page_buffer(nbytes) if huge_pages and nbytes else torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise EngineError(f"cannot pin {nbytes} bytes of host memory for CPU storage (cudaHostRegister "
                              f"error {int(err)}): lower the plan's CPU budget or free host memory")
    return buf


HUGE_PAGE = 2 << 20


def _huge_page_buffer(nbytes: int) -> torch.Tensor:
    """nbytes of private anonymous memory starting on a huge-page boundary, advised MADV_HUGEPAGE
    before anything touches it. The tensor keeps the mapping alive (unmapped with its storage)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    start = -torch.frombuffer(mapping, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    # a storage of its own from the aligned start: what is registered is then the whole storage,
    # and torch's is_pinned (which asks about the storage's first byte) says so
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)


def unpin(buf: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def create_runtime(mg: MemGraph) -> CudaRuntime:
    if not torch.cuda.is_available():
        raise EngineError("this MemGraph was compiled for CUDA, but no CUDA device is available; "
                          "compile with device='cpu' to run on the CPU backend")
    return CudaRuntime(mg)
