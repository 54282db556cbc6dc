"""Discrete-event simulation of one MemGraph step under the engine's own resource model.

    res = engine.simulate(mg, costs, jitter=0.1, ordering="deterministic", seed=3)
    res.step_time, res.compute_idle, res.host_busy, res.timeline   # [(vertex, stream, start, end), ...]
    res.write_timeline("sim.json", mg)                              # the same Chrome timeline engine.run writes

No hardware and no second scheduler: the loop's ``Scheduler`` with the real
StreamPool / WorkspacePool decides every launch, exactly as
``engine.loop.drive`` does; only the clock is virtual. What the model assumes:

- Durations. A compute vertex takes its TaskGraph vertex's ``time`` (else the
  cost model's estimate); a transfer (reload, offload, input, output) takes its
  bytes over the bandwidth of its direction; a COPY (arena to arena) reads and
  writes its bytes at HBM speed. ``overhead`` adds a constant to every duration
  (see Host for how it differs from host time). With ``jitter`` = sigma > 0 each
  duration is multiplied by exp(sigma*Z - sigma^2/2) (lognormal, mean 1, so noise
  levels compare at equal expected work).
- Sharing. Vertices running at the same time on one *pool* share its rate
  equally (processor sharing): h2d and d2h are separate pools (full-duplex link,
  each direction at its own bandwidth, concurrently, both slowed to the link's
  measured duplex rate while both copy: the cost model's duplex_bandwidth, 89 GB/s
  in all on the H100 against 55 each way alone) or one pool when
  ``duplex=False``; two h2d streams moving at once each get half the link. On
  several devices, the links together move at most the cost model's
  ``host_links`` (each direction, and both at once), every busy link slowed
  alike: four H100s of one host move 190 GB/s in all, not four links' 356. All
  compute streams of a device share one compute pool: a big kernel fills the
  GPU alone, so more compute streams give the loop more choice, not more speed.
- Launch-ahead (CUDA backend, engine/cuda.py). A compute vertex is reported
  complete to the loop when it is launched, while its stream holds fewer than
  ``launch_ahead`` unreported-finished vertices; it queues FIFO on its stream and
  really starts when the stream is free and every predecessor has really
  finished (cudaStreamWaitEvent). Transfers are reported when really finished, or, with
  ``transfer_ahead`` = k, the first k unfinished copies of each copy stream at launch, as on the
  device.
  A vertex launched early behind a slow one (an offload after a queued kernel)
  holds its stream instance from launch to report, as on the device. A copy
  between devices launches only once its writers have run: the loop hears of
  that (engine.loop.Ran) when it polls the device, as engine/cuda.py's does.
- Host. The loop thread is one serial resource: every launch, compute or
  transfer, occupies it for ``host_per_vertex`` seconds (default: the cost
  model's ``host_per_vertex_on(backend)``, else its ``host_per_vertex``, else 0;
  bench/engine_overhead.py measures about 15 us on an H100). A launch begins at
  max(when the loop took the report that made it launchable, when the host ended
  the previous launch), and its vertex's device work no earlier than the launch
  ends (``launched_at`` + ``host_per_vertex``). The loop takes reports as
  ``engine.loop.drive`` does with engine/cuda.py's completions: one at a time
  when the host is free, queued early reports first, the device's news (finished
  transfers, early reports freed by the depth) when none is queued or
  ``LOOK_WHILE_BUSY_S`` after the last look, all that has come in at once.
  With launch-ahead the host runs ahead of the GPU
  while it launches faster than the GPU drains: N kernels shorter than the host
  cost take about N x ``host_per_vertex``, while long kernels hide it (only the
  first launch shows). ``res.host_busy`` is the host's launch time (vertices x
  ``host_per_vertex``), to set beside ``step_time`` and ``compute_busy``.
  ``overhead`` is the older stand-in: it lengthens each vertex's own device
  time, so it holds the vertex's stream, counts as compute or link busy time, is
  shared by the pool and scaled by jitter, and is paid in parallel on concurrent
  streams and never hidden; it gives the host model's step time only for a chain
  launched without launch-ahead, where host and device alternate. Both may be
  set; they add.
- Messages between ranks (Stream.COMM): alone, at their bytes over the cost model's rank_bandwidth,
  as if the peer had posted its end already; engine/ranks_sim.py simulates every rank together.
  While a message is on a device (moving or waiting for its peer, as NCCL's kernel spins on SMs),
  that device computes at the cost model's ``compute_beside_messages`` of its speed.
- Not modelled: host time that is not a launch (taking a report, polling; fold
  it into ``host_per_vertex``, which is measured per vertex), kernel launch
  latency on the device, PCIe contention with anything else, CPU-side work of
  the ops themselves.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..ir.costs import CostModel, FixedRates, HostLinks
from ..ir.memgraph import Kind, MemGraph, MVertex, Stream
from ..ir.optimizer import update_elements
from .dispatch import per_vertex
from .errors import StallError
from .loop import Record, Scheduler, StaticGraph
from .policy import Policy, make_policy
from .resources import (
    CUDA_LAUNCH_AHEAD,
    LOOK_WHILE_BUSY_S,
    StreamPool,
    WorkspacePool,
    reported_ahead,
    stream_counts,
    transfer_depth,
)
from .runtime import arena_devices, workspace_capacity
from .timeline import write_timeline

log = logging.getLogger(__name__)

DEFAULT_RATES = FixedRates()  # without a cost model: an H100's link and HBM (planners.costs.H100's figures)

Costs = CostModel | Mapping[int, float] | None  # what simulate and time_floor price a MemGraph with


def rates_of(costs: Costs) -> CostModel:
    """The cost model behind ``costs``: itself, or DEFAULT_RATES for None or a mapping of durations."""
    return DEFAULT_RATES if costs is None or isinstance(costs, Mapping) else costs


class Span(NamedTuple):
    """One vertex on the timeline: which stream instance ran it, from when to when (seconds)."""

    vertex: int
    stream: str  # "compute 0", "h2d 1", ... ("... @dev" on devices other than 0)
    start: float
    end: float


@dataclass
class SimResult:
    step_time: float  # seconds from the first launch to the last vertex's end
    compute_busy: float  # seconds some compute vertex ran (summed over devices)
    compute_idle: float  # step_time per device minus compute_busy: the GPU waiting on transfers or order
    h2d_busy: float  # seconds the host->device link moved something
    d2h_busy: float
    host_busy: float  # seconds the loop thread spent launching (vertices x host_per_vertex)
    bytes_h2d: int  # reloads + batch inputs
    bytes_d2h: int  # offloads + outputs
    ordering: str
    seed: int
    jitter: float
    timeline: list[Span] = field(default_factory=list, repr=False)
    launch_order: list[int] = field(default_factory=list, repr=False)
    host_per_vertex: float = 0.0  # host seconds per launch this run used
    launched_at: list[float] = field(default_factory=list, repr=False)  # when the host began each launch
    records: list[Record] = field(default_factory=list, repr=False)  # engine.loop Records, for traces
    keys: list = field(default_factory=list, repr=False)
    instances: dict = field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        """The scalar results (what a benchmark row stores)."""
        return {"step_time": self.step_time, "compute_busy": self.compute_busy, "compute_idle": self.compute_idle,
                "h2d_busy": self.h2d_busy, "d2h_busy": self.d2h_busy, "host_busy": self.host_busy,
                "host_per_vertex": self.host_per_vertex, "bytes_h2d": self.bytes_h2d,
                "bytes_d2h": self.bytes_d2h, "ordering": self.ordering, "seed": self.seed, "jitter": self.jitter}

    def write_timeline(self, path: str | Path, mg: MemGraph, meta: dict | None = None) -> Path:
        """A Chrome/Perfetto trace through engine/timeline.py's writer (times are simulated)."""
        launched = {r.vertex: self.launched_at[r.vertex] for r in self.records
                    if not math.isnan(self.launched_at[r.vertex])}
        return write_timeline(path, mg, self.records, self.keys, 0.0, instances=self.instances,
                           meta={"simulated": True, **self.summary(), **(meta or {})}, launched=launched)


