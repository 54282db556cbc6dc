"""Data parallelism on the devices of one host, traced into one TaskGraph (compile's ``devices=``).

The step of ``compile(..., devices=N)`` is eager's

    opt.zero_grad()
    for b in micro_batches:             # one per device, in device order
        loss_fn(model, b).backward()    # gradients accumulate: g = g_0 + g_1 + ... + g_{N-1}
    for p in model.parameters():
        p.grad /= N                     # DDP's averaging
    clip_grad_norm_(...); opt.step()

traced as it runs, each micro-batch's forward and backward on its own device. Its arithmetic is
that loop's exactly: each micro-batch's gradients are computed alone (autograd.grad), then added
in device order into the device that owns the parameter's update and divided by N there, as the
loop's AccumulateGrad and ``/=`` do. DDP sums with NCCL in an order of its own, so on CUDA the
step equals DDP within float tolerance and this loop bitwise (the CPU backend, virtual devices).

`place_on_devices` then gives every vertex and value a device:

- micro-batch m's forward and backward vertices (and its batch inputs) run on device m;
- each trainable parameter has an owner (`owners`: the optimizer's update units, cut into N runs of
  about equal bytes in program order): its gradient sum, its update and its optimizer states live
  there;
- every other device that reads a weight reads a replica of its own, a persistent value on that
  device, refreshed after the update by a copy from the owner (DDP keeps every weight everywhere
  too); with ``casts_travel``, a weight read only through autocast's casts has none: its owner
  casts it once and the devices receive the cast (`weight_casts`; compile chooses this below half
  the unplanned peak, not yet the planner per weight);
- a buffer the step updates in place (BatchNorm's statistics) is updated by each micro-batch in
  turn, as eager's loop does, moving from device to device;
- any other vertex runs where its largest input lives, and a value read on another device than its
  own is copied there by a transfer vertex (``_to_copy`` on the reader's device);
- gradients travel to their owner in buckets, as DDP's do: the gradients one device sends one owner
  are joined (``cat``, in the order they are made) into buckets of up to BUCKET_BYTES, one transfer
  each, and the owner's sums read them as views of the bucket it received; the updated weights go
  back the same way (the owner's weights of a bucket joined, one transfer per device, each replica
  refreshed by a ``copy_`` from its view). With a transfer per gradient and per replica, gpt1.3b's
  step on four H100s was 3,363 launches long, 1,758 of them transfers, and ran 275 ms against the
  189 ms simulated. Joining and splitting copy bytes: the arithmetic is unchanged.

Last, the program order interleaves the devices (position i of every device's micro-batch before
position i + 1 of any), so each gradient's sum follows its last backward at once.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import torch
from networkx.utils import UnionFind

from ..ir.taskgraph import TaskGraph, TensorRef, ValueKind, Vertex, drop_unproduced, map_refs
from .accumulate import loss_outputs
from .errors import UnsupportedFeature


def read_devices(device: torch.device, devices) -> int:
    """How many devices of `device`'s kind compile's ``devices=`` names, checked: N, or a list of
    devices of one kind numbered consecutively from ``device``'s index (the engine numbers a step's
    GPUs from its first: a rank of a process group may start at cuda:2). On CUDA every one must exist
    and all must be the same model with the same memory, since every device gets the same budget.
    Virtual CPU devices ("cpu" N times, or N) share the host: each has its own arena and streams."""
    if devices is None:
        return 1
    first = device.index or 0
    if isinstance(devices, (list, tuple)):
        named = [torch.device(d) for d in devices]
        kinds = {d.type for d in named}
        if len(kinds) != 1 or device.type not in kinds:
            raise UnsupportedFeature(f"devices {[str(d) for d in named]} must all be of the kind of device "
                                     f"{str(device)!r}")
        if device.type == "cuda" and [d.index for d in named] != list(range(first, first + len(named))):
            raise UnsupportedFeature(f"devices {[str(d) for d in named]}: the engine numbers a step's GPUs from "
                                     f"its device ({device}), so give cuda:{first} ... cuda:{first + len(named) - 1} "
                                     f"(choose others with device= or CUDA_VISIBLE_DEVICES)")
        devices = len(named)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UnsupportedFeature(f"devices must be a positive number of devices or a list of them, got {devices!r}")
    if device.type == "cuda" and devices > 1:
        present = torch.cuda.device_count()
        if first + devices > present:
            raise UnsupportedFeature(f"devices={devices} GPUs from cuda:{first} were asked for and this host has "
                                     f"{present}: compile with devices={max(1, present - first)} or fewer")
        props = [torch.cuda.get_device_properties(i) for i in range(first, first + devices)]
        kinds = {(p.name, p.total_memory) for p in props}
        if len(kinds) > 1:
            raise UnsupportedFeature(f"the GPUs differ ({', '.join(f'cuda:{first + i} {p.name} {p.total_memory >> 20} MiB' for i, p in enumerate(props))}): "
                                     f"every device gets the same budget, so they must be alike; choose alike ones "
                                     f"with CUDA_VISIBLE_DEVICES")
    return devices


def check_devices(devices: int, accumulation_steps: int, backward: bool) -> int:
    """The number of devices a step runs on, checked against what the trace supports with it."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UnsupportedFeature(f"devices must be a positive number of devices, got {devices!r}")
    if devices > 1 and accumulation_steps > 1:
        raise UnsupportedFeature("devices > 1 with accumulation_steps > 1 is not supported yet: give each device "
                                 "a larger micro-batch, or compile for one device with accumulation")
    if devices > 1 and not backward:
        raise UnsupportedFeature("a forward-only step (backward=False) runs on one device: compile one per device")
    return devices


