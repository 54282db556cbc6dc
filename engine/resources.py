"""Resources a vertex holds while it runs, each a small manager with the same two verbs.

    handle = manager.try_acquire(description)   # None: not now (never blocks)
    manager.release(handle)

- streams (``StreamPool``): a fixed number of stream instances per stream
  key ((stream class, device)); one vertex per instance at a time (the paper's
  "a single stream can only be used by a single launched vertex at a time");
- workspace (``WorkspacePool``): temporary device bytes per device, bounded
  so arena plus workspace stays inside the user's budget.

A vertex's needs are computed once per MemGraph (``loop.StaticGraph``) and
taken all-or-nothing by ``Scheduler._acquire`` (engine/loop.py). Only the loop
thread calls these, so they need no locking of their own.

There is no lock manager: MVertex.lock exists in the MemGraph format for
sum-into accumulation, but no builder produces one, so the engine refuses a
vertex with a lock (``StaticGraph``) until a builder and its resource land
together.
"""

from __future__ import annotations

from collections.abc import Hashable

from ..ir.memgraph import Stream

WORKSPACE = "workspace"  # the name StaticGraph.needs gives the WorkspacePool

# Stream instances per class when the caller does not say. The paper used 5
# streams per GPU; CPU lanes are worker threads, and torch ops already use
# intra-op threads, so two compute lanes give real overlap without thrashing.
# On CUDA one compute stream with launch-ahead (engine/cuda.py) measured
# fastest (bench/engine_overhead.py: 3 compute streams cost 2.5 us more per
# vertex), and large kernels fill the GPU alone. Two streams per copy direction, although the
# H100 never ran two copies of one direction at once (trace of gpt1.3b at 50%, bench/trace_waits.py:
# no overlap in 108 ms of copies): the copy engine then chooses between the two streams' queues,
# which may hold an urgent copy behind another stream's (4 ms in that trace), but one stream, where
# the copies run strictly in the order the loop queued them, measured slower on the same MemGraph,
# 217.9 ms against 212.2 (bench/results/h100/engine_variants_gpt1.3b_streams.json, simulated 211.9 and 201.0).
# One host lane: a CPU optimizer update already spreads over every core (torch's intra-op threads).
# One lane per device for copies from other devices' arenas (Stream.D2D, several devices only), and one
# per rank for messages to and from other ranks (Stream.COMM, run in their one fixed order).
DEFAULT_STREAMS = {
    "cpu": {Stream.COMPUTE: 2, Stream.H2D: 1, Stream.D2H: 1, Stream.HOST: 1, Stream.D2D: 1, Stream.COMM: 1},
    "cuda": {Stream.COMPUTE: 1, Stream.H2D: 2, Stream.D2H: 2, Stream.HOST: 1, Stream.D2D: 1, Stream.COMM: 1},
}


# Vertices a CUDA stream reports to the loop at launch, before they finish (engine/cuda.py): compute
# kernels queue up so the host runs ahead of the GPU; a copy queued behind the running one starts
# without waiting for the host to see that one end (engine.run's transfer_ahead).
CUDA_LAUNCH_AHEAD = 16
CUDA_TRANSFER_AHEAD = 4  # bench/results/h100/engine_variants_*.json: 0 -> 4 took gpt350m at 25% from 232 to 201 ms
# While reports wait (launch-ahead reports a unit at enqueue, so a busy loop always has some), the
# completion sources (engine/completions.py) still look at the streams this often, and the simulator
# with them: a unit waiting for another's run (a copy between devices waits for its writers) is
# launched only once the loop hears of it. Looked at only when no report waited, gpt1.3b on two H200s
# at 25% heard of the writers of its copies between devices a median 7.0 ms late, 70 launches after
# they ran: 60 ms of the GPUs' idle in a 299 ms step (bench/results/2026-11-29_h200x2_rows-ablation-allocator.md).
LOOK_WHILE_BUSY_S = 200e-6


def transfer_depth(device_type: str, transfer_ahead: int | None) -> int:
    """Copies reported at enqueue per copy stream: ``transfer_ahead``, else the backend's default."""
    if transfer_ahead is None:
        return CUDA_TRANSFER_AHEAD if device_type == "cuda" else 0
    if isinstance(transfer_ahead, bool) or not isinstance(transfer_ahead, int) or transfer_ahead < 0:
        raise ValueError(f"transfer_ahead must be a whole number of copies >= 0 (0: report each copy when it "
                         f"ends), got {transfer_ahead!r}")
    return transfer_ahead