# -- durations ---------------------------------------------------------------------------------

def link_bandwidths(costs: Costs = None, bandwidth: Any = None) -> tuple[float, float]:
    """(h2d, d2h) bytes/s: ``bandwidth`` (one number, (h2d, d2h) or {"h2d":, "d2h":}), else the cost model's."""
    if bandwidth is None:
        model = rates_of(costs)
        return float(model.h2d_bandwidth), float(model.d2h_bandwidth)
    if isinstance(bandwidth, Mapping):
        return float(bandwidth["h2d"]), float(bandwidth["d2h"])
    if isinstance(bandwidth, (tuple, list)):
        return float(bandwidth[0]), float(bandwidth[1])
    return float(bandwidth), float(bandwidth)


def both_ways_share(costs: Costs = None, bandwidth: Any = None) -> float:
    """The rate each direction keeps while the other copies too: the link's duplex rate over the
    two directions' own rates added (1: no shared cap). From ``bandwidth``'s "duplex" when it is a
    mapping with one, else from the cost model's duplex_bandwidth."""
    h2d, d2h = link_bandwidths(costs, bandwidth)
    both = None
    if isinstance(bandwidth, Mapping):
        both = bandwidth.get("duplex")
    elif bandwidth is None:
        both = rates_of(costs).duplex_bandwidth
    return min(1.0, float(both) / (h2d + d2h)) if both else 1.0


