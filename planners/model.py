"""The planning problem: a TaskGraph in a fixed serial order, reduced to decisions with static effects.

Decisions (shared by greedy, ILP and brute force; evaluated by memory.py):
- per *group* (a forward vertex whose outputs are read by the backward pass, or a backward value
  left idle for a long stretch such as a tied weight's first gradient): keep its saved outputs,
  offload them (copied out after production, gone after their last use before the gap, reloaded
  for the use after it), or recompute the vertex (with the chain of unsaved forward values it
  needs) right before they are needed again;
- per *item* (a parameter, or the optimizer states of one parameter; per module on big models):
  home on the GPU, or on the CPU (streamed in before each run of uses, updated values written
  back after the update).

"Needed again" is the first backward use, pulled earlier when a recomputed vertex reads the
group's outputs (chains): the need time of a group is min(first backward use, need times of
the recomputed groups reading it). Every (kind, need time) pair is an *option* whose memory
intervals and window loads are fixed, which keeps the ILP linear and lets a brute force
enumerate exactly the same space.

Positions are indices in the serial order. Memory is counted per position the way BuildMemGraph
simulates it (a value occupies the arena from production or reload to its last use); windows
are runs of positions whose transfers overlap their compute, and they price time only: a
transfer lands in the window of production (offload, write-back) or the one before its use
(reload, fetch). Sizes are rounded up to the builder's alignment.

The link in both directions at once is a resource too: a window's offloads and reloads together
take at least their bytes over `bw_duplex` (the H100 moved 89 GB/s in all both ways at once against
55 each way alone).

Host time is the third resource of a window, beside the GPU and the link: the engine's event
loop spends `host_per_vertex` seconds on every MemGraph vertex it launches, concurrently with
the device. Every TaskGraph vertex, batch input and step output is one launch (base_host); a
decision adds the launches of its own vertices (one per recomputed vertex, an offload and a
reload per saved value, a fetch per streamed run and a write-back per updated home) in the
windows where they run.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ..ir.taskgraph import MESSAGE_OPS, TaskGraph

log = logging.getLogger(__name__)

KEEP, OFFLOAD, RECOMPUTE = "keep", "offload", "recompute"


@dataclass
class Option:
    kind: str
    at: int  # position from which the backward copy is present (-1 for keep)
    intervals: list[tuple[int, int, int]]  # (first, last position, bytes) the saved outputs occupy
    compute: tuple[int, float] | None = None  # (window, seconds) of recomputation
    h2d: tuple[int, int] | None = None  # (window, bytes) reloaded
    d2h: tuple[int, int] | None = None  # (window, bytes) offloaded
    extra: int = 0  # bytes of the recompute chain's temporaries, at position `at`
    host: tuple[tuple[int, float], ...] = ()  # (window, host seconds) of the vertices it launches


@dataclass
class Group:
    vertex: int
    pos: int
    saved: list[int]  # output value ids read after the forward pass
    nbytes: int  # aligned bytes of the saved outputs
    n0: int  # first use after the gap (the backward pass, for forward groups) of any saved output
    forward: bool = True  # False: an idle backward value, which can only be offloaded
    candidates: list[int] = field(default_factory=list)  # possible need times, ascending, n0 last
    chain: list[int] = field(default_factory=list)  # unsaved forward producers recomputed with it
    requires: list[int] = field(default_factory=list)  # groups whose outputs the recomputation reads
    persistent: list[int] = field(default_factory=list)  # persistent values the recomputation reads
    rc_time: float = 0.0
    options: list[Option] = field(default_factory=list)
    index: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, at) -> option

    def option(self, kind: str, at: int) -> int | None:
        return self.index.get((kind, -1 if kind == KEEP else at))


@dataclass
class Item:
    name: str
    kind: str  # "parameter" | "frozen" | "optimizer_state"
    values: list[int]
    nbytes: int  # pinned CPU bytes when homed there
    delta: list[tuple[int, int, int]]  # memory intervals (CPU home minus GPU home), signed bytes
    h2d: dict[int, int]  # window -> bytes fetched when homed on the CPU
    d2h: dict[int, int]  # window -> bytes written back when homed on the CPU
    present: dict[int, list[tuple[int, int]]]  # value -> positions it is on the GPU when homed on the CPU
    host: dict[int, float] = field(default_factory=dict)  # window -> host seconds of its fetches and write-backs

    def covers(self, value: int, position: int) -> bool:
        return any(first <= position <= last for first, last in self.present[value])


@dataclass
class Problem:
    tg: TaskGraph
    order: list[int]
    pos: np.ndarray  # vertex id -> position
    times: np.ndarray  # seconds per position
    win_start: np.ndarray
    win_end: np.ndarray  # inclusive
    window_of: np.ndarray  # position -> window
    base: np.ndarray  # bytes present at each position whatever the decisions
    base_compute: np.ndarray  # seconds per window
    base_h2d: np.ndarray
    base_d2h: np.ndarray
    base_host: np.ndarray  # host seconds per window of the launches every plan makes
    groups: list[Group]
    items: list[Item]
    item_of: dict[int, int]  # persistent value -> item
    required_by: list[list[int]]
    cap: int  # bytes available to values at every position
    cpu_cap: float  # pinned bytes available (inf when unbounded)
    bw_h2d: float
    bw_d2h: float
    max_workspace: int
    alignment: int
    gpu_budget: int
    headroom: float
    host_per_vertex: float = 0.0  # host seconds per launched MemGraph vertex (costs.CostModel)
    # bytes/s the link moves in all with both directions busy (inf: each direction at its own rate)
    bw_duplex: float = float("inf")

    @property
    def latest_first(self) -> list[int]:
        """Group indices from the latest-produced back (requirers before what they require)."""
        if not hasattr(self, "_latest_first"):
            self._latest_first = sorted(range(len(self.groups)), key=lambda i: -self.groups[i].pos)
        return self._latest_first

    @property
    def n(self) -> int:
        return len(self.order)

    @property
    def n_windows(self) -> int:
        return len(self.win_start)


# -- serial order --------------------------------------------------------------------------------

def step_order(tg: TaskGraph) -> list[int]:
    """Program order with each parameter's update moved right after its gradient is complete and
    the last reader of the weights it overwrites has run (so the builder updates them in place),
    so gradients die at once and optimizer states are needed one block at a time.

    Each optimizer vertex goes right after its trigger: the latest non-optimizer vertex it waits for,
    directly (a gradient it reads, a reader of a home it overwrites) or through the optimizer
    vertices it reads from or must not overwrite the input of. Waiting is inherited along those
    edges rather than shared by every vertex they connect: every fused update reads the one step
    counter, and sharing would hold all of them (and so every gradient) to the end of the backward.
    """
    n = len(tg.vertices)
    # a message to or from another rank keeps its place: every rank posts them in one order (trace/ranks.py)
    is_opt = [v.phase == "optimizer" and v.op not in MESSAGE_OPS for v in tg.vertices]
    opt = [v.id for v in tg.vertices if is_opt[v.id]]
    if not opt:
        return list(range(n))
    consumers = tg.consumers()
    trigger: dict[int, int] = {}
    for vid in opt:  # program order is topological: what vid waits for has its trigger already
        waits = -1
        vertex = tg.vertices[vid]
        for old, _new in vertex.copy_in:
            if tg.values[old].kind.is_persistent:  # readers of the bytes it overwrites go first
                for reader in consumers[old]:
                    if reader != vid:
                        waits = max(waits, trigger.get(reader, -1) if is_opt[reader] else reader)
        for val in vertex.inputs():
            prod = tg.values[val].producer
            if prod >= 0:
                waits = max(waits, trigger[prod] if is_opt[prod] else prod)
        trigger[vid] = waits
    after: dict[int, list[int]] = defaultdict(list)
    for vid in opt:
        after[trigger[vid]].append(vid)
    order = list(after.get(-1, []))
    for vid in range(n):
        if not is_opt[vid]:
            order.append(vid)
            order.extend(after.get(vid, []))
    if not _topological(tg, order):
        log.warning("interleaved optimizer order is not topological; using program order")
        return list(range(n))
    return order


def _topological(tg: TaskGraph, order: list[int]) -> bool:
    seen = set()
    for vid in order:
        for val in tg.vertices[vid].inputs():
            prod = tg.values[val].producer
            if prod >= 0 and prod not in seen:
                return False
        seen.add(vid)
    return len(seen) == len(tg.vertices)


def make_windows(times: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut positions into about `count` runs of similar compute time."""
    n = len(times)
    count = max(1, min(count, n))
    if float(times.sum()) <= 0:
        times = np.ones(n)  # no costs known: equal numbers of positions
    target = float(times.sum()) / count
    starts, acc = [0], 0.0
    for p in range(n):
        acc += float(times[p])
        if acc >= target * (len(starts)) and p + 1 < n and len(starts) < count:
            starts.append(p + 1)
    starts_arr = np.array(starts, dtype=np.int64)
    ends = np.append(starts_arr[1:] - 1, n - 1)
    return starts_arr, ends
