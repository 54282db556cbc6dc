"""Segments: runs of compute vertices the engine launches as one unit (a CUDA graph on CUDA).

Launching a vertex from Python costs the host 15-40 us; most kernels of a training step take
less. Everything a MemGraph does is static (fixed arena places), so a run of compute vertices
can be captured once and replayed as one CUDA graph. Which runs: a segment is a maximal run of
consecutive compute vertices of mg.serial on one stream and device (other kinds, and other devices'
vertices, skipped over), such that only its first vertex has a predecessor that is not compute (a
reload, an input) and only its last has a successor that is not compute (an offload, an output, a
reload into bytes it freed), but for transfers between devices: any member may feed a transfer to
another device (the copy waits for the segment, held to SEND_DELAY_S), and any member may read a
transfer from another device that comes before the segment's first vertex in mg.serial (a bucket of
gradients the owner's sums read one after another, trace/data_parallel.py). A segment that begins by
reading such a transfer takes only vertices that read one too or read its members' results: the
replicas' refreshes from a bucket of weights do not hold up the backward that follows them in
mg.serial (on four H100s that held each device ~110 ms, simulated). A message to or from another rank
(Stream.COMM) counts as such a transfer: without it a rank of gpt1.3b on an H200 launched 531 units a
step where a GPU of one process launched 162, every received bucket and weight cutting the segments
around its readers.

Why that is safe: contracting such a run into one vertex keeps the graph acyclic. A path leaving
the run and coming back into it enters it by an edge from an outsider. That outsider is no compute
vertex of the run's device (every one between two members in the serial order is a member, and
edges point forward in it), nor of another device (no edge joins two devices' kernels: they share
no bytes, their data moves by transfer vertices), so it is a transfer or another non-compute vertex,
whose successor in the run can only be the run's first member, which precedes every vertex of the
path, or a transfer from another device placed before the first member, which no path from a
member reaches (edges point forward in the serial order). A rank's messages also wait for each other,
one at a time in tag order, which no edge shows; that order is the serial order's (check_message_order),
so a message a segment reads, placed before the segment's first vertex, never waits for one that
waits for the segment. And it costs the runtime little choice: offloads still start the moment their compute is done, compute
that waits for a reload is never held back by one it does not need.

Random vertices that draw stay alone (their generator state is set per launch, which a capture would
freeze), and so do kernels that read a device tensor on the host (kernels/ops.py reads_on_host), which
no capture can hold. An attention op whose dropout probability is 0 is random by its schema only: it
draws nothing (kernels/ops.py draws) and joins segments like any kernel; kept alone, gpt1.3b's three
attention ops per layer and device cut its runs around them (189 of 2,823 units a step on two GPUs at
25%, counted on the exported step).
"""

from __future__ import annotations

import torch

from ..ir.memgraph import Edge, Kind, MemGraph, Stream
from ..kernels.ops import draws, reads_on_host

# A member may send a result to another device (a gradient to its owner) before its segment ends: the
# copy then starts when the segment has run, at most this long (or this many vertices, where ops carry
# no times) after the member. Closing a segment at every send would cut a device's backward at every
# gradient, and the event loop's launches would bound the step (gpt350m on two H200s).
SEND_DELAY_S = 1e-3
SEND_DELAY_VERTICES = 32
# Copies from another device of this process (D2D) and messages to or from another rank (COMM, in the tag
# order every rank's serial order keeps, memgraph/ranks.py check_message_order) join segments alike.
BETWEEN_DEVICES = (Stream.D2D, Stream.COMM)