def host_seconds(costs: Costs = None, host_per_vertex: float | None = None, backend: str = "cuda") -> float:
    """Host seconds per launch: ``host_per_vertex``, else the cost model's figure for ``backend``.

    A planners.costs.CostModel knows it per backend (``host_per_vertex_on``: 15 us on CUDA, 0 on the
    CPU backend, whose op times already hold it); a mapping of durations or no model means 0 (the
    simulator before host time).
    """
    if host_per_vertex is None:
        host_per_vertex = rates_of(costs).host_per_vertex_on(backend)
    h = float(host_per_vertex)
    if not (h >= 0 and math.isfinite(h)):
        raise ValueError(f"host_per_vertex must be a finite number of seconds >= 0, got {host_per_vertex!r}")
    return h


def moved_bytes(mg: MemGraph, vid: int) -> int:
    """Bytes a transfer or COPY moves: the values' own sizes (the places may be padded to alignment)."""
    mv = mg.vertices[vid]
    places = mv.reads if mv.reads else mv.writes
    values = mg.taskgraph.values
    total = 0
    for value, place in places.items():
        total += values[value].nbytes if 0 <= value < len(values) else place.nbytes
    return int(total)


def direction(mv) -> str | None:
    """'h2d' / 'd2h' for vertices that cross the link, None for those that stay on the device."""
    if mv.kind in (Kind.RELOAD, Kind.INPUT):
        return "h2d"
    if mv.kind in (Kind.OFFLOAD, Kind.OUTPUT):
        return "d2h"
    return None


class _Durations:
    """Seconds per vertex kind before noise: the ``time_<kind>`` hooks of engine/dispatch.py's one dispatch."""

    def __init__(self, mg: MemGraph, model: CostModel, h2d: float, d2h: float, hbm: float):
        self.mg, self.model, self.h2d, self.d2h, self.hbm = mg, model, h2d, d2h, hbm
        self.untimed = 0  # compute vertices that carry no time (and got none from the cost model)

    def time_compute(self, mv: MVertex) -> float:
        tg = self.mg.taskgraph
        if not 0 <= mv.task_vertex < len(tg.vertices):
            return 0.0
        tv = tg.vertices[mv.task_vertex]
        if mv.stream is Stream.HOST:  # the host's cores, not the GPU: the op's GPU time says nothing
            return update_elements(tv) / self.model.host_update_rate
        if mv.stream is Stream.D2D:  # a copy from another device: the link between them, not this one's HBM
            return sum(p.nbytes for p in mv.writes.values()) / self.model.d2d_bandwidth
        if mv.stream is Stream.COMM:  # a message to or from another rank: the link between ranks
            return sum(p.nbytes for p in (*mv.reads.values(), *mv.writes.values())) / self.model.rank_bandwidth
        t = float(tv.time)
        if t <= 0:
            t = float(self.model.estimate(tg, tv)[0])
        self.untimed += t <= 0
        return t

    def time_h2d(self, mv: MVertex) -> float:
        return moved_bytes(self.mg, mv.id) / self.h2d

    def time_d2h(self, mv: MVertex) -> float:
        return moved_bytes(self.mg, mv.id) / self.d2h

    def time_copy(self, mv: MVertex) -> float:
        return 2 * moved_bytes(self.mg, mv.id) / self.hbm  # read and write, both in HBM

    time_reload = time_input = time_h2d
    time_offload = time_output = time_d2h


def nominal_durations(mg: MemGraph, costs: Costs = None, bandwidth: Any = None, overhead: float = 0.0) -> list[float]:
    """Seconds per MemGraph vertex before noise.

    costs: None (TaskGraph vertex.time), a mapping {MemGraph vertex id: seconds} that overrides
    any vertex, or a cost model (ir.costs.CostModel: its estimate where a compute vertex carries no
    time, its link and HBM rates).
    """
    override = costs if isinstance(costs, Mapping) else {}
    model = rates_of(costs)
    h2d, d2h = link_bandwidths(model, bandwidth)
    durations = _Durations(mg, model, h2d, d2h, float(model.hbm_bandwidth))
    # a vertex of an unknown kind is priced as compute (its task vertex's time, if any)
    hooks = per_vertex(durations, "time_", mg.vertices, unknown=durations.time_compute)
    out = []
    for mv, seconds in zip(mg.vertices, hooks):
        if mv.id in override:
            out.append(float(override[mv.id]))
            continue
        out.append(seconds(mv) + overhead)
    if durations.untimed and durations.untimed == sum(1 for mv in mg.vertices if mv.kind is Kind.COMPUTE):
        log.warning("no compute vertex carries a time: the simulation counts transfers only "
                    "(annotate with planners.costs.CostModel().annotate(mg.taskgraph) or pass costs=)")
    return out


