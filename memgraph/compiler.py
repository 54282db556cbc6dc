"""memgraph.compile: trace -> plan -> build, the one call most users make."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from ..engine.host_memory import describe_host, pinnable_bytes
from ..engine.timing_sim import simulate
from ..ir.budget import Budget, format_bytes
from ..ir.errors import InfeasibleBudget
from ..ir.memgraph import MemGraph
from ..ir.optimizer import CompiledOptimizer
from ..ir.plan import Plan
from ..ir.taskgraph import TaskGraph
from ..planners.cache import CachedPlan, PlanCache, plan_key, taskgraph_digest
from ..planners.costs import default_costs
from ..planners.driver import check_options, plan_candidates, run_plan, smallest_budget
from ..planners.host_update import check_mode as check_host_update
from ..planners.host_update import fused_updates, host_update_candidates
from ..planners.measure import device_name
from ..planners.model import step_order
from ..trace.data_parallel import read_devices
from ..trace.passes import DONATE, run_passes
from ..trace.ranks import check_ranks, message_order, rank_slice
from ..trace.split_loss import split_loss_head
from ..trace.tracer import check_clipping, target_device, trace_step
from .builder import build, build_walks, prepare
from .heap import collect_young_only
from .keep_transfers import keep_transfers
from .per_device import per_device_plans
from .progress import Phases, stderr_is_terminal
from .ranks import (
    Ranks,
    agree,
    broadcast_weights,
    check_message_order,
    configuration,
    connect,
    measure_rank_bandwidth,
    read_process_group,
)
from .remake_offloaded import recompute_evicted
from .report import compile_report

UNBOUNDED = 1 << 62  # a budget nothing ever exceeds
GIB = 1 << 30

log = logging.getLogger(__name__)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


PHASES = ("tracing", "measuring op costs", "planning", "building")


def compile(model: torch.nn.Module, loss_fn, example_batch, optimizer: torch.optim.Optimizer | None = None,
            budget: float | str | None = None, device: str | torch.device | None = None,
            planner: str = "auto", cpu_budget: int | str | None = None, alignment: int | None = None,
            fused_optimizer: bool | None = None, max_grad_norm: float | None = None, norm_type: float = 2.0,
            accumulation_steps: int = 1, verbose: bool = True, cache: bool | str | os.PathLike = True,
            backward: bool = True, split: str | int = "auto", host_update: str = "off",
            devices: int | list | None = None, process_group=None, rank_bandwidth: float | None = None,
            weight_layout: str = "auto", **planner_options) -> MemGraph:
    """Compile one training step of `model` into a MemGraph that runs within `budget` GPU bytes.

    budget: how much GPU memory the step may use (ir/budget.py):
      - a fraction of the unplanned peak, the bytes the step takes with everything kept on the
        GPU: a float in (0, 1] (0.5) or a percentage string ("50%");
      - a size: a string with a unit ("6GiB", "512MiB", "1.5GB") or an int of bytes. An int below
        1 MiB is refused (budget=1 is a fraction written as an int, not one byte);
      - None: the unplanned peak (everything kept).
      Anything else raises turnip.ir.budget.BudgetError (a ValueError) saying what is accepted; a
      budget below what the step can run in raises InfeasibleBudget naming the smallest that works.
    planner: "auto" (the ILP, and on CUDA also the greedy plan, built both, keeping the one the
    timing simulator runs faster), "ilp", "greedy", or "none" (keep everything and let
    BuildMemGraph evict under pressure).
    cpu_budget: pinned CPU bytes the plan may use, in the same forms as budget (a fraction is of
    the GPU's unplanned peak); None: on CUDA, what this host can pin (engine/host_memory.py: its
    available memory less a reserve): a plan that pins more is planned again within that, and
    where that cannot help (cpu_budget given, or nothing planned) compile raises InfeasibleBudget
    (resource "cpu") before any step runs.
    alignment: byte alignment of arena places (default 256 on CUDA, 64 on the CPU).
    fused_optimizer: Adam/AdamW as one fused kernel per parameter (default on CUDA); off, the
    exact single-tensor torch.optim update (the CPU default, bitwise equal to eager).
    max_grad_norm, norm_type: clip the gradients before the update as
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm, norm_type) would; max_grad_norm is a
    positive finite number (anything else raises ValueError before tracing) or None.
    accumulation_steps: accumulate gradients over this many micro-batches per step, as eager's
    ``opt.zero_grad(); for b in micro: loss_fn(model, b).backward(); opt.step()`` (gradients
    summed in place in eager's order; clipping, if asked, applies to the accumulated gradient).
    example_batch is one micro-batch; engine.run(mg, [b1, ..., bk]) then takes a list or tuple
    of k batches like it and returns out["losses"] (the k losses of loss_fn, a tensor of shape
    (k,)) and out["loss"] (their sum l1 + ... + lk, added in order: the loss whose gradient the
    update applies; with the usual loss / k inside loss_fn, the mean loss). loss_fn is not
    changed. Memory is planned over the whole step, one micro-batch's activations at a time.
    backward: False compiles the forward alone (inference, long-sequence prefill): loss_fn is
    then any ``fn(model, batch)`` returning the outputs to keep, a tensor (engine.run's
    out["output"]), a tuple or list of tensors (out["output:0"], out["output:1"], ...) or a dict of
    str -> tensor (out["output:<key>"]); the weights are read-only (streamed from pinned memory when
    the budget needs it), nothing is differentiated or updated, and optimizer, max_grad_norm and
    accumulation_steps are refused. The outputs come back in pinned host memory on CUDA.
    split: "auto" (default), "off" or an int k >= 2: the loss head of a language model (its LM
    head matmul, log-softmax, NLL loss and their backward) runs as k blocks of rows
    (trace/split_loss.py), so no op holds all the logits and budgets below the unsplit step's
    smallest run. The loss sum, the total weight and the head's weight gradient then add block by
    block, in another order than eager's kernels: the step equals eager within float tolerance,
    not bitwise (tests/test_split.py). "auto" splits only a step the budget could not run
    otherwise (below its smallest budget), into the fewest blocks (2, 4, ..., 64) that fit, so a
    step that fits stays eager's bit for bit; mg.stats["loss_blocks"] says what was chosen. A step
    with no recognizable loss head is compiled unsplit.
    verbose: True (default) shows a progress bar over the phases "tracing", "measuring op
    costs", "planning" and "building", and prints the compile report (budget, unplanned peak,
    arena, tensors kept / offloaded / recomputed, bytes moved per step, predicted step time or
    "not predicted" on the CPU backend) to stderr at the end. Both appear only when stderr is a
    terminal, and the report is not printed when logging already shows INFO messages of this
    module. False shows neither. Either way the report is logged at INFO on the logger
    "turnip.memgraph.compiler" (memgraph.report.compile_report(mg) gives the same text, also for a
    loaded MemGraph); library messages go through `logging` only.
    cache: the plan cache (planners/cache.py). True (default): a plan is looked up before planning
    and stored after, as JSON in $TURNIP_CACHE_DIR/plans (default ~/.cache/turnip/plans), keyed by
    the traced step (structure, shapes, dtypes, op costs), the budgets in bytes, the device, the
    planner and its options; a second compile of the same step skips planning. A path: that
    folder. False: plan every time, store nothing.
    host_update: experimental. Which optimizer updates the host's cores run on the CPU homes of
    their parameters and states, the gradient copied to pinned memory (ZeRO-Offload's CPU step, per
    fused Adam/AdamW update: planners/host_update.py), when the budget is below the unplanned peak:
    "off" (default), "auto" (on CUDA with planner "auto": plans with and without, the simulator
    picks) or "all" (every fused update, its parameters and states homed on the CPU). Needs the
    fused optimizer (the CUDA default). Off by default because it changes the numbers: torch's CPU
    fused AdamW is not the CUDA kernel, and where sqrt(exp_avg_sq) is near eps the two differ by
    up to about lr; and because on the H100 it is slower so far (bench/results/2026-11-24_h100_near-whole-plan-host-updates.md).
    devices: run the step on this many devices of `device`'s kind (or a list of them: "cuda:0",
    "cuda:1", ...; `device="cpu", devices=3` gives three virtual CPU devices, each with its own arena
    and streams): data parallel, one forward and backward per device on its micro-batch
    (example_batch is one device's), as eager's accumulation over the devices' micro-batches with
    every gradient then divided by their count (DDP's averaging; trace/data_parallel.py). Each
    parameter's gradient is summed on the device that owns its update, the update and its optimizer
    states live there, and the other devices' replicas of the weight are refreshed from it by
    device-to-device copies, or, where a weight is read only through its autocast cast, it may keep
    no replica: the owner casts it and sends the cast (ZeRO-3's sharding, in the compute dtype);
    weight_layout says which. The budget is per device. engine.run(mg, batch) takes a list of one
    batch per device, or one batch with devices x the example's rows (split along dim 0);
    out["losses"] holds each device's loss and out["loss"] their mean. The planners see the devices as
    one device with N times the budget (plan_step says why that holds and what it misses), and beside
    that each device's share is planned on its own (memgraph/per_device.py); the simulator picks. Not yet:
    accumulation_steps > 1 with devices, and sharding the weights read outside autocast.
    process_group: the torch.distributed group of ranks (processes, each launched by torchrun with
    this same call) the step runs over; default: the initialized world group, if any (one rank:
    one process). Each rank runs `devices` devices on its own batch, as with DDP, and the step
    equals eager's accumulation over every rank's micro-batches in rank order with DDP's averaging
    (trace/ranks.py). Transfers between ranks are messages through the group (gloo on the CPU,
    NCCL on CUDA), run in one order every rank shares. Every rank must call compile alike (checked:
    the first difference is refused on every rank); rank 0's weights are broadcast first, as DDP
    does. mg.state_dict() then holds this rank's share (the parameters it owns); every rank calling
    memgraph.gather_state_dict(mg) / gather_optimizer_state_dict(mg) gives rank 0 the whole; each
    rank's mg.save(path) keeps its share, and memgraph.load(path) goes on from it once the loaded
    MemGraph's process_group is set (the group of the same ranks). On CUDA, each rank compiles for its own GPUs:
    device="cuda:<first>" (default: the current GPU, torchrun's LOCAL_RANK as users set it) and devices=G
    for G GPUs from there (a rank r of G GPUs each: device=f"cuda:{LOCAL_RANK * G}"); a rank's messages
    leave from and arrive on its first GPU (trace/ranks.py's WIRE_DEVICE).
    rank_bandwidth: bytes/s of a message between two ranks, for the planners and the simulator;
    default: measured between ranks 0 and 1 at compile on CUDA (memgraph/ranks.py), the spec's
    25 GB/s (a 200 Gb/s NIC) on the CPU. Not yet: random ops (dropout).
    weight_layout: on several devices (or ranks), where the weights live between their uses:
    "replicas" (a copy of every weight on every device, refreshed after its update), "casts" (a
    weight read only through its autocast cast lives on its owner; the cast travels), or "auto"
    (default): replicas where the step fits its budget whole, and below that both layouts planned
    and built, the simulator keeping the faster (fastest_layout): the casts first, then the
    replicas from greedy plans, planned in full only where those come within PLANNER_GAIN_AT_MOST
    of the casts. mg.stats["weight_layouts_simulated_s"] gives the simulated steps of the layouts
    planned, ["weight_layouts_screened_s"] the greedy ones of a layout left there. A step without
    autocast casts of trained weights has replicas only.
    planner_options: passed to turnip.planners.plan (see its docstring): time_limit (seconds
    the ILP solver may run; default None, scaled to the problem: planners/driver.py's
    ilp_time_limit, 0.25 ms per binary variable, 15 ms with op costs measured on the GPU, within
    0.5-10 s; the ILP starts from the greedy plan and returns it when it finds nothing better in
    time), headroom, windows, gap, depth, reload_room (experimental, default False: count a planned
    reload's bytes from its prefetch window, not from its use),
    max_candidates, max_chain, max_items, order, solver, threads, msg, tie_blocks; and costs, a
    planners.costs.CostModel (default: measured on a present CUDA device, analytic otherwise).
    """
    gpu_limit = Budget.read(budget)  # read once, here: a budget that cannot be read fails before tracing
    check_clipping(max_grad_norm)
    check_host_update(host_update)
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout must be one of {', '.join(map(repr, WEIGHT_LAYOUTS))}, not {weight_layout!r}")
    cpu_limit = Budget.read(cpu_budget, what="cpu_budget") if cpu_budget is not None else None
    store = PlanCache.open(cache)
    if planner != "none":  # so are unknown planners and options (a cached plan would not see them)
        check_options(planner, **{k: v for k, v in planner_options.items() if k != "costs"})
        if "replay_receives" in planner_options:  # over ranks a replayed receive would wait for a send never made
            raise TypeError("replay_receives is not a compile option: compile sets it where a receive can run "
                            "again (each device's share of a step of one process)")
    device = target_device(device or default_device())
    ranks = read_process_group(process_group, device)
    if ranks is not None and device.type == "cuda" and device.index is None:
        # torchrun's ranks each set their own (first) GPU current
        device = torch.device("cuda", torch.cuda.current_device())
    device_count = read_devices(device, devices)
    if ranks is not None:
        agree(ranks, configuration(model, example_batch, optimizer, device, device_count, budget, {
            "planner": planner, "split": split, "max_grad_norm": max_grad_norm, "host_update": host_update,
            "accumulation_steps": accumulation_steps, "fused_optimizer": fused_optimizer, "backward": backward,
            "weight_layout": weight_layout,
            **{k: v for k, v in planner_options.items() if k != "costs"}}), device)
        broadcast_weights(model, ranks, device)
        connect(ranks, device)
    measure_costs = planner != "none" or device_count > 1  # several devices: the simulator picks the build
    alignment = alignment or (256 if device.type == "cuda" else 64)
    started = time.perf_counter()
    with collect_young_only(), Phases(list(PHASES), enabled=verbose) as progress:
        with progress.phase("tracing"):
            loss_blocks = split_blocks(split)
            step = trace_step(model, loss_fn, example_batch, optimizer=optimizer, device=device,
                              fused_optimizer=fused_optimizer, max_grad_norm=max_grad_norm, norm_type=norm_type,
                              accumulation_steps=accumulation_steps, backward=backward,
                              loss_blocks=loss_blocks, donate=split != "auto",
                              devices=device_count * (ranks.count if ranks else 1))

            def finished(casts_travel: bool = False) -> TaskGraph:
                return this_rank(step.finished(casts_travel), ranks, device)

            tg = finished()
            traced = None
            if split == "auto":  # kept as traced: its loss head is split if the budget needs it
                traced, tg = tg, donated(tg)
            if host_update != "off" and not fused_updates(tg):
                raise ValueError(f"host_update={host_update!r} runs fused Adam/AdamW updates on the host, and this "
                                 f"step has none ({_optimizer_name(optimizer)}): compile with "
                                 f"fused_optimizer=True and Adam or AdamW, or host_update='off'")
        costs = planner_options.pop("costs", None)
        if measure_costs:  # op times and workspace first: the unplanned peak includes workspace
            with progress.phase("measuring op costs"):
                if ranks is not None and rank_bandwidth is None and device.type == "cuda":
                    rank_bandwidth = measure_rank_bandwidth(ranks, device)
                costs = costs if costs is not None else default_costs(tg, rank_bandwidth)
                costs.annotate(tg)
        else:
            progress.skip("measuring op costs")
        with progress.phase("planning"):
            keep_all, peak = everything_kept(tg, alignment)
            gpu_budget = gpu_limit.bytes(peak)
            cpu_bytes = cpu_limit.bytes(peak) if cpu_limit is not None else None
            log.debug("traced %d vertices in %.1fs; unplanned peak %s, budget %s", len(tg.vertices),
                      time.perf_counter() - started, format_bytes(peak), format_bytes(gpu_budget))
            if traced is not None and planner != "none" and tg.devices * tg.ranks == 1 and \
                    gpu_budget < smallest_budget(tg, alignment):
                tg, loss_blocks = split_to_fit(traced, tg, gpu_budget, alignment, costs, progress)
            elif traced is not None and not backward and gpu_limit.size is not None:
                whole = undonated_if_it_fits(traced, gpu_budget, alignment, costs)
                if whole is not None:
                    tg, keep_all, peak = whole
            layouts = [Layout(tg, keep_all, peak, casts_travel=False)]
            if tg.devices * tg.ranks > 1 and planner != "none" and weight_layout != "replicas":
                casts = (weight_layout == "casts" or gpu_budget < peak) and step.casts_weights()
                if ranks is not None:  # the step every rank slices must be one: any rank's need decides
                    casts = any(ranks.exchange(casts, device))
                if casts:
                    progress.describe("planning", "placing again: the weights' casts travel, not the weights")
                    travelling = finished(casts_travel=True)
                    if split == "auto":
                        travelling = donated(travelling)
                    costs.annotate(travelling)
                    layout = Layout(travelling, *everything_kept(travelling, alignment), casts_travel=True)
                    layouts = [layout] if weight_layout == "casts" else [*layouts, layout]
                    log.info("budget %s is below the unplanned peak %s on %d devices: %s", format_bytes(gpu_budget),
                             format_bytes(peak), tg.devices * tg.ranks,
                             "the weights' autocast casts made on their owners and sent, in place of replicas"
                             if weight_layout == "casts" else "both layouts of the weights planned, the simulator "
                             "picks (replicas on every device, or casts made on their owners and sent)")

            def plans_by(tg: TaskGraph, method: str, **kwargs) -> list[Plan]:
                """plan_step for this compile (its budgets, device, costs, options), by ``method``."""
                return plan_step(tg, gpu_budget, cpu_bytes, method, device, costs, alignment, progress,
                                 planner_options, host_update, **kwargs)

            def key_for(layout: Layout, cpu_bytes: int | None) -> str:
                return plan_key(layout.tg, gpu_budget, cpu_bytes, device=str(device), planner=planner,
                                options={**planner_options, **host_update_facts(host_update, costs)},
                                alignment=alignment, costs=costs)

            screening = len(layouts) > 1 and ranks is None and planner in ("auto", "ilp")
            if screening:  # below the peak the casts win most often: planned first, in full (fastest_layout)
                layouts.sort(key=lambda layout: not layout.casts_travel)
            for index, layout in enumerate(layouts):
                if len(layouts) > 1:
                    progress.describe("planning", f"{layout.name}: {_planning_detail(planner, planner_options)}")
                if layout.peak <= gpu_budget:
                    continue
                if planner != "none" and store is not None:
                    layout.key = key_for(layout, cpu_bytes)
                    layout.hit = store.load(layout.key, layout.tg, gpu_budget, cpu_bytes)
                if layout.hit is not None:
                    progress.describe("planning", "cached plan")
                elif screening and index > 0:
                    layout.deferred = True  # planned in full only if its greedy plans come near (fastest_layout)
                else:
                    if len(layouts) == 1:
                        progress.describe("planning", _planning_detail(planner, planner_options))
                    layout.candidates = plans_by(layout.tg, planner,
                                                 planned=layout.built_ahead(alignment, costs, device.type))

        def stored(mg: MemGraph, layout: Layout, cpu_bytes: int | None) -> MemGraph:
            if planner != "none":
                mg.stats["plan_cache"] = "off" if layout.key is None else "miss"
            if layout.key is not None:
                store.store(layout.key, CachedPlan(mg.plan, mg.stats["build_walk"], mg.stats.get("simulated_step_s")),
                            about={"device": str(device), "device_name": device_name(str(device)),
                                   "planner": planner, "gpu_budget": gpu_budget, "cpu_budget": cpu_bytes,
                                   "vertices": len(layout.tg.vertices)})
            return mg

        def built_of(layout: Layout, candidates: list[Plan], method: str) -> MemGraph:
            """The MemGraph of a layout's candidate plans, planned again by ``method`` for less where
            a device's share does not fit (built_on_every_device)."""
            tg = layout.tg

            def built(plans: list[Plan]) -> tuple[MemGraph, InfeasibleBudget | None]:
                mg, walk, short = build_candidates(tg, plans, alignment, costs, device.type,
                                                   compact_walks(gpu_budget, layout.peak), layout.ahead)
                mg.stats["build_walk"] = walk
                return mg, short

            def replanned(scale: float) -> list[Plan]:
                progress.describe("building", "planning again for less: a device's share did not fit")
                return plans_by(tg, method, scale=scale)

            faster = functools.partial(faster_simulated, costs=costs, backend=device.type)
            return built_on_every_device(candidates, built, replanned, gpu_budget, tg.devices, faster)

        def screened_layout(layout: Layout) -> MemGraph:
            """A deferred layout's greedy plans built: what fastest_layout weighs it by first. Cached
            under the layout's key (a full plan replaces it if the layout is planned further), so a
            compile that finds it decides alike without planning the layout again."""
            progress.describe("building", f"{layout.name}: greedy plans first")
            return stored(built_of(layout, plans_by(layout.tg, "greedy"), "greedy"), layout, cpu_bytes)

        def built_layout(layout: Layout) -> MemGraph:
            """The MemGraph of one layout's plans (or its cached plan, or everything kept)."""
            tg = layout.tg
            if layout.deferred:
                progress.describe("building", f"{layout.name}: {_planning_detail(planner, planner_options)}")
                layout.candidates = plans_by(tg, planner)
                layout.deferred = False
            mg = build_cached(tg, layout.hit, alignment) if layout.hit is not None else None
            if layout.hit is not None and mg is None:  # the cached plan did not build: plan afresh, overwrite it
                layout.candidates = plans_by(tg, planner)
            if mg is not None:
                mg.stats["plan_cache"] = "hit"
                return mg
            if layout.candidates is None:  # everything fits: nothing to plan
                if host_update != "off":
                    log.info("the step fits its budget: every update stays on the GPU (host_update=%r applies "
                             "below the unplanned peak)", host_update)
                return keep_everything(tg, layout.keep_all, gpu_budget, cpu_bytes, alignment, costs, device.type)

            return stored(built_of(layout, layout.candidates, planner), layout, cpu_bytes)

        with progress.phase("building"):
            layout, mg = fastest_layout(layouts, built_layout, costs, device.type, ranks, device,
                                        screened_layout if screening else None)
            tg, peak = layout.tg, layout.peak
            # pinned memory is page-locked: a plan that pins more than the host has is planned again
            # within it (or refused) here, not found out when the engine pins it
            host_cpu_bytes = within_host(mg.cpu_bytes, pinnable_bytes() if device.type == "cuda" else None,
                                         cpu_budget, replannable=layout.candidates is not None or layout.hit is not None)
            if host_cpu_bytes is not None:
                cpu_bytes = host_cpu_bytes
                log.warning("the plan pins %s of host memory; %s: planning again within %s",
                            format_bytes(mg.cpu_bytes), describe_host(), format_bytes(cpu_bytes))
                progress.describe("building", "planning again within the host's memory")
                layout.key = key_for(layout, cpu_bytes) if layout.key else None
                layout.hit = None
                try:
                    layout.candidates = plans_by(tg, planner)
                    mg = built_layout(layout)
                except InfeasibleBudget as exc:
                    raise InfeasibleBudget(f"{exc} ({describe_host()}; a larger GPU budget needs less of it)",
                                           minimum=exc.minimum, vertex=exc.vertex, resource=exc.resource) from None
                mg.stats["cpu_budget_source"] = "host memory"
            # engine.run follows its hyperparameters (LR schedulers); its state exports to eager
            mg.optimizer = CompiledOptimizer(mg, optimizer) if optimizer is not None else None
            if ranks is not None:
                check_message_order(mg)
                mg.process_group = ranks.group
            mg.initial_state = dict(tg.initial_state)
            mg.names = dict(tg.state_names)
            mg.device = str(device)
            mg.stats["unplanned_peak"] = peak
            if tg.devices * tg.ranks > 1:
                mg.stats["weight_layout"] = layout.name
            mg.stats["loss_blocks"] = loss_blocks or 1
            mg.stats["compile_seconds"] = time.perf_counter() - started
            phases = dict(progress.seconds)  # building, still running, is the rest
            mg.stats["compile_phase_seconds"] = {**phases, "building": mg.stats["compile_seconds"] - sum(phases.values())}
            record_prediction(mg, costs, device)
    report = compile_report(mg)
    log.info("%s", report)
    if report_printed(verbose):
        print(report, file=sys.stderr)
    return mg


def this_rank(tg: TaskGraph, ranks: Ranks | None, device: torch.device) -> TaskGraph:
    """The step every rank traced, checked to be one, and this rank's share of it (trace/ranks.py);
    on one process, the step."""
    if ranks is None:
        return tg
    check_ranks(tg, ranks.count)
    agree(ranks, {"traced step": taskgraph_digest(tg)}, device, what="the steps they traced")
    # the updates right after their gradients (the planners' order); the weights they send to other ranks last
    return rank_slice(tg, ranks.rank, ranks.count, order=message_order(tg, step_order(tg), ranks.count))


def undonated_if_it_fits(traced: TaskGraph, gpu_budget: int, alignment: int, costs) -> tuple | None:
    """(graph, keep-everything MemGraph, unplanned peak) of a forward-only step without buffer
    donation when it fits ``gpu_budget`` whole, else None.

    Donation buys memory with kernel time: an elementwise kernel writing over an input it reads
    through other strides or a broadcast (Llama's rotary products, RMSNorm's weight) ran 9-13%
    slower than into a fresh buffer on the H100, 11 ms of a 32K-token 7B prefill (the kernel
    profiles of bench/results/h100/prefill_s15.json and prefill_s16.json, turnip beside eager).
    A step whose budget holds it whole without donation needs none of that memory. Training steps
    stay donated: at eager's peak their donated loss head is what fits."""
    if costs is not None:
        costs.annotate(traced)
    keep_all, peak = everything_kept(traced, alignment)
    if peak > gpu_budget:
        return None
    log.info("the forward-only step fits %s without buffer donation (%s with everything kept): not donated",
             format_bytes(gpu_budget), format_bytes(peak))
    return traced, keep_all, peak


def split_blocks(split) -> int | None:
    """compile's split= as trace's loss_blocks: None for "off" and "auto" (which traces unsplit
    first), else the number of row blocks."""
    if split in ("off", "auto"):
        return None
    if isinstance(split, bool) or not isinstance(split, int) or split < 2:
        raise ValueError(f"split must be \"auto\", \"off\" or an int >= 2 (row blocks of the loss head), "
                         f"not {split!r}")
    return split


MAX_LOSS_BLOCKS = 64


def donated(traced: TaskGraph) -> TaskGraph:
    """A copy of a graph traced with donate=False, with buffer donation applied (trace/donate.py
    rewrites vertices in place; the traced graph is kept as it is)."""
    tg = dataclasses.replace(traced, vertices=[dataclasses.replace(v) for v in traced.vertices],
                             values=[dataclasses.replace(v) for v in traced.values])
    return run_passes(tg, [DONATE])


def split_to_fit(traced: TaskGraph, tg: TaskGraph, gpu_budget: int, alignment: int, costs, progress) -> tuple:
    """(graph, blocks): ``traced`` with its loss head in the fewest blocks (2, 4, ...,
    MAX_LOSS_BLOCKS) whose smallest budget fits ``gpu_budget``, donated; the most blocks tried when
    none fits (planning then says how small the step can go); ``tg`` itself when ``traced`` has no
    loss head. Splitting rewrites the traced graph: no second trace."""
    best, blocks = tg, None
    k = 2
    while k <= MAX_LOSS_BLOCKS:
        progress.describe("planning", f"splitting the loss head into {k} row blocks")
        split_graph = split_loss_head(traced, k)
        if split_graph is traced:  # no loss head: splitting cannot help
            break
        candidate = donated(split_graph)
        if costs is not None:
            costs.annotate(candidate)
        best, blocks = candidate, k
        if gpu_budget >= smallest_budget(candidate, alignment):
            break
        k *= 2
    if blocks:
        log.info("the budget %s is below the unsplit step's smallest (%s): its loss head runs in %d row blocks "
                 "(smallest budget now %s)", format_bytes(gpu_budget), format_bytes(smallest_budget(tg, alignment)),
                 blocks, format_bytes(smallest_budget(best, alignment)))
    return best, blocks


def within_host(needed: int, limit: int | None, cpu_budget, replannable: bool) -> int | None:
    """None when a plan pinning ``needed`` bytes fits this host's pinnable memory ``limit`` (None:
    unknown, or not a CUDA plan); else the CPU budget to plan again within (``limit`` in whole GiB,
    so the plan cache finds the plan again). Raises InfeasibleBudget when planning again cannot
    help: the user fixed cpu_budget, or nothing was planned (everything kept on the GPU)."""
    if limit is None or needed <= limit:
        return None
    if cpu_budget is None and replannable and limit >= GIB:
        return limit // GIB * GIB
    given = "" if cpu_budget is None else f" within cpu_budget={cpu_budget!r}"
    raise InfeasibleBudget(f"the plan needs {format_bytes(needed)} ({needed} bytes) of pinned host memory{given}, "
                           f"more than {describe_host()}: give a smaller cpu_budget (the planner then keeps "
                           f"or recomputes more on the GPU), a larger GPU budget, or free host memory",
                           minimum=needed, resource="cpu")


def report_printed(verbose: bool) -> bool:
    """Whether compile(verbose=verbose) prints its report on stderr: on a terminal, when logging
    does not already show this module's INFO messages (callers that print it themselves, like
    the demo, ask here to print it once)."""
    return verbose and stderr_is_terminal() and not log.isEnabledFor(logging.INFO)


def _optimizer_name(optimizer) -> str:
    if optimizer is None:
        return "no optimizer"
    return f"{type(optimizer).__name__}, fused={optimizer.defaults.get('fused')}"


def host_update_facts(host_update: str, costs) -> dict:
    """What of host_update the plan cache keys on: the mode, and where the simulator may pick host
    updates, the host's rate it prices them at."""
    if host_update == "off" or costs is None:
        return {"host_update": host_update}
    return {"host_update": host_update, "host_update_rate": float(costs.host_update_rate)}


def _planning_detail(planner: str, options: dict) -> str:
    if planner in ("auto", "ilp"):
        limit = options.get("time_limit")
        return f"ILP, up to {limit:g} s" if limit is not None else "greedy, then the ILP"
    return "greedy" if planner == "greedy" else ""


def plan_step(tg, gpu_budget: int, cpu_bytes: int | None, planner: str, device: torch.device, costs, alignment: int,
              progress: Phases, options: dict, host_update: str = "off", scale: float = 1.0,
              planned=None) -> list[Plan]:
    """The plans to build: on CUDA with planner "auto" every candidate (the simulator picks), each
    also with its updates on the host (host_update "auto"), else the one plan (host_update "all":
    with every update on the host). The progress bar names what the planner does (greedy, the
    ILP's time limit).

    A step on several devices is planned, for now, as if one device held all of them with N times
    the budget (less the fullest device's excess of persistent bytes, home_imbalance, on each), and
    beside that with each device's share planned on its own budget (per_device_candidates). The
    devices' copies of the step are alike and run side by side, so each window of
    the serial order holds about N times one device's compute, bytes and transfers, and the window's
    time (its busiest resource), and so the plan that minimises it, scale alike; the builder then
    holds each device to its own budget, evicting where a device's share of the plan does not fit.
    Not modelled yet: each device's link against the host's total, device-to-device transfers, the
    owners' unequal shares; and a weight homed on the host is stored once per replica. scale: plan
    for that fraction of the budget (built_on_every_device's second try). planned: given each
    planning problem's plans as soon as they are made (planners.driver.plan_candidates)."""
    def describe(detail: str) -> None:
        progress.describe("planning", detail)

    plan_budget = int(planning_budget(tg, gpu_budget) * scale)
    every_candidate = planner == "auto" and device.type == "cuda"
    if every_candidate:
        plans = plan_candidates(tg, plan_budget, cpu_bytes, costs=costs, alignment=alignment, describe=describe,
                                planned=planned, **options)
    else:
        plans = [make_plan(tg, plan_budget, cpu_bytes, planner, costs=costs, alignment=alignment, describe=describe,
                           **options)]
    if planner != "none" and tg.devices > 1:
        describe("each device's share on its own")
        plans += per_device_candidates(tg, int(gpu_budget * scale), cpu_bytes, costs, alignment, options,
                                       "auto" if every_candidate else "greedy")
    plans = host_update_candidates(tg, plans, host_update if every_candidate else
                                   "all" if host_update == "all" else "off")
    return [dataclasses.replace(plan, gpu_budget=gpu_budget) if tg.devices > 1 else plan for plan in plans]


def per_device_candidates(tg, gpu_budget: int, cpu_bytes: int | None, costs, alignment: int, options: dict,
                          method: str = "greedy") -> list[Plan]:
    """The plans of each device's share planned on its own budget by ``method`` (memgraph/per_device.py),
    as candidates beside the planned-as-one ones, where there are any."""
    try:
        return per_device_plans(tg, gpu_budget, cpu_bytes, costs, alignment, method, **options)
    except InfeasibleBudget as short:  # the planned-as-one candidates stand, and the builder says what fits
        log.info("a device's share has no plan in %s: no per-device candidate (%s)", format_bytes(gpu_budget), short)
        return []


def planning_budget(tg, gpu_budget: int) -> int:
    """The budget the planners plan a step for: ``gpu_budget`` on one device; on N devices, planned as
    one (plan_step), N times it less each device's share of the fullest device's excess."""
    return gpu_budget * tg.devices - tg.devices * home_imbalance(tg)


WEIGHT_LAYOUTS = ("auto", "replicas", "casts")


@dataclass
class Layout:
    """One placement of a step over several devices, planned and built beside the others
    (compile's weight_layout): the TaskGraph, its everything-kept MemGraph and peak, and what
    planning found for it (the plan cache's key and hit, or the candidate plans)."""

    tg: TaskGraph
    keep_all: MemGraph
    peak: int
    casts_travel: bool  # each weight's autocast cast made on its owner and sent (trace/data_parallel.py)
    key: str | None = None
    hit: object | None = None
    candidates: list[Plan] | None = None
    deferred: bool = False  # planned only when built: after the layouts before it, if its greedy plans come near
    # id of a candidate plan -> its allocate-ahead walk, built while the other planning problem solved
    ahead: dict[int, tuple[object, MemGraph]] = dataclasses.field(default_factory=dict)

    def built_ahead(self, alignment: int, costs, backend: str):
        """What plan_step calls with each planning problem's plans as soon as they are made: on CUDA
        with one device, their allocate-ahead walks built and simulated then, on the planning thread,
        while the other problem's ILP solves (HiGHS releases the GIL), not after it. A plan that does
        not build is left to built_walks, which builds it again and says why."""
        if backend != "cuda" or self.tg.devices > 1:  # on several devices plan_step makes new plans
            return None

        def build_now(plans: list[Plan]) -> None:
            for plan in plans:
                try:
                    ready, mg = ahead_walk(self.tg, plan, alignment)
                except InfeasibleBudget:
                    continue
                simulated_step(mg, costs, backend)
                self.ahead[id(plan)] = (ready, mg)

        return build_now

    @property
    def name(self) -> str:
        return "casts" if self.casts_travel else "replicas"


# The planner's plans beat greedy's by at most this in the simulator on the steps measured: gpt1.3b on
# two H200s, casts at 25% 11% (235.6 against 265.2 ms) and 4%, replicas at 50% 8% and at 25% 0.2%
# (bench/results/h200x2/s17/call1, call2). A layout whose greedy plans simulate slower than the
# fastest layout built so far by more is not planned further: on those H200s at 25% and 20% the
# replicas lost by 40% and took 36 of the compile's 65 s.
PLANNER_GAIN_AT_MOST = 0.15


def fastest_layout(layouts: list[Layout], built_layout, costs, backend: str, ranks=None, device=None,
                   screened_layout=None) -> tuple[Layout, MemGraph]:
    """The layout whose MemGraph (``built_layout(layout)``) the simulator runs faster, and that
    MemGraph; over several ranks, the layout whose slowest rank is fastest, so every rank takes the
    same. Neither layout wins everywhere: gpt1.3b on two H200s (op costs measured there, simulated)
    ran 179.6 ms with the casts travelling against 199.1 with replicas at 50% of eager's peak, and
    the 4-GPU H100 host measured the replicas faster at 69% of the unplanned peak (252.6 against
    300.9 ms, bench/results/2026-11-28_h100x4_casts-travel.md). A layout none of whose plans fits
    a device gives way to the others; where every one fails, the first one's refusal is raised.

    screened_layout: given, a layout marked ``deferred`` is first built from its greedy plans
    (``screened_layout(layout)``) and planned in full (``built_layout``) only if that simulates
    within PLANNER_GAIN_AT_MOST of the fastest layout built before it; mg.stats
    ["weight_layouts_screened_s"] gives the greedy times of the layouts left there."""
    if len(layouts) == 1:
        return layouts[0], built_layout(layouts[0])
    built, refusals, screened = [], [], {}
    for layout in layouts:
        if screened_layout is not None and layout.deferred and built:
            fastest = min(simulated_step(mg, costs, backend) for _, mg in built)
            try:
                rough = simulated_step(screened_layout(layout), costs, backend)
            except InfeasibleBudget:  # the greedy plans do not build: the planner's may
                rough = None
            if rough is not None and rough > fastest * (1 + PLANNER_GAIN_AT_MOST):
                log.info("the %s layout's greedy plans simulate %.1f ms against %.1f: not planned further",
                         layout.name, rough * 1e3, fastest * 1e3)
                screened[layout.name] = rough
                continue
        try:
            built.append((layout, built_layout(layout)))
        except InfeasibleBudget as exc:
            log.info("the %s layout does not fit: %s", layout.name, exc)
            refusals.append(exc)
    times = {layout.name: simulated_step(mg, costs, backend) for layout, mg in built}
    if ranks is not None:  # every rank's times, in layout order (math.inf: that rank could not build it)
        every = ranks.exchange([times.get(layout.name, math.inf) for layout in layouts], device)
        times = {layout.name: max(column) for layout, column in zip(layouts, zip(*every)) if layout.name in times}
    if not built or min(times.values()) == math.inf:
        raise refusals[0]
    layout, mg = min(built, key=lambda pair: times[pair[0].name])
    mg.stats["weight_layouts_simulated_s"] = times
    if screened:
        mg.stats["weight_layouts_screened_s"] = screened
    log.info("weights: %s (simulated %s)", layout.name, ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in times.items()))
    return layout, mg


MULTI_DEVICE_PLANS = 4  # plans built_on_every_device tries before it gives the builder's refusal
# each plan made again is for at most this fraction of the last one's budget: the greedy planner's
# steps are coarse, so a plan for 99% of the budget is often the same plan (gpt1.3b on two H100s at
# 25%: a device 0.4% short, the plans for 100% and 99% alike, the one for 90% built)
REPLAN_AT_MOST = 0.95


def built_on_every_device(candidates: list[Plan], build_plans, replan, gpu_budget: int, devices: int,
                          faster=None):
    """What ``build_plans(candidates)`` built (it returns that and the refusal of a candidate the
    planner predicted faster than what built, or None: build_candidates); on several devices, where no candidate builds because one device's
    share of a plan made for all of them as one (plan_step) does not fit its budget, the plans made
    again for less, in proportion to what the builder found that device needs and by at least
    1 - REPLAN_AT_MOST (``replan(scale)``), up to MULTI_DEVICE_PLANS plans in all. gpt1.3b on two
    and on four H100s at 25% of eager's peak: the greedy plan left a device 0.3 and 1 GiB short at
    the loss head's upcast.

    Given ``faster(a, b)``, where some candidates build but one the planner predicted faster than
    them did not, the plans are made again for less too, and ``faster`` keeps the better build. gpt1.3b on two H200s at 20%: the plan
    that built simulated 728 ms, the planner's favourite made again for 95% 432 (measured 430)."""
    scale, best, short = 1.0, None, None
    for attempt in range(MULTI_DEVICE_PLANS):
        try:
            result, favourite_short = build_plans(candidates)
        except InfeasibleBudget as exc:
            if best is None and (devices == 1 or not exc.minimum or exc.minimum <= gpu_budget
                                 or attempt == MULTI_DEVICE_PLANS - 1):
                raise
            short = exc
        else:
            best = result if best is None else faster(best, result)
            short = favourite_short if faster is not None and devices > 1 else None
        if short is None or not short.minimum or short.minimum <= gpu_budget or attempt == MULTI_DEVICE_PLANS - 1:
            return best
        scale *= min(gpu_budget / short.minimum, REPLAN_AT_MOST)
        log.info("a device's share of the plan needs %s of its %s budget; planning for %.0f%% of it",
                 format_bytes(short.minimum), format_bytes(gpu_budget), 100 * scale)
        candidates = replan(scale)
    return best


def simulated_step(mg: MemGraph, costs, backend: str) -> float:
    """mg's simulated step in seconds: the one already known, else simulated now and kept."""
    if "simulated_step_s" not in mg.stats:
        mg.stats["simulated_step_s"] = simulate(mg, costs, backend=backend).step_time
    return mg.stats["simulated_step_s"]


def faster_simulated(a: MemGraph, b: MemGraph, costs, backend: str) -> MemGraph:
    """The one of two built MemGraphs the simulator runs faster (simulated now where no time is known)."""
    return b if simulated_step(b, costs, backend) < simulated_step(a, costs, backend) else a


def favourite_refused(refused: list[tuple[Plan, InfeasibleBudget]], built: list[Plan]) -> InfeasibleBudget | None:
    """Of the candidates that left a device short (``refused``: plan and the builder's refusal), the
    refusal needing the most among those the planner predicted faster than every plan that built:
    worth planning again for less (built_on_every_device); None where there is none."""
    predicted = min((plan.predicted_time for plan in built if plan.predicted_time is not None), default=math.inf)
    return max((exc for plan, exc in refused if exc.minimum and plan.predicted_time is not None
                and plan.predicted_time < predicted), key=lambda exc: exc.minimum, default=None)


def home_imbalance(tg) -> int:
    """Bytes of persistent values the fullest device holds beyond the devices' mean (owners' shares of
    the optimizer states differ): the budget one plan for all devices leaves that device short of."""
    if tg.devices == 1:
        return 0
    held = [0] * tg.devices
    for v in tg.values:
        if v.kind.is_persistent:
            held[v.device] += v.nbytes
    return max(held) - sum(held) // tg.devices


# the compact walk is built only for this many plans, those whose allocate-ahead walk simulates
# fastest: over 47 replan tables (H100 exports of gpt350m, gpt1.3b and a Llama at 60/50/25/10%,
# bench/results/h100/replan_blocks/), the fastest candidate of these was at most 1.6% slower in the
# simulator than the fastest of both walks of every plan, and the same in 41 of them (one, 2.2%
# slower at worst, with the compact walk of the fastest plan alone); the compact walk wins mostly
# near the peak (gpt350m at 50-60%). A 7B LoRA step at 20% builds 6 MemGraphs instead of 8.
COMPACT_FOR = 2
# ... and only at budgets of at least this share of the unplanned peak: in the 101 replan tables
# where both walks were built (bench/results/h100/replan_blocks/, analytic/s1*), the compact walk
# ran fastest only at 52-62% (15 of 20 tables there); in the 56 below 40% its best was 4.2-20%
# slower than the allocate-ahead walk's, in the 25 at 40-51% 1-7% slower. Below it, a compile
# builds and simulates two MemGraphs fewer: gpt1.3b at the suite's 50% (51% of its unplanned peak)
# 0.4-0.6 s of a 10 s compile on the H200, whose compact walks simulated 25-44% slower there.
COMPACT_ABOVE = 0.52
# The candidates that simulate within this factor of the fastest are amended too (amended_if_faster),
# not only the fastest. A plan that just fits the planner's model can make the builder evict a large
# value where it is read again at once: on the H200 export of a Llama at 60% (bench/results/h200/s20),
# the greedy plan of the whole budget evicted the loss head's 500 MiB log-softmax and simulated at
# 208.6 ms, 4.6% behind the ILP's 199.4; with that eviction recomputed, 194.8, and the filing code's
# plan ran 191.3-191.6 ms. Each amended runner-up costs a build and a simulation.
AMEND_WITHIN = 1.05


def compact_walks(budget: int, peak: int) -> int:
    """How many plans the compact walk is built for at this budget (bytes per device) and unplanned
    peak: COMPACT_FOR, or none below COMPACT_ABOVE of the peak."""
    return COMPACT_FOR if budget >= COMPACT_ABOVE * peak else 0


@dataclass
class Built:
    """A candidate plan built by one walk of the builder."""
    index: int  # the plan's place among the candidates
    plan: Plan
    walk: str | None  # "ahead", "compact"; None where build chose by itself
    mg: MemGraph


def ahead_walk(tg, plan: Plan, alignment: int):
    """(the plan expanded and scheduled, which its compact walk reuses; its allocate-ahead MemGraph)."""
    ready = prepare(tg, plan, alignment)
    return ready, build_walks(tg, plan, alignment=alignment, walks=("ahead",), prepared=ready)["ahead"]


def built_walks(tg, candidates: list[Plan], alignment: int, costs, backend: str, compact_for: int = COMPACT_FOR,
                stand: bool = False, ahead: dict | None = None) -> tuple[list[Built], list[tuple[Plan, InfeasibleBudget]]]:
    """The candidates built, and the refusals of those that left a device short. On CUDA each plan
    is built by the allocate-ahead walk, the ``compact_for`` of them it runs fastest in the simulator
    by the compact walk too (memgraph/builder.py build_walks; compact_walks says how many). A
    refusal is raised on one device or for a single candidate, unless ``stand`` (every candidate's
    refusal is kept and the others stand). ahead: {id of a plan: (its preparation, its allocate-ahead
    MemGraph)} already built (Layout.built_ahead)."""
    ahead = ahead or {}
    found: list[Built] = []
    refused = []  # (plan, refusal) of the candidates that left a device short
    prepared = {}  # id of an allocate-ahead MemGraph -> its plan expanded and scheduled, for its compact walk
    for k, plan in enumerate(candidates):
        # on several devices a plan made for all of them as one may leave one device short: the others stand
        try:
            if backend == "cuda":
                ready, mg = ahead[id(plan)] if id(plan) in ahead else ahead_walk(tg, plan, alignment)
                built = {"ahead": mg}
                prepared[id(mg)] = ready
            else:
                built = {None: build(tg, plan, alignment=alignment)}
        except InfeasibleBudget as exc:
            if not stand and (tg.devices == 1 or len(candidates) == 1):
                raise
            log.info("the %s plan does not build on every device (%s); the other candidates stand", plan.planner, exc)
            refused.append((plan, exc))
            continue
        found += [Built(k, plan, walk, mg) for walk, mg in built.items()]
    if backend == "cuda":
        for ahead in sorted(found, key=lambda b: simulated_step(b.mg, costs, backend))[:compact_for]:
            packed = build_walks(tg, ahead.plan, alignment=alignment, walks=("compact",),
                                 prepared=prepared[id(ahead.mg)]).get("compact")
            if packed is not None:
                found.append(Built(ahead.index, ahead.plan, "compact", packed))
    return found, refused


def build_candidates(tg, candidates: list[Plan], alignment: int, costs, backend: str,
                     compact_for: int = COMPACT_FOR, ahead: dict | None = None
                     ) -> tuple[MemGraph, str | None, InfeasibleBudget | None]:
    """The MemGraph of the plans (built_walks) the simulator runs fastest, amended where that runs
    faster (amended_if_faster), which walk of the builder made it ("ahead", "compact"; None where
    build chose by itself), and the refusal of a candidate that left a device short though the planner
    predicted it faster than every one that built (favourite_refused)."""
    found, refused = built_walks(tg, candidates, alignment, costs, backend, compact_for, ahead=ahead)
    if not found:
        raise refused[0][1]
    mgs = [b.mg for b in found]
    best = mgs[0] if len(mgs) == 1 else fastest_simulated(mgs, costs, backend)
    walk = next(b.walk for b in found if b.mg is best)
    picked = amended_if_faster(tg, best, walk, alignment, costs, backend)
    if len(mgs) > 1:
        # a runner-up close behind may be slowed by the builder's evictions alone, and amended run faster
        # than the pick (AMEND_WITHIN)
        within = AMEND_WITHIN * simulated_step(best, costs, backend)
        for b in found:
            if b.mg is best or simulated_step(b.mg, costs, backend) > within:
                continue
            amended = amended_if_faster(tg, b.mg, b.walk, alignment, costs, backend)
            if amended is not b.mg and simulated_step(amended, costs, backend) < simulated_step(picked, costs, backend):
                amended.stats["simulated_candidates"] = {**best.stats["simulated_candidates"],
                                                         **amended.stats["simulated_candidates"]}
                log.info("taking %s amended instead: simulated %.3f ms", b.plan.planner,
                         simulated_step(amended, costs, backend) * 1e3)
                picked, walk = amended, b.walk
    return picked, walk, favourite_refused(refused, [b.plan for b in found])


def amended_if_faster(tg, best: MemGraph, walk: str | None, alignment: int, costs, backend: str) -> MemGraph:
    """``best``, or the MemGraph of its plan amended, where the simulator runs that one faster: to
    recompute what the builder evicted (memgraph/remake_offloaded.py), then, on several devices, to
    keep the copies between devices the plan makes again (memgraph/keep_transfers.py)."""
    amendments = (("recomputed evictions", lambda mg: recompute_evicted(tg, mg.plan, mg, costs) if costs is not None else None),
                  ("copies between devices kept", lambda mg: keep_transfers(tg, mg.plan)))
    for what, amend in amendments:
        amended = amend(best)
        if amended is None:
            continue
        try:
            mg = build_by_walk(tg, amended, walk, alignment)
        except InfeasibleBudget as exc:
            log.info("the plan amended (%s) does not build (%s)", what, exc)
            continue
        seconds = simulate(mg, costs, backend=backend).step_time
        before = best.stats.get("simulated_step_s")
        if before is None:
            before = simulate(best, costs, backend=backend).step_time
        log.info("%s: simulated %.3f ms against %.3f", what, seconds * 1e3, before * 1e3)
        if seconds >= before:
            continue
        mg.stats["simulated_step_s"] = seconds
        mg.stats["simulated_candidates"] = {**best.stats.get("simulated_candidates", {}),
                                            f"{amended.planner}+{what}": seconds}
        best = mg
    return best


def build_by_walk(tg, plan: Plan, walk: str | None, alignment: int) -> MemGraph:
    """The MemGraph of ``plan`` built by the builder walk named ("ahead", "apart", "compact"; None:
    build's choice)."""
    if walk == "compact":
        return build(tg, plan, alignment=alignment, compact=True)
    if walk in ("ahead", "apart"):
        return build_walks(tg, plan, alignment=alignment, walks=(walk,))[walk]
    return build(tg, plan, alignment=alignment)


def build_cached(tg, hit: CachedPlan, alignment: int) -> MemGraph | None:
    """The MemGraph of a cached plan, built by the walk that won when it was planned; None (with a
    warning) when it does not build."""
    try:
        mg = build_by_walk(tg, hit.plan, hit.walk, alignment)
    except Exception as exc:  # noqa: BLE001 - a cached plan that does not build is planned again
        log.warning("the cached plan does not build (%s: %s); planning again", type(exc).__name__, exc)
        return None
    if hit.simulated_step_s is not None:
        mg.stats["simulated_step_s"] = hit.simulated_step_s
    return mg


def keep_everything(tg, keep_all: MemGraph, gpu_budget: int, cpu_bytes: int | None, alignment: int,
                    costs=None, backend: str = "cpu") -> MemGraph:
    """The MemGraph when the budget holds the unplanned peak: on several CUDA devices, of the
    allocate-ahead walks (builder.build_walks "ahead" and "apart") the faster in the simulator."""
    # the paper's allocate-ahead build leaves the runtime more freedom than the compact one (on two H100s,
    # gpt1.3b simulates 174 ms against 206 ms)...
    plan = Plan(gpu_budget=gpu_budget, cpu_budget=cpu_bytes, planner="none")
    try:
        if backend == "cuda" and tg.devices > 1 and costs is not None:
            walks = build_walks(tg, plan, alignment=alignment, walks=("ahead", "apart"))
            kept = [mg for mg in walks.values() if mg.summary()["bytes_offloaded"] == 0]
            mg = fastest_simulated(kept, costs, backend) if kept else walks["ahead"]
        else:
            mg = build(tg, plan, alignment=alignment)
    except InfeasibleBudget:
        mg = None
    keep_all.plan.gpu_budget, keep_all.plan.cpu_budget = gpu_budget, cpu_bytes
    if mg is None or mg.summary()["bytes_offloaded"] > 0:  # ...unless it has to evict to get it
        return keep_all
    return mg


def record_prediction(mg: MemGraph, costs, device: torch.device) -> None:
    """Store the predicted step time where op costs were measured on this very device (the
    simulator's when compile ran it, else the planner's, else one simulation now), and the
    device's name; on the CPU backend, or with analytic costs, there is no prediction."""
    if costs is None or not getattr(costs, "measure", False) or device.type != "cuda":
        return
    seconds = mg.stats.get("simulated_step_s", mg.plan.predicted_time)
    if seconds is None:
        seconds = simulate(mg, costs, backend=device.type).step_time
    mg.stats["predicted_step_s"] = float(seconds)
    mg.stats["costs_measured_on"] = device_name(str(device))


def _walk_suffix(mg: MemGraph) -> str:
    """How a candidate's name shows the builder walk that made it (none for allocate-ahead)."""
    return "/compact" if "seconds_pack" in mg.stats else "/apart" if mg.stats.get("crossing_last") else ""


def fastest_simulated(candidates: list[MemGraph], costs, backend: str) -> MemGraph:
    """The candidate the timing simulator runs fastest. The planner's window model prices
    transfers as hidden under compute and cannot see how the builder's evictions and the
    engine's launches play out; the simulator runs the built MemGraph through the engine's own
    scheduler with host time per launch, and on the H100 came within 10% of measured steps
    where the planner's prediction was off by up to 2.4x (bench/results/h100)."""
    timed = [(simulated_step(mg, costs, backend), k, mg) for k, mg in enumerate(candidates)]
    best_time, _, best = min(timed)
    best.stats["simulated_step_s"] = best_time
    best.stats["simulated_candidates"] = {f"{mg.plan.planner}{_walk_suffix(mg)}#{k}": t for t, k, mg in timed}
    log.info("simulated candidates: %s; taking %s", best.stats["simulated_candidates"], best.plan.planner)
    return best


def unplanned_peak(keep_all: MemGraph) -> int:
    """GPU bytes the step takes with everything kept: the arena BuildMemGraph packs it into,
    plus the largest op workspace. Fractional budgets are fractions of this."""
    return keep_all.arena_bytes + keep_all.taskgraph.step_workspace()


def everything_kept(tg: TaskGraph, alignment: int) -> tuple[MemGraph, int]:
    """The MemGraph of ``tg`` with every value kept on the GPU and its unplanned_peak. Compact:
    freed bytes are reused first, so the arena is the peak rather than the sum of all values."""
    keep_all = build(tg, Plan(gpu_budget=UNBOUNDED, planner="none"), alignment=alignment, compact=True)
    return keep_all, unplanned_peak(keep_all)


def make_plan(tg, gpu_budget: int, cpu_budget: int | None, planner: str, **options):
    if planner == "none":
        return Plan(gpu_budget=gpu_budget, cpu_budget=cpu_budget, planner="none")
    return run_plan(tg, gpu_budget, cpu_budget=cpu_budget, method=planner, **options)
