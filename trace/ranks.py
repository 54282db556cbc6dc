"""Several processes (ranks, launched by torchrun): one rank's share of a step traced over every device.

Every rank traces the same step over all ranks' devices (``ranks x local`` of them, rank-major:
global device ``g`` is device ``g % local`` of rank ``g // local``), placed by
trace/data_parallel.py exactly as one process with that many devices would place it. So the
arithmetic is eager's accumulation over every rank's micro-batches, in rank order, then DDP's
division by their count, and each parameter has one owner among all devices.

`rank_slice` then keeps what runs on this rank's devices, renumbered 0..local-1. A transfer
between devices of two ranks becomes a pair of *messages*: on the sending rank a ``turnip::send``
vertex reading the value, on the receiving rank a ``turnip::recv`` vertex making it. Each message
carries its peer and its *tag*, its position among all the step's messages in program order, which
is the same on every rank since every rank slices the same graph: the engine runs a rank's messages
on one lane in tag order (torch.distributed pairs sends with receives in the order each pair of
ranks posts them; NCCL requires it). A value that several devices of one rank read (an owner's updated
weights) crosses to that rank once and is copied on from its wire device. The step's outputs (the losses) are sent to every rank, so each
returns them as one process would.

Gradients cross ranks as they cross devices: each device's bucket of gradients goes to the
parameter's owner, which sums them in device order. The owner receives every other device's
bucket, the bytes a reduce-scatter moves with one device per rank, and the sum is eager's order
bitwise, which a ring or tree reduction is not.
"""

from __future__ import annotations

import bisect
import dataclasses

from ..ir.taskgraph import RECV, SEND, TaskGraph, Value, ValueKind, map_refs
from ..kernels.ops import draws
from .errors import UnsupportedFeature

# Every message of a rank leaves from and arrives on this one of its devices: NCCL pairs a rank's end of a
# link with one GPU (the one its process group is bound to, or the first it used), and a buffer on another
# GPU of the rank is copied there first (or from there after), over the rank's own device-to-device link.
WIRE_DEVICE = 0
# message_order sends an updated weight this many messages after its update's place; None: after every
# other message. On two H200s (gpt1.3b, 2 ranks) 3 behind ran 194.6 ms at 100% and 247.3 at 50% where
# the end ran 184.0 and 229.8 (the one process 159.1 / 191.9 and 155.4 / 184.0 in those calls): the
# owner's update runs behind its compute lane's queue, so 3 buckets later it is often not yet done
WEIGHTS_BEHIND: int | None = None


def check_ranks(tg: TaskGraph, ranks: int) -> None:
    """What a step over several ranks cannot do yet, refused before any work."""
    drawn = [v for v in tg.vertices if draws(v)]
    if drawn:
        first = drawn[0]
        raise UnsupportedFeature(
            f"{first.op} in {first.module or 'the step'} draws random numbers, and a step over {ranks} ranks "
            f"cannot draw them as eager's loop over every rank's micro-batches would (each rank has its own "
            f"generator): not supported yet; train without dropout, or on one host (devices=)")


def rank_slice(tg: TaskGraph, rank: int, ranks: int, order: list[int] | None = None) -> TaskGraph:
    """Rank ``rank``'s share of ``tg`` (placed over ``ranks`` ranks' devices, rank-major): its devices'
    vertices and values renumbered from 0, messages in place of transfers from and to other ranks.
    ``order``: a topological order of ``tg``'s vertices to keep them in (default: program order);
    the messages' tags follow it."""
    return sliced(tg, rank, ranks, order).taskgraph


@dataclasses.dataclass
class Slice:
    """A rank's share of a step (rank_slice) and where its parts came from in the whole step:
    ``values[v]`` the whole step's value of the slice's value v, ``vertices[u]`` the whole step's
    vertex of the slice's vertex u (a message: its transfer), -1 for what the slice added (the
    outputs' copies for every rank, the wire device's copies)."""

    taskgraph: TaskGraph
    values: dict[int, int]
    vertices: list[int]