def transfer_bytes(mg: MemGraph) -> tuple[int, int]:
    """(bytes host->device, bytes device->host) one step moves: reloads + inputs, offloads + outputs."""
    b_in = sum(moved_bytes(mg, mv.id) for mv in mg.vertices if direction(mv) == "h2d")
    b_out = sum(moved_bytes(mg, mv.id) for mv in mg.vertices if direction(mv) == "d2h")
    return b_in, b_out


def time_floor(mg: MemGraph, costs: Costs = None, bandwidth: Any = None, *, host_per_vertex: float | None = None,
               backend: str = "cuda") -> dict:
    """Lower bound on the step: max(compute incl. recompute and copies, bytes in / H2D bw, bytes out / D2H bw,
    vertices x host seconds per launch, the host lane's optimizer updates one after another) as
    "floor"; "floor_both_ways" adds (bytes in + bytes out) /
    the link's duplex rate where one is known (both directions at once move less than their two
    one-way rates added: 89.4 GB/s on the H100 against 2 x 55.2), a bound just as hard and tighter
    for steps that move much both ways. ``host_per_vertex`` and ``backend`` as in ``simulate``."""
    model = rates_of(costs)
    durations = nominal_durations(mg, costs, bandwidth)
    h2d, d2h = link_bandwidths(model, bandwidth)
    compute = sum(d for mv, d in zip(mg.vertices, durations) if mv.stream is Stream.COMPUTE)
    # the host lane runs its updates one at a time, each on all of its cores (engine/host_lane.py)
    host_updates = sum(d for mv, d in zip(mg.vertices, durations) if mv.stream is Stream.HOST)
    b_in, b_out = transfer_bytes(mg)
    # the host launches every vertex one after another, and the last launch ends before its vertex does
    host = len(mg.vertices) * host_seconds(costs, host_per_vertex, backend)
    parts = {"compute": compute, "h2d": b_in / h2d, "d2h": b_out / d2h, "host": host, "host_updates": host_updates}
    both = (h2d + d2h) * both_ways_share(model, bandwidth)
    both_ways = (b_in + b_out) / both if both < h2d + d2h else 0.0
    return {**parts, "both_ways": both_ways, "floor": max(parts.values()),
            "floor_both_ways": max(*parts.values(), both_ways), "bytes_h2d": b_in, "bytes_d2h": b_out}


# -- the simulation ------------------------------------------------------------------------------

class _Lane:
    """One stream instance: launched vertices in FIFO order, the one running, launch-ahead counters."""

    __slots__ = ("depth", "name", "pool", "queue", "reported", "running", "unreported")

    def __init__(self, name: str, pool: tuple, depth: int):
        self.name, self.pool, self.depth = name, pool, depth  # depth: vertices reported at launch (0: none)
        self.queue: collections.deque[int] = collections.deque()  # launched, not started
        self.running = -1
        self.reported = 0  # early-reported vertices not yet finished
        self.unreported: collections.deque[int] = collections.deque()


