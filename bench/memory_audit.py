"""What a turnip step allocates beside its arena: the CUDA allocations live at the step's peak.

    python -m turnip.bench.memory_audit [--model gpt350m] [--budget none|0.6] [--out DIR]

Compiles the model, runs one step (allocation, library handles), then records the caching
allocator's history over a second step and lists, at the moment of the step's peak, every live
block except the arena with its size and the Python frame that allocated it. Writes
bench/results/memory_audit_<model>.json. The point: the compile-time budget check must count
everything listed here. Beside it: eager's peak per phase and the blocks eager's own step holds at
its peak, grouped by size with the model line that allocated them ("eager_peaks_by_phase"), to set
against turnip's largest live values at its planned peak ("planned_peak"): a value turnip keeps
that eager does not shows there (llama's per-layer causal masks were found so).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import engine, memgraph
from ..memgraph.packing import stays
from ..memgraph.schedule import Schedule
from .models.sizes import make_workload
from .results import result_path, run_metadata

log = logging.getLogger(__name__)


def live_at_peak(snapshot: dict, allocated_before: int | None = None) -> tuple[int, list[dict]]:
    """Replay the allocator trace: (peak bytes allocated, blocks allocated in the trace live at that
    moment). ``allocated_before``: the bytes allocated when recording began; blocks from before
    that are freed then count as freed (eager's old gradients at zero_grad), so the peak found is
    the step's real one, not that of its new allocations alone."""
    live: dict[int, dict] = {}
    total = allocated_before or 0
    peak = total
    at_peak: list[dict] = []
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
            elif event["action"] == "free_completed":
                if event["addr"] in live:
                    total -= live.pop(event["addr"])["size"]
                elif allocated_before is not None:
                    total -= event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
    return peak, at_peak


def recorded(run: Callable[[], Any]) -> tuple[int, dict]:
    """(bytes allocated before, the caching allocator's snapshot) of ``run()`` recorded with its
    allocation history, the device synchronized before and after."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        run()
        torch.cuda.synchronize()
        return before, torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def planned_peak(mg, count: int = 15) -> dict:
    """Where the keep-everything schedule's live bytes peak: the step, its op, and the largest values
    live there (each with the op and phase producing it), to set beside eager's peak by phase."""
    tg, plan = mg.taskgraph, mg.plan
    graph, order = plan.expand(tg)
    sched = Schedule(graph, order, plan, mg.alignment)
    items = stays(graph, sched)
    delta = [0] * (len(sched.steps) + 1)
    for stay in items:
        delta[stay.first] += stay.size
        delta[stay.last + 1] -= stay.size
    live, peak, at = 0, -1, 0
    for s in range(len(sched.steps)):
        live += delta[s]
        if live > peak:
            peak, at = live, s
    vertex = graph.vertices[sched.task_vertex_of(graph, at)]
    top = sorted((st for st in items if st.first <= at <= st.last), key=lambda st: -st.size)[:count]

    def producer(v: int) -> str:
        p = graph.values[v].producer
        return f"{graph.vertices[p].op} [{graph.vertices[p].phase}] {graph.vertices[p].module}" if p >= 0 else "input"

    return {"homes_bytes": sched.home_bytes, "live_peak_bytes": peak, "peak_step": at, "steps": len(sched.steps),
            "peak_op": f"{vertex.op} [{vertex.phase}] {vertex.module}",
            "largest_live": [{"bytes": st.size, "value": st.values[0], "producer": producer(st.values[0])} for st in top]}


def eager_peaks(workload, batch) -> dict:
    """Eager's allocated peak in each phase of a step (after a warm-up step), and between steps."""
    model = workload.fresh_model("cuda")
    opt = workload.optimizer([p for p in model.parameters() if p.requires_grad])
    phases = {}

    def step(record: bool):
        def mark(name):
            torch.cuda.synchronize()
            if record:
                phases[name] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad()
        mark("before")
        loss = workload.loss_fn(model, batch)
        mark("forward")
        loss.backward()
        mark("backward")
        opt.step()
        mark("optimizer")

    step(False)
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step(True)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    phases["between_steps"] = torch.cuda.memory_allocated()
    # what eager holds at its own peak, the blocks allocated before the recorded step (weights,
    # optimizer states) apart: grouped by size, to set beside planned_peak's largest live values
    phases["replayed_peak"], at_peak = live_at_peak(snapshot, allocated_before)
    sizes = collections.Counter(e["size"] for e in at_peak)
    phases["step_blocks_at_peak"] = [{"bytes": size, "count": n, "where": next(
        frame_of(e) for e in at_peak if e["size"] == size)} for size, n in sorted(sizes.items(), key=lambda x: -x[0] * x[1])[:25]]
    phases["step_bytes_at_peak"] = sum(e["size"] for e in at_peak)
    model = opt = None  # free eager's step before turnip compiles
    torch.cuda.empty_cache()
    return phases


def frame_of(event: dict) -> str:
    frames = [f for f in event.get("frames", []) if f.get("filename", "").endswith(".py")]
    for f in frames:
        if "/turnip/" in f["filename"] or "/kernels/" in f["filename"] or "/engine/" in f["filename"]:
            return f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    for f in frames:  # eager: the model's own line (bench/models, transformers' modeling files)
        if "/models/" in f["filename"]:
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['line']}" if frames else "?"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt350m")
    parser.add_argument("--budget", default="none", help="'none' (keep everything) or a fraction of the peak")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench/results)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    workload = make_workload(args.model)
    batch = workload.batch_on("cuda")
    optimizer = workload.optimizer([p for p in workload.model.parameters() if p.requires_grad])
    budget = None if args.budget == "none" else float(args.budget)
    eager = eager_peaks(workload, batch)
    log.info("eager peaks by phase: %s", eager)
    mg = memgraph.compile(workload.model, workload.loss_fn, batch, optimizer=optimizer, budget=budget, device="cuda")
    engine.run(mg, batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before, snapshot = recorded(lambda: engine.run(mg, batch))
    arena = mg.arena_bytes
    blocks = [b for b in snapshot["segments"] for b in b["blocks"] if b["state"] == "active_allocated"]
    persistent = sorted((b["size"] for b in blocks if b["size"] != arena and b["size"] < arena), reverse=True)
    _, at_peak = live_at_peak(snapshot)
    step_blocks = sorted(({"bytes": e["size"], "where": frame_of(e)} for e in at_peak), key=lambda b: -b["bytes"])
    result = {"benchmark": "memory_audit", **run_metadata(), "model": args.model, "budget": args.budget,
              "gpu_budget": mg.plan.gpu_budget, "arena_bytes": arena, "unplanned_peak": mg.stats.get("unplanned_peak"),
              "max_workspace": max((v.workspace for v in mg.taskgraph.vertices), default=0),
              "allocated_between_steps": before, "peak_allocated_in_step": torch.cuda.max_memory_allocated(),
              "persistent_blocks_besides_arena": persistent[:20],
              "eager_peaks_by_phase": eager, "planned_peak": planned_peak(mg), "allocated_during_step_at_peak": step_blocks[:20]}
    path = Path(args.out) / f"memory_audit_{args.model}.json" if args.out else result_path(f"memory_audit_{args.model}.json")
    path.write_text(json.dumps(result, indent=2, default=str))
    log.info("%s", json.dumps({k: v for k, v in result.items() if k not in ("commit", "date")}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