def find_segments(mg: MemGraph, max_size: int | None = None, min_size: int = 2) -> list[list[int]]:
    """The segments of ``mg`` (vertex ids, each list in serial order). ``max_size`` bounds a
    segment's length (None: unbounded; 1: no segments); runs shorter than ``min_size`` are left
    as single vertices."""
    if max_size is not None and max_size < 1:
        raise ValueError(f"segment size must be at least 1 (1 launches every vertex alone), got {max_size}")
    if max_size == 1:
        return []
    vertices, tasks, values = mg.vertices, mg.taskgraph.vertices, mg.taskgraph.values
    device_type = torch.device(mg.taskgraph.device).type
    # the host's updates (Stream.HOST) are not kernels: outside every segment, like transfers
    compute = [mv.kind is Kind.COMPUTE and mv.stream is Stream.COMPUTE for mv in vertices]
    position = {vid: k for k, vid in enumerate(mg.serial)}
    enters_from_outside = [False] * len(vertices)  # a predecessor that is not compute, nor a transfer from another device
    received_at = [-1] * len(vertices)  # the latest serial position of a predecessor copying from another device
    leaves_to_outside = [False] * len(vertices)  # a successor that is not compute, but a transfer to another device
    sends = [False] * len(vertices)  # a successor that copies to another device
    data_preds: list[list[int]] = [[] for _ in vertices]
    for src, dst, kind in mg.edges:
        if kind is Edge.DATA:
            data_preds[dst].append(src)
        if vertices[src].stream in BETWEEN_DEVICES:
            received_at[dst] = max(received_at[dst], position[src])
        elif not compute[src]:
            enters_from_outside[dst] = True
        if vertices[dst].stream in BETWEEN_DEVICES:
            sends[src] = True
        elif not compute[dst]:
            leaves_to_outside[src] = True

    def lane(vid: int) -> tuple:
        mv = vertices[vid]
        places = [p for p in (*mv.writes.values(), *mv.reads.values()) if p.where == "gpu"]
        return mv.stream, places[0].device if places else 0

    segments: list[list[int]] = []
    runs: dict[tuple, list[int]] = {}  # one open run per stream and device
    receiving: dict[tuple, set[int]] = {}  # lane -> members of its open run, where that run began with a receive

    def joins_receiving(vid: int, key: tuple) -> bool:
        """Whether ``vid`` may join its lane's run that began by reading a transfer from another
        device: only what reads such a transfer or a member's result, so nothing unrelated (the next
        layer's backward) waits for the copy."""
        members = receiving.get(key)
        return members is None or received_at[vid] >= 0 or any(p in members for p in data_preds[vid])
    held: dict[tuple, tuple[float, int]] = {}  # lane -> (seconds, vertices) its run ran since its first send

    def close(key: tuple) -> None:
        run = runs[key]
        if len(run) >= min_size:
            segments.append(list(run))
        run.clear()
        held.pop(key, None)
        receiving.pop(key, None)

    for vid in mg.serial:
        if not compute[vid]:
            continue
        key = lane(vid)
        run = runs.setdefault(key, [])
        task = tasks[vertices[vid].task_vertex]
        alone = draws(task) or reads_on_host(task.op, (values[ref.value].dtype for ref in task.refs()), device_type)
        if run and (alone or enters_from_outside[vid] or received_at[vid] > position[run[0]]
                    or not joins_receiving(vid, key) or (max_size is not None and len(run) >= max_size)):
            close(key)
        if alone:
            continue
        if not run and received_at[vid] >= 0:
            receiving[key] = set()
        if key in receiving:
            receiving[key].add(vid)
        run.append(vid)
        if key in held or sends[vid]:
            seconds, count = held.get(key, (0.0, 0))
            held[key] = (seconds + tasks[vertices[vid].task_vertex].time, count + 1)
        if leaves_to_outside[vid] or (key in held and (held[key][0] >= SEND_DELAY_S or held[key][1] >= SEND_DELAY_VERTICES)):
            close(key)
    for key in runs:
        close(key)
    segments.sort(key=lambda seg: position[seg[0]])  # in the serial order of their first vertices
    return segments


def segment_problems(mg: MemGraph) -> list[str]:
    """Why ``mg.segments`` cannot be launched as units ([] when they can): unknown or repeated
    vertices, non-compute members, mixed streams, or a contraction that would make a cycle."""
    problems = []
    n = len(mg.vertices)
    unit_of = list(range(n))
    seen: set[int] = set()
    for k, seg in enumerate(mg.segments):
        for vid in seg:
            if not 0 <= vid < n:
                problems.append(f"segment {k} names vertex {vid}, outside 0..{n - 1}")
                continue
            if vid in seen:
                problems.append(f"vertex {vid} is in more than one segment")
            seen.add(vid)
            if mg.vertices[vid].kind is not Kind.COMPUTE:
                problems.append(f"segment {k} holds vertex {vid} of kind {mg.vertices[vid].kind.value}")
            unit_of[vid] = n + k
        if len({mg.vertices[v].stream for v in seg if 0 <= v < n}) > 1:
            problems.append(f"segment {k} mixes streams")
    if problems:
        return problems
    position = {vid: i for seg in mg.segments for i, vid in enumerate(seg)}
    for src, dst, _ in mg.edges:
        if unit_of[src] == unit_of[dst] >= n and position[src] >= position[dst]:
            problems.append(f"segment {unit_of[src] - n} runs vertex {dst} before its predecessor {src}")
    if problems:
        return problems
    succ: dict[int, set[int]] = {}
    indegree: dict[int, int] = {u: 0 for u in set(unit_of)}
    for src, dst, _ in mg.edges:
        a, b = unit_of[src], unit_of[dst]
        if a != b and b not in succ.setdefault(a, set()):
            succ[a].add(b)
            indegree[b] += 1
    ready = [u for u, d in indegree.items() if d == 0]
    ordered = 0
    while ready:
        u = ready.pop()
        ordered += 1
        for w in succ.get(u, ()):
            indegree[w] -= 1
            if indegree[w] == 0:
                ready.append(w)
    if ordered < len(indegree):
        cyclic = sorted(u - n for u, d in indegree.items() if d > 0 and u >= n)
        problems.append(f"launching the segments as units makes a cycle (segments {cyclic[:5]} lie on it): "
                        f"a path leaves a segment and comes back")
    return problems