class _Sim:
    EPS = 1e-15  # seconds: remaining work below this counts as done (float residue of the sharing)

    def __init__(self, mg: MemGraph, sched: Scheduler, durations: list[float], duplex: bool, depth: int,
                 host: float = 0.0, transfer_depth: int = 0, both_ways: float = 1.0,
                 link_rates: tuple[float, float] = (1.0, 1.0), host_links: HostLinks | None = None,
                 compute_beside_messages: float = 1.0):
        self.mg, self.s, self.dur, self.depth, self.host = mg, sched, durations, depth, host
        self.compute_beside_messages = compute_beside_messages  # compute's share while a message is on
        self.both_ways = both_ways  # each direction's rate while the other copies too (both_ways_share)
        self.rate = {"h2d": link_rates[0], "d2h": link_rates[1]}  # bytes/s of one device's link, each way
        self.host_links = host_links or HostLinks()
        self.transfer_depth = transfer_depth
        g = sched.g
        self.g = g
        self.pending = list(g.indegree)  # predecessors not really finished
        self.lanes: dict[tuple[int, int], _Lane] = {}
        self.lane_of: list[_Lane | None] = [None] * g.n
        self.reported = bytearray(g.n)
        self.launched_at = [math.nan] * g.n
        self.ready_at = [math.nan] * g.n  # launch ends: the device may start the vertex from then on
        self.host_free = 0.0  # when the loop thread ends the launches it has begun
        self.host_busy = 0.0
        self.start = [math.nan] * g.n
        self.end = [math.nan] * g.n
        self.remaining = [0.0] * g.n
        self.active: dict[tuple, list[int]] = collections.defaultdict(list)  # pool -> running vertices
        self.busy: dict[tuple, float] = collections.defaultdict(float)
        self.duplex = duplex
        # reports the loop takes in turn, and device news it has not polled yet: a unit id is its report,
        # ~id (negative) says that unit, reported at enqueue, has run (engine.loop.Ran)
        self.completions: collections.deque[int] = collections.deque()
        self.unpolled: list[int] = []
        self.looked = -math.inf  # when the loop last polled the device
        self.early = bytearray(g.n)  # reported before it ran
        self.finished = 0
        self.now = 0.0
        # started vertices that may not progress yet: a rank's message until its peer posts it too (ranks_sim)
        self.waiting: set[int] = set()
        self.holds: Callable[[int], bool] | None = None  # whether a vertex just started must wait
        self._host_at = math.nan  # the host's event next_event found first

    def _lane(self, key: int, inst: int) -> _Lane:
        lane = self.lanes.get((key, inst))
        if lane is None:
            stream, dev = self.g.keys[key]
            pool_name = stream.value if (self.duplex or stream in (Stream.COMPUTE, Stream.HOST, Stream.D2D, Stream.COMM)) else "link"
            name = f"{stream.value} {inst}" + (f" @{dev}" if dev else "")
            depth = reported_ahead(stream, self.depth, self.transfer_depth)
            lane = _Lane(name, (pool_name, dev), depth)
            self.lanes[(key, inst)] = lane
        return lane

    # the loop side: launches and reports, in the order engine.loop.drive processes them
    def _launch_all(self, launches) -> None:
        for item in launches:
            vid = item.vertex
            lane = self._lane(item.key, item.instance)
            self.lane_of[vid] = lane
            # one loop thread: a batch's launches run back to back, each after the host's previous one
            begin = max(self.now, self.host_free)
            self.launched_at[vid] = begin
            self.host_free = self.ready_at[vid] = begin + self.host
            self.host_busy += self.host
            lane.queue.append(vid)
            if lane.depth:
                if lane.reported < lane.depth:
                    lane.reported += 1
                    self._report(vid, self.completions)  # at launch, as engine/cuda.py's launch
                else:
                    lane.unreported.append(vid)

    def _report(self, vid: int, to: collections.deque[int] | list[int]) -> None:
        self.reported[vid] = 1
        self.early[vid] = math.isnan(self.end[vid])
        to.append(vid)

    def _drain(self) -> None:
        # As engine.loop.drive with engine/completions.py's EventCompletions: the loop takes one report whenever
        # it is free (done launching), and polls the device when no report is queued or LOOK_WHILE_BUSY_S
        # after its last look, taking all its news at once, behind the reports queued. So a run of early
        # reports goes before a transfer that ended meanwhile, and news that come in while the host is
        # launching waits for it. With no host time this is the order the reports were made in.
        while self.host_free <= self.now:
            if not self.completions or self.now - self.looked >= LOOK_WHILE_BUSY_S:
                self.looked = self.now
                if self.unpolled:
                    self.completions.extend(self.unpolled)
                    self.unpolled.clear()
                elif not self.completions:
                    break
            news = self.completions.popleft()
            if news < 0:
                self._launch_all(self.s.ran(~news))
            else:
                self._launch_all(self.s.complete(news, ran=not self.early[news]))
        self._start_ready()

    def _host_event(self) -> float:
        """The next time the host changes what can happen: it is done launching while reports wait,
        or a launch ends for a stream's first vertex whose predecessors are done."""
        t = self.host_free if (self.completions or self.unpolled) and self.host_free > self.now else math.inf
        for lane in self.lanes.values():
            if lane.running < 0 and lane.queue:
                head = lane.queue[0]
                if self.pending[head] == 0 and self.now < self.ready_at[head] < t:
                    t = self.ready_at[head]
        return t

    # the device side: lanes start their head when its predecessors are done, pools share rates
    def _start_ready(self) -> None:
        for lane in self.lanes.values():
            if (lane.running < 0 and lane.queue and self.pending[lane.queue[0]] == 0
                    and self.ready_at[lane.queue[0]] <= self.now):
                vid = lane.queue.popleft()
                lane.running = vid
                self.start[vid] = self.now
                self.remaining[vid] = self.dur[vid]
                self.active[lane.pool].append(vid)
                if self.holds is not None and self.holds(vid):
                    self.waiting.add(vid)

    def _finish(self, vid: int) -> None:
        lane = self.lane_of[vid]
        lane.running = -1
        self.end[vid] = self.now
        self.finished += 1
        for s in self.g.succs[vid]:
            self.pending[s] -= 1
        if self.reported[vid]:
            lane.reported -= 1
            if self.g.watched[vid]:
                self.unpolled.append(~vid)
        else:  # transfers report when done (as engine/cuda.py's poll: reported vertices are the older ones)
            if lane.unreported and lane.unreported[0] == vid:
                lane.unreported.popleft()
            self._report(vid, self.unpolled)
        while lane.depth and lane.unreported and lane.reported < lane.depth:
            lane.reported += 1
            self._report(lane.unreported.popleft(), self.unpolled)

    def _speeds(self, pools: list[tuple[tuple, list[int]]]) -> dict[tuple, float]:
        """Each busy pool's rate as a share of its own: a direction of the link runs at
        ``both_ways`` of it while the other direction of that device copies too, and every device's
        links together at most what the host moves (``host_links``: each direction, and both)."""
        speed = {pool: 1.0 for pool, _ in pools}
        if self.compute_beside_messages < 1.0:  # a message on the device, moving or waiting for its peer
            for (name, dev), vids in self.active.items():
                if name == "comm" and vids and ("compute", dev) in speed:
                    speed[("compute", dev)] *= self.compute_beside_messages
        if self.both_ways < 1.0:
            busy = set(speed)
            for name, dev in busy:
                if name in ("h2d", "d2h") and ({"h2d": "d2h", "d2h": "h2d"}[name], dev) in busy:
                    speed[(name, dev)] = self.both_ways
        links = [pool for pool in speed if pool[0] in self.rate]
        for cap, capped in ((self.host_links.h2d, ("h2d",)), (self.host_links.d2h, ("d2h",)),
                            (self.host_links.both, ("h2d", "d2h"))):
            moving = sum(self.rate[pool[0]] * speed[pool] for pool in links if pool[0] in capped)
            if cap is not None and moving > cap:  # the host's share: every link slowed alike
                for pool in links:
                    if pool[0] in capped:
                        speed[pool] *= cap / moving
        return speed

    def next_event(self) -> tuple[int, float, bool, list, dict]:
        """(the vertex that ends first or -1, seconds until the next event, whether it is the host's,
        the busy pools with their progressing vertices, each pool's speed). dt is inf when nothing
        can happen: every vertex done, or a stall (or, among ranks, every one waiting on a peer)."""
        pools = [(pool, [v for v in vids if v not in self.waiting] if self.waiting else vids)
                 for pool, vids in self.active.items() if vids]
        pools = [(pool, vids) for pool, vids in pools if vids]
        host_event = self._host_event()
        # the next event: the pool whose least-remaining vertex ends first at its shared rate
        speed = self._speeds(pools)
        first, dt = -1, math.inf
        for pool, vids in pools:
            for v in vids:
                t = self.remaining[v] * len(vids) / speed[pool]
                if t < dt:
                    first, dt = v, t
        if host_event < self.now + dt:  # the host acts first: running vertices progress, none is due
            self._host_at = host_event
            return -1, host_event - self.now, True, pools, speed
        return first, dt, False, pools, speed

    def advance(self, first: int, dt: float, host: bool, pools: list, speed: dict) -> None:
        """Move the clock ``dt`` on (to the host's event when ``host``), finishing ``first`` and
        whatever else ran out, then let the loop take its reports and the lanes start their heads."""
        self.now = self._host_at if host else self.now + dt
        done = []
        for pool, vids in pools:
            self.busy[pool] += dt
            share = dt * speed[pool] / len(vids)
            for v in vids:
                left = self.remaining[v] - share
                self.remaining[v] = left
                if v == first or left <= self.EPS:
                    done.append(v)
        if done:
            ended = set(done)
            for vids in self.active.values():
                vids[:] = [v for v in vids if v not in ended]
        for v in sorted(done):
            self._finish(v)
        self._drain()

    def stall(self) -> StallError:
        stuck = self.s.stuck()
        return StallError(f"simulated stall: {len(stuck)} of {self.g.n} vertices can never run "
                          f"(nothing ready, nothing in flight)\n{self.s.explain_stuck(self.mg)}", stuck)

    def begin(self) -> None:
        self._launch_all(self.s.start())
        self._drain()

    def run(self) -> None:
        self.begin()
        while self.finished < self.g.n:
            first, dt, host, pools, speed = self.next_event()
            if dt == math.inf:
                raise self.stall()
            self.advance(first, dt, host, pools, speed)
        self.check_finished()

    def check_finished(self) -> None:
        if not self.s.finished:  # every vertex ran, so the loop must agree
            raise RuntimeError("simulation ended with the scheduler not finished")