def averaged_gradients(per_device: list[tuple], marks: list, node_count) -> tuple:
    """Eager's accumulation of the devices' gradients (in device order), then DDP's division by
    their count, traced parameter by parameter; marks gets (first node, end node, parameter index)
    of each parameter's sum, which `place_on_devices` puts on the parameter's owner."""
    count = len(per_device)
    averaged = []
    for i in range(len(per_device[0])):
        start = node_count()
        present = [grads[i] for grads in per_device if grads[i] is not None]
        total = None
        if present:
            total = present[0]
            for g in present[1:]:
                total = total + g
            total = total / count
        marks.append((start, node_count(), i))
        averaged.append(total)
    return tuple(averaged)


def mean_loss(losses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the devices' losses summed in order and divided by their count; the losses stacked)."""
    total, stacked = loss_outputs(losses)
    return total / len(losses), stacked


# bytes of gradients (or of updated weights) one transfer between two devices carries at most. Larger
# buckets mean fewer launches; smaller ones let a sum (or a replica's refresh) start sooner, and hold
# less memory in flight (a bucket and what it joins are held at once while it is made). A small
# model's buckets are smaller still: each owner's share in at least BUCKETS_PER_OWNER of them.
BUCKET_BYTES = 256 << 20
BUCKETS_PER_OWNER = 4


def owners(tg: TaskGraph, params: list[int], count: int) -> dict[int, int]:
    """The device that owns each persistent value an update writes (parameters, optimizer states)
    and each parameter: update units (values joined by optimizer vertices, through anything but
    0-dimensional values such as the shared step counter) in the order of their parameters, cut
    into `count` contiguous runs of about equal bytes."""
    units = UnionFind()  # value ids: the values one optimizer update touches together
    for vertex in tg.vertices:
        if vertex.phase != "optimizer":
            continue
        touched = [x for x in [*vertex.inputs(), *(o for o in vertex.outputs if o >= 0)]
                   if len(tg.values[x].shape) > 0]
        for x in touched[1:]:
            units.union(touched[0], x)
    for old, new in tg.bindings.items():  # a state's update reaches its home through its binding
        if len(tg.values[old].shape) > 0 and new in units.parents:
            units.union(old, new)
    members: dict[int, list[int]] = {}
    order: list[int] = []
    for p in params:
        root = units[p]
        if root not in members:
            members[root] = []
            order.append(root)
    for x in list(units.parents):
        root = units[x]
        if root in members and tg.values[x].kind.is_persistent:
            members[root].append(x)
    sizes = [sum(tg.values[x].nbytes for x in set(members[r])) for r in order]
    total = sum(sizes) or 1
    owner: dict[int, int] = {}
    done = 0
    for root, size in zip(order, sizes):
        device = min(count - 1, (done + size // 2) * count // total)
        done += size
        for x in members[root]:
            owner[x] = device
    return owner


def place_on_devices(tg: TaskGraph, count: int, micro_of: dict[int, int], reduce_of: dict[int, int],
                     params: list[int], casts_travel: bool = False) -> TaskGraph:
    """The TaskGraph of one device's step with every vertex and value on one of `count` devices.
    micro_of: vertex -> the micro-batch (device) whose forward or backward made it; reduce_of:
    vertex -> index into `params` of the parameter whose gradient sum it is part of. casts_travel:
    the weights' dtype casts run on their owners and travel (`weight_casts`)."""
    owner = owners(tg, params, count)
    trained = trained_weights(tg)
    mutated = set(tg.bindings) - trained  # optimizer states, BatchNorm statistics, the step counter

    # -- devices of inputs and vertices --------------------------------------------------------------
    per_micro = len(tg.batch_inputs) // count
    for m in range(count):
        for vid in tg.batch_inputs[m * per_micro:(m + 1) * per_micro]:
            tg.values[vid].device = m
    for val in tg.values:
        if val.kind.is_persistent:
            val.device = owner.get(val.id, 0)
    replicated = {v.id for v in tg.values if v.kind.is_persistent and v.id not in mutated}
    cast_of = weight_casts(tg, trained, micro_of) if casts_travel else {}
    for vertex in tg.vertices:
        if vertex.id in cast_of:
            vertex.device = owner[cast_of[vertex.id]]
        elif vertex.id in micro_of:
            vertex.device = micro_of[vertex.id]
        elif vertex.id in reduce_of:
            vertex.device = owner[params[reduce_of[vertex.id]]]
        elif vertex.phase == "optimizer":
            written = [old for old, _ in vertex.copy_in if old in owner] + \
                      [o for o in vertex.outputs if o >= 0 and o in owner]
            vertex.device = owner[written[0]] if written else _largest_input(tg, vertex, replicated)
        else:
            vertex.device = _largest_input(tg, vertex, replicated)
        for out in vertex.outputs:
            if out >= 0:
                tg.values[out].device = vertex.device

    # -- replicas, transfers, bindings back home --------------------------------------------------------
    out = dataclasses.replace(tg, vertices=[], devices=count)  # the values (and their list) carry on
    replica: dict[tuple[int, int], int] = {}  # (persistent value, device) -> its replica there
    moved: dict[tuple[int, int], int] = {}  # (value, device) -> its transferred copy there

    def copy_of(vid: int, device: int, vertex: Vertex) -> int:
        val = tg.values[vid]
        if vid in replicated:
            key = (vid, device)
            if key not in replica:
                replica[key] = out.add_value(val.shape, val.stride, val.dtype, val.nbytes, ValueKind.FROZEN,
                                             name=f"replica{device}:{val.name}", device=device)
                out.initial_state[replica[key]] = tg.initial_state[vid]
            return replica[key]
        key = (vid, device)
        if key not in moved:
            moved[key] = out.add_value(val.shape, val.stride, val.dtype, val.nbytes, device=device)
            out.add_vertex("aten::_to_copy", (val.dense_ref,), {}, (moved[key],), module=vertex.module,
                           phase=vertex.phase, device=device)
        return moved[key]

    trained_bytes = sum(tg.values[x].nbytes for x in trained)
    bucket_bytes = max(1, min(BUCKET_BYTES, trained_bytes // (count * BUCKETS_PER_OWNER)))
    bucket_of = _gradient_buckets(tg, reduce_of, replicated, bucket_bytes)
    received: dict[int, tuple[int, int]] = {}  # gradient -> (the bucket its owner received, offset there)

    def receive(bucket: list[int], vertex: Vertex) -> None:
        """Join ``bucket``'s gradients on their device and copy the bucket to ``vertex``'s."""
        sent = _joined(out, tg, bucket, vertex, tg.values[bucket[0]].device, "bucket")
        got = _copied_to(out, sent, vertex.device, vertex)
        offset = 0
        for x in bucket:
            received[x] = (got, offset)
            offset += _numel(tg.values[x])

    micro_at: dict[int, int] = {}  # micro_of, by the ids of `out`
    cast_made: dict[tuple, int] = {}  # a weight's cast (op, args) -> its result, made once on the owner
    same_cast: dict[int, int] = {}  # the result of a cast made again -> the first one's
    cast_vertex: dict[int, int] = {}  # a cast's result -> the cast's id in `out`
    ahead_of: dict[int, int] = {}  # a cast's id in `out` -> its first reader's there
    for vertex in tg.vertices:
        if vertex.id in cast_of:
            key = (vertex.op, vertex.args, tuple(sorted(vertex.kwargs.items(), key=lambda kv: kv[0])))
            if key in cast_made:
                same_cast[vertex.outputs[0]] = cast_made[key]
                continue
            cast_made[key] = vertex.outputs[0]
        views: dict[int, tuple[int, int]] = {}
        casts_read = [cast_vertex[same_cast.get(x, x)] for x in vertex.inputs() if same_cast.get(x, x) in cast_vertex]
        for x in vertex.inputs():
            if x in same_cast:
                x_home = same_cast[x]
                views[x] = (x_home, 0) if tg.values[x_home].device == vertex.device else \
                    (copy_of(x_home, vertex.device, vertex), 0)
                continue
            if tg.values[x].device == vertex.device:
                continue
            if x in bucket_of:
                if x not in received:
                    receive(bucket_of[x], vertex)
                views[x] = received[x]
            else:
                views[x] = (copy_of(x, vertex.device, vertex), 0)
        new_id = out.add_copy(_rerouted(vertex, views) if views else vertex)
        if vertex.id in cast_of:
            cast_vertex[vertex.outputs[0]] = new_id
        elif vertex.id in micro_of:
            micro_at[new_id] = micro_of[vertex.id]
            for cast in casts_read:
                ahead_of.setdefault(cast, new_id)
    for old in list(out.bindings):
        new = out.bindings[old]
        home = out.values[old].device
        if out.values[new].device != home:  # a buffer last updated on another device goes home
            out.bindings[old] = copy_of(new, home, out.vertices[out.values[new].producer])
    # the replicas take the updated weights once their owner has them, a bucket of them per transfer
    readers_of: dict[int, list[tuple[int, int]]] = {}  # trained weight -> (device, its replica there)
    for (vid, device), rep in sorted(replica.items()):
        if vid in trained:
            readers_of.setdefault(vid, []).append((device, rep))
    updated = sorted(readers_of, key=lambda vid: out.values[out.bindings[vid]].producer)
    for bucket in _buckets(updated, lambda vid: (owner[vid], out.values[vid].dtype), lambda vid: out.values[vid].nbytes,
                           bucket_bytes):
        new_values = [out.bindings[vid] for vid in bucket]
        last = out.vertices[max(out.values[x].producer for x in new_values)]
        home = owner[bucket[0]]
        sent = _joined(out, out, new_values, last, home, "weights")
        targets = sorted({device for vid in bucket for device, _ in readers_of[vid]})
        for device in targets:
            got = _copied_to(out, sent, device, last)
            offset = 0
            for vid in bucket:
                val = out.values[vid]
                for reader, rep in readers_of[vid]:
                    if reader != device:
                        continue
                    fresh = out.add_value(val.shape, val.stride, val.dtype, val.nbytes, device=device)
                    out.add_vertex("aten::copy_", (TensorRef(fresh, val.shape, val.stride, 0),
                                                   TensorRef(got, val.shape, val.stride, offset)),
                                   {}, (fresh,), module=last.module, phase="optimizer", copy_in=((rep, fresh),),
                                   device=device)
                    out.bindings[rep] = fresh
                offset += _numel(val)
    return drop_unproduced(_interleaved(out, micro_at, count, ahead_of))  # the results of casts made once


def trained_weights(tg: TaskGraph) -> set[int]:
    """The parameters the step's optimizer updates (bound to a value an optimizer vertex makes)."""
    produced_by_update = {new for new in tg.bindings.values()
                          if tg.values[new].producer >= 0 and tg.vertices[tg.values[new].producer].phase == "optimizer"}
    return {old for old, new in tg.bindings.items() if new in produced_by_update and tg.values[old].kind is ValueKind.PARAMETER}


def weight_casts(tg: TaskGraph, trained: set[int], micro_of: dict[int, int]) -> dict[int, int]:
    """The forward's dtype casts of trained weights (autocast's bf16 copy of a Linear's weight, read
    by its matmul and saved for the backward): cast vertex -> the weight. They run on the weight's
    owner, once for all micro-batches, and the other devices receive the cast (half an fp32
    replica's bytes, over device-to-device links) instead of keeping a replica of the weight: a
    weight every device reads only so is then held on its owner alone (ZeRO-3's sharding, with
    what travels already in the compute dtype), and no replica is refreshed after the update."""
    casts = {}
    for vertex in tg.vertices:
        if vertex.op != "aten::_to_copy" or vertex.id not in micro_of or set(vertex.kwargs) != {"dtype"}:
            continue
        inputs = list(vertex.inputs())
        if len(inputs) == 1 and inputs[0] in trained and len(vertex.args) == 1:
            casts[vertex.id] = inputs[0]
    return casts


def _numel(val) -> int:
    return math.prod(val.shape)


def _copied_to(out: TaskGraph, sent: int, device: int, vertex: Vertex) -> int:
    """A transfer of the bucket ``sent`` to ``device`` (with ``vertex``'s module and phase): its copy there."""
    val = out.values[sent]
    got = out.add_value(val.shape, val.stride, val.dtype, val.nbytes, name=val.name, device=device)
    out.add_vertex("aten::_to_copy", (val.dense_ref,), {}, (got,), module=vertex.module, phase=vertex.phase,
                   device=device)
    return got


def _buckets(values: list[int], key, nbytes, bucket_bytes: int) -> list[list[int]]:
    """``values`` (in the order they are made) cut into buckets: consecutive values of one key (the
    pair of devices, the dtype) in the order given, up to ``bucket_bytes`` each (a larger value alone)."""
    open_bucket: dict = {}  # key -> (bucket, its bytes)
    buckets: list[list[int]] = []
    for x in values:
        k = key(x)
        bucket, size = open_bucket.get(k, (None, 0))
        if bucket is None or size + nbytes(x) > bucket_bytes:
            bucket, size = [], 0
            buckets.append(bucket)
        bucket.append(x)
        open_bucket[k] = (bucket, size + nbytes(x))
    return buckets


def _gradient_buckets(tg: TaskGraph, reduce_of: dict[int, int], replicated: set[int],
                      bucket_bytes: int) -> dict[int, list[int]]:
    """Each gradient a device sends to the owner of its sum -> its bucket: the gradients sent from one
    device to one owner, of one dtype, in the order they are made. The sums come after every
    micro-batch's backward in the trace, so a bucket is whole before its first gradient is read."""
    owner_of: dict[int, int] = {}  # gradient sent -> the device summing it
    for vertex in tg.vertices:
        if vertex.id not in reduce_of:
            continue
        for x in vertex.inputs():
            val = tg.values[x]
            if val.device != vertex.device and x not in replicated and not val.kind.is_persistent:
                owner_of.setdefault(x, vertex.device)
    sent = sorted(owner_of, key=lambda x: tg.values[x].producer)
    bucket_of = {}
    for bucket in _buckets(sent, lambda x: (tg.values[x].device, owner_of[x], tg.values[x].dtype),
                           lambda x: tg.values[x].nbytes, bucket_bytes):
        for x in bucket:
            bucket_of[x] = bucket
    return bucket_of


def _joined(out: TaskGraph, source: TaskGraph, members: list[int], vertex: Vertex, device: int, what: str) -> int:
    """A ``cat`` on ``device`` of ``members`` (values of ``source``, dense, one dtype), each as the flat
    run of its storage: the bucket value it makes, in ``out``."""
    vals = [source.values[x] for x in members]
    numel = sum(_numel(v) for v in vals)
    bucket = out.add_value((numel,), (1,), vals[0].dtype, sum(v.nbytes for v in vals), name=what, device=device)
    out.add_vertex("aten::cat", ([TensorRef(v.id, (_numel(v),), (1,), 0) for v in vals],), {}, (bucket,),
                   module=vertex.module, phase=vertex.phase, device=device)
    return bucket


def _largest_input(tg: TaskGraph, vertex: Vertex, replicated: set[int]) -> int:
    """Where a vertex no rule places runs: the device of its largest input (replicated weights are
    everywhere and do not count; ties go to the lower device; no input: device 0)."""
    best, device = -1, 0
    for x in vertex.inputs():
        if x in replicated:
            continue
        val = tg.values[x]
        if val.nbytes > best or (val.nbytes == best and val.device < device):
            best, device = val.nbytes, val.device
    return device


def _rerouted(vertex: Vertex, views: dict[int, tuple[int, int]]) -> Vertex:
    """``vertex`` reading each value x of ``views`` as the same view of another value, shifted by an
    offset (value, elements): a copy on its device, or its place in a received bucket."""
    def ref(r: TensorRef) -> TensorRef:
        value, offset = views.get(r.value, (r.value, 0))
        return TensorRef(value, r.size, r.stride, r.storage_offset + offset)

    return dataclasses.replace(vertex, args=map_refs(vertex.args, ref), kwargs=map_refs(vertex.kwargs, ref),
                               copy_in=tuple((views.get(a, (a, 0))[0], b) for a, b in vertex.copy_in))


# positions of a micro-batch's program a weight's cast (and its transfers) is placed ahead of its
# first reader: about a transformer block's forward, so a block's weights are cast on their owners
# and sent while the devices run the block before. Placed at its reader (0), the other devices wait
# on the owner (gpt1.3b on two GPUs, analytic costs: 227 ms against 202 with replicas); placed at
# the start of the step, every device holds every block's cast from then on.
CAST_LEAD = 32


def _interleaved(tg: TaskGraph, micro_of: dict[int, int], count: int, ahead_of: dict[int, int]) -> TaskGraph:
    """The vertices renumbered in an order that interleaves the devices: a topological order (data,
    and in-place writers after the other readers of what they overwrite) taking, among ready
    vertices, the one of the earliest position within its micro-batch (a vertex of `ahead_of`
    CAST_LEAD positions before its reader's; other vertices take the latest position of what they
    read), then the lower device, then the earlier in program order."""
    produced = {o: v.id for v in tg.vertices for o in v.outputs if o >= 0}
    local: dict[int, int] = {}
    seen = [0] * count
    for vertex in tg.vertices:
        if vertex.id in micro_of:
            local[vertex.id] = seen[micro_of[vertex.id]]
            seen[micro_of[vertex.id]] += 1
    rank: dict[int, int] = {}
    waits: dict[int, set[int]] = {}
    readers: dict[int, list[int]] = {}
    for vertex in tg.vertices:
        for x in vertex.inputs():
            readers.setdefault(x, []).append(vertex.id)
    for vertex in tg.vertices:
        preds = {produced[x] for x in vertex.inputs() if x in produced}
        # an in-place op goes after every other reader of the version it overwrites, so it can write over
        # it (the builder's in-place rule; an update of a weight in its home); the trace's order had it so
        preds.update(r for old, _ in vertex.copy_in for r in readers.get(old, ()) if r != vertex.id)
        waits[vertex.id] = preds
        if vertex.id in micro_of:
            rank[vertex.id] = local[vertex.id]
        elif vertex.id in ahead_of:
            rank[vertex.id] = max(0, local[ahead_of[vertex.id]] - CAST_LEAD)
        else:
            rank[vertex.id] = max((rank[p] for p in preds), default=0)
    # a micro-batch's random ops keep their traced order, so drawing them device after device in that order
    # (kernels/step_state.py, RngReplay) is eager's draw order: micro-batch 0's, then 1's, ...
    last_random: dict[int, int] = {}
    for vertex in tg.vertices:
        if vertex.random and vertex.id in micro_of:
            m = micro_of[vertex.id]
            if m in last_random:
                waits[vertex.id].add(last_random[m])
            last_random[m] = vertex.id
    users: dict[int, list[int]] = {v.id: [] for v in tg.vertices}
    for vid, preds in waits.items():
        for p in preds:
            users[p].append(vid)
    pending = {vid: len(preds) for vid, preds in waits.items()}
    ready = [(rank[v], tg.vertices[v].device, v) for v, n in pending.items() if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, _, vid = heapq.heappop(ready)
        order.append(vid)
        for u in users[vid]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (rank[u], tg.vertices[u].device, u))
    if len(order) != len(tg.vertices):
        raise RuntimeError("the traced step has a cycle")  # a trace is a program: it cannot
    out = dataclasses.replace(tg, vertices=[])
    for vid in order:
        out.add_copy(tg.vertices[vid])
    return out

