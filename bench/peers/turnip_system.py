"""turnip itself, run like a peer: memgraph.compile under a budget, then engine.run per step.

Besides the peers' fields it records compile time (apart from step time), the
MemGraph's facts (arena, vertices, bytes planned each way), the simulator's
prediction of the step, and turnip's *floor*: the step cannot be faster than
max(compute incl. recompute, bytes in / H2D bandwidth, bytes out / D2H bandwidth, the host's
optimizer updates one after another where the plan runs some there).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ... import engine, memgraph
from ...engine.timing_sim import simulate, time_floor, transfer_bytes
from ...ir.memgraph import Kind, MemGraph
from ...memgraph.report import plan_mix
from ...planners.costs import CostModel
from .common import (
    EAGER_MATH,
    INFEASIBLE,
    PeerResult,
    TimeLimitExceeded,
    Workload,
    guarded,
    is_cuda,
    release_memory,
    timed_steps,
    trainable,
)

log = logging.getLogger(__name__)


def budget_argument(budget: float, eager_peak: int | None) -> tuple[int | float, str]:
    """What memgraph.compile gets: a size (an int of bytes, the suite's ``16GiB``) as it is; a fraction as
    bytes of the measured eager peak when known, else the fraction itself (then compile reads it as a
    fraction of the traced step's unplanned peak)."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        return budget, "bytes given"
    if eager_peak:
        return max(1, int(budget * eager_peak)), "eager peak"
    return float(budget), "unplanned peak"


def compute_counts(mg) -> tuple[int, int]:
    """(compute vertices in the MemGraph, those that are not recomputed copies)."""
    tg = mg.taskgraph
    total = recomputed = 0
    for mv in mg.vertices:
        if mv.kind is Kind.COMPUTE:
            total += 1
            if 0 <= mv.task_vertex < len(tg.vertices) and tg.vertices[mv.task_vertex].recompute_of >= 0:
                recomputed += 1
    return total, total - recomputed


def timed_turnip_steps(result: PeerResult, mg: MemGraph, batch, steps: int, device, warmup: int = 1,
                       deadline: float | None = None) -> None:
    """timed_steps of engine.run(mg, batch), and the loop's own time over the timed ones (loop_facts)."""
    loop_times = []

    def step():
        loss = engine.run(mg, batch)["loss"]
        loop_times.append(mg.runtime.last_loop_time)
        return loss

    timed_steps(result, step, steps, device, warmup=warmup, deadline=deadline)
    result.extra.update(loop_facts(loop_times[len(loop_times) - len(result.step_s):]))


def loop_facts(loop_times: list) -> dict:
    """The loop thread's own cost per launch over the timed steps (engine.loop.LoopTime), the median,
    beside what the simulator charges (sim_host_per_launch_us, from floor_and_sim): on one H200 the
    traced steps of gpt350m at 50% launched a unit every 45-51 us where the simulator charged 15
    (bench/results/2026-11-29_h200_same-call-rows.md)."""
    if not loop_times:
        return {}
    return {"loop_busy_us_per_launch": statistics.median(t.busy_per_launch_s for t in loop_times) * 1e6,
            "loop_busy_s": statistics.median(t.busy_s for t in loop_times),
            "loop_launches": loop_times[-1].launches}


def floor_and_sim(mg, device, eager_step_s: float | None, sim_trace: Path | None) -> dict:
    """The floor and the simulator's step time. On CUDA the cost model measures op times and the link
    (cached on disk); elsewhere there is no link to measure and the analytic rates describe some other
    device, so the compute estimate is eager's step time scaled by the recompute share."""
    out: dict = {}
    costs = CostModel(device=str(mg.device))
    tg = mg.taskgraph
    if any(v.time <= 0 for v in tg.vertices):
        costs.annotate(tg)
    fl = time_floor(mg, costs)
    total, original = compute_counts(mg)
    eager_compute = eager_step_s * total / max(original, 1) if eager_step_s else None
    if is_cuda(device):
        compute, basis = fl["compute"], "cost model (measured)"
        link = (fl["h2d"], fl["d2h"])
        # the duplex rate too: on the H200 it measured 74.7-101 GB/s between processes, and the simulator
        # follows it (bench/results/2026-11-29_h200_same-call-rows.md)
        out.update(h2d_bandwidth=costs.h2d_bandwidth, d2h_bandwidth=costs.d2h_bandwidth,
                   duplex_bandwidth=costs.duplex_bandwidth)
    else:
        compute, basis = eager_compute, "eager step x recompute share (no link on the CPU)"
        link = (None, None)
    # the host's optimizer updates (Plan.host_update) run one after another on the host lane
    host_updates = fl["host_updates"] if is_cuda(device) else None
    parts = [x for x in (compute, *link, host_updates) if x is not None]
    if is_cuda(device):  # both directions at once share the link's duplex rate (measured on CUDA only)
        out.update(floor_both_ways_link_s=fl["both_ways"],
                   floor_with_duplex_s=max([*parts, fl["both_ways"]]) if parts else None)
    out.update(floor_s=max(parts) if parts else None, floor_compute_s=compute, floor_h2d_s=link[0],
               floor_d2h_s=link[1], floor_host_updates_s=host_updates, floor_basis=basis,
               floor_compute_eager_s=eager_compute,
               floor_compute_model_s=fl["compute"], recompute_vertices=total - original)
    sim = simulate(mg, costs, backend="cuda")  # the CUDA engine's model, whatever device compiled it
    out.update(sim_step_s=sim.step_time, sim_compute_idle_s=sim.compute_idle, sim_host_busy_s=sim.host_busy,
               sim_host_per_launch_us=sim.host_per_vertex * 1e6,
               sim_basis="cost model (measured)" if is_cuda(device) else "analytic H100-class cost model")
    if sim_trace is not None:
        sim.write_timeline(sim_trace, mg, meta={"budget": mg.plan.gpu_budget})
        out["sim_trace"] = str(sim_trace)
    return out


def compiled_again(result: PeerResult, compiled: Callable[..., MemGraph]) -> None:
    """The row's step compiled a second time by ``compiled`` (run's, which made the first), its op
    costs now cached and no plan cache (issue 32's warm compile): compile_again_s, its phases,
    planner and simulated step in the row. The time limit running out here costs this figure only."""
    t0 = time.perf_counter()
    try:
        again = compiled(cache=False, verbose=False)
    except TimeLimitExceeded as exc:
        result.extra["compile_again_error"] = str(exc)
        return
    result.extra.update(compile_again_s=time.perf_counter() - t0,
                        compile_again_phase_s=again.stats.get("compile_phase_seconds"),
                        compile_again_planner=again.plan.planner,
                        compile_again_sim_step_s=again.stats.get("simulated_step_s"))


def run(workload: Workload, device, steps: int, budget: float, eager_peak: int | None = None,
        eager_step_s: float | None = None, warmup: int = 1, deadline: float | None = None,
        limit_s: float | None = None, trace_path: str | Path | None = None, planner: str = "auto",
        planner_options: dict | None = None, compile_again: bool = False) -> PeerResult:
    result = PeerResult("turnip", math=EAGER_MATH)  # the traced step's own ops: eager's numbers
    arg, basis = budget_argument(budget, eager_peak)
    result.extra.update(budget=budget, budget_bytes=arg if isinstance(arg, int) else None, budget_basis=basis,
                        planner_requested=planner, planner_options=dict(planner_options or {}))

    def body():
        # the canonical CPU model is only read by the trace; its weights go into the arena at the first run
        model = workload.model
        batch = workload.batch_on(device)

        def compiled(**more) -> MemGraph:
            """The row's step compiled, a fresh optimizer over the model each time."""
            return memgraph.compile(model, workload.loss_fn, batch, optimizer=workload.optimizer(trainable(model)),
                                    budget=arg, device=device, planner=planner, **(planner_options or {}), **more)

        t0 = time.perf_counter()
        try:
            mg = compiled()
        except memgraph.InfeasibleBudget as exc:
            result.status, result.error = INFEASIBLE, str(exc)[:600]
            result.extra["compile_s"] = time.perf_counter() - t0
            return
        result.extra["compile_s"] = time.perf_counter() - t0
        summary = mg.summary()
        result.extra.update(
            arena_bytes=mg.arena_bytes, cpu_bytes=mg.cpu_bytes, vertices=summary["vertices"],
            planned_bytes_offloaded=summary["bytes_offloaded"], planned_bytes_reloaded=summary["bytes_reloaded"],
            planner=summary["planner"], predicted_time_s=summary["predicted_time"],
            unplanned_peak=mg.stats.get("unplanned_peak"),
            # the plan's mix: tensors kept / offloaded / recomputed, weights and states homed on the CPU
            plan_mix=asdict(plan_mix(mg)), loss_blocks=mg.stats.get("loss_blocks", 1),
            compile_phase_s=mg.stats.get("compile_phase_seconds"))
        if eager_peak and mg.stats.get("unplanned_peak"):
            result.extra["unplanned_peak_within_eager"] = mg.stats["unplanned_peak"] <= eager_peak
        if result.extra["budget_bytes"] is None:
            result.extra["budget_bytes"] = int(mg.plan.gpu_budget)
        log.info("turnip @ %s: compiled in %.1fs, arena %.1f MiB, %d vertices", budget, result.extra["compile_s"],
                 mg.arena_bytes / 2**20, summary["vertices"])
        release_memory(device)  # compile may have measured ops on the device: count the steps only
        timed_turnip_steps(result, mg, batch, steps, device, warmup=warmup, deadline=deadline)
        result.bytes_h2d, result.bytes_d2h = transfer_bytes(mg)
        if trace_path is not None:  # one more (untimed) step, traced; its failure must not cost the timings
            try:
                engine.run(mg, batch, timeline=trace_path)
                result.extra["trace"] = str(trace_path)
            except Exception as exc:  # noqa: BLE001 - includes the time limit running out here
                log.warning("turnip traced step failed: %r", exc)
                result.extra["trace_error"] = repr(exc)[:300]
        mg.release(keep=False)  # the next system must not find this one's arena still allocated
        if compile_again:
            compiled_again(result, compiled)
        try:
            sim_trace = Path(str(trace_path).removesuffix(".json") + ".sim.json") if trace_path else None
            result.extra.update(floor_and_sim(mg, device, eager_step_s, sim_trace))
        except Exception as exc:  # noqa: BLE001 - the measured steps stand without their floor (time limit too)
            log.warning("turnip floor/simulation failed: %r", exc)
            result.extra["floor_error"] = repr(exc)[:300]

    result = guarded(result, device, body, limit_s)
    budget_bytes = result.extra.get("budget_bytes")
    if result.peak_allocated is not None and budget_bytes:
        result.extra["fits_budget"] = result.peak_allocated <= budget_bytes
    return result

