"""Scale on paper: project turnip's, DDP's and FSDP2's step time on many nodes from one GPU's exported step.

    python -m turnip.bench.scale --step bench/results/h200/steps/step_gpt1.3b.step \\
        --nodes 1,2,4,8,16 --gpus-per-node 4,8 --budgets 0.25,0.5 \\
        --nic-gbps 400 --nics-per-node 8 --nic-latency-us 5 --nvlink-gbps 3152 --out bench/results/analytic/scale

Writes ``scale_<model>.json`` (every row, the check against measured multi-GPU steps where the
step's device has some) and ``scale_<model>.png`` (step time and tokens/s per GPU against GPUs).
Tracing and planning a step over 128 GPUs is out of reach, so the projection uses the symmetry of
data parallelism: every worker runs the same step on its own micro-batch, so one representative
GPU's step plus the traffic data parallelism adds gives the step of all.

The model, and every assumption it makes:

- Workers. W = nodes x GPUs per node data-parallel workers, each on the exported step's batch
  (global batch W x the step's); tokens/s counts every worker's tokens.
- Topology, two levels. Inside a node each GPU moves ``nvlink`` bytes/s each way (394 GB/s measured
  on the H100 hosts, 364 GB/s on the H200 pair) with ``nvlink_latency`` per message; between nodes a
  node's NICs move ``nics_per_node x nic_gbps`` bits/s each way, shared evenly by its GPUs (8 x 400
  Gb/s over 8 GPUs: 50 GB/s per GPU) with ``nic_latency`` per message. No congestion in the fabric
  beyond the NICs (a full-bisection network); the host's PCIe, where ``host_links`` (the node's
  totals, h2d/d2h/both) is given, is shared evenly by the node's GPUs, else each GPU keeps the
  exported step's own link.
- Collectives, hierarchical rings. A reduce-scatter of S bytes (all-gather alike): a ring inside
  the node ((G-1)/G x S over NVLink, G-1 latencies), then a ring across the N nodes on the node's
  1/G shard ((N-1)/N x S/G over the GPU's NIC share, N-1 latencies). An all-reduce is a
  reduce-scatter then an all-gather. All of one GPU's collectives queue on one link (FIFO): a
  bucket's collective starts when its gradients exist and the previous one is done. While a
  collective overlaps compute, the compute runs at ``compute_beside_messages`` of its speed (0.92,
  the cost model's figure for NCCL's kernels on the SMs): the overlapped time x (1 - 0.92) is added.
- turnip (sharded optimizer states, trace/data_parallel.py: each parameter has an owner, gradients
  are summed on the owner, the owner updates, updated weights come back). The representative GPU's
  step is the exported TaskGraph with its optimizer states' bytes and its optimizer-phase vertices'
  times divided by W (it owns 1/W of the parameters: 1/W of the update and of the states, so of
  their offload traffic too), planned at the per-GPU budget as compile plans on CUDA (planner
  "auto": every candidate of planners.driver.plan_candidates built in the allocate-ahead walk, the
  fastest simulated taken; everything kept where the budget holds the unplanned peak) and simulated
  by engine.simulate. This replaces scaling the simulated timeline by hand: the planner sees the states
  shrink and spends the freed memory on activations, as compile does on several GPUs. The step's
  gradients (fp32, the optimizer's inputs) become buckets of ``turnip_bucket`` bytes (256 MiB, as
  trace/data_parallel.py joins them) in the order the simulated step produces them; each bucket is
  reduce-scattered when ready, its 1/W shard updated (the bucket's share of the update time / W),
  and its weights all-gathered back (fp32 parameter bytes; the "casts travel" layout would send bf16
  and halve it). The step ends when the simulated step ends and the last all-gather is done.
  Not modelled: the gradients a GPU sends away and frees early (its memory is counted as on one
  GPU, conservative), the bucket buffers' memory, the update on the compute lane competing with
  the backward (its time is counted in the simulated step and as a delay in the collective chain).
- DDP (fused AdamW, everything on each GPU). Compute: the step's op times in program order (eager
  runs one stream; on the H200 the sum is 150 ms against 145 ms measured for eager with fused
  AdamW). Gradients in production order in buckets of 25 MiB (DDP's bucket_cap_mb), each
  all-reduced when ready; the optimizer (the full update) runs after the last all-reduce. Its peak:
  eager's measured peak (else the step's unplanned peak) plus one copy of the gradients (DDP's
  buckets): not reported (None) where that exceeds the GPU's memory, and flagged where it exceeds
  the budget.
- FSDP2 (fully_shard per transformer block, then the root, as bench/peers/distributed_worker.py;
  fp32 gather and reduce, no mixed-precision policy). Units: the parameters of each "blocks.N" (or
  "layers.N") module, the rest the root. The root is gathered once before the forward; each block
  is all-gathered before its forward and again before its backward, prefetched one unit ahead
  (unit k+1's gather is issued when unit k starts computing); each block's gradients are
  reduce-scattered after its backward, the root's at the end; then the optimizer on the 1/W shard.
  The backward's vertices belong to the unit whose gradient they lead to (program order). Peak:
  eager's minus (1 - 1/W) of the parameters, gradients and states, plus two units' parameters and
  gradients (the prefetched one); flagged as for DDP. The measured FSDP2 reserved peaks are
  ~5 GiB above this estimate (allocator), so its "fits" is optimistic.
- Budgets are fractions of ``eager_peak``: eager's measured peak (39829110784 bytes, 37.09 GiB
  reserved, for gpt1.3b, the figure the measured multi-GPU budgets used; pass --eager-peak), else
  the export's eager_peak_allocated, else the step's unplanned peak (lora7b: no eager peak was
  exported). A LoRA step has only the adapters' gradients and states: its communication is tiny,
  and its scaling is nearly perfect by construction.
- Not modelled anywhere: stragglers and jitter, NCCL's protocol choice and SM count, the loop's
  host overhead beyond what the simulator prices for the one GPU, gradient clipping's global norm
  (an all-reduce of one scalar), pipeline or tensor parallelism.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.loop import StaticGraph
from ..engine.timing_sim import nominal_durations, simulate
from ..ir.budget import format_bytes
from ..ir.errors import InfeasibleBudget
from ..ir.step_file import load_step
from ..ir.taskgraph import TaskGraph, ValueKind, iter_refs
from ..memgraph.builder import build_walks
from ..memgraph.compiler import everything_kept, plan_step
from ..memgraph.progress import Phases
from .replan import ALIGNMENT, offline_costs
from .results import result_path, run_metadata

log = logging.getLogger(__name__)

GB = 1e9
MIB = 2**20
DDP_BUCKET = 25 * MIB  # DistributedDataParallel's bucket_cap_mb
TURNIP_BUCKET = 256 * MIB  # trace/data_parallel.py's buckets
COMPUTE_BESIDE_MESSAGES = 0.92  # planners/costs.py DeviceSpec: compute speed while NCCL's kernels run
GPT13B_EAGER_PEAK = 39829110784  # bytes: eager's measured reserved peak, the measured multi-GPU budgets' base

# Measured multi-GPU steps (ms, median) to check the 1-node rows against: (device name, model, GPUs,
# system, budget, ms, the host's NVLink GB/s per GPU each way, the host's PCIe totals h2d/d2h/both or
# None, the file). The budgets are fractions of GPT13B_EAGER_PEAK.
MEASURED = [
    ("NVIDIA H200", "gpt1.3b", 2, "ddp", None, 159.5, 364, None, "h200x2/s9/call4_x2_0.5.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "fsdp2", None, 181.1, 364, None, "h200x2/s9/call4_x2_0.5.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "turnip", 0.5, 179.3, 364, None, "h200x2/s9/call4_x2_0.5.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "turnip", 0.25, 362.1, 364, None, "h200x2/s8/call5_x2_0.25.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "ddp", None, 161.8, 364, None, "h200x2/s19/call2/x2.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "fsdp2", None, 186.4, 364, None, "h200x2/s19/call2/x2.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "turnip", 0.5, 185.2, 364, None, "h200x2/s19/call2/x2.json"),
    ("NVIDIA H200", "gpt1.3b", 2, "turnip", 0.25, 278.4, 364, None, "h200x2/s19/call2/x2.json"),
    # four H200s: NVLink not measured on that host; the pair's figure
    ("NVIDIA H200", "gpt1.3b", 4, "ddp", None, 161.3, 364, None, "h200x4/s19/call3/x4.json"),
    ("NVIDIA H200", "gpt1.3b", 4, "fsdp2", None, 178.5, 364, None, "h200x4/s19/call3/x4.json"),
    ("NVIDIA H200", "gpt1.3b", 4, "turnip", 0.5, 220.7, 364, None, "h200x4/s19/call3/x4.json"),
    ("NVIDIA H200", "gpt1.3b", 4, "turnip", 0.25, 254.1, 364, None, "h200x4/s19/call3/x4.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 2, "ddp", None, 175.2, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call4_x2_peers.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 2, "turnip", 0.5, 267.0, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call4_x2_0.5.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 2, "turnip", 0.25, 441.1, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call4_x2_0.25.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 4, "ddp", None, 178.0, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call4_x4_peers.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 4, "fsdp2", None, 192.9, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call4_x4_peers.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 4, "turnip", 0.5, 270.0, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call4_x4_0.5.json"),
    ("NVIDIA H100 80GB HBM3", "gpt1.3b", 4, "turnip", 0.25, 457.3, 394, (164e9, 128e9, 190e9),
     "h100x4/s2/call3_x4_0.25.json"),
]


# --- the links -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """nodes x gpus_per_node GPUs; bandwidths in bytes/s each way, latencies in seconds."""

    nodes: int = 1
    gpus_per_node: int = 1
    nvlink: float = 394 * GB  # per GPU
    nvlink_latency: float = 2e-6
    nic: float = 8 * 400e9 / 8  # per node: NICs x bits/s / 8
    nic_latency: float = 5e-6
    host_links: tuple | None = None  # the node's PCIe totals (h2d, d2h, both) bytes/s, shared by its GPUs
    compute_beside_messages: float = COMPUTE_BESIDE_MESSAGES

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nic_per_gpu(self) -> float:
        return self.nic / self.gpus_per_node


def ring_seconds(nbytes: float, members: int, bandwidth: float, latency: float) -> float:
    """A ring reduce-scatter (or all-gather) of ``nbytes`` over ``members``: each sends (m-1)/m of it."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    return (members - 1) / members * nbytes / bandwidth + (members - 1) * latency


