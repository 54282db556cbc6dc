"""Every rank's step simulated together: a message moves only once both of its ranks have posted it.

    results = engine.simulate_ranks([mg_rank0, mg_rank1], costs)   # one SimResult per rank
    max(r.step_time for r in results)                               # the step, as the slowest rank ends it

``simulate`` runs one rank's MemGraph alone and prices each message (a SEND or RECV vertex, on the
rank's one message lane, Stream.COMM) at its bytes over the link between ranks, as if its peer were
always ready. A rank's messages run one at a time in the tag order every rank shares, so one that
its peer posts late holds the whole lane: on two H200s the solo simulation put two ranks of gpt1.3b
at 50% at 193 ms where they ran 237. Here each rank is the engine's own loop on a virtual clock
(timing_sim's model, unchanged), all on one clock: a message that has started on its lane waits,
making no progress, until the matching message (same tag, the other rank) has started on its
peer's, then both move its bytes at the link's rate and end together.

What it assumes beyond timing_sim: ranks start the step at the same time; a waiting message holds
its lane, and slows its device's compute as a moving one does (NCCL's kernel spins on SMs: the cost
model's compute_beside_messages); messages between different pairs of ranks do not share bandwidth.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ..ir.memgraph import MemGraph, Stream
from ..ir.taskgraph import SEND
from .errors import StallError
from .timing_sim import Costs, SimResult, prepared, sim_result


def simulate_ranks(mgs: list[MemGraph], costs: Costs | list[Costs] = None, **options: Any) -> list[SimResult]:
    """One step of every rank's MemGraph (``mgs[r]`` rank r's, ranks 0..R-1 of one step), simulated
    together; ``costs`` one for all or one per rank, ``options`` simulate's. One SimResult per rank,
    its times on the shared clock."""
    ranks = len(mgs)
    if ranks < 1:
        raise ValueError("simulate_ranks needs the MemGraph of every rank, got none")
    for r, mg in enumerate(mgs):
        if (mg.taskgraph.rank, mg.taskgraph.ranks) != (r, ranks):
            raise ValueError(f"mgs[{r}] is rank {mg.taskgraph.rank} of {mg.taskgraph.ranks}: give every rank's "
                             f"MemGraph of one step, in rank order ({ranks} given)")
    per_rank = costs if isinstance(costs, list) else [costs] * ranks
    runs = [prepared(mg, c, **options) for mg, c in zip(mgs, per_rank)]
    sims = [run.sim for run in runs]
    partner = _partners(sims)

    def peer_waits(rank: int, unit: int) -> bool:
        """Whether the message ``unit`` of ``rank`` still waits for its peer to post its end."""
        peer, peer_unit = partner[rank].get(unit, (None, None))
        return peer is not None and math.isnan(sims[peer].start[peer_unit])

    for rank, sim in enumerate(sims):
        sim.holds = functools.partial(peer_waits, rank)
    for sim in sims:
        sim.begin()
    while any(sim.finished < sim.g.n for sim in sims):
        for rank, sim in enumerate(sims):  # a waiting message moves once its peer's has started
            sim.waiting = {unit for unit in sim.waiting if peer_waits(rank, unit)}
        events = [sim.next_event() if sim.finished < sim.g.n else (-1, math.inf, False, [], {}) for sim in sims]
        dt = min(event[1] for event in events)
        if dt == math.inf:
            stuck = [r for r, sim in enumerate(sims) if sim.finished < sim.g.n]
            waiting = {r: sorted(sims[r].waiting)[:5] for r in stuck}
            raise StallError(f"simulated ranks stall: ranks {stuck} can never finish (units waiting on a peer's "
                             f"message: {waiting})\n" + "\n".join(str(sims[r].stall()) for r in stuck), [])
        for sim, (first, own_dt, host, pools, speed) in zip(sims, events):
            if sim.finished == sim.g.n:
                continue
            if own_dt == dt:
                sim.advance(first, dt, host, pools, speed)
            else:  # another rank's event comes first: this one's running vertices progress, none ends
                sim.advance(-1, dt, False, pools, speed)
    for sim in sims:
        sim.check_finished()
    return [sim_result(run) for run in runs]


def _partners(sims) -> list[dict[int, tuple[int, int]]]:
    """Per rank: its message units -> (the peer rank, the peer's unit of the same message)."""
    posted: dict[tuple[int, int, int], tuple[int, int]] = {}  # (sender, receiver, tag) -> (rank, unit)
    partner: list[dict[int, tuple[int, int]]] = [{} for _ in sims]
    for rank, sim in enumerate(sims):
        tasks = sim.mg.taskgraph.vertices
        for unit, members in enumerate(sim.g.units):
            mv = sim.mg.vertices[members[0]]
            if mv.stream is not Stream.COMM:
                continue
            task = tasks[mv.task_vertex]
            peer, tag = int(task.kwargs["peer"]), int(task.kwargs["tag"])
            key = (rank, peer, tag) if task.op == SEND else (peer, rank, tag)
            if key in posted:
                other_rank, other_unit = posted.pop(key)
                partner[rank][unit] = (other_rank, other_unit)
                partner[other_rank][other_unit] = (rank, unit)
            else:
                posted[key] = (rank, unit)
    if posted:
        (sender, receiver, tag), _ = next(iter(posted.items()))
        raise ValueError(f"message {tag} from rank {sender} to rank {receiver} has no match on the other rank "
                         f"({len(posted)} unmatched): the MemGraphs are not the ranks of one step")
    return partner
