"""Resources a vertex holds while it runs, each a small manager with acquire/release.

- streams: a fixed number of stream instances per (stream class, device);
  one vertex per instance at a time (the paper's "a single stream can only
  be used by a single launched vertex at a time");
- workspace: temporary device bytes per device, bounded so arena plus
  workspace stays inside the user's budget;
- locks: named mutexes (sum-into accumulation: one writer at a time).

Only the loop thread calls these, so they need no locking of their own.
Acquire never blocks: it says yes or no and the loop parks the vertex.
"""

from __future__ import annotations

from collections.abc import Hashable

from turnip.ir.memgraph import Stream

# Stream instances per class when the caller does not say. The paper used 5
# streams per GPU; CPU lanes are worker threads, and torch ops already use
# intra-op threads, so two compute lanes give real overlap without thrashing.
# On CUDA one compute stream with launch-ahead (engine/cuda.py) measured
# fastest (bench/engine_overhead.py: 3 compute streams cost 2.5 us more per
# vertex), and large kernels fill the GPU alone; two streams per copy
# direction keep a copy engine busy while the loop notices the last one end.
DEFAULT_STREAMS = {
    "cpu": {Stream.COMPUTE: 2, Stream.H2D: 1, Stream.D2H: 1},
    "cuda": {Stream.COMPUTE: 1, Stream.H2D: 2, Stream.D2H: 2},
}


def stream_counts(device_type: str, overrides: dict | None = None) -> dict[Stream, int]:
    """Default counts for the backend, updated with ``overrides`` ({"compute": 4} or {Stream.H2D: 2})."""
    counts = dict(DEFAULT_STREAMS.get(device_type, DEFAULT_STREAMS["cpu"]))
    for key, n in (overrides or {}).items():
        cls = Stream(key.value if isinstance(key, Stream) else key)
        if int(n) < 1:
            raise ValueError(f"streams[{cls.value!r}] must be at least 1, got {n}")
        counts[cls] = int(n)
    return counts


class StreamPool:
    """Free stream instances per key; a key is an index into ``keys`` ((Stream, device) pairs)."""

    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)
        # a stack of free instances: the most recently freed is reused first, which on CUDA keeps
        # a dependent chain on one stream (its ordering is then free) and on CPU keeps threads warm
        # free[key] is read directly by the loop's hot path (a method call per key costs more than the check)
        self.free = [list(range(n - 1, -1, -1)) for n in sizes]

    def available(self, key: int) -> bool:
        return bool(self.free[key])

    def acquire(self, key: int) -> int | None:
        free = self.free[key]
        return free.pop() if free else None

    def release(self, key: int, instance: int) -> None:
        self.free[key].append(instance)

    def busy(self, key: int) -> int:
        return self.sizes[key] - len(self.free[key])


class WorkspacePool:
    """Bytes of temporary memory per device. A capacity of None is unbounded."""

    def __init__(self, capacity: dict[Hashable, int | None]):
        self.capacity = dict(capacity)
        self.used: dict[Hashable, int] = {dev: 0 for dev in capacity}
        self.peak: dict[Hashable, int] = {dev: 0 for dev in capacity}

    def fits_ever(self, device: Hashable, nbytes: int) -> bool:
        cap = self.capacity.get(device)
        return cap is None or nbytes <= cap

    def acquire(self, device: Hashable, nbytes: int) -> bool:
        cap = self.capacity.get(device)
        used = self.used.get(device, 0)
        if cap is not None and used + nbytes > cap:
            return False
        used += nbytes
        self.used[device] = used
        if used > self.peak.get(device, 0):
            self.peak[device] = used
        return True

    def release(self, device: Hashable, nbytes: int) -> None:
        self.used[device] -= nbytes


class LockTable:
    """Named locks (MVertex.lock), held by at most one running vertex each."""

    def __init__(self):
        self._held: set[str] = set()

    def acquire(self, name: str) -> bool:
        if name in self._held:
            return False
        self._held.add(name)
        return True

    def release(self, name: str) -> None:
        self._held.discard(name)

    def held(self, name: str) -> bool:
        return name in self._held