def reduce_scatter_seconds(nbytes: float, topo: Topology) -> float:
    """Hierarchical: a ring inside the node over NVLink, then a ring across nodes on the node's shard."""
    inside = ring_seconds(nbytes, topo.gpus_per_node, topo.nvlink, topo.nvlink_latency)
    across = ring_seconds(nbytes / topo.gpus_per_node, topo.nodes, topo.nic_per_gpu, topo.nic_latency)
    return inside + across


all_gather_seconds = reduce_scatter_seconds  # the same traffic, reversed


def all_reduce_seconds(nbytes: float, topo: Topology) -> float:
    return reduce_scatter_seconds(nbytes, topo) + all_gather_seconds(nbytes, topo)


# --- what the step's gradients are -------------------------------------------------------------------


@dataclass
class Gradient:
    """One gradient the optimizer reads: when it exists, its bytes, its parameter's bytes, its update's seconds."""

    value: int
    producer: int  # TaskGraph vertex
    nbytes: int
    param_bytes: int
    update: float  # its share of the optimizer vertex's time (unsharded)
    ready: float = 0.0


def value_ids(args) -> Iterable[int]:
    """The value ids of every TensorRef in a vertex's (nested) args."""
    return (ref.value for ref in iter_refs(args))


def gradients(tg: TaskGraph) -> list[Gradient]:
    """The optimizer's gradient inputs (values made outside the optimizer phase), in program order of
    their producers; each optimizer vertex's time and parameter bytes split over its gradients by bytes."""
    found: dict[int, Gradient] = {}
    for vertex in tg.vertices:
        if vertex.phase != "optimizer":
            continue
        ids = list(dict.fromkeys(value_ids((vertex.args, vertex.kwargs))))
        grads = [i for i in ids if tg.values[i].producer >= 0 and tg.vertices[tg.values[i].producer].phase != "optimizer"]
        params = optimizer_params(tg, vertex)
        total = sum(tg.values[g].nbytes for g in grads)
        param_total = sum(tg.values[p].nbytes for p in params) or total
        for g in grads:
            share = tg.values[g].nbytes / total if total else 0.0
            if g in found:  # a later optimizer op reading the same gradient: its time adds to the update
                found[g].update += vertex.time * share
                continue
            found[g] = Gradient(g, tg.values[g].producer, tg.values[g].nbytes, int(param_total * share),
                                vertex.time * share)
    return sorted(found.values(), key=lambda g: g.producer)


