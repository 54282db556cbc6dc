"""A step over several devices of one process planned device by device.

plan_step (memgraph/compiler.py) plans such a step as one device with N times the budget, and the
builder then holds each device to its own. Where the plan is tight that picture misleads: memory
one device lacks is free on another, so the plan keeps, offloads and recomputes for a device that
does not exist, and the builder evicts what each real device cannot hold. Here each device's share
of the step (trace/ranks.py's slice: its transfers to and from the other devices become messages,
priced at the device-to-device link) is planned on its own budget, and the shares' plans are put
back together on the whole step. compile builds that plan beside the planned-as-one candidates and
the simulator picks. On the 2 x H200 export of gpt1.3b with replicas it simulated 339.3 ms at 25% of
eager's peak per GPU, where the best planned-as-one plan of that layout simulated 397.2 (made
again for less: none built at the whole budget); with the
casts travelling 524.2, where the planned-as-one ILP plan simulated 306.0; at 50% it lost (207.0
against 198.7) (bench/results/h200x2/s7/replan_gpt1.3b_x2_*_s7.json, from ``python -m turnip.bench.replan
plan --step bench/results/h200x2/steps/step_gpt1.3b_x2[_casts]_s6.step --budgets 0.25[,0.5]
--eager-peak 39829110784``).

On CUDA with planner "auto" each share is planned as the whole step is, greedy then the ILP over
blocks; elsewhere greedily. On the 2 x H200 export of gpt1.3b with replicas (2-core CPU, `python -m
turnip.bench.replan plan --step bench/results/h200x2/steps/step_gpt1.3b_x2_s6.step --budgets 0.5
--eager-peak 39829110784`), the ILP's shares simulated 182.7 ms at 50% of eager's peak per GPU,
where the greedy shares simulated 207.0 and the best planned-as-one candidate 199.4; at 25%, 327.2
against 340.5; with the casts travelling at 25%, 438.5 against 445.6 (planning 1.6, 6.3 and 15.8 s
longer; bench/results/2026-11-29_h200_later-rounds.md). The shares are planned side by side, on
threads: HiGHS releases the GIL while it solves.

A share receives each weight's bf16 cast from its owner when the casts travel. As a rank's message,
a receive could not run again, so neither could anything reading it: the share kept or offloaded
every matmul output in the backward's reach (2.84 GiB of addmm outputs per GPU at 25% on
gpt1.3b), over the host link. Between devices of one process the whole step's copy can simply
run again, so the shares are planned with replay_receives; and the owner casts the weight again
just before the copy (cast_again_at_the_source), rather than holding its first cast from the
forward to the other device's backward. On the 2 x H200 export with the casts travelling (`python
-m turnip.bench.replan plan --step bench/results/h200x2/steps/step_gpt1.3b_x2_casts_s6.step
--budgets 0.5,0.25,0.2 --eager-peak 39829110784 --planner-option time_limit=10`), at 25% this plan
simulates 260.5 ms, where before the fastest candidate simulated 339.8 (and 327.2 with replicas);
at 20% and 50% planned-as-one plans stay fastest (318.1 and 176.3)
(bench/results/2026-11-29_cpu_replayed-receives.md).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

from ..ir.plan import Plan, Recompute
from ..ir.taskgraph import TaskGraph
from ..planners.costs import CostModel
from ..planners.driver import plan_and_start
from ..planners.model import step_order
from ..trace.ranks import Slice, sliced
from .remake_offloaded import in_place_writers, made_from_gpu_weights

log = logging.getLogger(__name__)


def per_device_plans(tg: TaskGraph, gpu_budget: int, cpu_budget: int | None, costs: CostModel, alignment: int,
                     method: str = "greedy", **options) -> list[Plan]:
    """The plans of ``tg`` (one process, several devices) made of each device's share planned on
    ``gpu_budget`` (and an equal part of ``cpu_budget``) by the planner ``method``: the shares' plans
    merged, then, where the ILP's plan of some share beat its greedy plan in the planner's model,
    the greedy plans merged too (a share's model does not see the other devices' waits, and the
    simulator picks). None on one device, over ranks (each rank already plans its own share), or
    where a share's plan reorders the step: an empty list."""
    if tg.devices < 2 or tg.ranks > 1:
        return []
    order = step_order(tg)
    share_costs = copy.copy(costs)  # a share's messages are the whole step's transfers between devices
    share_costs.rank_bandwidth = costs.d2d_bandwidth
    share_cpu = cpu_budget // tg.devices if cpu_budget is not None else None
    shares = [sliced(tg, device, tg.devices, order=order) for device in range(tg.devices)]
    for share in shares:  # one after another: on CUDA an op not priced yet is measured on the GPU
        share_costs.annotate(share.taskgraph)

    def plans_of(share: Slice) -> list[Plan]:
        # a weight's cast or activation received from another device can be received again, over
        # the device-to-device link, where the share would otherwise offload it or what reads it
        return plan_and_start(share.taskgraph, gpu_budget, share_cpu, method=method, costs=share_costs,
                              alignment=alignment, replay_receives=True, **options)

    with ThreadPoolExecutor(max_workers=len(shares), thread_name_prefix="turnip-share") as pool:
        planned = list(pool.map(plans_of, shares))
    for device, (share, plans) in enumerate(zip(shares, planned)):
        for plan in plans:
            if plan.order is not None:
                kept = [share.vertices[u] for u in plan.order if share.vertices[u] >= 0]
                mine = set(kept)
                if kept != [v for v in order if v in mine]:
                    log.info("device %d's plan reorders the step: no per-device candidate", device)
                    return []
    # each share's first plan, then, where some share has two, the greedy plans the ILP started from
    picks = (0, -1) if any(len(plans) > 1 for plans in planned) else (0,)
    return [cast_again_at_the_source(tg, merged([(share, plans[k]) for share, plans in zip(shares, planned)],
                                                order, gpu_budget, cpu_budget))
            for k in picks]