def simulate(mg: MemGraph, costs: Costs = None, jitter: float = 0.0, ordering: str | Policy = "nondeterministic",
             seed: int = 0, streams: dict | None = None, bandwidth: Any = None, *, duplex: bool = True,
             backend: str = "cuda", launch_ahead: int | None = None, overhead: float = 0.0,
             host_per_vertex: float | None = None, transfer_ahead: int | None = None) -> SimResult:
    """Simulate one step of ``mg``; see the module docstring for the model.

    costs: None (TaskGraph vertex.time), {MemGraph vertex id: seconds}, or a cost model (ir.costs.CostModel,
    which planners.costs.CostModel implements).
    jitter: sigma of the lognormal noise on every duration (0: exact). seed: noise and random ordering.
    ordering: "nondeterministic", "deterministic", "random" or a Policy, as in engine.run.
    streams: stream instances per class ({"compute": 1, "h2d": 2}); defaults are the backend's.
    bandwidth: bytes/s, one number or (h2d, d2h) or {"h2d":, "d2h":}; default the cost model's, else 50 GB/s.
    duplex: False puts both directions on one shared link. backend: "cuda" or "cpu" (stream counts,
    launch-ahead). launch_ahead: unreported compute vertices per stream (None: backend default, 0: off).
    transfer_ahead: copies a copy stream reports at enqueue, as engine.run's (None: the backend's default).
    overhead: seconds added to every vertex's device time (kept for old callers; host_per_vertex models
    the loop's cost, see the module docstring for how the two differ).
    host_per_vertex: host seconds per launch on the one loop thread; None: the cost model's (host_seconds).
    """
    run = prepared(mg, costs, jitter, ordering, seed, streams, bandwidth, duplex=duplex, backend=backend,
                   launch_ahead=launch_ahead, overhead=overhead, host_per_vertex=host_per_vertex,
                   transfer_ahead=transfer_ahead)
    run.sim.run()
    return sim_result(run)