def optimizer_params(tg: TaskGraph, vertex) -> list[int]:
    """The parameters an optimizer vertex updates: its PARAMETER inputs, or the old side of its in-place
    pairs (a traced in-place update reads the updated values, copy_in pairs them with the inputs)."""
    ids = set(value_ids((vertex.args, vertex.kwargs)))
    old = {o for o, _ in vertex.copy_in}
    return sorted(i for i in ids | old if tg.values[i].kind is ValueKind.PARAMETER)


def buckets(grads: Sequence[Gradient], cap: int) -> list[list[Gradient]]:
    """Gradients in order of readiness, joined into buckets of at most ``cap`` bytes (at least one each)."""
    out: list[list[Gradient]] = []
    size = cap
    for grad in sorted(grads, key=lambda g: (g.ready, g.producer)):
        if size + grad.nbytes > cap:
            out.append([])
            size = 0
        out[-1].append(grad)
        size += grad.nbytes
    return out


# --- the representative GPU's turnip step -------------------------------------------------------------


def sharded_step(tg: TaskGraph, workers: int) -> TaskGraph:
    """``tg`` as a worker owning 1/W of the parameters sees it: optimizer states' bytes (and their
    updated versions') and the optimizer-phase vertices' times divided by W."""
    if workers <= 1:
        return tg
    states = {v.id for v in tg.values if v.kind is ValueKind.OPTIMIZER_STATE}
    states |= {tg.bindings[s] for s in states if s in tg.bindings}
    values = [dataclasses.replace(v, nbytes=max(1, v.nbytes // workers)) if v.id in states and v.nbytes > 1024 else v
              for v in tg.values]
    vertices = [dataclasses.replace(v, time=v.time / workers) if v.phase == "optimizer" else v for v in tg.vertices]
    return dataclasses.replace(tg, values=values, vertices=vertices)


def per_gpu_facts(facts: dict, topo: Topology) -> dict:
    """The exported step's link facts with the node's PCIe totals (when given) shared by its GPUs."""
    if not topo.host_links:
        return facts
    h2d, d2h, both = (x / topo.gpus_per_node if x else math.inf for x in topo.host_links)
    out = dict(facts)
    out["h2d_bandwidth"] = min(facts["h2d_bandwidth"], h2d)
    out["d2h_bandwidth"] = min(facts["d2h_bandwidth"], d2h)
    out["duplex_bandwidth"] = min(facts.get("duplex_bandwidth") or math.inf, both, out["h2d_bandwidth"] + out["d2h_bandwidth"])
    return out


def simulate_at_budget(tg: TaskGraph, facts: dict, budget: int, planner: str = "auto") -> tuple[float, dict, dict]:
    """One GPU's step planned at ``budget`` bytes (everything kept where the unplanned peak fits) and
    simulated: its seconds, the end time of every TaskGraph vertex on the simulated timeline, and facts.
    planner "auto": compile's candidates on CUDA (planners.driver.plan_candidates), each built in the
    allocate-ahead walk, the fastest simulated taken (as compile picks); else that one planner's plan."""
    costs = offline_costs(facts)
    costs.annotate(tg)
    kept, peak = everything_kept(tg, ALIGNMENT)
    if budget >= peak:
        candidates = [("kept", kept)]
    else:
        plans = plan_step(tg, budget, None, planner, torch.device("cuda"), costs, ALIGNMENT, Phases([], enabled=False),
                          {}, "off", 1.0)
        candidates = []
        for k, plan in enumerate(plans):
            try:
                candidates.append((f"{plan.planner}#{k}", build_walks(tg, plan, alignment=ALIGNMENT,
                                                                      walks=("ahead",))["ahead"]))
            except InfeasibleBudget as exc:
                log.warning("%s#%d does not build at %s: %s", plan.planner, k, format_bytes(budget), exc)
        if not candidates:
            raise InfeasibleBudget(f"no plan builds at {format_bytes(budget)}")
    sims = [(simulate(mg, costs, backend="cuda"), how, mg) for how, mg in candidates]
    sim, how, mg = min(sims, key=lambda s: s[0].step_time)
    return sim.step_time, vertex_ends(mg, sim, costs), {"plan": how, "unplanned_peak": peak,
                                                          "bytes_h2d": sim.bytes_h2d, "bytes_d2h": sim.bytes_d2h,
                                                          "compute_idle_s": sim.compute_idle}


def vertex_ends(mg, sim, costs) -> dict[int, float]:
    """When each TaskGraph vertex ends on the simulated timeline. A timeline span is a unit (a segment
    replayed as one CUDA graph, named by its first vertex): its vertices run back to back, each for its
    share of the span by its nominal duration."""
    graph = StaticGraph(mg)
    nominal = nominal_durations(mg, costs)
    ends: dict[int, float] = {}
    for span in sim.timeline:
        unit = graph.units[graph.unit_of[span.vertex]]
        total = sum(nominal[v] for v in unit) or 1.0
        clock = span.start
        for vid in unit:
            clock += nominal[vid] * (span.end - span.start) / total
            task = mg.vertices[vid].task_vertex
            if task >= 0:
                ends[task] = max(ends.get(task, 0.0), clock)
    return ends


def turnip_tail(grads: Sequence[Gradient], topo: Topology, cap: int = TURNIP_BUCKET) -> tuple[float, float]:
    """The collective chain of the sharded step: per bucket a reduce-scatter once its gradients exist,
    the owner's update of its 1/W, an all-gather of the updated weights; one link, FIFO. The end of the
    last all-gather, and the seconds the link was busy."""
    free = end = busy = 0.0
    for bucket in buckets(grads, cap):
        ready = max(g.ready for g in bucket)
        scatter = reduce_scatter_seconds(sum(g.nbytes for g in bucket), topo)
        free = max(free, ready) + scatter
        updated = free + sum(g.update for g in bucket) / topo.workers
        gather = all_gather_seconds(sum(g.param_bytes for g in bucket), topo)
        free = max(free, updated) + gather
        busy += scatter + gather
        end = free
    return end, busy


_SIMULATED: dict[tuple, tuple] = {}


def project_turnip(tg: TaskGraph, facts: dict, budget: int, topo: Topology, planner: str = "auto") -> dict:
    """turnip's projected step on ``topo`` at ``budget`` bytes per GPU (the module docstring)."""
    step = sharded_step(tg, topo.workers)
    facts = per_gpu_facts(facts, topo)
    key = (id(tg), topo.workers, budget, planner, facts["h2d_bandwidth"], facts["d2h_bandwidth"],
           facts.get("duplex_bandwidth"))
    if key not in _SIMULATED:  # nodes x GPUs with the same W and links plan the same step
        _SIMULATED[key] = simulate_at_budget(step, facts, budget, planner)
    simulated, ends, info = _SIMULATED[key]
    grads = gradients(step)
    for grad in grads:
        grad.ready = ends.get(grad.producer, simulated)
        grad.update *= topo.workers  # gradients() read the sharded times; turnip_tail divides again
    comm_end, busy = (turnip_tail(grads, topo) if topo.workers > 1 else (0.0, 0.0))
    overlapped = min(busy, simulated)
    slowed = overlapped * (1 - topo.compute_beside_messages) if topo.workers > 1 else 0.0
    total = max(simulated + slowed, comm_end)
    return {"turnip_s": total, "turnip_compute_s": simulated + slowed, "turnip_exposed_comm_s": total - simulated - slowed,
            "turnip_comm_busy_s": busy, "turnip_simulated_one_gpu_s": simulated, **{f"turnip_{k}": v for k, v in info.items()}}


# --- DDP and FSDP2 from the same op times ---------------------------------------------------------------


def eager_ends(tg: TaskGraph) -> list[float]:
    """When each vertex ends if the step runs its ops one after another in program order (eager)."""
    ends, clock = [], 0.0
    for vertex in tg.vertices:
        clock += vertex.time
        ends.append(clock)
    return ends


def optimizer_seconds(tg: TaskGraph) -> float:
    return sum(v.time for v in tg.vertices if v.phase == "optimizer")


def persistent_bytes(tg: TaskGraph) -> dict[str, int]:
    grads = gradients(tg)
    return {"params": sum(v.nbytes for v in tg.values if v.kind is ValueKind.PARAMETER),
            "states": sum(v.nbytes for v in tg.values if v.kind is ValueKind.OPTIMIZER_STATE),
            "grads": sum(g.nbytes for g in grads)}


def project_ddp(tg: TaskGraph, topo: Topology, eager_peak: int, gpu_bytes: int, cap: int = DDP_BUCKET) -> dict:
    """DDP's step: eager's compute, gradients all-reduced bucket by bucket as produced, then the full update."""
    ends = eager_ends(tg)
    opt = optimizer_seconds(tg)
    backward_end = ends[-1] - opt
    grads = gradients(tg)
    for grad in grads:
        grad.ready = ends[grad.producer]
    free = busy = 0.0
    if topo.workers > 1:
        for bucket in buckets(grads, cap):
            seconds = all_reduce_seconds(sum(g.nbytes for g in bucket), topo)
            free = max(free, max(g.ready for g in bucket)) + seconds
            busy += seconds
    slowed = min(busy, backward_end) * (1 - topo.compute_beside_messages)
    total = max(backward_end + slowed, free) + opt
    peak = eager_peak + persistent_bytes(tg)["grads"]
    fits = peak <= gpu_bytes
    return {"ddp_s": total if fits else None, "ddp_compute_s": ends[-1] + slowed,
            "ddp_exposed_comm_s": total - ends[-1] - slowed, "ddp_peak_bytes": peak, "ddp_fits_gpu": fits}


def unit_of(name: str) -> str:
    """The FSDP2 unit of a module or parameter name: "blocks.N"/"layers.N" (anywhere in the path), else the root."""
    parts = name.removeprefix("param:").split(".")
    for k, part in enumerate(parts[:-1]):
        if part in ("blocks", "layers", "h") and parts[k + 1].isdigit():
            return ".".join(parts[: k + 2])
    return ""


def fsdp2_units(tg: TaskGraph) -> tuple[list[str], dict[int, str], dict[str, int], dict[str, int]]:
    """Each vertex's unit (forward: its module's; backward: the unit of the next gradient it leads to;
    optimizer: none), units in forward order, and each unit's parameter and gradient bytes."""
    grads = gradients(tg)
    param_unit = {}
    for vertex in tg.vertices:
        if vertex.phase == "optimizer":
            for i in optimizer_params(tg, vertex):
                param_unit[i] = unit_of(tg.values[i].name or vertex.module)
    grad_unit = {}
    for vertex in tg.vertices:
        if vertex.phase != "optimizer":
            continue
        unit = unit_of(vertex.module)
        for g in value_ids((vertex.args, vertex.kwargs)):
            grad_unit[g] = unit
    unit_of_vertex: dict[int, str] = {}
    order: list[str] = []
    for vertex in tg.vertices:
        if vertex.phase == "forward":
            unit_of_vertex[vertex.id] = unit_of(vertex.module)
            if unit_of_vertex[vertex.id] not in order:
                order.append(unit_of_vertex[vertex.id])
    produced = sorted((g.producer, grad_unit.get(g.value, "")) for g in grads)
    k = 0
    for vertex in tg.vertices:
        if vertex.phase != "backward":
            continue
        while k < len(produced) and produced[k][0] < vertex.id:
            k += 1
        unit_of_vertex[vertex.id] = produced[k][1] if k < len(produced) else ""
    if "" not in order:
        order.insert(0, "")
    for value in tg.values:  # FSDP2 shards and gathers the frozen weights too (a LoRA step's base model)
        if value.kind is ValueKind.FROZEN and value.name.startswith("param:"):
            param_unit[value.id] = unit_of(value.name)
    params: dict[str, int] = dict.fromkeys(order, 0)
    for value, unit in param_unit.items():
        params[unit] = params.get(unit, 0) + tg.values[value].nbytes
    grad_bytes: dict[str, int] = dict.fromkeys(order, 0)
    for g in grads:
        unit = grad_unit.get(g.value, "")
        grad_bytes[unit] = grad_bytes.get(unit, 0) + g.nbytes
    return order, unit_of_vertex, params, grad_bytes


def project_fsdp2(tg: TaskGraph, topo: Topology, eager_peak: int, gpu_bytes: int) -> dict:
    """FSDP2's step: per-unit all-gathers (prefetched one unit ahead) and reduce-scatters on one link,
    compute in program order, then the update of the 1/W shard."""
    order, unit_of_vertex, params, grad_bytes = fsdp2_units(tg)
    w = topo.workers
    link = {"free": 0.0, "busy": 0.0}

    def collective(ready: float, seconds: float) -> float:
        link["free"] = max(link["free"], ready) + seconds
        link["busy"] += seconds
        return link["free"]

    gathered: dict[tuple[str, str], float] = {("forward", ""): collective(0.0, all_gather_seconds(params[""], topo))}
    clock, current, last_grad = 0.0, {}, {}
    for phase in ("forward", "backward"):
        seen: list[str] = []
        for vertex in tg.vertices:
            if vertex.phase != phase:
                continue
            unit = unit_of_vertex.get(vertex.id, "")
            if unit not in seen:
                seen.append(unit)
                key = (phase, unit)
                if key not in gathered:  # not prefetched: gather now (the root stays gathered from the forward)
                    gathered[key] = 0.0 if unit == "" else collective(clock, all_gather_seconds(params[unit], topo))
                clock = max(clock, gathered[key])
                nxt = _next_unit(tg, unit_of_vertex, phase, vertex.id, unit)
                if nxt is not None and nxt != "" and (phase, nxt) not in gathered:  # prefetch one ahead
                    gathered[(phase, nxt)] = collective(clock, all_gather_seconds(params[nxt], topo))
            clock += vertex.time
            current[phase] = clock
            if phase == "backward":
                last_grad[unit] = clock
                if unit != "" and _last_of_unit(tg, unit_of_vertex, vertex.id, unit):
                    collective(clock, reduce_scatter_seconds(grad_bytes[unit], topo))
    compute = clock
    ends = collective(clock, reduce_scatter_seconds(grad_bytes.get("", 0), topo)) if w > 1 else clock
    opt = optimizer_seconds(tg) / w
    busy = link["busy"] if w > 1 else 0.0
    slowed = min(busy, compute) * (1 - topo.compute_beside_messages)
    total = max(compute + slowed, ends if w > 1 else 0.0) + opt
    sizes = persistent_bytes(tg)
    sizes["frozen"] = sum(v.nbytes for v in tg.values if v.kind is ValueKind.FROZEN and v.name.startswith("param:"))
    biggest = max((params[u] + grad_bytes.get(u, 0) for u in order if u), default=0)
    peak = int(eager_peak - (1 - 1 / w) * sum(sizes.values()) + (2 * biggest if w > 1 else 0))
    fits = peak <= gpu_bytes
    return {"fsdp2_s": total if fits else None, "fsdp2_compute_s": compute + slowed + opt,
            "fsdp2_exposed_comm_s": total - compute - slowed - opt, "fsdp2_peak_bytes": peak, "fsdp2_fits_gpu": fits}


def _next_unit(tg: TaskGraph, unit_of_vertex: dict[int, str], phase: str, start: int, unit: str) -> str | None:
    """The unit of the first vertex of ``phase`` after ``start`` that is not ``unit``."""
    for vertex in tg.vertices[start + 1:]:
        if vertex.phase == phase and unit_of_vertex.get(vertex.id, "") != unit:
            return unit_of_vertex.get(vertex.id, "")
    return None


def _last_of_unit(tg: TaskGraph, unit_of_vertex: dict[int, str], vid: int, unit: str) -> bool:
    """Whether ``vid`` is the last backward vertex of ``unit`` before another unit's."""
    nxt = next((v for v in tg.vertices[vid + 1:] if v.phase == "backward"), None)
    return nxt is None or unit_of_vertex.get(nxt.id, "") != unit


# --- rows --------------------------------------------------------------------------------------------------


@dataclass
class Step:
    """An exported step and the facts the projection needs."""

    path: Path
    tg: TaskGraph
    facts: dict
    eager_peak: int  # the bytes fractional budgets are of
    eager_peak_source: str
    tokens: int  # tokens of one worker's batch

    @property
    def model(self) -> str:
        return self.facts.get("model") or self.path.stem.removeprefix("step_")


def load(path: Path, eager_peak: int | None = None) -> Step:
    tg = load_step(path)
    facts = json.loads(path.with_suffix(".json").read_text())
    offline_costs(facts).annotate(tg)
    if eager_peak:
        base, source = eager_peak, "given"
    elif facts.get("eager_peak_allocated"):
        base, source = facts["eager_peak_allocated"], "eager_peak_allocated (export)"
    else:
        base, source = everything_kept(tg, ALIGNMENT)[1], "unplanned peak (no eager peak exported)"
    batch = [tg.values[i] for i in tg.batch_inputs] or [v for v in tg.values if v.kind is ValueKind.BATCH]
    tokens = math.prod(batch[0].shape) if batch else 1
    return Step(path, tg, facts, int(base), source, tokens)


def project(step: Step, topo: Topology, fraction: float, gpu_bytes: int, planner: str = "auto") -> dict:
    """One row: the three systems on ``topo`` at ``fraction`` of the step's eager peak per GPU."""
    started = time.perf_counter()
    budget = int(fraction * step.eager_peak)
    row = {"model": step.model, "nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node, "gpus": topo.workers,
           "budget": fraction, "budget_bytes": budget, "tokens_per_gpu_step": step.tokens}
    row.update(project_turnip(step.tg, step.facts, budget, topo, planner))
    row.update(project_ddp(step.tg, topo, step.eager_peak, gpu_bytes))
    row.update(project_fsdp2(step.tg, topo, step.eager_peak, gpu_bytes))
    row["ddp_fits_budget"] = row["ddp_peak_bytes"] <= budget
    row["fsdp2_fits_budget"] = row["fsdp2_peak_bytes"] <= budget
    for system in ("turnip", "ddp", "fsdp2"):
        seconds = row[f"{system}_s"]
        row[f"{system}_ms"] = seconds * 1e3 if seconds else None
        row[f"{system}_tokens_per_s"] = topo.workers * step.tokens / seconds if seconds else None
    row["seconds"] = time.perf_counter() - started
    log.info("%s %dx%d at %.0f%%: turnip %.1f ms (%s), DDP %s, FSDP2 %s", step.model, topo.nodes, topo.gpus_per_node,
             fraction * 100, row["turnip_ms"], row["turnip_plan"], _ms(row["ddp_ms"]), _ms(row["fsdp2_ms"]))
    return row


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def check(step: Step, gpu_bytes: int, link: Topology, planner: str = "auto") -> list[dict]:
    """The 1-node projections against MEASURED rows of the step's device and model: projected, measured, error."""
    device = step.facts.get("device_name")
    out = []
    cache: dict[tuple, dict] = {}
    for name, model, gpus, system, budget, ms, nvlink, host, source in MEASURED:
        if name != device or model != step.model:
            continue
        topo = dataclasses.replace(link, nodes=1, gpus_per_node=gpus, nvlink=nvlink * GB, host_links=host)
        fraction = budget if budget is not None else 0.5
        key = (gpus, fraction, host)
        if key not in cache:
            cache[key] = project(dataclasses.replace(step, eager_peak=GPT13B_EAGER_PEAK), topo, fraction, gpu_bytes,
                                 planner)
        projected = cache[key][f"{system}_ms"]
        out.append({"device": name, "model": model, "gpus": gpus, "system": system, "budget": budget,
                    "measured_ms": ms, "projected_ms": projected, "nvlink_GBps": nvlink, "host_links": host,
                    "error": projected / ms - 1 if projected else None, "source": source})
    return out


def grid(step: Step, nodes: Sequence[int], gpus_per_node: Sequence[int], fractions: Sequence[float], link: Topology,
         gpu_bytes: int, planner: str = "auto") -> list[dict]:
    return [project(step, dataclasses.replace(link, nodes=n, gpus_per_node=g), f, gpu_bytes, planner)
            for f in fractions for g in gpus_per_node for n in nodes]


def format_table(rows: list[dict]) -> str:
    lines = [(f"{'model':<8} {'nodes':>5} {'x':>2} {'GPUs':>5} {'budget':>6} {'turnip ms':>9} {'exposed':>7} "
              f"{'DDP ms':>8} {'FSDP2 ms':>8} {'turnip tok/s/GPU':>16} {'DDP tok/s/GPU':>13}")]
    for r in rows:
        ddp = "-" if r["ddp_ms"] is None else f"{r['ddp_ms']:.1f}" + ("" if r["ddp_fits_budget"] else "*")
        fsdp = "-" if r["fsdp2_ms"] is None else f"{r['fsdp2_ms']:.1f}" + ("" if r["fsdp2_fits_budget"] else "*")
        per_gpu = r["turnip_tokens_per_s"] / r["gpus"]
        ddp_tok = "-" if r["ddp_tokens_per_s"] is None else f"{r['ddp_tokens_per_s'] / r['gpus']:.0f}"
        lines.append(f"{r['model']:<8} {r['nodes']:>5} {r['gpus_per_node']:>2} {r['gpus']:>5} {r['budget']:>6.0%} "
                     f"{r['turnip_ms']:>9.1f} {r['turnip_exposed_comm_s'] * 1e3:>7.1f} {ddp:>8} {fsdp:>8} "
                     f"{per_gpu:>16.0f} {ddp_tok:>13}")
    lines.append("* its peak exceeds the per-GPU budget (it runs only on a GPU with room for its peak)")
    return "\n".join(lines)


def format_check(rows: list[dict]) -> str:
    lines = [f"{'device':<22} {'GPUs':>4} {'system':<7} {'budget':>6} {'measured':>9} {'projected':>9} {'error':>7}"]
    for r in rows:
        budget = "-" if r["budget"] is None else f"{r['budget']:.0%}"
        projected = "-" if r["projected_ms"] is None else f"{r['projected_ms']:.1f}"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(f"{r['device']:<22} {r['gpus']:>4} {r['system']:<7} {budget:>6} {r['measured_ms']:>9.1f} "
                     f"{projected:>9} {error:>7}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str = "") -> Path:
    """Step time and tokens/s per GPU against GPUs: one line per system, budget and GPUs per node."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"turnip": "tab:red", "ddp": "black", "fsdp2": "tab:blue"}
    styles = {0.25: ":", 0.5: "-"}
    for (fraction, per_node), group in _groups(rows).items():
        group = sorted(group, key=lambda r: r["gpus"])
        marker = "o" if per_node == 8 else "s"
        for system in ("turnip", "ddp", "fsdp2"):
            if system != "turnip" and fraction != min(styles):  # DDP and FSDP2 ignore the budget: draw them once
                continue
            points = [(r["gpus"], r[f"{system}_ms"], r[f"{system}_tokens_per_s"] / r["gpus"]) for r in group
                      if r[f"{system}_ms"]]
            if not points:
                continue
            label = f"{system} {fraction:.0%}" if system == "turnip" else f"{system} (full memory)"
            label += f", {per_node}/node"
            xs, ms, tok = zip(*points, strict=True)
            style = styles.get(fraction, "--") if system == "turnip" else "--"
            left.plot(xs, ms, style, marker=marker, color=colors[system], label=label, alpha=0.85)
            right.plot(xs, tok, style, marker=marker, color=colors[system], label=label, alpha=0.85)
    for ax, ylabel in ((left, "projected step ms"), (right, "projected tokens/s per GPU")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (nodes x GPUs per node)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    right.set_ylim(bottom=0)
    left.legend(fontsize=7)
    fig.suptitle(title or "scale on paper")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for row in rows:
        out.setdefault((row["budget"], row["gpus_per_node"]), []).append(row)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnip.bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", action="append", default=None, help="an exported step_<model>.step (repeatable; "
                        "default gpt1.3b and lora7b of bench/results/h200/steps)")
    parser.add_argument("--nodes", default="1,2,4,8,16")
    parser.add_argument("--gpus-per-node", default="4,8")
    parser.add_argument("--budgets", default="0.25,0.5", help="fractions of eager's peak per GPU")
    parser.add_argument("--eager-peak", type=int, default=None, help="bytes the budgets are fractions of (default: "
                        f"{GPT13B_EAGER_PEAK} for gpt1.3b, else the export's eager peak, else its unplanned peak)")
    parser.add_argument("--nic-gbps", type=float, default=400.0, help="bits/s of one NIC, each way, in Gb/s")
    parser.add_argument("--nics-per-node", type=int, default=8)
    parser.add_argument("--nic-latency-us", type=float, default=5.0)
    parser.add_argument("--nvlink-gbps", type=float, default=394 * 8, help="NVLink per GPU each way in Gb/s "
                        "(3152 = 394 GB/s, measured on the H100 hosts)")
    parser.add_argument("--nvlink-latency-us", type=float, default=2.0)
    parser.add_argument("--host-links", default=None, metavar="H2D,D2H,BOTH", help="a node's PCIe totals in bytes/s, "
                        "shared by its GPUs (default: each GPU keeps the export's link)")
    parser.add_argument("--compute-beside-messages", type=float, default=COMPUTE_BESIDE_MESSAGES)
    parser.add_argument("--gpu-gib", type=float, default=None, help="GPU memory for DDP/FSDP2's fit (default: 139 on "
                        "an H200 export, 79 on an H100's)")
    parser.add_argument("--planner", default="auto", help='"auto" (compile\'s candidates, the fastest simulated) or one planner, e.g. "greedy" (faster)')
    parser.add_argument("--no-check", action="store_true", help="skip the 1-node check against measured steps")
    parser.add_argument("--out", default=None, help="folder (default bench/results/analytic/scale)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    root = Path(__file__).resolve().parent / "results"
    steps = [Path(s) for s in args.step] if args.step else [root / "h200/steps/step_gpt1.3b.step",
                                                            root / "h200/steps/step_lora7b.step"]
    out = Path(args.out) if args.out else result_path("analytic/scale/x").parent
    out.mkdir(parents=True, exist_ok=True)
    host = tuple(None if x.strip() == "none" else float(x) for x in args.host_links.split(",")) if args.host_links else None
    link = Topology(nvlink=args.nvlink_gbps * 1e9 / 8, nvlink_latency=args.nvlink_latency_us * 1e-6,
                    nic=args.nics_per_node * args.nic_gbps * 1e9 / 8, nic_latency=args.nic_latency_us * 1e-6,
                    host_links=host, compute_beside_messages=args.compute_beside_messages)
    fractions = [float(x) for x in args.budgets.split(",") if x]
    for path in steps:
        facts = json.loads(path.with_suffix(".json").read_text())
        eager_peak = args.eager_peak or (GPT13B_EAGER_PEAK if facts.get("model") == "gpt1.3b" else None)
        step = load(path, eager_peak)
        gib = args.gpu_gib or (79.0 if "H100" in str(facts.get("device_name")) else 139.0)
        gpu_bytes = int(gib * 2**30)
        rows = grid(step, _ints(args.nodes), _ints(args.gpus_per_node), fractions, link, gpu_bytes, args.planner)
        checked = [] if args.no_check else check(step, gpu_bytes, link, args.planner)
        doc = {"benchmark": "scale", "step": str(path), **run_metadata(), "model": step.model,
               "step_device": facts.get("device_name"), "eager_peak": step.eager_peak,
               "eager_peak_source": step.eager_peak_source, "gpu_bytes": gpu_bytes,
               "link": dataclasses.asdict(link), "persistent_bytes": persistent_bytes(step.tg),
               "tokens_per_gpu_step": step.tokens, "rows": rows, "check": checked}
        target = out / f"scale_{step.model}.json"
        target.write_text(json.dumps(doc, indent=1, default=str))
        figure = plot(rows, out / f"scale_{step.model}.png",
                      f"{step.model}: projected on nodes of {args.gpus_per_node} GPUs, "
                      f"{args.nics_per_node} x {args.nic_gbps:g} Gb/s per node")
        print(f"{step.model} (budgets of {format_bytes(step.eager_peak)}, {step.eager_peak_source}; "
              f"gradients {format_bytes(persistent_bytes(step.tg)['grads'])} per step)")
        print(format_table(rows))
        if checked:
            print(format_check(checked))
        print(f"rows in {target}, plot in {figure}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