def reported_ahead(stream_class: Stream, compute_depth: int, copy_depth: int) -> int:
    """Units a lane of ``stream_class`` reports finished at enqueue: compute_depth for kernels (launch
    ahead), copy_depth for the host link's copies (transfer_ahead), none for the host lane and for
    copies between devices. A copy between devices is reported when it has run: its readers are
    kernels (the owner's sums reading a bucket of gradients, the replicas' refreshes), and a kernel
    launched behind a copy still in flight holds up its whole stream; on four H100s the refreshes,
    launched ahead of the weights they copy, held each device's backward for ~110 ms (simulated)."""
    if stream_class is Stream.COMPUTE:
        return compute_depth
    if stream_class in (Stream.HOST, Stream.D2D, Stream.COMM):
        return 0
    return copy_depth


def stream_counts(device_type: str, overrides: dict | None = None) -> dict[Stream, int]:
    """Default counts for the backend, updated with ``overrides`` ({"compute": 4} or {Stream.H2D: 2})."""
    counts = dict(DEFAULT_STREAMS.get(device_type, DEFAULT_STREAMS["cpu"]))
    for key, n in (overrides or {}).items():
        cls = Stream(key.value if isinstance(key, Stream) else key)
        if int(n) < 1:
            raise ValueError(f"streams[{cls.value!r}] must be at least 1, got {n}")
        if cls is Stream.COMM and int(n) != 1:
            raise ValueError(f"streams['comm'] must be 1, got {n}: a rank's messages run one at a time in the "
                             f"order every rank shares")
        counts[cls] = int(n)
    return counts


class StreamPool:
    """Free stream instances per key; a key is an index into StaticGraph.keys ((Stream, device) pairs).

    Description: a key. Handle: the pair (key, instance), built once here, so
    acquiring and releasing allocate nothing.
    """

    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)
        # a stack of free instances: the most recently freed is reused first, which on CUDA keeps
        # a dependent chain on one stream (its ordering is then free) and on CPU keeps threads warm.
        # free[key] is read (and popped) directly by the loop's hot path: a method call per key costs
        # more than the check
        self.free: list[list[tuple[int, int]]] = [[(key, i) for i in range(n - 1, -1, -1)]
                                                  for key, n in enumerate(sizes)]

    def try_acquire(self, key: int) -> tuple[int, int] | None:
        free = self.free[key]
        return free.pop() if free else None

    def release(self, handle: tuple[int, int]) -> None:
        self.free[handle[0]].append(handle)

    def busy(self, key: int) -> int:
        return self.sizes[key] - len(self.free[key])


class WorkspacePool:
    """Bytes of temporary memory per device. A capacity of None is unbounded.

    Description: (device, nbytes), built once per vertex by StaticGraph. Handle:
    the description itself (releasing gives those bytes back).
    """

    def __init__(self, capacity: dict[Hashable, int | None]):
        self.capacity = dict(capacity)
        self.used: dict[Hashable, int] = {dev: 0 for dev in capacity}
        self.peak: dict[Hashable, int] = {dev: 0 for dev in capacity}

    def never_fits(self, description: tuple[Hashable, int]) -> str | None:
        """Why ``description`` can never be granted, or None if it fits an idle pool."""
        device, nbytes = description
        cap = self.capacity.get(device)
        if cap is None or nbytes <= cap:
            return None
        return f"needs {nbytes} workspace bytes, more than the {cap} available on device {device}"

    def try_acquire(self, description: tuple[Hashable, int]) -> tuple[Hashable, int] | None:
        device, nbytes = description
        cap = self.capacity.get(device)
        used = self.used.get(device, 0)
        if cap is not None and used + nbytes > cap:
            return None
        used += nbytes
        self.used[device] = used
        if used > self.peak.get(device, 0):
            self.peak[device] = used
        return description

    def release(self, handle: tuple[Hashable, int]) -> None:
        device, nbytes = handle
        self.used[device] -= nbytes