class Prepared(NamedTuple):
    """A simulation set up by ``prepared`` and what its SimResult reports beside its clock."""

    sim: _Sim
    graph: StaticGraph
    policy: Policy
    pool: StreamPool
    seed: int
    jitter: float


def prepared(mg: MemGraph, costs: Costs = None, jitter: float = 0.0, ordering: str | Policy = "nondeterministic",
             seed: int = 0, streams: dict | None = None, bandwidth: Any = None, *, duplex: bool = True,
             backend: str = "cuda", launch_ahead: int | None = None, overhead: float = 0.0,
             host_per_vertex: float | None = None, transfer_ahead: int | None = None) -> Prepared:
    """The simulation of one step of ``mg``, not yet run, as simulate's arguments say: simulate runs
    it, engine/ranks_sim.py runs several together."""
    if jitter < 0:
        raise ValueError(f"jitter is the lognormal sigma and must be >= 0, got {jitter}")
    host = host_seconds(costs, host_per_vertex, backend)
    policy = make_policy(ordering, seed)
    graph = StaticGraph(mg)
    counts = stream_counts(backend, streams)
    pool = StreamPool([counts[stream] for stream, _ in graph.keys])
    ws = WorkspacePool(workspace_capacity(mg, arena_devices(mg)))
    sched = Scheduler(graph, policy.ranks(mg), policy.strict, pool, ws)
    per_vertex = nominal_durations(mg, costs, bandwidth, overhead)
    # a unit (a segment, replayed as one CUDA graph) runs its vertices back to back for one launch
    durations = [sum(per_vertex[vid] for vid in unit) for unit in graph.units]
    if jitter > 0:
        z = np.random.default_rng(seed).standard_normal(len(durations))
        durations = (np.asarray(durations) * np.exp(jitter * z - jitter * jitter / 2)).tolist()
    depth = (CUDA_LAUNCH_AHEAD if backend == "cuda" else 0) if launch_ahead is None else int(launch_ahead)
    sim = _Sim(mg, sched, durations, duplex, depth, host, transfer_depth(backend, transfer_ahead),
               both_ways_share(costs, bandwidth), link_bandwidths(costs, bandwidth), rates_of(costs).host_links,
               rates_of(costs).compute_beside_messages)
    return Prepared(sim, graph, policy, pool, seed, jitter)