def merged(parts: list[tuple[Slice, Plan]], order: list[int], gpu_budget: int, cpu_budget: int | None) -> Plan:
    """The whole step's plan from its shares' plans: every decision named by the whole step's
    values and vertices (a share's messages by their transfers), the whole step's order."""
    plan = Plan(gpu_budget=gpu_budget, cpu_budget=cpu_budget, order=list(order),
                planner=f"{parts[0][1].planner}/per-device")
    place = {vid: i for i, vid in enumerate(order)}
    for share, part in parts:
        values, vertices = share.values, share.vertices
        plan.recompute += [Recompute(vertices[rc.vertex], vertices[rc.before]) for rc in part.recompute
                           if vertices[rc.vertex] >= 0 and vertices[rc.before] >= 0]
        plan.offload |= {values[x] for x in part.offload if x in values}
        plan.home.update({values[x]: where for x, where in part.home.items() if x in values})
        plan.release_after.update({values[x]: [vertices[u] for u in after if vertices[u] >= 0]
                                   for x, after in part.release_after.items() if x in values})
        plan.host_update |= {vertices[u] for u in part.host_update if vertices[u] >= 0}
        plan.resident |= {values[x] for x in part.resident if x in values}
    # the copies in the order they run: a share's copies keep theirs, the shares interleave by place
    plan.recompute.sort(key=lambda rc: place[rc.before])
    # No predicted_time: a share's prediction is one device's step, where the planned-as-one candidates
    # predict the N devices' work on one device, and compile compares predictions to decide whether a
    # candidate that left a device short is worth planning again for less (favourite_refused). With the
    # shares' times there, a per-device plan that built kept the planned-as-one ones from being made again
    # (the 2 x H200 casts export at 25%: 524.2 ms kept, where the planned-as-one ILP plan simulates 306.0).
    peaks = [part.predicted_peak for _, part in parts]
    plan.predicted_peak = max(peaks) if None not in peaks else None
    plan.stats = {"per_device": [part.stats for _, part in parts],
                  "per_device_predicted_s": [part.predicted_time for _, part in parts]}
    return plan


def cast_again_at_the_source(tg: TaskGraph, plan: Plan) -> Plan:
    """The plan with each value a device receives again (replay_receives) cast again on its sender
    first, where the sender made it by one op from weights homed on the GPU (a Linear weight's bf16
    cast): the copy then reads the new cast, and the sender need not hold its first one from the
    forward to the receiver's backward. Not where a weight it reads is updated in place before."""
    order = plan.order if plan.order is not None else list(range(len(tg.vertices)))
    position = {vid: k for k, vid in enumerate(order)}
    first_update = in_place_writers(tg, position)
    recompute, again = [], set()
    for rc in plan.recompute:
        source = tg.transfer_source(tg.vertices[rc.vertex])
        caster = made_from_gpu_weights(tg, plan, source) if source is not None else None
        if caster is not None and (caster, rc.before) not in again and \
                all(first_update.get(x, len(order)) > position[rc.before] for x in tg.vertices[caster].inputs()):
            recompute.append(Recompute(caster, rc.before))
            again.add((caster, rc.before))
        recompute.append(rc)
    if not again:
        return plan
    return dataclasses.replace(plan, recompute=recompute, stats={**plan.stats, "cast_again_at_the_source": len(again)})