def sliced(tg: TaskGraph, rank: int, ranks: int, order: list[int] | None = None) -> Slice:
    """rank_slice's share with where its values and vertices came from (Slice)."""
    if tg.devices % ranks:
        raise ValueError(f"{tg.devices} devices do not divide among {ranks} ranks")
    local = tg.devices // ranks
    traced, traced_values = len(tg.vertices), len(tg.values)
    tg, sent = _outputs_sent_to_every_rank(tg, ranks)
    order = [*(order if order is not None else range(traced)), *range(traced, len(tg.vertices))]
    rank_of = [v.device // local for v in tg.values]
    out = dataclasses.replace(tg, values=[], vertices=[], devices=local, rank=rank, ranks=ranks)
    new_id: dict[int, int] = {}
    origin: list[int] = []  # the whole step's vertex of each vertex added to ``out``, -1 for a wire copy

    def kept(val: Value) -> int:
        if val.id not in new_id:
            new_id[val.id] = out.add_value(val.shape, val.stride, val.dtype, val.nbytes, val.kind,
                                           name=val.name, device=val.device % local)
        return new_id[val.id]

    for val in tg.values:  # inputs first, in their order: the batch's leaves, the weights
        if val.kind.is_input and rank_of[val.id] == rank:
            kept(val)

    def ref(r):
        return dataclasses.replace(r, value=new_id[r.value])

    def staged(val: Value) -> int:
        """A copy of ``val`` on the rank's wire device, for a message to or from another of its devices."""
        return out.add_value(val.shape, val.stride, val.dtype, val.nbytes, ValueKind.INTERMEDIATE,
                             name=f"wire:{val.name}", device=WIRE_DEVICE)

    tag = 0
    # (value, receiving rank) -> the value received on that rank's wire device (on the receiver; None
    # elsewhere): a value several devices of one rank read crosses once and is copied on from there
    delivered: dict[tuple[int, int], int | None] = {}
    for vid in order:
        vertex = tg.vertices[vid]
        source = tg.transfer_source(vertex)
        if source is not None and rank_of[source] != vertex.device // local:
            sender, receiver = rank_of[source], vertex.device // local
            if vertex.op != "aten::_to_copy" or vertex.kwargs or \
                    tg.values[vertex.outputs[0]].dtype != tg.values[source].dtype:
                raise UnsupportedFeature(f"vertex {vertex.id} ({vertex.op}) moves a value between ranks "
                                         f"{sender} and {receiver} as more than a plain copy")
            first = (source, receiver) not in delivered
            if first:
                delivered[(source, receiver)] = None
            if sender == rank and first:
                val = tg.values[source]
                outgoing = new_id[source]
                if val.device % local != WIRE_DEVICE:
                    outgoing = staged(val)
                    out.add_vertex("aten::_to_copy", (dataclasses.replace(val.dense_ref, value=new_id[source]),), {},
                                   (outgoing,), module=vertex.module, phase=vertex.phase, device=WIRE_DEVICE)
                    origin.append(-1)
                out.add_vertex(SEND, (dataclasses.replace(val.dense_ref, value=outgoing),),
                               {"peer": receiver, "tag": tag}, (), module=vertex.module, phase=vertex.phase,
                               device=WIRE_DEVICE)
                origin.append(vid)
            elif receiver == rank:
                val = tg.values[vertex.outputs[0]]
                on_wire = vertex.device % local == WIRE_DEVICE
                if first:
                    got = kept(val)
                    into = got if on_wire else staged(val)
                    out.add_vertex(RECV, (), {"peer": sender, "tag": tag}, (into,), module=vertex.module,
                                   phase=vertex.phase, device=WIRE_DEVICE)
                    origin.append(vid)
                    delivered[(source, receiver)] = into
                if on_wire:  # the received value itself (a second delivery: the one a device off the wire got)
                    new_id.setdefault(val.id, delivered[(source, receiver)])
                else:  # copied on from the wire device: the received value's copy, or this transfer's own
                    out.add_vertex("aten::_to_copy",
                                   (dataclasses.replace(val.dense_ref, value=delivered[(source, receiver)]),), {},
                                   (kept(val),), module=vertex.module, phase=vertex.phase,
                                   device=vertex.device % local)
                    origin.append(-1 if first else vid)
            if first:
                tag += 1
            continue
        if vertex.device // local != rank:
            continue
        for o in vertex.outputs:
            if o >= 0:
                kept(tg.values[o])
        out.add_copy(vertex, args=map_refs(vertex.args, ref), kwargs=map_refs(vertex.kwargs, ref),
                     outputs=tuple(new_id[o] if o >= 0 else o for o in vertex.outputs),
                     copy_in=tuple((new_id[a], new_id[b]) for a, b in vertex.copy_in),
                     device=vertex.device % local)
        origin.append(vid)
    out.outputs = {name: new_id[sent.get((name, rank), x)] for name, x in tg.outputs.items()}
    out.bindings = {new_id[a]: new_id[b] for a, b in tg.bindings.items() if a in new_id}
    out.batch_inputs = [new_id[x] for x in tg.batch_inputs if x in new_id]
    out.initial_state = {new_id[x]: t for x, t in tg.initial_state.items() if x in new_id}
    out.state_names = {name: new_id[x] for name, x in tg.state_names.items() if x in new_id}
    out.validate()
    return Slice(out, {new: old for old, new in new_id.items() if old < traced_values},
                 [vid if vid < traced else -1 for vid in origin])


def message_order(tg: TaskGraph, order: list[int], ranks: int, behind: int | None = WEIGHTS_BEHIND) -> list[int]:
    """``order`` (a topological order of ``tg``, placed over ``ranks`` ranks' devices) with every
    updated weight that crosses to another rank, and what follows from it, moved ``behind`` messages
    later (None, or past the last message: to the end).

    A rank's messages run one at a time in the tag order every rank shares, so a weight sent right
    after its update (step_order's place for it) puts the owner's whole round trip (the bucket of
    gradients arriving, the sum, the update) between two buckets of the backward: the sender's next
    bucket waits for it, and its compute for the bucket's memory. On two H200s that held each rank's
    backward ~100 ms a step (gpt1.3b at 100%: 258 ms against the one process's 156). A few buckets
    later the update may have run, and the weights would go out during the backward rather than all
    at its end; measured, the end was faster (WEIGHTS_BEHIND). A moved vertex goes after everything
    it waits for (its inputs' producers, the readers of what it overwrites) and after its weight's
    place, so the order stays topological."""
    if ranks < 2:
        return list(order)
    local = tg.devices // ranks

    def crosses(vertex) -> bool:
        source = tg.transfer_source(vertex)
        return source is not None and tg.values[source].device // local != vertex.device // local

    roots = {v.id for v in tg.vertices if v.phase == "optimizer" and crosses(v)}
    consumers = tg.consumers()

    def downstream(vid: int) -> list[int]:
        vertex = tg.vertices[vid]
        made = [*(o for o in vertex.outputs if o >= 0), *(new for _, new in vertex.copy_in)]
        return [reader for value in made for reader in consumers[value]]

    late = set()
    stack = list(roots)
    while stack:  # the weights' transfers and everything downstream of them
        vid = stack.pop()
        if vid not in late:
            late.add(vid)
            stack.extend(downstream(vid))
    kept = [v for v in order if v not in late]
    kept_index = {v: i for i, v in enumerate(kept)}
    messages = [i for i, v in enumerate(kept) if crosses(tg.vertices[v])]
    place = {v: i for i, v in enumerate(order)}
    kept_place = [place[v] for v in kept]
    after: dict[int, int] = {}  # late vertex -> the index in ``kept`` it follows
    following: dict[int, list[int]] = {}  # that index -> the late vertices after it, in ``order``
    for vid in order:  # topological: what a vertex waits for has its place already
        if vid not in late:
            continue
        vertex = tg.vertices[vid]
        waits = [tg.values[x].producer for x in vertex.inputs()] + \
                [reader for old, _ in vertex.copy_in for reader in consumers[old] if reader != vid]
        target = max((kept_index[w] if w in kept_index else after[w] for w in waits if w >= 0), default=-1)
        if vid in roots:
            k = len(messages) if behind is None else \
                bisect.bisect_left(messages, bisect.bisect_left(kept_place, place[vid])) + behind - 1
            target = max(target, messages[k] if k < len(messages) else len(kept) - 1)
        after[vid] = target
        following.setdefault(target, []).append(vid)
    out = list(following.get(-1, []))
    for i, vid in enumerate(kept):
        out.append(vid)
        out.extend(following.get(i, []))
    return out


def _outputs_sent_to_every_rank(tg: TaskGraph, ranks: int) -> tuple[TaskGraph, dict[tuple[str, int], int]]:
    """(``tg`` with a copy of each output on the first device of every rank that does not hold it;
    (output name, rank) -> that copy)."""
    local = tg.devices // ranks
    tg = tg.copy()
    sent: dict[tuple[str, int], int] = {}
    for name, x in tg.outputs.items():
        val = tg.values[x]
        for rank in range(ranks):
            if val.device // local == rank:
                continue
            got = tg.add_value(val.shape, val.stride, val.dtype, val.nbytes, ValueKind.INTERMEDIATE,
                               name=val.name, device=rank * local)
            tg.add_vertex("aten::_to_copy", (val.dense_ref,), {}, (got,), phase="optimizer", device=rank * local)
            sent[(name, rank)] = got
    return tg, sent