def sim_result(run: Prepared) -> SimResult:
    """The SimResult of ``run``'s simulation, run to its end."""
    sim, graph, policy, pool, seed, jitter = run
    mg, sched, host, duplex = sim.mg, sim.s, sim.host, sim.duplex
    head = graph.head  # units are named by their first vertex
    timeline = sorted((Span(head[u], sim.lane_of[u].name, sim.start[u], sim.end[u]) for u in range(graph.n)),
                      key=lambda s: (s.start, s.vertex))
    inst_of = {id(lane): k for k, lane in sim.lanes.items()}
    records = [Record(head[u], inst_of[id(sim.lane_of[u])][0], inst_of[id(sim.lane_of[u])][1], sim.start[u],
                      sim.end[u], True) for u in range(graph.n)]
    step = max(sim.end, default=0.0)
    busy = collections.Counter()
    for (name, _dev), t in sim.busy.items():
        busy[name] += t
    n_compute_devices = len({dev for name, dev in sim.busy if name == "compute"}) or 1
    link_in = busy["h2d"] + busy["link"] if not duplex else busy["h2d"]
    b_in, b_out = transfer_bytes(mg)
    return SimResult(
        step_time=step, compute_busy=busy["compute"], compute_idle=step * n_compute_devices - busy["compute"],
        h2d_busy=link_in, d2h_busy=busy["d2h"] if duplex else link_in, host_busy=sim.host_busy,
        bytes_h2d=b_in, bytes_d2h=b_out, ordering=policy.name, seed=seed, jitter=jitter,
        host_per_vertex=host, timeline=timeline, launch_order=list(sched.launch_order),
        launched_at=[sim.launched_at[u] for u in graph.unit_of], records=records, keys=list(graph.keys),
        instances={k: n for k, n in enumerate(pool.sizes)})


# -- reading a simulated step ------------------------------------------------------------------

def idle_by_wait(mg: MemGraph, res: SimResult) -> dict[str, float]:
    """Seconds the GPU's compute lanes sat idle in ``res`` (a simulation of ``mg``), by what the
    compute unit after each gap waited for: its predecessor that finished last, named by edge
    ("data", "memory") and vertex kind (with the moved value's kind: "data reload
    optimizer_state"), or "host" where nothing it waited for ended during the gap (the launch).
    The tail after a device's last compute unit (the last write-backs) is not counted, so the
    values add up to compute_idle less that tail. A reading of where a plan loses time that the
    step time alone does not give."""
    graph = StaticGraph(mg)
    span = {s.vertex: s for s in res.timeline}
    end_of = [span[graph.head[graph.unit_of[v]]].end for v in range(len(mg.vertices))]
    preds: list[list[tuple[int, str]]] = [[] for _ in mg.vertices]
    for src, dst, kind in mg.edges:
        preds[dst].append((src, kind.value))

    def name(v: int, edge: str) -> str:
        mv = mg.vertices[v]
        value = mg.taskgraph.values[mv.value].kind.value if mv.kind is not Kind.COMPUTE and mv.value >= 0 else ""
        return " ".join(x for x in (edge, mv.kind.value, value) if x)

    idle: dict[str, float] = collections.defaultdict(float)
    lanes = collections.defaultdict(list)
    for s in res.timeline:
        if s.stream.startswith("compute"):
            lanes[s.stream.split(" ", 2)[-1] if "@" in s.stream else ""].append(s)
    for spans in lanes.values():  # per device: its compute streams together
        last = 0.0
        for s in sorted(spans, key=lambda x: x.start):
            if s.start > last + 1e-9:
                unit = graph.units[graph.unit_of[s.vertex]]
                inside = set(unit)
                waits = [(end_of[p], p, edge) for v in unit for p, edge in preds[v] if p not in inside]
                end, p, edge = max(waits, default=(0.0, -1, ""))
                idle[name(p, edge) if p >= 0 and end > last + 1e-9 else "host"] += s.start - last
            last = max(last, s.end)
    return dict(sorted(idle.items(), key=lambda kv: -kv[1]))
